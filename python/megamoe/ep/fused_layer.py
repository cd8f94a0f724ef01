"""The expert-parallel MoE layer on the fused kernels (DESIGN §3, §4).

Per rank, with the maps of :func:`~megamoe.ep.plan.plan_dispatch`:

forward
  ``q13 = x [a1 | a3]`` once per token -> exchange ``[x | q13]`` per route to the
  expert's rank (``all_to_all_single``, straight into a receive buffer of the group's
  rank-uniform size) -> pool gather over the received rows -> GEMM1 + side K segment +
  gated activation (pre-activations saved) -> GEMM2 + ``a2`` N segment -> the received
  rows' ``[y | p]`` back to their source (reverse exchange, send order) -> the EP1
  combine kernels over the returned rows: ``p_sum = sum_k w p``, ``out = sum_k w y +
  s p_sum b2`` (FP32, ``k`` in order).
backward
  ``db2 = s dout b2^T`` once per token -> exchange ``[dout | db2]`` rows and the route
  weights (FP32) -> pool gather -> dgrad2 (``a2`` as extra K rows), activation
  backward, dgrad1 and the
  ``b1``/``b3`` shrinks on the pool (the EP1 stages) -> ``[dx_route | sg | su]`` rows
  and the router grads back -> ``dx = sum_k dx_route + s (sg a1^T + su a3^T)`` with the
  combine kernels; expert-local grads (``b1, b3, a2``; ``w13, w2`` in ordinary mode) by
  the K-grouped GEMMs; shared ``a1, a3, b2`` grads in FP32, all-reduced (SUM) over the
  group by default.

Every expert sees its rows in the order an EP1 run over the concatenated global batch
would (docs/EXPERT-PARALLEL.md), and every sum runs in a fixed order, so the result is
deterministic; it equals EP1 up to the order of the shared-grad sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import pool
from .._checks import check_choice, check_tensor
from ..activation_backward import activation_backward
from ..fused_backward import GRAD_NAMES, _deinterleave, _side_shrink_weights
from ..grouped_gemm import ACTIVATIONS, gated_grouped_gemm, grouped_gemm
from ..heuristics import get_block_n
from ..registry import registry
from ..side_lora import SideLoRA
from ..weights import BaseWeights
from .exchange import reduce_shared_grads
from .plan import DispatchPlan, group_size, plan_dispatch

__all__ = ["fused_ep_moe", "moe"]


def _exchange_into(
    out_rows: int,
    send: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``all_to_all_single`` into the first ``sum(recv_splits)`` rows of a new
    ``[out_rows, ...]`` buffer (the rest stays unwritten: the pool plan never reads it)."""
    received = sum(recv_splits)
    out = send.new_empty((out_rows, *send.shape[1:]))
    if group is None:
        out[:received].copy_(send)
    elif received or send.shape[0]:
        dist.all_to_all_single(
            out[:received], send.contiguous(), list(recv_splits), list(send_splits), group=group
        )
    return out


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of BF16 operands with an FP32 result (no BF16 rounding of the sum)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=plan.pool.expert_pool_offsets[1:])


def _k_grouped_mm(a_t: torch.Tensor, b: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    out = torch._grouped_mm(a_t, b, offs=plan.pool.expert_pool_offsets[1:])
    return out.masked_fill_((plan.pool.expert_counts == 0).view(-1, 1, 1), 0.0)


class _FusedEPMoE(torch.autograd.Function):
    """Forward and backward of the fused EP layer (both contain collectives)."""

    @staticmethod
    def forward(ctx, options, plan, x, topk_weights, w13, w2, *side_tensors):
        hidden = w2.shape[1]
        intermediate = w2.shape[2]
        s = options["scale"]
        use_side = bool(side_tensors) and s != 0.0
        ctx.topk_dtype = topk_weights.dtype
        x = x.detach()
        topk_weights = topk_weights.detach().float().contiguous()
        w13, w2 = w13.detach(), w2.detach()
        side = tuple(t.detach() for t in side_tensors) if side_tensors else None
        token_rows = x
        if use_side:
            a1, b1, a3, b3, a2, b2 = side
            token_rows = torch.cat([x, x @ a1, x @ a3], dim=1)  # [x | q13], once per token
        recv = _exchange_into(
            plan.pool_routes,
            token_rows.index_select(0, plan.send_tokens),
            plan.send_splits,
            plan.recv_splits,
            plan.group,
        )
        routes = plan.pool
        pool_input = pool.gather_pool(recv, None, routes)
        preact = torch.empty(
            routes.pool_capacity, 2 * intermediate, dtype=torch.bfloat16, device=x.device
        )
        side_gemm1 = {}
        b_extra = None
        if use_side:
            side_gemm1 = dict(
                side_b_gate=b1.transpose(1, 2).contiguous(),
                side_b_up=b3.transpose(1, 2).contiguous(),
                side_scale=s,
            )
            b_extra = a2.transpose(1, 2).contiguous()
        hidden_pool = gated_grouped_gemm(
            pool_input,
            w13,
            routes,
            k=hidden,
            activation=options["activation"],
            activation_clamp=options["activation_clamp"],
            preact_out=preact,
            block_n=get_block_n(routes.block_m, 2 * intermediate),
            **side_gemm1,
        )
        del pool_input
        pool_output = grouped_gemm(
            hidden_pool,
            w2,
            routes,
            b_extra=b_extra,
            block_n=get_block_n(routes.block_m, hidden),
        )
        del hidden_pool
        row_of_recv = routes.route_to_pool_row[: plan.num_recv, 0].long()
        returned = _exchange_into(
            plan.num_send,
            pool_output.index_select(0, row_of_recv),
            plan.recv_splits,
            plan.send_splits,
            plan.group,
        )
        del pool_output
        back = plan.return_plan
        side_expand = p_sum = None
        if use_side:
            p_sum = pool.side_sum(returned, back, topk_weights, hidden)  # [T, r]
            side_expand = p_sum @ b2
        out = pool.combine(
            returned, back, topk_weights, side_expand, scale=s if use_side else 0.0, hidden=hidden
        )
        ctx.plan = plan
        ctx.options = options
        ctx.use_side = use_side
        ctx.has_side = side is not None
        # Received q13 (small) for db1/db3; the received x only in ordinary mode (dw13).
        # Copied from the received rows only: the buffer's tail is never written.
        received = plan.num_recv
        keep_recv = recv_q13 = None
        if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:
            keep_recv = recv
            if recv.shape[1] != hidden:
                keep_recv = recv.new_zeros(plan.pool_routes, hidden)
                keep_recv[:received] = recv[:received, :hidden]
        if use_side:
            recv_q13 = recv.new_zeros(plan.pool_routes, recv.shape[1] - hidden)
            recv_q13[:received] = recv[:received, hidden:]
        ctx.save_for_backward(
            x, topk_weights, w13, w2, preact, keep_recv, recv_q13, p_sum, *(side or ())
        )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        plan, options = ctx.plan, ctx.options
        x, topk_weights, w13, w2, preact, recv_x, recv_q13, p_sum, *side = ctx.saved_tensors
        needs = ctx.needs_input_grad
        base_grads = bool(needs[4] or needs[5])
        use_side = ctx.use_side
        s = options["scale"]
        hidden = w2.shape[1]
        interleave = registry().gate_up_interleave
        routes = plan.pool
        dout = dout.to(torch.bfloat16).contiguous()

        # Out: [dout | s dout b2^T] rows and the route weights (FP32, not rounded).
        token_rows = dout
        if use_side:
            a1, b1, a3, b3, a2, b2 = side
            db2 = (s * (dout @ b2.T).float()).to(torch.bfloat16)  # once per token
            token_rows = torch.cat([dout, db2], dim=1)
        recv = _exchange_into(
            plan.pool_routes,
            token_rows.index_select(0, plan.send_tokens),
            plan.send_splits,
            plan.recv_splits,
            plan.group,
        )
        recv_w = torch.zeros(plan.pool_routes, 1, dtype=torch.float32, device=dout.device)
        recv_w[: plan.num_recv] = _exchange_into(
            plan.num_recv,
            topk_weights.reshape(-1).index_select(0, plan.send_routes)[:, None],
            plan.send_splits,
            plan.recv_splits,
            plan.group,
        )
        dout_pool = pool.gather_pool(recv, None, routes)  # [P, H (+ r)]
        del recv

        # The EP1 expert stages on the pool; dgrad2 with the a2 term as extra K rows.
        w2_k = torch.cat([w2, a2.transpose(1, 2)], dim=1) if use_side else w2
        z = _grouped_mm(dout_pool, w2_k, plan)
        del w2_k
        dgrad_preact, weighted_h, drouter = activation_backward(
            preact,
            z,
            recv_w,
            routes,
            activation=options["activation"],
            activation_clamp=options["activation_clamp"],
            weighted_h=use_side or base_grads,
        )
        del z
        grads = dict.fromkeys(GRAD_NAMES)
        if use_side:
            rank = a1.shape[1]
            # s is already in the exchanged s dout b2^T columns.
            a2_t = _k_grouped_mm(dout_pool[:, hidden:].T, weighted_h, plan)  # [E_l, r, I]
            grads["a2"] = a2_t.transpose(1, 2).contiguous()
            q13_pool = pool.gather_pool(recv_q13, None, routes)
            b13 = _k_grouped_mm(q13_pool.T, dgrad_preact, plan)  # [E_l, 2r, 2I]
            gate_cols, up_cols = _deinterleave(b13, interleave)
            grads["b1"] = (s * gate_cols[:, :rank].float()).to(torch.bfloat16)
            grads["b3"] = (s * up_cols[:, rank:].float()).to(torch.bfloat16)
            del q13_pool, b13
        if base_grads:
            grads["w2"] = _k_grouped_mm(dout_pool[:, :hidden].T, weighted_h, plan)
            x_pool = pool.gather_pool(recv_x, None, routes)
            grads["w13"] = _k_grouped_mm(dgrad_preact.T, x_pool, plan)
            del x_pool
        del dout_pool, weighted_h
        dx_pool = _grouped_mm(dgrad_preact, w13, plan)  # [P, H]
        pieces = [dx_pool]
        if use_side:
            pieces.append(_grouped_mm(dgrad_preact, _side_shrink_weights(b1, b3, interleave), plan))
        del dgrad_preact

        # Back: [dx_route | sg | su] rows and the router grads, in send order.
        row_of_recv = routes.route_to_pool_row[: plan.num_recv, 0].long()
        back_rows = torch.cat([p.index_select(0, row_of_recv) for p in pieces], dim=1)
        del pieces, dx_pool
        returned = _exchange_into(
            plan.num_send, back_rows, plan.recv_splits, plan.send_splits, plan.group
        )
        returned_dw = _exchange_into(
            plan.num_send,
            drouter.index_select(0, row_of_recv),
            plan.recv_splits,
            plan.send_splits,
            plan.group,
        )
        back = plan.return_plan
        position = back.route_to_pool_row.long()
        grads["topk_weights"] = torch.where(
            position >= 0, returned_dw[position.clamp(min=0)], 0.0
        ).to(ctx.topk_dtype)
        ones = torch.ones_like(topk_weights)
        side_expand = shrink = None
        if use_side:
            shrink = pool.side_sum(returned, back, ones, hidden)  # [T, 2r] = [sg | su]
            side_expand = shrink @ torch.cat([a1, a3], dim=1).T
        grads["x"] = pool.combine(
            returned, back, ones, side_expand, scale=s if use_side else 0.0, hidden=hidden
        )
        if use_side:
            shared = [s * _mm_fp32(x.T, shrink), s * _mm_fp32(p_sum.T, dout)]
            if options["reduce_shared_grads"]:
                reduce_shared_grads(shared, plan.group)
            a13_grad = shared[0].to(torch.bfloat16)
            grads["a1"] = a13_grad[:, :rank].contiguous()
            grads["a3"] = a13_grad[:, rank:].contiguous()
            grads["b2"] = shared[1].to(torch.bfloat16)
        elif ctx.has_side:
            # A zero scale: every adapter gradient is exactly zero.
            for name, t in zip(("a1", "b1", "a3", "b3", "a2", "b2"), side, strict=True):
                grads[name] = torch.zeros_like(t)
        order = ["x", "topk_weights", "w13", "w2"]
        if ctx.has_side:
            order += ["a1", "b1", "a3", "b3", "a2", "b2"]
        result = [None, None]  # options, plan
        for name, need in zip(order, needs[2:], strict=True):
            result.append(grads[name] if need else None)
        return tuple(result)


def fused_ep_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    side_tensors: tuple[torch.Tensor, ...],
    plan: DispatchPlan,
    *,
    scale: float,
    activation: str,
    activation_clamp: float | None,
    reduce_shared_grads: bool,
) -> torch.Tensor:
    """Run the fused EP layer (module docstring) with an existing dispatch plan.

    Args:
        x: ``[T, H]`` BF16 (``T`` may be 0 on a rank).
        topk_weights: ``[T, K]`` float32.
        w13: ``[E_l, 2I, H]`` BF16 in the kernels' gate/up interleave (``base.w13``).
        w2: ``[E_l, H, I]`` BF16.
        side_tensors: ``(a1, b1, a3, b3, a2, b2)`` BF16 (shared factors replicated,
            expert-local ones this rank's) or ``()``.
        plan: :func:`~megamoe.ep.plan.plan_dispatch` of this step's ``topk_ids``.
        scale, activation, activation_clamp: as in ``mm.moe``.
        reduce_shared_grads: all-reduce the ``a1, a3, b2`` gradients over the group.

    Returns:
        ``[T, H]`` BF16; differentiable like ``mm.moe``.
    """
    options = {
        "scale": float(scale),
        "activation": activation,
        "activation_clamp": activation_clamp,
        "reduce_shared_grads": reduce_shared_grads,
    }
    return _FusedEPMoE.apply(options, plan, x, topk_weights, w13, w2, *side_tensors)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None = None,
    *,
    group: dist.ProcessGroup | None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    reduce_shared_grads: bool = True,
    max_tokens: int | None = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """The MoE layer with experts sharded over ``group``, on the fused pipeline.

    What ``mm.moe(..., group=pg)`` runs (a collective: every rank of ``group`` calls it,
    and every rank runs the backward if any does). On CPU tensors (gloo) the stages run
    their torch twins, which is how the EP logic is tested without GPUs.

    Args:
        x: ``[T, H]`` BF16 tokens of this rank (``T`` may differ between ranks, or be 0).
        topk_ids: ``[T, K]`` int32/int64 *global* expert ids in ``[-1, E)``.
        topk_weights: ``[T, K]`` float32, differentiable.
        base: this rank's experts (:func:`~megamoe.prepare_base_weights` of ``[E_l, ...]``,
            global ids ``rank * E_l ..``), format ``"bf16"``.
        side: optional BF16 :class:`~megamoe.SideLoRA`: shared ``a1, a3, b2`` (the same on
            every rank) and this rank's ``b1, b3, a2``.
        group: the EP process group (NCCL on GPUs, gloo on CPU), or None (one process).
        activation, activation_clamp: as in ``mm.moe``.
        reduce_shared_grads: all-reduce (SUM) the ``a1, a3, b2`` gradients over the group
            so they do not depend on the EP degree (turn off if the trainer reduces them).
        max_tokens: a static ``T_max`` of the group (skips the agreement all-reduce).
        check_ids: reject ids outside ``[-1, E)`` (every rank raises together).

    Returns:
        ``[T, H]`` BF16.
    """
    if not isinstance(base, BaseWeights):
        raise TypeError(f"base: expected megamoe.BaseWeights, got {type(base).__name__}")
    if base.format != "bf16":
        raise ValueError(f"base: format {base.format!r} has no fused EP path yet; use 'bf16'")
    device = base.device
    check_tensor(
        "x",
        x,
        shape=(None, base.hidden),
        dtypes=(torch.bfloat16,),
        device=device,
        contiguous=True,
    )
    tokens = x.shape[0]
    check_tensor(
        "topk_ids",
        topk_ids,
        shape=(tokens, None),
        dtypes=(torch.int32, torch.int64),
        device=device,
        contiguous=True,
    )
    check_tensor(
        "topk_weights",
        topk_weights,
        shape=tuple(topk_ids.shape),
        dtypes=(torch.float32,),
        device=device,
        contiguous=True,
    )
    check_choice("activation", activation, tuple(ACTIVATIONS))
    if side is not None:
        if not isinstance(side, SideLoRA):
            raise TypeError(f"side: expected megamoe.SideLoRA or None, got {type(side).__name__}")
        if side.dtype != torch.bfloat16 or side.device != device:
            raise TypeError(
                f"side: expected bfloat16 tensors on {device}, got {side.dtype} on {side.device}"
            )
        dims = (side.hidden, side.intermediate, side.num_experts)
        if dims != (base.hidden, base.intermediate, base.num_experts):
            raise ValueError(
                f"side: (H, I, E_l) = {dims} does not match base "
                f"{(base.hidden, base.intermediate, base.num_experts)}"
            )
    if not isinstance(reduce_shared_grads, bool):
        raise TypeError(
            f"reduce_shared_grads: expected a bool, got {type(reduce_shared_grads).__name__}"
        )
    # Everything that must match across ranks is checked in plan_dispatch's one
    # all-reduce, so a mismatch raises on every rank instead of hanging a collective.
    uniform = {
        "hidden": base.hidden,
        "intermediate": base.intermediate,
        "side_rank": 0 if side is None else side.rank,
        "activation": tuple(ACTIVATIONS).index(activation),
        "activation_clamp (set or None)": int(activation_clamp is not None),
        "reduce_shared_grads": int(reduce_shared_grads),
    }
    plan = plan_dispatch(
        topk_ids,
        base.num_experts * group_size(group),
        group=group,
        max_tokens=max_tokens,
        check_ids=check_ids,
        uniform=uniform,
    )
    return fused_ep_moe(
        x,
        topk_weights,
        base.w13,
        base.w2,
        side.tensors() if side is not None else (),
        plan,
        scale=side.scale if side is not None else 0.0,
        activation=activation,
        activation_clamp=activation_clamp,
        reduce_shared_grads=reduce_shared_grads,
    )
