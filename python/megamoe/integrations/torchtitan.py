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
  ``w1_EFD``/``w2_EDF``/``w3_EFD`` get ``requires_grad=False``, the factors ``a1 .. b2``
  train), or
- a trainable base (``rank = 0``).

Usage (a model registry function that takes ``converters=``, e.g. llama4/qwen3/dsv3)::

    from megamoe.integrations.torchtitan import MegaMoEConverter
    converters = [MegaMoEConverter.Config(rank=64, alpha=128.0)]

Parameters and sharding. The module keeps torchtitan's own parameters (``w1_EFD [E, F,
D]`` gate, ``w3_EFD [E, F, D]`` up, ``w2_EDF [E, D, F]``) under their names, so
checkpoints, state-dict adapters and FSDP2/EP sharding plans apply unchanged. Under
FSDP2/EP they are DTensors: each call uses the local shards (``to_local()``, no gather),
as ``GroupedExperts`` does. The adapter factors are ordinary parameters (FSDP shards
them like any other); with EP the expert-local ones (``b1``, ``b3``, ``a2``) must be
sharded along the expert dim like ``w1_EFD`` (their local shard is used).

The one copy. megamoe reads ``w13 [E, 2I, H]`` (gate rows, then up rows) as one tensor,
while torchtitan stores ``w1`` and ``w3`` as two parameters, so each call concatenates
the two local shards into one transient BF16 ``w13`` (``E_l * 2I * H`` elements, alive
until the backward; the base's gradient is split back to ``w1``/``w3``). Avoiding it
would take re-registering ``w1``/``w3`` as views of one concatenated parameter, with
state-dict hooks keeping the two names for checkpoints; that is not done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

try:
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module
except ImportError as exc:
    raise ImportError(
        "megamoe.integrations.torchtitan needs torchtitan 0.3; install the extra: "
        "pip install 'megamoe[titan]'"
    ) from exc

from .. import ops, reference
from .._checks import check_choice
from ..side_lora import SIDE_RANK_MAX, SIDE_RANK_MULTIPLE, SideLoRA
from ..weights import prepare_base_weights

__all__ = ["BACKENDS", "MegaMoEConverter", "MegaMoEGroupedExperts"]

#: ``"fused"``: :func:`megamoe.moe` (Hopper). ``"reference"``: float32 reference (tests).
BACKENDS = ("fused", "reference")
_ADAPTER_NAMES = ("a1", "b1", "a3", "b3", "a2", "b2")


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class MegaMoEGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` computed by megamoe (SwiGLU, as the original).

    Same parameters as ``GroupedExperts`` (``w1_EFD``, ``w2_EDF``, ``w3_EFD``) plus, with
    ``rank > 0``, the side-LoRA factors ``a1 [D, r]``, ``b1 [E, r, F]``, ``a3 [D, r]``,
    ``b3 [E, r, F]``, ``a2 [E, F, r]``, ``b2 [r, D]`` (float32 master weights, cast to
    BF16 every call) and the scale ``alpha / rank``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        rank: int = 0
        """Side-LoRA rank (a multiple of 16 in [16, 256]); 0: trainable base, no adapters."""

        alpha: float | None = None
        """LoRA alpha: scale ``alpha / rank``; None: scale 1."""

        backend: str = "fused"
        """``"fused"`` (Hopper kernels) or ``"reference"`` (float32, any device)."""

    def __init__(self, config: Config):
        super().__init__(config)
        check_choice("backend", config.backend, BACKENDS)
        rank = config.rank
        if rank and (rank % SIDE_RANK_MULTIPLE or not SIDE_RANK_MULTIPLE <= rank <= SIDE_RANK_MAX):
            raise ValueError(
                f"rank: expected 0 (trainable base) or a multiple of {SIDE_RANK_MULTIPLE} in "
                f"[{SIDE_RANK_MULTIPLE}, {SIDE_RANK_MAX}], got {rank}"
            )
        self.rank, self.backend = rank, config.backend
        self.scale = 1.0 if config.alpha is None or not rank else config.alpha / rank
        e, f, d, r = config.num_experts, config.hidden_dim, config.dim, rank
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
            for p in (self.w1_EFD, self.w2_EDF, self.w3_EFD):
                p.requires_grad_(False)

    def _init_adapters(self) -> None:
        """Shrink factors ``U(+-1/sqrt(fan_in))``, expand factors zero: the adapters
        start with an exactly zero contribution (as :class:`megamoe.MegaMoE`'s)."""
        with torch.no_grad():
            dim, hidden = self.w1_EFD.shape[2], self.w1_EFD.shape[1]
            for name, fan_in in (("a1", dim), ("a3", dim), ("a2", hidden)):
                bound = 1.0 / math.sqrt(fan_in)
                getattr(self, name).uniform_(-bound, bound)
            for name in ("b1", "b3", "b2"):
                getattr(self, name).zero_()

    def _init_self_parameters(self) -> None:
        # torchtitan's param_init covers the base's names; the adapters are ours.
        base = {"w1_EFD", "w2_EDF", "w3_EFD"}
        if self._param_init is not None:
            for name, param in self.named_parameters(recurse=False):
                if name in base:
                    self._init_param(name, param)
        if self.rank:
            self._init_adapters()

    def side_lora(self) -> SideLoRA | None:
        """The adapters as a :class:`~megamoe.SideLoRA` (local shards), or None."""
        if not self.rank:
            return None
        tensors = [_local(getattr(self, n)) for n in _ADAPTER_NAMES]
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
        w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        experts = w1.shape[0]
        # Each row's expert without a host sync: the number of segment ends <= row.
        ends = torch.cumsum(num_tokens_per_expert_E, dim=0)
        rows = torch.arange(x_RD.shape[0], device=x_RD.device)
        ids = torch.bucketize(rows, ends, right=True)
        ids = torch.where(ids >= experts, torch.full_like(ids, -1), ids).view(-1, 1)
        weights = torch.ones(x_RD.shape[0], 1, dtype=torch.float32, device=x_RD.device)
        dtype = torch.bfloat16 if self.backend == "fused" else w1.dtype
        # The one copy (module docstring): megamoe reads gate and up rows as one tensor.
        w13 = torch.cat([w1.to(dtype), w3.to(dtype)], dim=1)
        base = prepare_base_weights(w13, w2.to(dtype))
        if self.backend == "reference":
            out = reference.moe(
                x_RD, ids, weights, base, self.side_lora(), compute_dtype=torch.float32
            )
        else:
            out = ops.moe(x_RD.to(torch.bfloat16), ids, weights, base, self.side_lora())
        return out.type_as(x_RD)


class MegaMoEConverter(ModelConfigConverter):
    """Replace every ``GroupedExperts.Config`` in a torchtitan model config by
    :class:`MegaMoEGroupedExperts.Config` (same dims and init, plus megamoe's options)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        rank: int = 0
        """Side-LoRA rank; 0 keeps the base trainable and adds no adapters."""

        alpha: float | None = None
        """LoRA alpha (scale ``alpha / rank``)."""

        backend: str = "fused"
        """``"fused"`` or ``"reference"`` (float32 on any device, for tests)."""

    def __init__(self, config: Config, **kwargs):
        check_choice("backend", config.backend, BACKENDS)
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """Swap the experts' configs in place; returns the (same) root config."""
        converted = 0
        for _fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            if isinstance(cfg, MegaMoEGroupedExperts.Config):
                continue
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
