"""The fused MoE backward on the GPU (EP1, BF16 base), DESIGN §1 and §3.

Pipeline, given ``dout [T, H]`` and the forward's :class:`ForwardState`:

1. ``db2 = s dout b2^T`` once per token; gather ``[dout | db2]`` into the pool.
2. dgrad2, one grouped GEMM: ``z = [dout | db2]_pool @ [w2_e ; a2_e^T]`` (the adapter
   term as extra K rows).
3. activation backward (one kernel): router grad
   ``<z, h>``, ``dg | du`` (interleaved like ``w13``), ``bf16(w h)``.
4. K-grouped weight gradients over each expert's pool rows (tail rows are zeros,
   empty experts exact zeros): ``da2``, ``dw2``, ``dw13`` (ordinary), ``db1``, ``db3``.
5. dgrad1: ``dx_pool = (dg | du) @ w13_e``; the ``b1``/``b3`` shrinks
   ``(dg b1_e^T | du b3_e^T)`` as a second grouped GEMM, summed over k per token.
6. combine: ``dx = sum_k dx_pool + s (sg a1^T + su a3^T)`` (FP32, k in order).
7. dense shared ``da1``, ``da3``, ``db2`` once per token.

Memory policy: the forward keeps the route plan, ``q13``, ``p_sum`` and GEMM1's
pre-activations (``[T*K, 2I]`` BF16; none with activation checkpointing, which
recomputes them here). The backward frees each pool buffer as soon as its last reader
ran (docs/PERFORMANCE.md has the bytes at ep4rank).

The grouped GEMMs of steps 2, 4 and 6 run on ``torch._grouped_mm`` (cuBLAS/CUTLASS):
our engine has no transposed-B or K-grouped mode yet, and at ep4rank it is slower
than ``torch._grouped_mm`` for these shapes (docs/PERFORMANCE.md). Every other step
is a megamoe kernel or a small per-token torch op. Deterministic: no atomics, fixed
summation orders. No host synchronisation.
"""

from __future__ import annotations

import torch

from . import pool
from .activation_backward import activation_backward
from .fused_forward import ForwardState, recompute_preact
from .registry import registry
from .side_lora import SideLoRA
from .weights import BaseWeights

__all__ = ["GRAD_NAMES", "moe_backward"]

GRAD_NAMES = ("x", "topk_weights", "w13", "w2", "a1", "b1", "a3", "b3", "a2", "b2")


def _offsets(state: ForwardState) -> torch.Tensor:
    # torch._grouped_mm takes the cumulative group ends; rows past the last are ignored.
    return state.plan.expert_pool_offsets[1:]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, state: ForwardState) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]`` over the pool (M-grouped)."""
    return torch._grouped_mm(a, b, offs=_offsets(state))


def _k_grouped_mm(a_t: torch.Tensor, b: torch.Tensor, state: ForwardState) -> torch.Tensor:
    """``out[e] = a_t[:, rows of e] @ b[rows of e]``: the K-grouped weight gradient.

    Padding rows are zero in the pool operands (gather and activation backward write
    zeros there), so they add exact zeros. Experts without routes get exact zeros.
    """
    out = torch._grouped_mm(a_t, b, offs=_offsets(state))
    empty = (state.plan.expert_counts == 0).view(-1, 1, 1)
    return out.masked_fill_(empty, 0.0)


def _side_shrink_weights(b1: torch.Tensor, b3: torch.Tensor, interleave: int) -> torch.Tensor:
    """``[E, 2I, 2r]``: ``(dg | du) @ this = (dg b1_e^T | du b3_e^T)`` with ``dg | du``
    in ``w13``'s interleave (gate rows meet ``b1^T``, up rows ``b3^T``, zeros between)."""
    experts, rank, intermediate = b1.shape
    blocks = intermediate // interleave
    weights = b1.new_zeros(experts, blocks, 2, interleave, 2 * rank)
    weights[:, :, 0, :, :rank] = b1.transpose(1, 2).reshape(experts, blocks, interleave, rank)
    weights[:, :, 1, :, rank:] = b3.transpose(1, 2).reshape(experts, blocks, interleave, rank)
    return weights.view(experts, 2 * intermediate, 2 * rank)


def _deinterleave(t: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim (``2I``, interleaved gate/up blocks) into gate and up ``[.., I]``."""
    *lead, two_i = t.shape
    blocks = t.view(*lead, two_i // (2 * interleave), 2, interleave)
    return (
        blocks[..., 0, :].reshape(*lead, two_i // 2),
        blocks[..., 1, :].reshape(*lead, two_i // 2),
    )


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
    interleave = registry().gate_up_interleave
    use_side = state.q13 is not None
    s = side.scale if use_side else 0.0
    dout = dout.contiguous()
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(GRAD_NAMES)

    # 1-2. dgrad2 as one GEMM: z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T], the
    # adapter term as r extra K rows (one BF16 rounding of z, no second [P, I] buffer).
    w2 = base.w2_for_gemm()  # MXFP4: a transient decode
    db2_pool = None
    if use_side:
        db2 = (s * (dout @ side.b2.T).float()).to(torch.bfloat16)  # [T, r], once per token
        dout_pool = pool.gather_pool(dout, db2, plan)  # [P, H + r]
        w2 = torch.cat([w2, side.a2.transpose(1, 2)], dim=1)  # [E, H + r, I]
        if side_grads:
            db2_pool = pool.gather_pool(db2, None, plan)  # [P, r]: all da2 needs later
    else:
        dout_pool = pool.gather_pool(dout, None, plan)  # [P, H]
    z = _grouped_mm(dout_pool, w2, state)
    del w2
    if not base_grads:
        del dout_pool  # freed before the next pool buffers (memory policy)

    # 3. activation backward + router grad.
    preact = state.preact
    if preact is None:
        preact = recompute_preact(
            x, state, base, side, activation=activation, activation_clamp=activation_clamp
        )
    need_weighted_h = (use_side and side_grads) or base_grads
    dgrad_preact, weighted_h, drouter = activation_backward(
        preact,
        z,
        topk_weights,
        plan,
        activation=activation,
        activation_clamp=activation_clamp,
        weighted_h=need_weighted_h,
    )
    del z, preact
    row_of_route = plan.route_to_pool_row.long()
    grads["topk_weights"] = torch.where(
        row_of_route >= 0, drouter[row_of_route.clamp(min=0)], 0.0
    ).to(topk_weights.dtype)

    # 4. The weight gradients that contract over w h, so it can be freed.
    if use_side and side_grads:
        # s is already in the gathered s dout b2^T columns.
        a2_t = _k_grouped_mm(db2_pool.T, weighted_h, state)  # [E, r, I]
        grads["a2"] = a2_t.transpose(1, 2).contiguous()
        del a2_t, db2_pool
    if base_grads:
        grads["w2"] = _k_grouped_mm(dout_pool[:, :hidden].T, weighted_h, state)  # [E, H, I]
        del dout_pool
        x_pool = pool.gather_pool(x, None, plan)
        grads["w13"] = _k_grouped_mm(dgrad_preact.T, x_pool, state)  # [E, 2I, H]
        del x_pool
    del weighted_h

    # 5. db1, db3 (K-grouped over q13 and dg | du).
    if use_side and side_grads:
        rank = side.rank
        q13_pool = pool.gather_pool(state.q13, None, plan)  # [P, 2r]
        b13 = _k_grouped_mm(q13_pool.T, dgrad_preact, state)  # [E, 2r, 2I]
        gate_cols, up_cols = _deinterleave(b13, interleave)
        grads["b1"] = (s * gate_cols[:, :rank].float()).to(torch.bfloat16)
        grads["b3"] = (s * up_cols[:, rank:].float()).to(torch.bfloat16)
        del q13_pool, b13, gate_cols, up_cols

    # 6. dgrad1 and the b1/b3 shrinks.
    dx_pool = _grouped_mm(dgrad_preact, base.w13_for_gemm(), state)  # [P, H]
    side_expand = shrink = None
    if use_side:
        shrink_weights = _side_shrink_weights(side.b1, side.b3, interleave)
        shrink_pool = _grouped_mm(dgrad_preact, shrink_weights, state)
        ones = torch.ones_like(topk_weights, dtype=torch.float32)
        shrink = pool.side_sum(shrink_pool, plan, ones, 0)  # [T, 2r] = [sg | su]
        del shrink_pool
        a13 = torch.cat([side.a1, side.a3], dim=1)  # [H, 2r]
        side_expand = shrink @ a13.T  # [T, H]
    del dgrad_preact

    # 7. dx = sum_k dx_pool + s (sg a1^T + su a3^T).
    ones = torch.ones_like(topk_weights, dtype=torch.float32)
    grads["x"] = pool.combine(dx_pool, plan, ones, side_expand, scale=s, hidden=hidden)
    del dx_pool

    # 8. The dense shared-factor gradients, once per token.
    if use_side and side_grads:
        a13_grad = (s * (x.T @ shrink).float()).to(torch.bfloat16)  # [H, 2r]
        grads["a1"] = a13_grad[:, :rank].contiguous()
        grads["a3"] = a13_grad[:, rank:].contiguous()
        grads["b2"] = (s * (state.p_sum.T @ dout).float()).to(torch.bfloat16)
    return grads
