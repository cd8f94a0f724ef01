"""The fused MoE backward on the GPU (EP1; BF16 or MXFP4 base), DESIGN §1 and §3.

Pipeline, given ``dout [T, H]`` and the forward's :class:`ForwardState`:

1. ``db2 = s dout b2^T`` once per token; gather ``[dout | db2]`` into the pool.
2. dgrad2 with the activation backward as its epilogue, one engine GEMM
   (:mod:`megamoe.wrappers.activation_backward`): ``z = [dout | db2]_pool @ [w2_e ; a2_e^T]``
   (``a2^T`` a K side segment) is consumed where it is computed into the router grad
   ``<z, h>``, ``dg | du`` and ``bf16(w h)``; ``z`` never reaches memory.
3. K-grouped weight gradients over each expert's data rows (:mod:`megamoe.wrappers.k_grouped_gemm`:
   padding rows never read, empty experts exact zeros): ``da2``, ``dw2``, ``dw13``
   (ordinary), ``db1``, ``db3``.
4. dgrad1, one engine GEMM: ``dx_pool = (dg | du) @ w13_e`` with the ``b1``/``b3``
   shrinks ``(dg b1_e^T | du b3_e^T)`` as ``2r`` extra output columns (``dg | du`` is
   read once).
5. combine: ``dx = sum_k dx_pool + s (sg a1^T + su a3^T)`` (FP32, k in order), with
   ``[sg | su]`` the per-token sums of the shrinks.
6. dense shared ``da1``, ``da3``, ``db2`` once per token: sums over the tokens in FP32
   on the engine (:mod:`megamoe.wrappers.token_sum`), rounded once.

Steps 1-4 are :func:`pool_backward`, shared with the expert-parallel layer
(:mod:`megamoe.ep.fused_layer`), which runs them on the pool of received rows.

Memory policy: the forward keeps the route plan, ``q13``, ``p_sum`` and GEMM1's
pre-activations (``[T*K, 2I]`` BF16; none with activation checkpointing, which
recomputes them here). dgrad2's epilogue writes ``dg | du`` over the pre-activations
(their last reader), so a second backward through the same graph raises. The backward
frees each pool buffer as soon as its last reader ran (docs/PERFORMANCE.md has the
bytes at ep4rank). Every GEMM reads the weights in the user's layout (MXFP4: decoded
inside the GEMM pipeline) and a trainable base's gradients land in that layout.
Deterministic: no atomics, fixed summation orders. No host synchronisation. Each stage
runs in a profiler range ``megamoe::<stage>`` (:func:`megamoe.pipeline.fused_forward.stage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..side_lora import SIDE_NAMES, SideLoRA
from ..weights import BaseWeights
from ..wrappers import pool
from ..wrappers.activation_backward import fused_dgrad2_activation_backward_unchecked
from ..wrappers.grouped_gemm import grouped_gemm_unchecked
from ..wrappers.k_grouped_gemm import k_grouped_gemm_unchecked
from ..wrappers.routing import RoutePlan
from ..wrappers.token_sum import token_sum_unchecked
from .fused_forward import ForwardState, recompute_preact, stage

__all__ = [
    "GRAD_NAMES",
    "PoolBackward",
    "mm_fp32",
    "moe_backward",
    "pool_backward",
    "scaled_bf16",
]

GRAD_NAMES = ("x", "topk_weights", "w13", "w2", *SIDE_NAMES)
#: The expert-local gradients of one pool (:attr:`PoolBackward.local`).
_LOCAL_NAMES = ("b1", "b3", "a2", "w13", "w2")


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of BF16 operands with an FP32 result (the sum is not rounded to BF16)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def scaled_bf16(product: torch.Tensor, scale: float) -> torch.Tensor:
    """``bf16(scale * product)`` of an FP32 tensor (any strides) in one launch, into a new
    contiguous tensor: scaled in FP32 and rounded once, bitwise
    ``(scale * product).to(torch.bfloat16)`` without its FP32 temporary and second pass."""
    out = torch.empty(product.shape, dtype=torch.bfloat16, device=product.device)
    return torch.mul(product, scale, out=out)


@dataclass
class PoolBackward:
    """What :func:`pool_backward` returns for one pool (rows as in its plan).

    - ``dx_shrink_pool`` ``[P, H (+ 2r)]`` BF16: each route's ``(dg | du) w13_e``, then
      (with an adapter) its ``(dg b1_e^T | du b3_e^T)``.
    - ``drouter`` ``[P]`` float32: each route's ``<z, h>`` (0 on padding rows).
    - ``local``: the expert-local gradients ``b1, b3`` ``[E_l, r, I]``, ``a2``
      ``[E_l, I, r]``, ``w13`` ``[E_l, 2I, H]``, ``w2`` ``[E_l, H, I]`` (None where not
      asked for).
    """

    dx_shrink_pool: torch.Tensor
    drouter: torch.Tensor
    local: dict[str, torch.Tensor | None]


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
        preact: ``[P, 2I]`` BF16 GEMM1 pre-activations ``g | u`` of the forward;
            overwritten with ``dg | du`` (the buffer is reused: one pool-sized buffer
            less at the backward's peak).
        route_weights: float32 shaped like ``plan.route_to_pool_row``.
        plan: the pool's route plan; base, side: the local experts (``side`` None: no
            active adapter).
        q13_rows: ``[rows, 2r]`` BF16 ``[x a1 | x a3]`` (for ``db1``, ``db3``) or None.
        x_rows: ``[rows, H]`` BF16 ``x`` (for ``dw13``, ordinary mode) or None.
        activation, activation_clamp: as in the forward.
        base_grads, side_grads: which expert-local gradients to form.
    """
    args = dict(
        activation=activation,
        activation_clamp=activation_clamp,
        base_grads=base_grads,
    )
    if side is not None:
        return _side_lora_pool_backward(
            dout_rows, db2_rows, preact, route_weights, plan, base, side,
            q13_rows=q13_rows, x_rows=x_rows, side_grads=side_grads, **args,
        )  # fmt: skip
    if db2_rows is not None or q13_rows is not None:
        raise ValueError("db2_rows, q13_rows: adapter rows given without an active adapter")
    return _ordinary_pool_backward(
        dout_rows, preact, route_weights, plan, base, x_rows=x_rows, **args
    )


def _side_lora_pool_backward(
    dout_rows: torch.Tensor,
    db2_rows: torch.Tensor | None,
    preact: torch.Tensor,
    route_weights: torch.Tensor,
    plan: RoutePlan,
    base: BaseWeights,
    side: SideLoRA,
    *,
    q13_rows: torch.Tensor | None,
    x_rows: torch.Tensor | None,
    activation: str,
    activation_clamp: float | None,
    base_grads: bool,
    side_grads: bool,
) -> PoolBackward:
    """:func:`pool_backward` with an active adapter (a trainable base optional)."""
    hidden, inter, rank = base.hidden, base.intermediate, side.rank
    local: dict[str, torch.Tensor | None] = dict.fromkeys(_LOCAL_NAMES)
    # dgrad2 + activation backward: z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T].
    with stage("gather_dout"):
        dout_pool = pool.gather_pool_unchecked(dout_rows, db2_rows, plan)  # [P, H + r]
    dgrad_preact, weighted_h, drouter = _dgrad2(
        dout_pool, preact, route_weights, plan, base, side.a2,
        activation=activation, activation_clamp=activation_clamp,
        weighted_h=side_grads or base_grads,
    )  # fmt: skip
    # The weight gradients that contract over w h, then free it.
    if side_grads:
        with stage("grad_a2"):
            # s is already in the db2 columns.
            local["a2"] = k_grouped_gemm_unchecked(
                weighted_h, dout_pool[:, hidden:], plan
            )  # [E, I, r]
    if base_grads:
        with stage("grad_w2"):
            local["w2"] = k_grouped_gemm_unchecked(
                dout_pool[:, :hidden], weighted_h, plan
            )  # [E, H, I]
    # dw2 and da2 were their last readers: free the [P, H + r] dout pool and w h before
    # the [P, H] x pool arrives.
    del dout_pool, weighted_h
    if base_grads:
        local["w13"] = _grad_w13(dgrad_preact, x_rows, plan)
    if side_grads:
        with stage("grad_b13"):
            q13_pool = pool.gather_pool_unchecked(q13_rows, None, plan)  # [P, 2r]
            # The two diagonal blocks of [q1 | q3]^T (dg | du) only: db1 = s q1^T dg,
            # db3 = s q3^T du, each [E, r, I] in the adapters' layout (row-strided views in).
            local["b1"] = k_grouped_gemm_unchecked(
                q13_pool[:, :rank], dgrad_preact[:, :inter], plan, scale=side.scale
            )
            local["b3"] = k_grouped_gemm_unchecked(
                q13_pool[:, rank:], dgrad_preact[:, inter:], plan, scale=side.scale
            )
            del q13_pool
    # dgrad1 with the b1/b3 shrinks as extra columns, b1 and b3 read as given: (dg | du)
    # read once.
    with stage("dgrad1"):
        dx_shrink_pool = grouped_gemm_unchecked(
            dgrad_preact,
            base.w13,
            plan,
            b_major="mn",
            b_scales=base.w13_scales,
            b_extra_blocks=(side.b1, side.b3),
        )  # [P, H + 2r]
    return PoolBackward(dx_shrink_pool, drouter, local)


def _ordinary_pool_backward(
    dout_rows: torch.Tensor,
    preact: torch.Tensor,
    route_weights: torch.Tensor,
    plan: RoutePlan,
    base: BaseWeights,
    *,
    x_rows: torch.Tensor | None,
    activation: str,
    activation_clamp: float | None,
    base_grads: bool,
) -> PoolBackward:
    """:func:`pool_backward` without an adapter (the base trainable or not)."""
    hidden = base.hidden
    local: dict[str, torch.Tensor | None] = dict.fromkeys(_LOCAL_NAMES)
    # dgrad2 + activation backward: z = dout_pool @ w2_e.
    with stage("gather_dout"):
        dout_pool = pool.gather_pool_unchecked(dout_rows, None, plan)  # [P, H]
    dgrad_preact, weighted_h, drouter = _dgrad2(
        dout_pool, preact, route_weights, plan, base, None,
        activation=activation, activation_clamp=activation_clamp, weighted_h=base_grads,
    )  # fmt: skip
    if base_grads:
        with stage("grad_w2"):
            local["w2"] = k_grouped_gemm_unchecked(
                dout_pool[:, :hidden], weighted_h, plan
            )  # [E, H, I]
    # dw2 was their last reader: free the [P, H] dout pool and w h before the [P, H] x
    # pool arrives (ordinary mode's peak is here).
    del dout_pool, weighted_h
    if base_grads:
        local["w13"] = _grad_w13(dgrad_preact, x_rows, plan)
    with stage("dgrad1"):
        dx_pool = grouped_gemm_unchecked(
            dgrad_preact, base.w13, plan, b_major="mn", b_scales=base.w13_scales, b_extra=None
        )  # [P, H]
    return PoolBackward(dx_pool, drouter, local)


def _dgrad2(
    dout_pool: torch.Tensor,
    preact: torch.Tensor,
    route_weights: torch.Tensor,
    plan: RoutePlan,
    base: BaseWeights,
    side_a2: torch.Tensor | None,
    *,
    activation: str,
    activation_clamp: float | None,
    weighted_h: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """dgrad2 with the activation backward as its epilogue: ``(dg | du, w h or None,
    drouter)``, ``dg | du`` written over ``preact`` (its last reader), whose version is
    bumped."""
    with stage("dgrad2"):
        dgrad_preact, weighted_h_out, drouter = fused_dgrad2_activation_backward_unchecked(
            dout_pool,
            base.w2,
            preact,
            route_weights,
            plan,
            side_a2=side_a2,  # [E, I, r] as given, read K-major
            activation=activation,
            activation_clamp=activation_clamp,
            weighted_h=weighted_h,
            w2_scales=base.w2_scales,
            dgrad_out=preact,  # dg | du over g | u: this epilogue is their last reader
        )
        # The saved pre-activations now hold dg | du: a second backward through the same
        # graph (retain_graph=True) fails loudly in autograd's saved-tensor version check
        # instead of reading them.
        torch.autograd.graph.increment_version(preact)
    return dgrad_preact, weighted_h_out, drouter


def _grad_w13(dgrad_preact: torch.Tensor, x_rows: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """``dw13 [E, 2I, H]`` (a trainable base): the x pool gathered, contracted with
    ``dg | du`` and freed."""
    with stage("grad_w13"):
        x_pool = pool.gather_pool_unchecked(x_rows, None, plan)
        grad = k_grouped_gemm_unchecked(dgrad_preact, x_pool, plan)  # [E, 2I, H]
        del x_pool
    return grad


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
        base_grads: also return ``w13`` (``[E_l, 2I, H]``, the layout of ``base.w13``)
            and ``w2`` ``[E_l, H, I]`` (ordinary mode).
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
        with stage("recompute_gemm1"):
            preact = recompute_preact(
                x, state, base, side, activation=activation, activation_clamp=activation_clamp
            )
    db2 = None
    if use_side:
        with stage("adapter_dout"):
            db2 = scaled_bf16(mm_fp32(dout, side.b2.T), s)  # [T, r], once per token
    stage_grads = pool_backward(
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
    with stage("grad_router"):
        # One zero past the pool's rows: the -1 of a masked or remote route reads it.
        drouter = F.pad(stage_grads.drouter, (0, 1))
        grads["topk_weights"] = drouter[plan.route_to_pool_row].to(topk_weights.dtype)
    grads.update({k: v for k, v in stage_grads.local.items() if v is not None})

    # dx = sum_k dx_pool + s (sg a1^T + su a3^T), k in order, FP32.
    with stage("combine_dx"):
        ones = torch.ones_like(topk_weights, dtype=torch.float32)
        side_expand = shrink = None
        dx_pool = stage_grads.dx_shrink_pool  # [P, H (+ 2r)]: dx, then the shrinks
        if use_side:
            shrink = pool.side_sum_unchecked(dx_pool, plan, ones, hidden)  # [T, 2r] = [sg | su]
            side_expand = shrink @ torch.cat([side.a1, side.a3], dim=1).T  # [T, H]
        grads["x"] = pool.combine_unchecked(
            dx_pool, plan, ones, side_expand, scale=s, hidden=hidden
        )
    del stage_grads, dx_pool

    # The dense shared-factor gradients, once per token, FP32 sums rounded once.
    if use_side and side_grads:
        with stage("grad_shared"):
            rank = side.rank
            a13_grad = token_sum_unchecked(x, shrink)  # [H, 2r] FP32
            grads["a1"] = scaled_bf16(a13_grad[:, :rank], s)
            grads["a3"] = scaled_bf16(a13_grad[:, rank:], s)
            grads["b2"] = scaled_bf16(token_sum_unchecked(state.p_sum, dout), s)
    return grads
