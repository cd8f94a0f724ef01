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

import struct

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..pipeline.fused_backward import GRAD_NAMES, mm_fp32, pool_backward
from ..pipeline.fused_forward import expert_stage, stage
from ..side_lora import SideLoRA
from ..validation import check_moe_inputs
from ..weights import BaseWeights
from ..wrappers import pool
from ..wrappers.grouped_gemm import ACTIVATIONS
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
    ``[out_rows, ...]`` buffer (the rest stays unwritten: the pool plan never reads it).

    Every rank calls the collective, also with nothing to send or receive: a rank that
    skipped it would leave its peers waiting (gloo exchanges zero-length messages).
    """
    received = sum(recv_splits)
    out = send.new_empty((out_rows, *send.shape[1:]))
    with stage("exchange"):
        if group is None:
            out[:received].copy_(send)
        else:
            dist.all_to_all_single(
                out[:received], send.contiguous(), list(recv_splits), list(send_splits), group=group
            )
    return out


def _local_weights(
    w13: torch.Tensor, w2: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> BaseWeights:
    """This rank's experts: BF16, or MXFP4 (packed values + the UE8M0 ``scales``)."""
    experts, two_i, last = w13.shape
    if scales is not None:
        return BaseWeights("mxfp4", w13, w2, *scales, experts, 2 * last, two_i // 2)
    return BaseWeights("bf16", w13, w2, None, None, experts, last, two_i // 2)


def _float_bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as an int (exact equality across ranks; -0.0
    counts as 0.0)."""
    return struct.unpack("<q", struct.pack("<d", value + 0.0))[0]


class _FusedEPMoE(torch.autograd.Function):
    """Forward and backward of the fused EP layer (both contain collectives; every rank
    runs the same sequence, since the pool capacity and ``use_side`` are rank-uniform)."""

    @staticmethod
    def forward(ctx, options, plan, x, topk_weights, w13, w2, *side_tensors):
        hidden = w2.shape[1]  # w2 [E_l, H, I or I/2 packed]
        s = options["scale"]
        use_side = bool(side_tensors) and s != 0.0
        ctx.topk_dtype = topk_weights.dtype
        x = x.detach()
        topk_weights = topk_weights.detach().float().contiguous()
        base = _local_weights(w13.detach(), w2.detach(), options["scales"])
        side = tuple(t.detach() for t in side_tensors) if side_tensors else None
        side_lora = SideLoRA(*side, scale=s) if use_side else None
        token_rows = x
        if use_side:
            token_rows = torch.cat([x, x @ side_lora.a1, x @ side_lora.a3], dim=1)  # [x | q13]
        recv = _exchange_into(
            plan.pool_routes,
            token_rows.index_select(0, plan.send_tokens),
            plan.send_splits,
            plan.recv_splits,
            plan.group,
        )
        routes = plan.pool
        width = hidden + (side_lora.rank if use_side else 0)
        preact = torch.empty(
            routes.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16, device=x.device
        )
        if routes.pool_capacity:
            pool_output = expert_stage(
                recv,
                None,
                routes,
                base,
                side_lora,
                activation=options["activation"],
                activation_clamp=options["activation_clamp"],
                preact=preact,
            )
        else:  # no rank holds a token: nothing to compute, the exchanges still run
            pool_output = x.new_empty(0, width)
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
            with stage("adapter_expand"):
                p_sum = pool.side_sum(returned, back, topk_weights, hidden)  # [T, r]
                side_expand = p_sum @ side_lora.b2
        with stage("combine"):
            out = pool.combine(
                returned, back, topk_weights, side_expand, scale=s if use_side else 0.0,
                hidden=hidden,
            )  # fmt: skip
        ctx.plan = plan
        ctx.options = options
        ctx.use_side = use_side
        ctx.has_side = side is not None
        # Received q13 (small) for db1/db3; the received x only in ordinary mode (dw13).
        # Copied from the received rows only: the buffer's tail is never written.
        received = plan.num_recv
        keep_x = recv_q13 = None
        if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:
            keep_x = recv
            if recv.shape[1] != hidden:
                keep_x = recv.new_zeros(plan.pool_routes, hidden)
                keep_x[:received] = recv[:received, :hidden]
        if use_side:
            recv_q13 = recv.new_zeros(plan.pool_routes, recv.shape[1] - hidden)
            recv_q13[:received] = recv[:received, hidden:]
        ctx.save_for_backward(
            x, topk_weights, w13, w2, preact, keep_x, recv_q13, p_sum, *(side or ())
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
        base = _local_weights(w13, w2, options["scales"])
        side_lora = SideLoRA(*side, scale=s) if use_side else None
        routes = plan.pool
        dout = dout.to(torch.bfloat16).contiguous()

        # Out: [dout | s dout b2^T] rows and the route weights (FP32, not rounded).
        token_rows = dout
        if use_side:
            db2 = (s * mm_fp32(dout, side_lora.b2.T)).to(torch.bfloat16)  # once per token
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

        # The EP1 pool stages over the received rows.
        grads = dict.fromkeys(GRAD_NAMES)
        width = hidden + (2 * side_lora.rank if use_side else 0)
        row_of_recv = routes.route_to_pool_row[: plan.num_recv, 0].long()
        if routes.pool_capacity:
            stage = pool_backward(
                recv,
                None,
                preact,
                recv_w,
                routes,
                base,
                side_lora,
                q13_rows=recv_q13,
                x_rows=recv_x,
                activation=options["activation"],
                activation_clamp=options["activation_clamp"],
                base_grads=base_grads,
                side_grads=use_side,
            )
            del recv
            grads.update({k: v for k, v in stage.local.items() if v is not None})
            # [dx | shrinks] per received row, in one gather.
            back_rows = stage.dx_shrink_pool.index_select(0, row_of_recv)
            back_dw = stage.drouter.index_select(0, row_of_recv)
            del stage
        else:  # no rank holds a token: the local grads are zeros, the exchanges run
            back_rows = dout.new_empty(0, width)
            back_dw = recv_w.new_empty(0)
            if use_side:
                for name, t in (("b1", side[1]), ("b3", side[3]), ("a2", side[4])):
                    grads[name] = torch.zeros_like(t)
            if base_grads:
                grads["w13"], grads["w2"] = torch.zeros_like(w13), torch.zeros_like(w2)

        # Back: [dx_route | sg | su] rows and the router grads, in send order.
        returned = _exchange_into(
            plan.num_send, back_rows, plan.recv_splits, plan.send_splits, plan.group
        )
        returned_dw = _exchange_into(
            plan.num_send, back_dw, plan.recv_splits, plan.send_splits, plan.group
        )
        back = plan.return_plan
        # Masked routes read the appended zero (also when nothing was sent at all).
        position = back.route_to_pool_row.long()
        padded_dw = torch.cat([returned_dw, returned_dw.new_zeros(1)])
        grads["topk_weights"] = padded_dw[torch.where(position >= 0, position, plan.num_send)].to(
            ctx.topk_dtype
        )
        ones = torch.ones_like(topk_weights)
        side_expand = shrink = None
        if use_side:
            shrink = pool.side_sum(returned, back, ones, hidden)  # [T, 2r] = [sg | su]
            side_expand = shrink @ torch.cat([side_lora.a1, side_lora.a3], dim=1).T
        grads["x"] = pool.combine(
            returned, back, ones, side_expand, scale=s if use_side else 0.0, hidden=hidden
        )
        if use_side:
            rank = side_lora.rank
            shared = [s * mm_fp32(x.T, shrink), s * mm_fp32(p_sum.T, dout)]
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
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the fused EP layer (module docstring) with an existing dispatch plan.

    Args:
        x: ``[T, H]`` BF16 (``T`` may be 0 on a rank).
        topk_weights: ``[T, K]`` float32.
        w13: ``[E_l, 2I, H]`` BF16 (``base.w13``, nn.Linear layout), or
            its MXFP4 packing ``[E_l, 2I, H/2]`` uint8.
        w2: ``[E_l, H, I]`` BF16, or ``[E_l, H, I/2]`` uint8 (MXFP4).
        side_tensors: ``(a1, b1, a3, b3, a2, b2)`` BF16 (shared factors replicated,
            expert-local ones this rank's) or ``()``.
        plan: :func:`~megamoe.ep.plan.plan_dispatch` of this step's ``topk_ids``.
        scale, activation, activation_clamp: as in ``mm.moe``.
        reduce_shared_grads: all-reduce the ``a1, a3, b2`` gradients over the group.
        scales: the UE8M0 scales ``(w13_scales, w2_scales)`` of an MXFP4 base (decoded
            inside the GEMM pipeline, as in EP1), or None for BF16.

    Returns:
        ``[T, H]`` BF16; differentiable like ``mm.moe``.
    """
    options = {
        "scales": scales,
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
            global ids ``rank * E_l ..``), format ``"bf16"`` or ``"mxfp4"`` (frozen).
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
    if isinstance(base, BaseWeights):
        # MXFP4 ordinary mode, as mm.moe (a no-op if mm.moe already converted it).
        base = base.for_call()
    check_moe_inputs(
        x,
        topk_ids,
        topk_weights,
        base,
        side,
        activation,
        activation_clamp,
        require_cuda=False,
        allow_no_tokens=True,
    )
    if not isinstance(reduce_shared_grads, bool):
        raise TypeError(
            f"reduce_shared_grads: expected a bool, got {type(reduce_shared_grads).__name__}"
        )
    # Everything that must match across ranks is checked in plan_dispatch's one
    # all-reduce, so a mismatch raises on every rank instead of hanging a collective:
    # shapes, the activation, the adapter scale and clamp (their float bits; a zero
    # scale drops the adapter columns from every exchange).
    scale = side.scale if side is not None else 0.0
    uniform = {
        "hidden": base.hidden,
        "intermediate": base.intermediate,
        "side_rank": 0 if side is None else side.rank,
        "base format (0 bf16, 1 mxfp4)": int(base.format == "mxfp4"),
        "activation": tuple(ACTIVATIONS).index(activation),
        "side.scale (float64 bits)": _float_bits(scale),
        "activation_clamp (float64 bits, -1: None)": (
            -1 if activation_clamp is None else _float_bits(float(activation_clamp))
        ),
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
        scale=scale,
        activation=activation,
        activation_clamp=activation_clamp,
        reduce_shared_grads=reduce_shared_grads,
        scales=(base.w13_scales, base.w2_scales) if base.format == "mxfp4" else None,
    )
