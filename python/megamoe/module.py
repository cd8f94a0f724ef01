"""``mm.MegaMoE``: the MoE expert block as a ``torch.nn.Module`` (DESIGN §5).

The module owns the expert weights and the shared-outer side-LoRA adapters as
``nn.Parameter``s and calls :func:`megamoe.moe` (``backend="fused"``) or
:func:`megamoe.reference.moe` (``backend="reference"``, float32, runs on the CPU).
Routing is the trainer's: ``forward(x, topk_ids, topk_weights)``.

Two training modes:

- frozen base with trainable adapters (``trainable_base=False``, the default): the
  prepared base (:func:`~megamoe.prepare_base_weights`, BF16 or MXFP4) is cached and
  rebuilt automatically when ``w13``/``w2`` change (see :meth:`MegaMoE.base_weights`);
- ordinary mode (``trainable_base=True``): the base is prepared every call,
  differentiably, so gradients reach ``w13``/``w2`` (with ``base_format="mxfp4"``
  straight through the quantizer: they are its master weights).

The adapters are wrapped in a :class:`~megamoe.SideLoRA` on every call: the optimizer
updates the parameters in place and the next call sees them (no refresh step).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from . import ops, reference
from .side_lora import SIDE_NAMES, SideLoRA, check_side_rank
from .validation.arguments import (
    check_finite_float,
    check_int,
    check_str_choice,
    check_tensor,
    has_data,
)
from .validation.layer import check_activation, check_devices, check_kernel_dims
from .weights import BASE_FORMATS, BaseWeights, prepare_base_weights

__all__ = ["BACKENDS", "MegaMoE"]

#: ``"fused"``: :func:`megamoe.moe` (CUDA kernels). ``"reference"``:
#: :func:`megamoe.reference.moe` in float32 (any device; for tests and debugging).
BACKENDS = ("fused", "reference")

_BASE_NAMES = ("w13", "w2")
# prepare_base_weights takes BF16 or FP32; FP32 keeps master weights for the optimizer.
_PARAM_DTYPES = (torch.bfloat16, torch.float32)
# Router weights: FP32, or BF16 as an HF router in a BF16 model returns them.
_ROUTER_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


class MegaMoE(nn.Module):
    """Routed-expert MoE block with shared-outer side-LoRA adapters (DESIGN §1).

    Args:
        hidden: ``H``, a multiple of the registry's ``hidden_multiple`` (64).
        intermediate: ``I`` per expert, a multiple of ``intermediate_multiple`` (64).
        num_experts: ``E``; this module holds every expert (EP1).
        top_k: ``K``, the routes per token ``forward`` expects.
        side_rank: adapter rank ``r`` (a multiple of 16 in [16, 256]); ``0`` or
            ``None`` builds no adapters (``a1`` .. ``b2`` are ``None``).
        side_scale: the adapter scale ``s``. Give at most one of ``side_scale`` and
            ``side_alpha``; with neither, ``s = 1.0`` (LoRA's ``alpha = r``). Either
            needs adapters: with ``side_rank`` 0 or None a scale is refused, not dropped.
        side_alpha: LoRA-style ``alpha``: ``s = side_alpha / side_rank``.
        activation: ``"swiglu"`` or ``"geglu"``.
        activation_clamp: ``None`` or ``c > 0`` (``g = min(g, c)``, ``u = clamp(u, ±c)``).
        trainable_base: ordinary mode: ``w13``/``w2`` require grad and the base is
            prepared differentiably every call. ``False``: frozen base, prepared once
            and cached. The mode follows the parameters' ``requires_grad`` at call
            time, so ``layer.requires_grad_(False)`` freezes the base too.
        base_format: ``"bf16"`` or ``"mxfp4"`` (the kernels read a quantized copy; in
            ordinary mode ``w13``/``w2`` are its master weights, trained straight
            through the quantizer, which runs again every call).
        param_dtype: storage dtype of the parameters: ``torch.bfloat16`` (default) or
            ``torch.float32`` (master weights; each call casts them to BF16
            differentiably, which the fused kernels read). ``dtype`` is an alias, as
            in ``nn.Linear``'s factory kwargs.
        backend: ``"fused"`` (default) or ``"reference"``.
        activation_checkpoint: fused backend: recompute GEMM1's pre-activations in the
            backward instead of keeping them (``T*K*2I`` BF16) between forward and
            backward (``mm.moe``'s option of the same name).
        device: factory kwarg: where the parameters are created.
        dtype: factory kwarg, alias of ``param_dtype``.

    Parameters (nn.Linear layout per expert):
        ``w13 [E, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up), ``w2 [E, H, I]``;
        adapters ``a1 [H, r]``, ``b1 [E, r, I]``, ``a3 [H, r]``, ``b3 [E, r, I]``,
        ``a2 [E, I, r]``, ``b2 [r, H]``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        side_rank: int | None = 128,
        *,
        side_scale: float | None = None,
        side_alpha: float | None = None,
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        trainable_base: bool = False,
        base_format: str = "bf16",
        param_dtype: torch.dtype | None = None,
        backend: str = "fused",
        activation_checkpoint: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden = check_int("hidden", hidden, minimum=1)
        self.intermediate = check_int("intermediate", intermediate, minimum=1)
        check_kernel_dims("hidden", hidden, "intermediate", intermediate)
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        # top_k may exceed num_experts: a layer holding one rank's experts sees the
        # other ranks' routes masked (-1), as mm.moe and get_block_m allow.
        self.top_k = check_int("top_k", top_k, minimum=1)
        if side_rank is None:
            side_rank = 0
        side_rank = check_int("side_rank", side_rank, minimum=0)
        check_side_rank("side_rank", side_rank, zero="0/None (no adapters)")
        self.side_rank = side_rank
        self.side_scale = _resolve_scale(side_scale, side_alpha, side_rank)
        check_activation(activation, activation_clamp)  # as mm.moe checks them
        self.activation = activation
        self.activation_clamp = None if activation_clamp is None else float(activation_clamp)
        if not isinstance(trainable_base, bool):
            raise TypeError(f"trainable_base: expected a bool, got {type(trainable_base).__name__}")
        check_str_choice("base_format", base_format, BASE_FORMATS)
        self.base_format = base_format
        check_str_choice("backend", backend, BACKENDS)
        self.backend = backend
        if not isinstance(activation_checkpoint, bool):
            kind = type(activation_checkpoint).__name__
            raise TypeError(f"activation_checkpoint: expected a bool, got {kind}")
        # Fused backend: keep only small per-token state between forward and backward
        # and recompute GEMM1's pre-activations in the backward (mm.moe's option).
        self.activation_checkpoint = activation_checkpoint
        if param_dtype is not None and dtype is not None and param_dtype != dtype:
            raise ValueError(
                f"dtype: alias of param_dtype, got both param_dtype={param_dtype} and dtype={dtype}"
            )
        given = "param_dtype" if param_dtype is not None else "dtype"  # the one to name
        param_dtype = param_dtype or dtype or torch.bfloat16
        if param_dtype not in _PARAM_DTYPES:
            raise TypeError(f"{given}: expected torch.bfloat16 or torch.float32, got {param_dtype}")

        factory = {"device": device, "dtype": param_dtype}
        h, i, e, r = hidden, intermediate, num_experts, side_rank
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **factory), requires_grad=trainable_base)
        self.w2 = nn.Parameter(torch.empty(e, h, i, **factory), requires_grad=trainable_base)
        if r:
            self.a1 = nn.Parameter(torch.empty(h, r, **factory))
            self.b1 = nn.Parameter(torch.empty(e, r, i, **factory))
            self.a3 = nn.Parameter(torch.empty(h, r, **factory))
            self.b3 = nn.Parameter(torch.empty(e, r, i, **factory))
            self.a2 = nn.Parameter(torch.empty(e, i, r, **factory))
            self.b2 = nn.Parameter(torch.empty(r, h, **factory))
        else:
            for name in SIDE_NAMES:
                self.register_parameter(name, None)
        # (key, BaseWeights) of the frozen base; see base_weights().
        # (key, weak references to w13 and w2, the prepared base): see base_weights.
        self._base_cache: tuple[tuple, tuple, BaseWeights] | None = None
        self.reset_parameters()

    # ------------------------------------------------------------------ init

    def reset_parameters(self) -> None:
        """Base like ``nn.Linear``'s default, adapters LoRA-style (zero contribution).

        Base: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` per expert, which is what
        ``nn.Linear`` draws (kaiming-uniform with ``a = sqrt(5)``). It is written out
        because ``nn.init.kaiming_uniform_`` on the stacked ``[E, out, in]`` tensor
        would take ``out * in`` as the fan-in.

        Adapters: the expand factors ``b1``, ``b3``, ``b2`` are zero and the shrink
        factors ``a1``, ``a3``, ``a2`` are drawn like nn.Linear weights (fan-in ``H``
        for ``a1``/``a3``, ``I`` for ``a2``). One zero factor per product makes the
        initial adapter contribution exactly zero, so wrapping a pretrained layer
        starts from its exact output; the other factor is random so the zero factor
        still gets a gradient (``db = s q^T dg`` with ``q = x a != 0``). Both zero
        would be a saddle point: neither factor would ever receive a gradient.
        """
        with torch.no_grad():
            _uniform_fan_in(self.w13, self.hidden)
            _uniform_fan_in(self.w2, self.intermediate)
            if self.side_rank:
                _uniform_fan_in(self.a1, self.hidden)
                _uniform_fan_in(self.a3, self.hidden)
                _uniform_fan_in(self.a2, self.intermediate)
                for t in (self.b1, self.b3, self.b2):
                    t.zero_()
        self._base_cache = None

    # ------------------------------------------------------------ parameters

    @property
    def trainable_base(self) -> bool:
        """Ordinary mode: true when ``w13`` or ``w2`` requires grad (checked every call)."""
        return bool(self.w13.requires_grad or self.w2.requires_grad)

    def adapter_parameters(self) -> list[nn.Parameter]:
        """The six adapter parameters ``[a1, b1, a3, b3, a2, b2]`` (empty without adapters)."""
        if not self.side_rank:
            return []
        return [getattr(self, name) for name in SIDE_NAMES]

    def base_parameters(self) -> list[nn.Parameter]:
        """The base expert weights ``[w13, w2]`` (for an ordinary-mode optimizer group)."""
        return [self.w13, self.w2]

    def side_lora(self) -> SideLoRA | None:
        """The adapters as a :class:`~megamoe.SideLoRA` for this backend, or ``None``.

        The fused backend gets BF16 tensors (a differentiable cast of FP32 master
        weights); the reference backend gets the parameters as they are.
        """
        if not self.side_rank:
            return None
        tensors = [getattr(self, name) for name in SIDE_NAMES]
        if self.backend == "fused":
            tensors = [t.to(torch.bfloat16) for t in tensors]
        return SideLoRA(*tensors, scale=self.side_scale)

    @torch.no_grad()
    def load_side_lora(self, side: SideLoRA) -> None:
        """Copy adapters (e.g. from :mod:`megamoe.adapter_convert`) into this module.

        Args:
            side: a :class:`~megamoe.SideLoRA` with this module's ``H``, ``I``, ``E``
                and rank. Its tensors are cast to the parameter dtype/device; its
                ``scale`` becomes ``side_scale``.
        """
        if not isinstance(side, SideLoRA):
            raise TypeError(f"side: expected a megamoe.SideLoRA, got {type(side).__name__}")
        if not self.side_rank:
            raise ValueError("side: this MegaMoE was built without adapters (side_rank=0)")
        want = (self.hidden, self.intermediate, self.num_experts, self.side_rank)
        got = (side.hidden, side.intermediate, side.num_experts, side.rank)
        if got != want:
            raise ValueError(
                f"side: expected adapters for H={want[0]}, I={want[1]}, E={want[2]}, r={want[3]}, "
                f"got H={got[0]}, I={got[1]}, E={got[2]}, r={got[3]}"
            )
        for name, value in zip(SIDE_NAMES, side.tensors()):
            getattr(self, name).copy_(value)
        self.side_scale = side.scale

    # The scale is a hyperparameter; keeping it in the state dict makes a checkpoint of
    # converted adapters (whose scale came with them) self-contained. It is stored as a
    # 0-d float64 tensor because save_pretrained (huggingface_hub / safetensors) accepts
    # tensors only; a dict from an older checkpoint is still read.
    # Without adapters (side_rank=0) the scale means nothing: an empty tensor, which
    # loading leaves the scale alone for (a base-only checkpoint loaded with
    # strict=False into a module with adapters keeps that module's scale).
    def get_extra_state(self) -> torch.Tensor:
        if not self.side_rank:
            return torch.empty(0, dtype=torch.float64, device="cpu")
        # On the CPU whatever the default device (under `with torch.device("meta")` a
        # meta scale would have no value to load).
        return torch.tensor(self.side_scale, dtype=torch.float64, device="cpu")

    def set_extra_state(self, state: torch.Tensor | dict) -> None:
        if isinstance(state, dict):
            state = state["side_scale"]
        if isinstance(state, torch.Tensor) and state.numel() == 0:
            return  # a module without adapters saved it
        if isinstance(state, torch.Tensor) and not has_data(state):
            return  # a meta or fake state (a meta -> meta load) carries no value
        if isinstance(state, torch.Tensor):
            if state.numel() != 1:
                raise ValueError(
                    f"_extra_state: expected the side scale as one value, got shape "
                    f"{list(state.shape)}"
                )
            state = state.item()
        self.side_scale = check_finite_float("side_scale", state, float32=True)

    # ------------------------------------------------------------- base cache

    def base_weights(self) -> BaseWeights:
        """The prepared base for the next call.

        Ordinary mode: prepared now, keeping the autograd link to ``w13``/``w2``.
        Frozen base: prepared under ``no_grad`` (outside inference mode, so a cache made
        by an inference-mode call also serves a training call) and cached; the cache is
        keyed on each tensor itself (a weak reference), its storage address and version
        counter, so ``load_state_dict``, an in-place edit (``with torch.no_grad():
        layer.w13.mul_(2)``), ``.to()`` or assigning a new tensor (even one at a freed
        tensor's address) all rebuild it. Writes that bypass the version counter need
        :meth:`invalidate_base_cache` after them: through ``.data``, by a c10d collective
        into the parameter (``dist.broadcast``), or under
        ``torch.autograd._unsafe_preserve_version_counter`` (FSDP2's unshard copies).
        """
        if self.trainable_base:
            self._base_cache = None  # don't hold a stale frozen copy next to a live one
            # Every step: no host read of a finiteness flag (a synchronisation per step).
            return prepare_base_weights(
                self.w13, self.w2, format=self.base_format, check_finite=False
            )
        if torch.compiler.is_compiling():
            # Traced: the cache key reads data_ptr and the version counter, which a
            # compiled graph cannot; prepare inside the graph instead (for BF16 a view
            # of the parameters once prepare_base_weights reads the user's layout).
            with torch.no_grad():
                return prepare_base_weights(self.w13, self.w2, format=self.base_format)
        key = self._base_key()
        cached = self._base_cache_hit(key)
        if cached is not None:
            return cached
        with torch.inference_mode(False), torch.no_grad():
            base = prepare_base_weights(self.w13, self.w2, format=self.base_format)
        sources = (weakref.ref(self.w13), weakref.ref(self.w2))
        self._base_cache = None if key is None else (key, sources, base)
        return base

    def invalidate_base_cache(self) -> None:
        """Drop the cached frozen base; the next call prepares it again."""
        self._base_cache = None

    def _base_key(self) -> tuple | None:
        parts = []
        for t in (self.w13, self.w2):
            if not has_data(t):  # fake or meta parameters: no address to key on
                return None
            try:
                version = t._version
            except RuntimeError:  # inference tensors keep no version counter: don't cache
                return None
            parts.append((t.data_ptr(), version, t.dtype, t.device))
        return (self.base_format, *parts)

    def _base_cache_hit(self, key: tuple | None) -> BaseWeights | None:
        """The cached base if ``key`` matches and it was made from these very tensors (a
        new tensor at a freed one's address, with an equal version count, is not)."""
        if key is None or self._base_cache is None:
            return None
        cached_key, sources, base = self._base_cache
        same = all(ref() is t for ref, t in zip(sources, (self.w13, self.w2), strict=True))
        return base if same and cached_key == key else None

    def __getstate__(self) -> dict:
        # Pickled (torch.save of the module, spawn-based workers, deepcopy) without the
        # cache: it holds weak references, which do not pickle, and a prepared copy of
        # the base that the next call rebuilds.
        state = dict(super().__getstate__())  # a copy: the live module keeps its cache
        state["_base_cache"] = None
        return state

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        # The cache's weak references make torch.utils.swap_tensors refuse w13/w2, which
        # load_state_dict uses under torch.__future__.set_swap_module_params_on_conversion
        # (DTensor / FSDP2 parameters); and a load replaces the base anyway.
        self._base_cache = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        # .to()/.cuda()/.half() replace the parameters; drop the prepared copy now so
        # the old device's memory is freed rather than held until the next call.
        self._base_cache = None
        return super()._apply(fn, recurse)

    # ----------------------------------------------------------------- forward

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Run the MoE block.

        Args:
            x: ``[T, H]`` tokens (bfloat16 for the fused backend; bf16/fp32/fp64 for
                the reference).
            topk_ids: ``[T, K]`` int32/int64 expert ids, ``-1`` = masked route;
                ``K`` must equal ``top_k``.
            topk_weights: ``[T, K]`` router weights, float32 or bfloat16 (an HF router
                in a BF16 model returns BF16; cast to float32 here, differentiably, so
                the router gradient comes back in the router's dtype); the reference
                backend also takes float64.

        Returns:
            ``[T, H]`` in ``x.dtype`` (the reference computes in float32 and casts).

        Raises:
            ValueError: an expert id outside ``[-1, num_experts)``. Both backends reject
                them: the reference here, at once (it would otherwise treat them as
                routes to another rank); the fused backend at once for CPU ids and, for
                CUDA ids, on the device without a host sync, raised by a later call or
                :func:`megamoe.check_errors` (the call that had them computes those
                routes as masked). Masking another rank's
                routes is the caller's job (the HF integration maps HF's sentinel ids to
                ``-1``: :func:`megamoe.integrations.transformers.mask_foreign_ids`).
        """
        if self.w13.dtype not in _PARAM_DTYPES:  # a .half() or .to(dtype) of the module
            raise TypeError(
                f"MegaMoE: its parameters are {self.w13.dtype} (converted after it was "
                "built?); it runs on torch.bfloat16 or torch.float32 parameters "
                "(param_dtype): convert it back with .to(torch.bfloat16)"
            )
        check_tensor("x", x, ndim=2)
        if x.shape[1] != self.hidden:
            raise ValueError(
                f"x: expected shape [T, {self.hidden}] (hidden={self.hidden}), got {list(x.shape)}"
            )
        check_tensor("topk_ids", topk_ids, ndim=2)
        if topk_ids.shape[1] != self.top_k:
            raise ValueError(
                f"topk_ids: expected shape [T, {self.top_k}] (top_k={self.top_k}), got "
                f"{list(topk_ids.shape)}"
            )
        check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_ROUTER_DTYPES)
        routes = (x.shape[0], self.top_k)
        check_tensor("topk_ids", topk_ids, shape=routes)
        check_tensor("topk_weights", topk_weights, shape=routes)
        if topk_weights.dtype == torch.bfloat16:
            topk_weights = topk_weights.to(torch.float32)
        if self.backend == "reference":
            self._check_ids(topk_ids)
        else:
            # What mm.moe refuses, checked before the base is prepared (a BF16 copy, or
            # an MXFP4 quantization of every expert, is no work for a refusal).
            check_tensor("x", x, dtypes=(torch.bfloat16,), contiguous=True)
            check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), contiguous=True)
            if topk_weights.dtype != torch.float32:
                raise TypeError(
                    f"topk_weights: expected dtype float32 or bfloat16 for the fused backend, "
                    f"got {topk_weights.dtype} (backend='reference' takes float64)"
                )
            check_tensor("topk_weights", topk_weights, contiguous=True)
            named = [("base", self.w13), ("x", x), ("topk_ids", topk_ids)]
            check_devices([*named, ("topk_weights", topk_weights)], "base")
            if has_data(self.w13) and not self.w13.is_cuda:
                raise ValueError(
                    f"base: expected CUDA weights for the fused backend, got {self.w13.device} "
                    "(MegaMoE(..., backend='reference') runs on any device)"
                )
        base = self.base_weights()
        side = self.side_lora()
        kwargs = {"activation": self.activation, "activation_clamp": self.activation_clamp}
        if self.backend == "reference":
            out = reference.moe(
                x, topk_ids, topk_weights, base, side, compute_dtype=torch.float32, **kwargs
            )
            return out.to(x.dtype)
        return ops.moe(
            x,
            topk_ids,
            topk_weights,
            base,
            side,
            activation_checkpoint=self.activation_checkpoint,
            **kwargs,
        )

    def _check_ids(self, topk_ids: torch.Tensor) -> None:
        """Reject ids outside ``[-1, num_experts)`` (the fused op's rule; the reference
        alone would take ids >= E_l as remote routes). Reads the extremes back to the
        host, so the reference backend is not capturable in a CUDA graph."""
        if topk_ids.numel() == 0 or topk_ids.dtype not in (torch.int32, torch.int64):
            return  # empty; a wrong dtype is reported by the reference's own check
        if not has_data(topk_ids):
            return  # meta or fake ids: no values (the reference checks their device)
        lowest, highest = int(topk_ids.min()), int(topk_ids.max())
        if lowest < -1 or highest >= self.num_experts:
            bad = highest if highest >= self.num_experts else lowest
            raise ValueError(
                f"topk_ids: expected expert ids in [0, {self.num_experts}) or -1 (masked "
                f"route), got {bad}; map other ranks' experts to -1 before the call"
            )

    def extra_repr(self) -> str:
        base = "trainable" if self.trainable_base else "frozen"
        parts = [
            f"hidden={self.hidden}",
            f"intermediate={self.intermediate}",
            f"num_experts={self.num_experts}",
            f"top_k={self.top_k}",
            f"side_rank={self.side_rank}",
        ]
        if self.side_rank:
            parts.append(f"side_scale={self.side_scale:g}")
        parts += [f"activation={self.activation!r}"]
        if self.activation_clamp is not None:
            parts.append(f"activation_clamp={self.activation_clamp:g}")
        parts += [
            f"base={base} {self.base_format}",
            f"param_dtype={str(self.w13.dtype).replace('torch.', '')}",
            f"backend={self.backend!r}",
        ]
        if self.activation_checkpoint:
            parts.append("activation_checkpoint=True")
        return ", ".join(parts)

    def named_adapter_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for the adapters (for optimizer groups by name)."""
        for name in SIDE_NAMES if self.side_rank else ():
            yield name, getattr(self, name)


def _resolve_scale(side_scale: float | None, side_alpha: float | None, rank: int) -> float:
    if side_scale is not None and side_alpha is not None:
        raise ValueError(
            f"side_scale: give side_scale or side_alpha (s = alpha / side_rank), not both; got "
            f"side_scale={side_scale}, side_alpha={side_alpha}"
        )
    if side_scale is not None:
        side_scale = check_finite_float("side_scale", side_scale, float32=True)
        if not rank:  # a scale no adapter would use, dropped silently otherwise
            raise ValueError("side_scale: needs adapters (side_rank > 0) to scale")
        return side_scale
    if side_alpha is not None:
        alpha = check_finite_float("side_alpha", side_alpha)
        if not rank:
            raise ValueError("side_alpha: needs adapters (side_rank > 0) to define alpha / rank")
        return check_finite_float("side_alpha / side_rank", alpha / rank, float32=True)
    return 1.0


def _uniform_fan_in(t: torch.Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(t, -bound, bound)
