"""The fused MoE backward on the GPU (EP1; BF16 or MXFP4 base), DESIGN §1 and §3.

Pipeline, given ``dout [T, H]`` and the forward's :class:`ForwardState`:

1. ``db2 = s dout b2^T`` once per token; gather ``[dout | db2]`` into the pool.
2. dgrad2, one grouped GEMM: ``z = [dout | db2]_pool @ [w2_e ; a2_e^T]`` (the adapter
   term as extra K rows).
3. activation backward (one kernel): router grad ``<z, h>``, ``dg | du`` (interleaved
   like ``w13``), ``bf16(w h)``.
4. K-grouped weight gradients over each expert's data rows (:mod:`megamoe.k_grouped_gemm`:
   padding rows never read, empty experts exact zeros): ``da2``, ``dw2``, ``dw13``
   (ordinary), ``db1``, ``db3``.
5. dgrad1: ``dx_pool = (dg | du) @ w13_e``; the ``b1``/``b3`` shrinks
   ``(dg b1_e^T | du b3_e^T)`` as a second grouped GEMM (torch), or as ``2r`` extra N
   columns of the same GEMM (the engine's dgrad1).
6. combine: ``dx = sum_k dx_pool + s (sg a1^T + su a3^T)`` (FP32, k in order), with
   ``[sg | su]`` the per-token sums of the shrinks.
7. dense shared ``da1``, ``da3``, ``db2`` once per token (FP32 sums, rounded once).

Steps 1-5 are :func:`pool_backward`, shared with the expert-parallel layer
(:mod:`megamoe.ep.fused_layer`), which runs them on the pool of received rows.

Memory policy: the forward keeps the route plan, ``q13``, ``p_sum`` and GEMM1's
pre-activations (``[T*K, 2I]`` BF16; none with activation checkpointing, which
recomputes them here). The backward frees each pool buffer as soon as its last reader
ran (docs/PERFORMANCE.md has the bytes at ep4rank).

The K-grouped weight gradients of step 4 run on our K-grouped kernel
(``MEGAMOE_WGRAD_ENGINE=0``: ``torch._grouped_mm`` over the whole segments, which relies
on zero padding rows). The dgrads of steps 2 and 5 run on ``torch._grouped_mm``
(cuBLAS/CUTLASS) unless ``MEGAMOE_DGRAD_ENGINE`` selects the engine's MN-major variants,
which are slower at ep4rank (docs/PERFORMANCE.md). Every other step is a megamoe kernel
or a small per-token torch op. Deterministic: no atomics, fixed
summation orders. No host synchronisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import pool
from .activation_backward import activation_backward, fused_dgrad2_activation_backward
from .fused_forward import ForwardState, recompute_preact
from .grouped_gemm import block_diagonal_side_weights, grouped_gemm
from .heuristics import get_block_n
from .k_grouped_gemm import k_grouped_gemm
from .registry import registry
from .routing import RoutePlan
from .side_lora import SideLoRA
from .weights import BaseWeights, mxfp4_decode_mode

__all__ = [
    "DGRAD_ENGINE_VAR",
    "GRAD_NAMES",
    "WGRAD_ENGINE_VAR",
    "PoolBackward",
    "dgrad_engine_mode",
    "mm_fp32",
    "moe_backward",
    "pool_backward",
    "wgrad_engine_enabled",
]

GRAD_NAMES = ("x", "topk_weights", "w13", "w2", "a1", "b1", "a3", "b3", "a2", "b2")

#: Opt-in switch ``MEGAMOE_DGRAD_ENGINE``: ``1`` runs dgrad1 on the grouped GEMM engine
#: (its MN-major B variants, the ``b1``/``b3`` shrink as extra N columns) and dgrad2 with
#: the activation backward as its epilogue; ``dgrad1`` / ``dgrad2`` run only that one
#: there; ``0`` (default) runs both on ``torch._grouped_mm`` plus the separate
#: activation-backward pass. Pools of BLOCK_M 128 only (the variants that exist). The
#: default follows the measurements in docs/PERFORMANCE.md ("Engine dgrads").
DGRAD_ENGINE_VAR = "MEGAMOE_DGRAD_ENGINE"
DGRAD_ENGINE_CHOICES = ("0", "1", "dgrad1", "dgrad2")


def dgrad_engine_mode() -> str:
    """``MEGAMOE_DGRAD_ENGINE``: ``"0"`` (unset), ``"1"``, ``"dgrad1"`` or ``"dgrad2"``."""
    value = os.environ.get(DGRAD_ENGINE_VAR, "0").strip() or "0"
    if value not in DGRAD_ENGINE_CHOICES:
        raise ValueError(
            f"{DGRAD_ENGINE_VAR}: expected one of {list(DGRAD_ENGINE_CHOICES)}, got {value!r}"
        )
    return value


#: ``MEGAMOE_WGRAD_ENGINE``: ``1`` (default) runs the K-grouped weight gradients on
#: :func:`~megamoe.k_grouped_gemm.k_grouped_gemm` (CUDA); ``0`` on ``torch._grouped_mm``
#: over whole pool segments (the comparison baseline of docs/PERFORMANCE.md).
WGRAD_ENGINE_VAR = "MEGAMOE_WGRAD_ENGINE"


def wgrad_engine_enabled() -> bool:
    """``MEGAMOE_WGRAD_ENGINE`` (``"1"`` unless set to ``"0"``)."""
    value = os.environ.get(WGRAD_ENGINE_VAR, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{WGRAD_ENGINE_VAR}: expected '0' or '1', got {value!r}")
    return value == "1"


def _stack_k_rows(w2: torch.Tensor, a2_t: torch.Tensor) -> torch.Tensor:
    """``[w2 ; a2^T]`` per expert, ``[E, H + r, I]``, as two plain copies.

    ``torch.cat`` with the transposed ``a2`` view takes its generic strided kernel for
    the whole result (2.9 ms for the 1 GiB ``w2`` at ep4rank, H200); copying ``w2`` into
    its slab on its own keeps that copy at memory speed. Same values bit for bit.
    """
    if a2_t.dtype != w2.dtype:  # copy_ would cast where cat promotes
        raise ValueError(f"a2: expected dtype {w2.dtype} like w2, got {a2_t.dtype}")
    experts, hidden, inter = w2.shape
    out = w2.new_empty(experts, hidden + a2_t.shape[1], inter)
    out[:, :hidden].copy_(w2)
    out[:, hidden:].copy_(a2_t)
    return out


def _deinterleave(t: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim (``2I``, interleaved gate/up blocks) into gate and up ``[.., I]``."""
    *lead, two_i = t.shape
    blocks = t.view(*lead, two_i // (2 * interleave), 2, interleave)
    return (
        blocks[..., 0, :].reshape(*lead, two_i // 2),
        blocks[..., 1, :].reshape(*lead, two_i // 2),
    )


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of BF16 operands with an FP32 result (the sum is not rounded to BF16)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@dataclass
class PoolBackward:
    """What :func:`pool_backward` returns for one pool (rows as in its plan).

    - ``dx_pool`` ``[P, H]`` BF16: each route's ``(dg | du) w13_e``.
    - ``shrink_pool`` ``[P, 2r]`` BF16 ``(dg b1_e^T | du b3_e^T)`` or None (no adapter).
    - ``dx_shrink_pool``: ``[P, H + 2r]`` when one GEMM wrote both (the engine's dgrad1;
      ``dx_pool`` and ``shrink_pool`` are then column views of it), else None.
    - ``drouter`` ``[P]`` float32: each route's ``<z, h>`` (0 on padding rows).
    - ``local``: the expert-local gradients ``b1, b3`` ``[E_l, r, I]``, ``a2``
      ``[E_l, I, r]``, ``w13`` ``[E_l, 2I, H]`` (kernel row order), ``w2`` ``[E_l, H, I]``
      (None where not asked for).
    """

    dx_pool: torch.Tensor
    shrink_pool: torch.Tensor | None
    drouter: torch.Tensor
    local: dict[str, torch.Tensor | None]
    dx_shrink_pool: torch.Tensor | None = None


def pool_backward(
    dout_rows: torch.Tensor,
    db2_rows: torch.Tensor | None,
    preact: torch.Tensor,
    route_weights: torch.Tensor,
    plan: RoutePlan,
    base: BaseWeights,
    side: SideLoRA | None,
    *,
    q13_rows: torch.Tensor | None,
    x_rows: torch.Tensor | None,
    activation: str,
    activation_clamp: float | None,
    base_grads: bool,
    side_grads: bool,
) -> PoolBackward:
    """The expert stage's backward over one pool, shared by EP1 and the EP layer.

    The ``*_rows`` tensors are indexed like the plan's routes (EP1: per token, with
    ``K`` routes each; EP: per received row, ``K = 1``); each is gathered into the pool
    here, so the pool buffers are freed as soon as their last reader ran.

    Args:
        dout_rows: ``[rows, H]`` BF16 ``dout``, or ``[rows, H + r]`` ``[dout | s dout
            b2^T]`` when ``db2_rows`` is None and an adapter is active.
        db2_rows: ``[rows, r]`` BF16 ``s dout b2^T`` (EP1) or None.
        preact: ``[P, 2I]`` BF16 GEMM1 pre-activations of the forward.
        route_weights: float32 shaped like ``plan.route_to_pool_row``.
        plan: the pool's route plan; base, side: the local experts (``side`` None: no
            active adapter).
        q13_rows: ``[rows, 2r]`` BF16 ``[x a1 | x a3]`` (for ``db1``, ``db3``) or None.
        x_rows: ``[rows, H]`` BF16 ``x`` (for ``dw13``, ordinary mode) or None.
        activation, activation_clamp: as in the forward.
        base_grads, side_grads: which expert-local gradients to form.
    """
    hidden = base.hidden
    interleave = registry().gate_up_interleave
    use_side = side is not None
    offsets = plan.expert_pool_offsets[1:]  # torch._grouped_mm's cumulative group ends

    def grouped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offsets)

    mode = dgrad_engine_mode()
    engine_pool = plan.block_m == 128 and preact.is_cuda
    engine = engine_pool and mode in ("1", "dgrad2")  # the fused dgrad2
    dgrad1_on_engine = engine_pool and mode in ("1", "dgrad1")
    # An MXFP4 base read by engine dgrads is decoded inside them (MEGAMOE_MXFP4_DECODE=
    # engine), except dgrad2 with an adapter: its B is [w2 ; a2^T], of two formats.
    mxfp4_in_engine = base.format == "mxfp4" and mxfp4_decode_mode() == "engine"

    def dgrad1(a: torch.Tensor, shrink_weights: torch.Tensor | None) -> torch.Tensor:
        """``a @ [w13_e | shrink_weights_e]`` on the engine (``[P, 2I] -> [P, H (+ 2r)]``)."""
        block_n = get_block_n(plan.block_m, hidden)
        if mxfp4_in_engine:
            w13, w13_scales = base.w13, base.w13_scales
        else:
            w13, w13_scales = base.w13_for_gemm(), None  # MXFP4: a transient decode
        return grouped_gemm(
            a,
            w13,
            plan,
            block_n=block_n,
            b_major="mn",
            b_scales=w13_scales,
            b_extra=shrink_weights,
        )

    wgrad_on_engine = preact.is_cuda and wgrad_engine_enabled()

    def k_grouped(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``[E, M, N]`` BF16 ``scale * a_e^T b_e`` over each expert's rows."""
        if wgrad_on_engine:
            return k_grouped_gemm(a, b, plan, scale=scale)
        # torch: whole segments (padding rows are zero in both operands; experts
        # without rows get exact zeros), the scale after a first rounding.
        out = torch._grouped_mm(a.T, b, offs=offsets)
        out = out.masked_fill_((plan.expert_counts == 0).view(-1, 1, 1), 0.0)
        return out if scale == 1.0 else (scale * out.float()).to(torch.bfloat16)

    local: dict[str, torch.Tensor | None] = dict.fromkeys(("b1", "b3", "a2", "w13", "w2"))
    # dgrad2 as one GEMM: z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T], the adapter
    # term as r extra K rows (z rounded once, no second [P, I] buffer).
    dout_pool = pool.gather_pool(dout_rows, db2_rows, plan)  # [P, H (+ r)]
    w2_scales = None
    if engine and mxfp4_in_engine and not use_side:
        w2, w2_scales = base.w2, base.w2_scales  # codes, decoded in the fused dgrad2
    else:
        w2 = base.w2_for_gemm()  # MXFP4: a transient decode
        if use_side:
            w2 = _stack_k_rows(w2, side.a2.transpose(1, 2))  # [E, H + r, I]
    activation_args = dict(
        activation=activation,
        activation_clamp=activation_clamp,
        weighted_h=(use_side and side_grads) or base_grads,
    )
    if engine:
        # dgrad2 with the activation backward as its epilogue: z never reaches memory.
        dgrad_preact, weighted_h, drouter = fused_dgrad2_activation_backward(
            dout_pool, w2, preact, route_weights, plan, w2_scales=w2_scales, **activation_args
        )
    else:
        z = grouped(dout_pool, w2)
    del w2
    db2_pool = None
    if use_side and side_grads:
        # s is already in these columns. Gathered on its own where possible, so the
        # [P, H + r] pool can go now.
        db2_pool = dout_pool[:, hidden:]
        if db2_rows is not None:
            db2_pool = pool.gather_pool(db2_rows, None, plan)
    # Kept only while a later reader needs it: dw2 (ordinary mode), or da2 when the
    # s dout b2^T columns were not given on their own (the EP layer's received rows).
    if not (base_grads or (db2_pool is not None and db2_rows is None)):
        del dout_pool
    if not engine:
        dgrad_preact, weighted_h, drouter = activation_backward(
            preact, z, route_weights, plan, **activation_args
        )
        del z

    # The weight gradients that contract over w h, so it can be freed.
    if use_side and side_grads:
        local["a2"] = k_grouped(weighted_h, db2_pool)  # [E, I, r]
        del db2_pool
    if base_grads:
        local["w2"] = k_grouped(dout_pool[:, :hidden], weighted_h)  # [E, H, I]
        # dw2 was their last reader: free the [P, H] dout pool and w h before the
        # [P, H] x pool arrives (ordinary mode's peak is here).
        dout_pool = weighted_h = None
        x_pool = pool.gather_pool(x_rows, None, plan)
        local["w13"] = k_grouped(dgrad_preact, x_pool)  # [E, 2I, H]
        del x_pool
    dout_pool = None  # drop the reference if it was kept
    del weighted_h
    if use_side and side_grads:
        rank = side.rank
        q13_pool = pool.gather_pool(q13_rows, None, plan)  # [P, 2r]
        b13 = k_grouped(q13_pool, dgrad_preact, side.scale)  # [E, 2r, 2I], s applied
        del q13_pool
        gate_cols, up_cols = _deinterleave(b13, interleave)
        local["b1"] = gate_cols[:, :rank].contiguous()
        local["b3"] = up_cols[:, rank:].contiguous()

    # dgrad1 and the b1/b3 shrinks.
    # (dg | du) @ this = (dg b1_e^T | du b3_e^T): GEMM1's block-diagonal side weights.
    shrink_weights = None
    if use_side:
        shrink_weights = block_diagonal_side_weights(
            side.b1.transpose(1, 2), side.b3.transpose(1, 2), interleave
        )
    if dgrad1_on_engine:
        # One GEMM: the shrinks are 2r extra N columns of dgrad1 (dg | du read once).
        out = dgrad1(dgrad_preact, shrink_weights)  # [P, H (+ 2r)]
        if not use_side:
            return PoolBackward(out, None, drouter, local)
        return PoolBackward(out[:, :hidden], out[:, hidden:], drouter, local, out)
    dx_pool = grouped(dgrad_preact, base.w13_for_gemm())  # [P, H]; MXFP4: transient decode
    shrink_pool = None
    if use_side:
        shrink_pool = grouped(dgrad_preact, shrink_weights)
    return PoolBackward(dx_pool, shrink_pool, drouter, local)


def moe_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    state: ForwardState,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    base_grads: bool = False,
    side_grads: bool = True,
) -> dict[str, torch.Tensor | None]:
    """Gradients of DESIGN §1 from the fused forward's state (module docstring).

    Args:
        dout: ``[T, H]`` BF16 gradient of the output.
        x, topk_weights, base, side: the forward's inputs (same tensors).
        state: the :class:`ForwardState` of that forward (``preact`` None: recompute).
        activation, activation_clamp: as in the forward.
        base_grads: also return ``w13`` (``[E_l, 2I, H]`` in the kernel's interleaved
            row order, like ``base.w13``) and ``w2`` ``[E_l, H, I]`` (ordinary mode).
        side_grads: return the adapter gradients (side-LoRA with an active adapter).

    Returns:
        A dict over :data:`GRAD_NAMES`: ``x`` ``[T, H]`` BF16, ``topk_weights``
        ``[T, K]`` float32 (0 on masked routes), adapter grads in BF16 (None without an
        active adapter or when ``side_grads`` is False), base grads or None.
    """
    plan = state.plan
    hidden = base.hidden
    use_side = state.q13 is not None
    s = side.scale if use_side else 0.0
    dout = dout.contiguous()
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(GRAD_NAMES)

    preact = state.preact
    if preact is None:
        preact = recompute_preact(
            x, state, base, side, activation=activation, activation_clamp=activation_clamp
        )
    db2 = None
    if use_side:
        db2 = (s * mm_fp32(dout, side.b2.T)).to(torch.bfloat16)  # [T, r], once per token
    stage = pool_backward(
        dout,
        db2,
        preact,
        topk_weights,
        plan,
        base,
        side if use_side else None,
        q13_rows=state.q13,
        x_rows=x,
        activation=activation,
        activation_clamp=activation_clamp,
        base_grads=base_grads,
        side_grads=side_grads,
    )
    del preact
    row_of_route = plan.route_to_pool_row.long()
    grads["topk_weights"] = torch.where(
        row_of_route >= 0, stage.drouter[row_of_route.clamp(min=0)], 0.0
    ).to(topk_weights.dtype)
    grads.update({k: v for k, v in stage.local.items() if v is not None})

    # dx = sum_k dx_pool + s (sg a1^T + su a3^T), k in order, FP32.
    ones = torch.ones_like(topk_weights, dtype=torch.float32)
    side_expand = shrink = None
    # One [P, H + 2r] pool when dgrad1 wrote the shrinks as its extra columns.
    dx_pool, shrink_pool, shrink_col0 = stage.dx_pool, stage.shrink_pool, 0
    if stage.dx_shrink_pool is not None:
        dx_pool = shrink_pool = stage.dx_shrink_pool
        shrink_col0 = hidden
    if use_side:
        shrink = pool.side_sum(shrink_pool, plan, ones, shrink_col0)  # [T, 2r] = [sg | su]
        side_expand = shrink @ torch.cat([side.a1, side.a3], dim=1).T  # [T, H]
    grads["x"] = pool.combine(dx_pool, plan, ones, side_expand, scale=s, hidden=hidden)
    del stage, dx_pool, shrink_pool

    # The dense shared-factor gradients, once per token, FP32 sums rounded once.
    if use_side and side_grads:
        rank = side.rank
        a13_grad = (s * mm_fp32(x.T, shrink)).to(torch.bfloat16)  # [H, 2r]
        grads["a1"] = a13_grad[:, :rank].contiguous()
        grads["a3"] = a13_grad[:, rank:].contiguous()
        grads["b2"] = (s * mm_fp32(state.p_sum.T, dout)).to(torch.bfloat16)
    return grads
