"""A torchtitan (0.3) model converter that runs the MoE experts on megamoe.

torchtitan's MoE (``torchtitan.models.common.moe``) routes and dispatches tokens itself
(``TokenChoiceTopKRouter``, a token dispatcher for EP=1 or all-to-all EP) and hands the
inner ``GroupedExperts`` the routed rows sorted by local expert with a count per
expert. :class:`MegaMoEConverter` replaces every ``GroupedExperts.Config`` in the model
config tree (before the model is built, like torchtitan's own LoRA and quantization
converters) by :class:`MegaMoEGroupedExperts.Config`, whose module computes those rows
with :func:`megamoe.moe` (one route per row, weight 1: torchtitan's dispatcher applies
the router scores in its combine), either

- a frozen base with shared-outer side-LoRA adapters (``rank > 0``; the base
  ``w13_E2FD``/``w2_EDF`` get ``requires_grad=False``, the factors ``a1 .. b2``
  train), or
- a trainable base (``rank = 0``).

Usage (a model registry function that takes ``converters=``, e.g. qwen3, deepseek_v3, kimi_k2_7)::

    from megamoe.integrations.torchtitan import MegaMoEConverter
    converters = [MegaMoEConverter.Config(rank=64, alpha=128.0)]

Parameters. megamoe reads gate and up as one ``w13 [E, 2I, H]`` tensor (all gate rows,
then all up rows), so the module holds them as ONE parameter ``w13_E2FD [E, 2, F, D]``
(gate ``[:, 0]``, up ``[:, 1]``) next to torchtitan's ``w2_EDF [E, D, F]``; each call
passes ``w13_E2FD``'s local shard viewed as ``[E_l, 2F_l, D]``: no concatenation. BF16
parameters (FSDP2's default ``param_dtype``) are passed as they are; FP32 parameters (no
FSDP, or ``param_dtype=None``) are cast to one transient BF16 copy per call, as the
stock module's ``.bfloat16()`` does. Under FSDP2/EP/TP the parameters are DTensors and
each call uses the local shards (``to_local()``, no gather), as ``GroupedExperts`` does.

Checkpoints keep torchtitan's names. A state-dict post-hook replaces ``w13_E2FD`` by
``w1_EFD = w13_E2FD[:, 0]`` and ``w3_EFD = w13_E2FD[:, 1]``: views, not copies
(torchtitan's ``ModelWrapper`` caches ``state_dict()`` for the whole run and DCP loads
into those tensors in place, so copies would hold a permanent second gate/up copy). A
load-state-dict pre-hook merges ``w1_EFD`` and ``w3_EFD`` back: when they are those
views (a DCP load has already written through them) the parameter itself is passed, else
they are stacked (a load-time transient: HF state-dict adapters, stock checkpoints). So
stock ``GroupedExperts`` and megamoe checkpoints load into each other with
``strict=True``, and torchtitan's HF adapters see the stock keys (by construction). The
Kimi K2.7 Muon optimizer config keys its expert patterns by ``w1_EFD``/``w3_EFD`` and is
not supported with a trainable base (gate/up would fall into its AdamW group). Tools
that key by ``named_parameters`` see ``w13_E2FD``, and so does the optimizer: its state
is keyed ``...inner_experts.w13_E2FD``, so a full resume (model + optimizer) between a
stock run and a megamoe run with a trainable base (``rank = 0``) misses those keys; load
the model only (exclude ``optimizer`` from the checkpoint load) when switching. A frozen
base has no optimizer state.

Sharding. torchtitan's ``update_from_config`` writes the experts' ``sharding_config``
after conversion, with entries for ``w1_EFD``/``w2_EDF``/``w3_EFD``;
:meth:`MegaMoEGroupedExperts.Config.build` derives ``w13_E2FD``'s entry from
``w1_EFD``'s layout (the new axis 1 is never sharded, so tensor dims >= 1 shift by one:
EP ``S(0)`` stays, TP colwise ``S(1)`` becomes ``S(2)``; a rank's local
``[E_l, 2, F_l, D]`` is its gate rows then the matching up rows). FSDP2 shards dim 0
(the experts) as for the stock module, except that torchtitan falls back to ``Shard(1)``
for all expert parameters when the FSDP x EP ranks exceed the experts; dim 1 is the
size-2 gate/up axis here, so ``init_states`` raises then (use at most as many FSDP x EP
ranks as experts).

Side-LoRA under ``parallelize`` (``rank > 0``). The build adds the adapters' entries,
derived from ``w1_EFD``'s like ``w13_E2FD``'s: the per-expert factors ``b1``, ``b3``
``[E, r, F]`` and ``a2 [E, F, r]`` are sharded as the base is (EP on the experts, TP on
F), the shared factors ``a1``, ``a3`` ``[D, r]`` and ``b2 [r, D]`` are replicated. Each
EP or TP rank computes only part of a shared factor's gradient (its experts' rows; its
F slice, where ``x a1``'s gradient is summed over F and ``p = h a2`` is a partial sum
over F), so their local tensors declare that gradient ``Partial`` on the ``tp``/``ep``
mesh dims and FSDP2 sums it there while it reduces over the data-parallel ranks. The
forward needs nothing more: under TP the experts' output is already a partial sum that
torchtitan reduces, ``s p b2`` with it. This runs on torchtitan's ``partial_dtensor``
SPMD backend (``--parallelism.spmd_backend partial_dtensor``); ``parallelize`` refuses
``rank > 0`` on the others: ``spmd_types`` (the default) keeps plain local tensors,
whose gradients cannot be declared partial, and ``full_dtensor`` is not tested.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

try:
    import spmd_types as spmd
    from torch.distributed.tensor import DTensor, Partial
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module
    from torchtitan.protocols.sharding import ShardingConfig, SpmdLayout
except ImportError as exc:
    raise ImportError(
        "megamoe.integrations.torchtitan needs torchtitan 0.3; install the extra: "
        "pip install 'megamoe[titan]'"
    ) from exc

from .. import ops, reference
from ..side_lora import SIDE_NAMES, SideLoRA, check_side_rank
from ..validation.arguments import check_finite_float, check_str_choice
from ..validation.layer import check_kernel_dims
from ..weights import prepare_base_weights
from ..wrappers.registry import registry

__all__ = ["BACKENDS", "MegaMoEConverter", "MegaMoEGroupedExperts"]

#: ``"fused"``: :func:`megamoe.moe` (Hopper). ``"reference"``: float32 reference (tests).
BACKENDS = ("fused", "reference")
#: The fused gate+up parameter and torchtitan's names for its halves.
_W13, _GATE, _UP = "w13_E2FD", "w1_EFD", "w3_EFD"
#: The side-LoRA factors every expert shares, and the mesh dims over which each rank
#: holds only part of their gradients (module docstring).
_SHARED_FACTORS = ("a1", "a3", "b2")
_MODEL_PARALLEL_DIMS = ("tp", "ep")
#: torchtitan's SPMD backend under which ``parallelize`` runs side-LoRA adapters.
_ADAPTER_BACKEND = "partial_dtensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _shared_local(t: torch.Tensor) -> torch.Tensor:
    """A shared factor's local tensor, its gradient declared ``Partial`` on the ``tp``/
    ``ep`` mesh dims where it is replicated: each of those ranks computes part of it."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "side-LoRA under parallelize: a shared factor lives on a mesh without dim names; "
            f"megamoe finds its {' and '.join(_MODEL_PARALLEL_DIMS)} dims by name"
        )
    grad_placements = tuple(
        Partial() if name in _MODEL_PARALLEL_DIMS and placement.is_replicate() else placement
        for name, placement in zip(names, t.placements, strict=True)
    )
    return t.to_local(grad_placements=grad_placements)


def _local_t(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor without autograd bookkeeping (for storage checks)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _split_w13_on_save(module, state_dict, prefix, local_metadata) -> None:
    """Checkpoint in ``GroupedExperts``' names. Views, not copies (module docstring)."""
    w13 = state_dict.pop(prefix + _W13, None)
    if w13 is None:
        return
    # GroupedExperts' key order (w1, w2, w3), then the adapters: this module's keys are
    # the last ones in the dict when its post-hook runs (it has no children).
    own = [prefix + n for n in ("w2_EDF", *SIDE_NAMES)]
    tail = {k: state_dict.pop(k) for k in own if k in state_dict}
    # Views of the detached data (keep_vars=True would otherwise hand out non-leaf views);
    # [E, F, D], a DTensor view under DTensor.
    w13 = w13.detach()
    state_dict[prefix + _GATE] = w13[:, 0]
    w2 = tail.pop(prefix + "w2_EDF", None)
    if w2 is not None:
        state_dict[prefix + "w2_EDF"] = w2
    state_dict[prefix + _UP] = w13[:, 1]
    state_dict.update(tail)


def _aliases(value: torch.Tensor, param: torch.Tensor, half: int) -> bool:
    """Whether ``value`` is exactly ``param[:, half]`` (the post-hook's view)."""
    if isinstance(value, DTensor) != isinstance(param, DTensor):
        return False
    v, ref = _local_t(value), _local_t(param)[:, half]
    return (
        v.device == ref.device
        and v.dtype == ref.dtype
        and v.untyped_storage().data_ptr() == ref.untyped_storage().data_ptr()
        and v.storage_offset() == ref.storage_offset()
        and tuple(v.shape) == tuple(ref.shape)
        and v.stride() == ref.stride()
    )


def _merge_w13_on_load(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:  # fmt: skip
    """Load ``w1_EFD``/``w3_EFD`` (torchtitan's names) into ``w13_E2FD``.

    ``nn.Module.load_state_dict`` hands each module a shallow copy of the caller's dict,
    so the pops below leave the caller's dict alone.
    """
    k1, k3, k13 = prefix + _GATE, prefix + _UP, prefix + _W13
    if k1 not in state_dict and k3 not in state_dict:
        return  # a native w13_E2FD key, or none: the default handling
    if (k1 in state_dict) != (k3 in state_dict):
        error_msgs.append(f"{prefix or '.'}: {_GATE} and {_UP} must be loaded together")
        state_dict.pop(k1, None)
        state_dict.pop(k3, None)
        return
    w1, w3 = state_dict.pop(k1), state_dict.pop(k3)
    if k13 in state_dict:
        error_msgs.append(f"{prefix or '.'}: got both {_W13} and {_GATE}/{_UP}")
        return
    param = module._parameters[_W13]
    if _aliases(w1, param, 0) and _aliases(w3, param, 1):
        state_dict[k13] = param  # a DCP load already wrote through the views
    elif w1.shape != w3.shape:
        error_msgs.append(
            f"{prefix or '.'}: {_GATE} and {_UP} shapes differ: "
            f"{list(w1.shape)} vs {list(w3.shape)}"
        )
    else:
        state_dict[k13] = torch.stack([w1, w3], dim=1)  # a load-time transient


def _gate_up_layout(w1: SpmdLayout) -> SpmdLayout:
    """``w1_EFD``'s ``[E, F, D]`` layout on ``[E, 2, F, D]``: the new axis 1 is never
    sharded, so tensor dims >= 1 shift by one (EP ``S(0)`` stays, TP ``S(1)`` -> ``S(2)``)."""
    if w1.partition_spec is not None:
        spec = tuple(w1.partition_spec)
        if spec:
            shifted = (spec[0], None, *spec[1:])
            if isinstance(w1.partition_spec, spmd.PartitionSpec):
                shifted = spmd.PartitionSpec(*shifted)
            return SpmdLayout(dict(w1.axis_types), partition_spec=shifted)
        return w1
    return SpmdLayout(
        {
            axis: spmd.S(t.dim + 1) if isinstance(t, spmd.Shard) and t.dim >= 1 else t
            for axis, t in w1.axis_types.items()
        }
    )


def _adapter_layouts(w13: SpmdLayout) -> dict[str, SpmdLayout]:
    """The side-LoRA factors' layouts from ``w13_E2FD``'s ``[E, 2, F, D]`` one: on each
    mesh axis, the experts' shard (EP ``S(0)``) shards ``b1``, ``b3``, ``a2`` on their
    expert dim, F's (TP ``S(2)``) shards ``b1``, ``b3 [E, r, F]`` on dim 2 and
    ``a2 [E, F, r]`` on dim 1, and the shared ``a1``, ``a3``, ``b2`` are replicated; an
    axis that does not shard the base is copied as it is."""
    if w13.partition_spec is not None:
        raise ValueError(
            f"sharding_config: side-LoRA adapters need {_W13}'s layout as per-axis types, "
            f"got a partition_spec {w13.partition_spec}"
        )
    per_expert = {"b1": {0: 0, 2: 2}, "b3": {0: 0, 2: 2}, "a2": {0: 0, 2: 1}}  # base dim -> own
    layouts: dict[str, dict] = {name: {} for name in SIDE_NAMES}
    for axis, kind in w13.axis_types.items():
        if not isinstance(kind, spmd.Shard):
            for name in SIDE_NAMES:
                layouts[name][axis] = kind
            continue
        if kind.dim not in (0, 2):
            raise ValueError(
                f"sharding_config: side-LoRA adapters follow the base sharded on its experts "
                f"or on F, got {_W13} sharded on dim {kind.dim} over {axis}"
            )
        for name in SIDE_NAMES:
            own = per_expert.get(name, {}).get(kind.dim)
            layouts[name][axis] = spmd.R if own is None else spmd.S(own)
    return {name: SpmdLayout(types) for name, types in layouts.items()}


def _fused_sharding(sc: ShardingConfig | None, rank: int = 0) -> ShardingConfig | None:
    """Replace the ``w1_EFD``/``w3_EFD`` entries by a ``w13_E2FD`` entry, and with
    ``rank > 0`` add the adapters' entries (:func:`_adapter_layouts`)."""
    if sc is None:
        return None
    shardings = dict(sc.state_shardings)
    w1, w3 = shardings.pop(_GATE, None), shardings.pop(_UP, None)
    if _W13 not in shardings:
        if w1 is None:
            raise ValueError(
                f"sharding_config.state_shardings: expected an entry for {_GATE} (or "
                f"{_W13}), got {sorted(sc.state_shardings)}"
            )
        if w3 is not None and w3 != w1:
            raise ValueError(
                f"sharding_config: {_GATE} and {_UP} must be sharded alike to share one "
                f"parameter, got {w1} and {w3}"
            )
        shardings[_W13] = _gate_up_layout(w1)
    if rank:
        for name, layout in _adapter_layouts(shardings[_W13]).items():
            shardings.setdefault(name, layout)
    return dataclasses.replace(sc, state_shardings=shardings)


#: The module of torchtitan's LoRAConverter and the frozen config classes it makes.
_TORCHTITAN_LORA = "torchtitan.components.lora"
#: The package of torchtitan's Float8 / MXFP8 grouped-experts converters, whose quantized
#: experts are subclasses (module and config) made at conversion.
_TORCHTITAN_QUANTIZATION = "torchtitan.components.quantization"


class MegaMoEGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` computed by megamoe (SwiGLU, as the original).

    Parameters: ``w13_E2FD [E, 2, F, D]`` (gate ``[:, 0]`` = torchtitan's ``w1_EFD``, up
    ``[:, 1]`` = ``w3_EFD``; checkpointed under those two names, see the module
    docstring), ``w2_EDF [E, D, F]`` and, with ``rank > 0``, the side-LoRA factors
    ``a1 [D, r]``, ``b1 [E, r, F]``, ``a3 [D, r]``, ``b3 [E, r, F]``, ``a2 [E, F, r]``,
    ``b2 [r, D]`` (float32 master weights, cast to BF16 every call) and the scale
    ``alpha / rank``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        rank: int = 0
        """Side-LoRA rank (a multiple of 16 in [16, 256]); 0: trainable base, no adapters."""

        alpha: float | None = None
        """LoRA alpha: scale ``alpha / rank``; None: scale 1. With ``rank = 0`` (no
        adapters) it is checked and not used, so one config can switch adapters off."""

        backend: str = "fused"
        """``"fused"`` (Hopper kernels) or ``"reference"`` (float32, any device)."""

        @classmethod
        def __init_subclass__(cls, **kwargs):
            # torchtitan's LoRAConverter wraps every config it does not target in a
            # subclass whose build freezes the module's direct parameters: here the
            # side-LoRA factors too, which then never train. Refused by name; in the
            # other order megamoe converts LoRA's frozen experts config.
            if cls.__module__ == _TORCHTITAN_LORA:
                raise ValueError(
                    "converters: torchtitan's LoRAConverter after MegaMoEConverter would "
                    "freeze megamoe's side-LoRA factors (direct parameters of the experts); "
                    "list LoRAConverter before MegaMoEConverter"
                )
            # Its Float8 / MXFP8 converters subclass the experts to quantize their
            # grouped_mm: megamoe never calls it, so the quantization would silently not
            # apply. In the other order megamoe refuses the quantized experts config.
            if cls.__module__.startswith(_TORCHTITAN_QUANTIZATION + "."):
                raise ValueError(
                    f"converters: a quantization converter of {cls.__module__} after "
                    "MegaMoEConverter: megamoe computes the experts with its own kernels "
                    "(a BF16 or MXFP4 base), so the quantization would not apply; leave "
                    "the grouped-experts quantization converter out"
                )
            super(MegaMoEGroupedExperts.Config, cls).__init_subclass__(**kwargs)

        def build(self, **kwargs):
            # torchtitan's update_from_config sets sharding_config (with w1_EFD/w3_EFD
            # entries) after the converter ran, so the w13_E2FD entry is derived here,
            # as NVFP4Linear.Config.build does. slots=True: no zero-arg super().
            instance = GroupedExperts.Config.build(self, **kwargs)
            instance._sharding_config = _fused_sharding(instance._sharding_config, self.rank)
            return instance

    def __init__(self, config: Config):
        super().__init__(config)
        check_str_choice("backend", config.backend, BACKENDS)
        rank = config.rank
        check_side_rank("rank", rank, zero="0 (trainable base)")
        self.rank, self.backend = rank, config.backend
        self.scale = 1.0
        if config.alpha is not None:  # at build, as attach_side_lora checks it
            alpha = check_finite_float("alpha", config.alpha)
            if rank:
                scale = alpha / rank
                self.scale = check_finite_float("scale (alpha / rank)", scale, float32=True)
        e, f, d, r = config.num_experts, config.hidden_dim, config.dim, rank
        # At build, not at the first forward (after sharding and the checkpoint load).
        check_kernel_dims("dim", d, "hidden_dim", f)
        self.dim, self.hidden_dim = d, f
        # One gate+up parameter in place of GroupedExperts' two (module docstring).
        w1 = self.w1_EFD
        del self.w1_EFD, self.w3_EFD
        self.register_parameter(
            _W13, nn.Parameter(torch.empty(e, 2, f, d, dtype=w1.dtype, device=w1.device))
        )
        self.register_state_dict_post_hook(_split_w13_on_save)
        self.register_load_state_dict_pre_hook(_merge_w13_on_load)
        if rank:
            shapes = {
                "a1": (d, r),
                "b1": (e, r, f),
                "a3": (d, r),
                "b3": (e, r, f),
                "a2": (e, f, r),
                "b2": (r, d),
            }
            for name, shape in shapes.items():
                self.register_parameter(name, nn.Parameter(torch.empty(shape)))
            self._init_adapters()
            # A frozen base: only the adapters train (DESIGN §1 side-LoRA).
            for p in (self.w13_E2FD, self.w2_EDF):
                p.requires_grad_(False)

    def gate_up_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w1_EFD, w3_EFD)``: the gate and up halves of ``w13_E2FD`` (views)."""
        return self.w13_E2FD[:, 0], self.w13_E2FD[:, 1]

    def parallelize(self, parallel_dims: object) -> None:
        """torchtitan's ``parallelize`` of this module under ``parallel_dims`` (its
        ``ParallelDims``), after a check: side-LoRA adapters need the ``spmd_backend``
        that sums the shared factors' gradients over the ranks (``ValueError``)."""
        backend = getattr(parallel_dims, "spmd_backend", None)
        if self.rank and self._sharding_config is not None and backend != _ADAPTER_BACKEND:
            raise ValueError(
                f"side-LoRA adapters (rank={self.rank}) run under torchtitan's parallelize "
                f"with spmd_backend={_ADAPTER_BACKEND!r} (--parallelism.spmd_backend "
                f"{_ADAPTER_BACKEND}), got {backend!r}, whatever the parallel degrees "
                "(one GPU included): the shared factors' gradients must be summed over "
                "any EP/TP ranks, which megamoe declares on their DTensors, and the "
                "default backend registers parameters anew as trainable, the frozen base "
                "included"
            )
        Module.parallelize(self, parallel_dims)

    def _init_adapters(self) -> None:
        """Shrink factors ``U(+-1/sqrt(fan_in))``, expand factors zero: the adapters
        start with an exactly zero contribution (as :class:`megamoe.MegaMoE`'s)."""
        with torch.no_grad():
            for name, fan_in in (("a1", self.dim), ("a3", self.dim), ("a2", self.hidden_dim)):
                bound = 1.0 / math.sqrt(fan_in)
                getattr(self, name).uniform_(-bound, bound)
            for name in ("b1", "b3", "b2"):
                getattr(self, name).zero_()

    def _check_not_sharded_on_gate_up(self) -> None:
        w = self.w13_E2FD
        if isinstance(w, DTensor) and any(getattr(p, "dim", None) == 1 for p in w.placements):
            raise ValueError(
                f"{type(self).__name__}.{_W13} [E, 2, F, D] is sharded on dim 1, the "
                f"size-2 gate/up axis (placements {tuple(w.placements)}): torchtitan's "
                "FSDP shards the expert parameters on Shard(1) when the FSDP x EP ranks "
                "exceed the number of experts; use at most as many FSDP x EP ranks as "
                "experts"
            )

    def _init_half(self, half: int, name: str) -> None:
        """Run ``param_init[name]`` (a ``[E, F, D]`` initializer) on one half: on a
        contiguous temporary, then copied, so a seeded init draws what the stock
        module's does (``trunc_normal_`` on a strided view draws different numbers)."""
        view = self.w13_E2FD[:, half]
        tmp = torch.empty_like(view)  # contiguous; a DTensor like a stock w1_EFD under DTensor
        self._init_param(name, tmp)
        with torch.no_grad():
            view.copy_(tmp)

    def _init_self_parameters(self) -> None:
        # init_states runs after fully_shard, on every run (checkpoint loads included).
        self._check_not_sharded_on_gate_up()
        # torchtitan's param_init covers the base's names; the adapters are ours.
        if self._param_init is not None and _W13 in self._param_init:
            self._init_param(_W13, self.w13_E2FD)  # a user-supplied fused initializer wins
            self._init_param("w2_EDF", self.w2_EDF)
        elif self._param_init is not None:  # GroupedExperts' order: w1, w2, w3
            self._init_half(0, _GATE)
            self._init_param("w2_EDF", self.w2_EDF)
            self._init_half(1, _UP)
        else:  # as torchtitan's Module: parameters and no initializer are an error
            raise ValueError(
                f"{type(self).__name__} has parameters ['{_W13}', 'w2_EDF'] but no "
                "param_init: set param_init on the Config (its w1_EFD, w2_EDF, w3_EFD "
                "initializers)"
            )
        if self.rank:
            self._init_adapters()

    def side_lora(self) -> SideLoRA | None:
        """The adapters as a :class:`~megamoe.SideLoRA` (local shards), or None."""
        if not self.rank:
            return None
        tensors = [
            (_shared_local if n in _SHARED_FACTORS else _local)(getattr(self, n))
            for n in SIDE_NAMES
        ]
        if self.backend == "fused":
            tensors = [t.to(torch.bfloat16) for t in tensors]
        return SideLoRA(*tensors, scale=self.scale)

    def forward(
        self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
    ) -> torch.Tensor:  # fmt: skip
        """``[R, D]`` rows sorted by local expert, ``[E_l]`` counts -> ``[R, D]``.

        Rows past the counts' sum (an EP dispatcher's padding) are masked routes: they
        come back as zeros.
        """
        w13, w2 = _local(self.w13_E2FD), _local(self.w2_EDF)
        experts, _, f_local, d = w13.shape
        # view, not reshape: a local shard that cannot be viewed fails loudly, no copy.
        w13 = w13.view(experts, 2 * f_local, d)
        multiple = registry().intermediate_multiple
        if f_local % multiple:
            raise ValueError(
                f"hidden_dim: this rank holds {f_local} of its {self.hidden_dim} (tensor "
                f"parallelism splits it), not a multiple of {multiple}: megamoe's kernels "
                "need each rank's slice to be one; use a TP degree that leaves one"
            )
        if x_RD.shape[0] == 0:
            return self._no_rows(x_RD, w13, w2)
        if self.backend == "fused" and w13.device.type == "cpu":
            # mm.moe's own error points at megamoe.reference.moe, which a torchtitan
            # user does not call: name the converter's option instead.
            raise ValueError(
                "backend: the fused experts need CUDA weights (a Hopper GPU), got CPU "
                "ones; MegaMoEConverter.Config(..., backend='reference') runs the same "
                "math in float32 on any device"
            )
        # Each row's expert without a host sync: the number of segment ends <= row.
        ends = torch.cumsum(num_tokens_per_expert_E, dim=0)
        rows = torch.arange(x_RD.shape[0], device=x_RD.device)
        ids = torch.bucketize(rows, ends, right=True)
        ids = torch.where(ids >= experts, torch.full_like(ids, -1), ids).view(-1, 1)
        weights = torch.ones(x_RD.shape[0], 1, dtype=torch.float32, device=x_RD.device)
        # .to() is a no-op for BF16 parameters (FSDP2's default param_dtype).
        dtype = torch.bfloat16 if self.backend == "fused" else w13.dtype
        base = prepare_base_weights(w13.to(dtype), w2.to(dtype))
        if self.backend == "reference":
            out = reference.moe(
                x_RD, ids, weights, base, self.side_lora(), compute_dtype=torch.float32
            )
        else:
            out = ops.moe(x_RD.to(torch.bfloat16), ids, weights, base, self.side_lora())
        return out.type_as(x_RD)

    def _no_rows(self, x_RD: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """``[0, D]`` for an EP rank the dispatcher sent no rows (the layer call refuses
        zero tokens outside megamoe's own EP path, and raising on one rank would leave the
        others waiting in the combine). Every weight, adapter and ``x`` still gets a
        gradient, zeros, as on the ranks with rows, so the gradient reductions (FSDP's,
        the shared factors' over EP/TP) see the same tensors on every rank."""
        side = self.side_lora()
        tensors = [x_RD, w13, w2, *(side.tensors() if side is not None else ())]
        anchor = sum(t.reshape(-1)[:0].sum() for t in tensors)  # 0, reads nothing
        return x_RD.new_zeros(0, x_RD.shape[1]) + anchor.to(x_RD.dtype)


class MegaMoEConverter(ModelConfigConverter):
    """Replace every ``GroupedExperts.Config`` in a torchtitan model config by
    :class:`MegaMoEGroupedExperts.Config` (same dims and init, plus megamoe's options).
    A subclass of it (gpt-oss's experts: other math) is refused with a ``ValueError``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        rank: int = 0
        """Side-LoRA rank; 0 keeps the base trainable and adds no adapters."""

        alpha: float | None = None
        """LoRA alpha (scale ``alpha / rank``)."""

        backend: str = "fused"
        """``"fused"`` or ``"reference"`` (float32 on any device, for tests)."""

    def __init__(self, config: Config, **kwargs):
        check_str_choice("backend", config.backend, BACKENDS)
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """Swap the experts' configs in place; returns the (same) root config."""
        converted = 0
        for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            if isinstance(cfg, MegaMoEGroupedExperts.Config):
                continue
            # LoRAConverter (listed first) froze these experts: megamoe freezes the base
            # itself and trains its side-LoRA, which is what LoRA asks of them.
            frozen_by_lora = (
                type(cfg).__module__ == _TORCHTITAN_LORA
                and type(cfg).__mro__[1] is GroupedExperts.Config
            )
            if frozen_by_lora and not self.config.rank:
                raise ValueError(
                    f"model_config: {fqn or 'the root'} was frozen by torchtitan's "
                    "LoRAConverter; MegaMoEConverter with rank=0 would train its base: "
                    "give a side-LoRA rank"
                )
            if type(cfg).__module__.startswith(_TORCHTITAN_QUANTIZATION + "."):
                raise ValueError(
                    f"model_config: {fqn or 'the root'} was quantized by a converter of "
                    f"{type(cfg).__module__}: megamoe computes the experts with its own "
                    "kernels (a BF16 or MXFP4 base); leave the grouped-experts "
                    "quantization converter out"
                )
            if type(cfg) is not GroupedExperts.Config and not frozen_by_lora:
                # A subclass computes other experts (gpt-oss: biases, interleaved gate/up,
                # its own clamped gate; Float8/MXFP8 conversions): converting it to plain
                # SwiGLU would change the model.
                raise ValueError(
                    f"model_config: {fqn or 'the root'} is a {type(cfg).__qualname__}, "
                    "not GroupedExperts.Config: megamoe's experts are bias-free SwiGLU "
                    "with [gate; up] weights; leave this model's experts unconverted"
                )
            new = MegaMoEGroupedExperts.Config(
                dim=cfg.dim,
                hidden_dim=cfg.hidden_dim,
                num_experts=cfg.num_experts,
                param_init=cfg.param_init,
                sharding_config=cfg.sharding_config,
                rank=self.config.rank,
                alpha=self.config.alpha,
                backend=self.config.backend,
            )
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted += 1
        if not converted:
            raise ValueError("model_config: found no GroupedExperts.Config to convert")
        return model_config
