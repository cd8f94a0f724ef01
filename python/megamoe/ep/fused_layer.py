"""The stages of the expert-parallel MoE layer on the fused kernels (DESIGN §3, §4); the
custom ops that run them are :mod:`megamoe.ep.ops`.

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

from ..pipeline.fused_backward import GRAD_NAMES, mm_fp32, pool_backward, scaled_bf16
from ..pipeline.fused_forward import expert_stage, gemm1, stage
from ..side_lora import SideLoRA
from ..weights import BaseWeights
from ..wrappers import pool
from ..wrappers.token_sum import token_sum_unchecked
from .exchange import reduce_shared_grads
from .plan import DispatchPlan

__all__ = ["ep_backward_stages", "ep_forward_stages", "float_bits"]


def _exchange_into(
    out: torch.Tensor,
    send: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``all_to_all_single`` into the first ``sum(recv_splits)`` rows of ``out`` (the
    rest is left as it is: unwritten rows the pool plan never reads, or a caller's
    padding); returns ``out``.

    Every rank calls the collective, also with nothing to send or receive: a rank that
    skipped it would leave its peers waiting (gloo exchanges zero-length messages).
    """
    received = sum(recv_splits)
    with stage("exchange"):
        if group is None:
            out[:received].copy_(send)
        else:
            dist.all_to_all_single(
                out[:received], send.contiguous(), list(recv_splits), list(send_splits), group=group
            )
    return out


def float_bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as an int (exact equality across ranks; -0.0
    counts as 0.0)."""
    return struct.unpack("<q", struct.pack("<d", value + 0.0))[0]


def ep_forward_stages(
    plan: DispatchPlan,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    *,
    activation: str,
    activation_clamp: float | None,
    keep_x: bool,
    keep_preact: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The forward (module docstring) over an existing dispatch plan: ``(out, saved)``,
    ``saved`` the backward's tensors ``preact``, ``recv_x`` (the received ``x`` rows, with
    ``keep_x``: a trainable base), ``recv_q13`` and ``p_sum`` (side path only; else None).
    Without ``keep_preact`` (activation checkpointing) only ``p_sum`` is kept: the
    backward exchanges the token rows again and recomputes GEMM1's pre-activations.

    A collective: every rank runs the same sequence, since the pool capacity and whether
    the side path runs (``side`` given with a non-zero scale) are rank-uniform.
    """
    hidden = base.hidden
    use_side = side is not None and side.scale != 0.0
    side = side if use_side else None
    topk_weights = topk_weights.float().contiguous()
    recv = _dispatch_token_rows(plan, x, side)
    routes = plan.pool
    width = hidden + (side.rank if use_side else 0)
    preact = None
    if keep_preact:
        preact = torch.empty(
            routes.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16, device=x.device
        )
    if routes.pool_capacity:
        pool_output = expert_stage(
            recv,
            None,
            routes,
            base,
            side,
            activation=activation,
            activation_clamp=activation_clamp,
            preact=preact,
        )
    else:  # no rank holds a token: nothing to compute, the exchanges still run
        pool_output = x.new_empty(0, width)
    # Received q13 (small) for db1/db3; the received x only in ordinary mode (dw13).
    # Copied here, from the received rows only (the buffer's tail is never written), so
    # that the receive buffer is freed before the return exchange and the combine, the
    # forward's largest moment.
    recv_x = recv_q13 = None
    if keep_preact:
        recv_x, recv_q13 = _split_received(plan, recv, hidden, keep_x=keep_x, use_side=use_side)
    del recv
    row_of_recv = routes.route_to_pool_row[: plan.num_recv, 0]
    send_back = pool_output.index_select(0, row_of_recv)
    returned = _exchange_into(
        send_back.new_empty(plan.num_send, send_back.shape[1]),
        send_back,
        plan.recv_splits,
        plan.send_splits,
        plan.group,
    )
    del pool_output
    back = plan.return_plan
    side_expand = p_sum = None
    if use_side:
        with stage("adapter_expand"):
            p_sum = pool.side_sum_unchecked(returned, back, topk_weights, hidden)  # [T, r]
            side_expand = p_sum @ side.b2
    with stage("combine"):
        out = pool.combine_unchecked(
            returned, back, topk_weights, side_expand, scale=side.scale if use_side else 0.0,
            hidden=hidden,
        )  # fmt: skip
    return out, {"preact": preact, "recv_x": recv_x, "recv_q13": recv_q13, "p_sum": p_sum}


def _dispatch_token_rows(
    plan: DispatchPlan, x: torch.Tensor, side: SideLoRA | None
) -> torch.Tensor:
    """``[x | q13]`` (``q13 = x [a1 | a3]`` once per token; ``side`` None: ``x``) sent
    to the experts' ranks: the ``[pool routes, H (+ 2r)]`` receive buffer."""
    token_rows = x
    if side is not None:
        token_rows = torch.cat([x, x @ torch.cat([side.a1, side.a3], dim=1)], dim=1)
    return _exchange_into(
        token_rows.new_empty(plan.pool_routes, token_rows.shape[1]),
        token_rows.index_select(0, plan.send_tokens),
        plan.send_splits,
        plan.recv_splits,
        plan.group,
    )


def _split_received(
    plan: DispatchPlan, recv: torch.Tensor, hidden: int, *, keep_x: bool, use_side: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The received rows' ``x`` (with ``keep_x``) and ``q13`` (the side path) for the
    backward, copied from the received rows only: the buffer's tail is never written."""
    received = plan.num_recv
    recv_x = recv_q13 = None
    if keep_x:
        recv_x = recv
        if recv.shape[1] != hidden:
            recv_x = recv.new_zeros(plan.pool_routes, hidden)
            recv_x[:received] = recv[:received, :hidden]
    if use_side:
        recv_q13 = recv.new_zeros(plan.pool_routes, recv.shape[1] - hidden)
        recv_q13[:received] = recv[:received, hidden:]
    return recv_x, recv_q13


def ep_backward_stages(
    plan: DispatchPlan,
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    saved: dict[str, torch.Tensor | None],
    *,
    activation: str,
    activation_clamp: float | None,
    base_grads: bool,
    reduce_shared: bool,
) -> dict[str, torch.Tensor | None]:
    """The backward (module docstring) over the forward's plan and ``saved`` tensors
    (:func:`ep_forward_stages`): the gradients by name (``x``, ``topk_weights`` float32,
    ``w13``/``w2`` with ``base_grads``, the six adapter tensors' when ``side`` ran the
    side path). ``saved["preact"]`` is overwritten with ``dg | du``; None (activation
    checkpointing): recomputed first, from the token rows exchanged again. A collective."""
    use_side = side is not None and side.scale != 0.0
    s = side.scale if use_side else 0.0
    hidden = base.hidden
    routes = plan.pool
    topk_weights = topk_weights.float().contiguous()
    dout = dout.to(torch.bfloat16).contiguous()
    saved = dict(saved)
    if saved["preact"] is None:
        # Activation checkpointing: the token rows again (the same exchange, so the same
        # received rows in the same order) and GEMM1's pre-activations from them, with
        # the forward's gather and launch: bitwise the values the forward computed.
        recv = _dispatch_token_rows(plan, x, side if use_side else None)
        saved["recv_x"], saved["recv_q13"] = _split_received(
            plan, recv, hidden, keep_x=base_grads, use_side=use_side
        )
        saved["preact"] = torch.empty(
            routes.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16, device=x.device
        )
        if routes.pool_capacity:
            with stage("recompute_gemm1"):
                pool_input = pool.gather_pool_unchecked(recv, None, routes)
                gemm1(
                    pool_input, routes, base, side if use_side else None,
                    activation=activation, activation_clamp=activation_clamp,
                    preact=saved["preact"],
                )  # fmt: skip
                del pool_input  # not held through the backward's peak (dgrads, wgrads)
        del recv

    # Out: [dout | s dout b2^T] rows and the route weights (FP32, not rounded).
    token_rows = dout
    if use_side:
        db2 = scaled_bf16(mm_fp32(dout, side.b2.T), s)  # once per token
        token_rows = torch.cat([dout, db2], dim=1)
    recv = _exchange_into(
        token_rows.new_empty(plan.pool_routes, token_rows.shape[1]),
        token_rows.index_select(0, plan.send_tokens),
        plan.send_splits,
        plan.recv_splits,
        plan.group,
    )
    # The weights of the received rows; zero past them (the pool's padding rows).
    recv_w = _exchange_into(
        torch.zeros(plan.pool_routes, 1, dtype=torch.float32, device=dout.device),
        topk_weights.reshape(-1).index_select(0, plan.send_routes)[:, None],
        plan.send_splits,
        plan.recv_splits,
        plan.group,
    )

    # The EP1 pool stages over the received rows.
    grads = dict.fromkeys(GRAD_NAMES)
    width = hidden + (2 * side.rank if use_side else 0)
    row_of_recv = routes.route_to_pool_row[: plan.num_recv, 0]
    if routes.pool_capacity:
        result = pool_backward(
            recv,
            None,
            saved["preact"],
            recv_w,
            routes,
            base,
            side if use_side else None,
            q13_rows=saved["recv_q13"],
            x_rows=saved["recv_x"],
            activation=activation,
            activation_clamp=activation_clamp,
            base_grads=base_grads,
            side_grads=use_side,
        )
        del recv
        grads.update({k: v for k, v in result.local.items() if v is not None})
        # [dx | shrinks] per received row, in one gather.
        back_rows = result.dx_shrink_pool.index_select(0, row_of_recv)
        back_dw = result.drouter.index_select(0, row_of_recv)
        del result
    else:  # no rank holds a token: the local grads are zeros, the exchanges run
        back_rows = dout.new_empty(0, width)
        back_dw = recv_w.new_empty(0)
        if use_side:
            for name in ("b1", "b3", "a2"):
                grads[name] = torch.zeros_like(getattr(side, name))
        if base_grads:
            # BF16 of the decode's shapes whatever the format (an MXFP4 base's codes are
            # narrower), as pool_backward gives them.
            bf16 = dict(dtype=torch.bfloat16, device=dout.device)
            inter = base.intermediate
            grads["w13"] = torch.zeros(base.num_experts, 2 * inter, hidden, **bf16)
            grads["w2"] = torch.zeros(base.num_experts, hidden, inter, **bf16)

    # Back: [dx_route | sg | su] rows and the router grads, in send order.
    returned = _exchange_into(
        back_rows.new_empty(plan.num_send, back_rows.shape[1]),
        back_rows,
        plan.recv_splits,
        plan.send_splits,
        plan.group,
    )
    # The router grads in send order, then a zero: a masked route's position, -1, reads
    # it (also when nothing was sent at all).
    returned_dw = _exchange_into(
        back_dw.new_zeros(plan.num_send + 1),
        back_dw,
        plan.recv_splits,
        plan.send_splits,
        plan.group,
    )
    back = plan.return_plan
    grads["topk_weights"] = returned_dw[back.route_to_pool_row]
    ones = torch.ones_like(topk_weights)
    side_expand = shrink = None
    if use_side:
        shrink = pool.side_sum_unchecked(returned, back, ones, hidden)  # [T, 2r] = [sg | su]
        side_expand = shrink @ torch.cat([side.a1, side.a3], dim=1).T
    grads["x"] = pool.combine_unchecked(returned, back, ones, side_expand, scale=s, hidden=hidden)
    if use_side:
        rank = side.rank
        # [a1 | a3] and b2's grads in one FP32 buffer: scaled and all-reduced at once.
        products = [token_sum_unchecked(x, shrink), token_sum_unchecked(saved["p_sum"], dout)]
        shared = torch.cat([p.reshape(-1) for p in products]).mul_(s)
        if reduce_shared:
            reduce_shared_grads([shared], plan.group)
        a13 = shared[: products[0].numel()].view(products[0].shape)
        # Each column slice rounds straight into its own contiguous gradient.
        grads["a1"] = a13[:, :rank].to(torch.bfloat16, memory_format=torch.contiguous_format)
        grads["a3"] = a13[:, rank:].to(torch.bfloat16, memory_format=torch.contiguous_format)
        grads["b2"] = shared[products[0].numel() :].view(products[1].shape).to(torch.bfloat16)
    return grads
