"""Dispatch and combine: the row exchanges of one expert-parallel step.

Forward: ``dispatch`` sends each unmasked route's row (``[x | q1 | q3]``) to the rank
owning its expert; ``combine`` returns each route's result row (``[y | p]``) to the
rank it came from, placed at its ``(t, k)`` slot; ``sum_over_k`` then sums over
``k = 0 .. K-1`` in that fixed order. Backward uses the same maps for ``[dout | dout
b2^T | w]`` rows out and ``[dx | dg b1^T | du b3^T | dw]`` rows back.

The exchange is ``torch.distributed.all_to_all_single`` with the plan's host split
sizes, so it runs on any backend (gloo on CPU, NCCL on GPU). It is differentiable
(:class:`AllToAllRows`: the backward is the reverse exchange), so ``dispatch``/``combine``
compose with autograd; the reference layer uses its closed-form backward instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .plan import DispatchPlan

__all__ = [
    "AllToAllRows",
    "all_to_all_rows",
    "combine",
    "dispatch",
    "reduce_shared_grads",
    "sum_over_k",
]


def _exchange(
    send: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if group is None:
        return send.clone()
    send = send.contiguous()
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=group)
    return recv


class AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """``send`` ``[sum(send_splits), *rest]`` -> ``[sum(recv_splits), *rest]``, in
        ``send``'s dtype (a collective)."""
        ctx.splits = (tuple(send_splits), tuple(recv_splits))
        ctx.group = group
        return _exchange(send, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """The reverse exchange: ``grad`` ``[sum(recv_splits), *rest]`` back to
        ``[sum(send_splits), *rest]``."""
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_rows(
    send: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Exchange rows: ``send`` ``[sum(send_splits), *rest]`` -> ``[sum(recv_splits), *rest]``.

    Rows ``send_splits[0]`` go to rank 0, the next ``send_splits[1]`` to rank 1, ...;
    the result holds the chunks received from ranks 0, 1, ... in that order. Any dtype
    the backend supports (gloo: float64/float32/bfloat16/int32/int64 tested). A
    collective; differentiable (the gradient goes back through the reverse exchange).
    ``group=None`` is the one-process case (a copy).
    """
    if send.shape[0] != sum(send_splits):
        raise ValueError(
            f"send: expected {sum(send_splits)} rows (the sum of send_splits), got {send.shape[0]}"
        )
    return AllToAllRows.apply(send, tuple(send_splits), tuple(recv_splits), group)


def dispatch(rows: torch.Tensor, plan: DispatchPlan, *, per_route: bool = False) -> torch.Tensor:
    """Send rows to the ranks owning the routes' experts (a collective).

    Args:
        rows: per token ``[T, *rest]`` (each route sends its token's row: ``[x | q13]``,
            ``[dout | dout b2^T]``), or with ``per_route=True`` per route ``[T, K, *rest]``
            (e.g. the routing weights ``[T, K, 1]``).
        plan: this step's :class:`~megamoe.ep.plan.DispatchPlan`.

    Returns:
        ``[N_recv, *rest]`` in receive order ``(source rank, source t*K + k)``, dtype and
        device of ``rows``.
    """
    if per_route:
        if rows.dim() < 2 or tuple(rows.shape[:2]) != (plan.num_tokens, plan.top_k):
            raise ValueError(
                f"rows: expected per-route rows [T={plan.num_tokens}, K={plan.top_k}, ...], "
                f"got {list(rows.shape)}"
            )
        flat = rows.reshape(plan.num_tokens * plan.top_k, *rows.shape[2:])
        send = flat.index_select(0, plan.send_routes)
    else:
        if rows.dim() < 1 or rows.shape[0] != plan.num_tokens:
            raise ValueError(
                f"rows: expected per-token rows [T={plan.num_tokens}, ...], got {list(rows.shape)}"
            )
        send = rows.index_select(0, plan.send_tokens)
    return all_to_all_rows(send, plan.send_splits, plan.recv_splits, plan.group)


def combine(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Return received routes' result rows to their source ranks (a collective).

    Args:
        rows: ``[N_recv, *rest]`` in receive order (the order :func:`dispatch` produced).
        plan: the same plan.

    Returns:
        ``[T, K, *rest]``: each route's row at its ``(t, k)`` slot; masked routes get
        zero rows. Every slot is written at most once (no accumulation), so the result
        is exact and deterministic.
    """
    if rows.dim() < 1 or rows.shape[0] != plan.num_recv:
        raise ValueError(
            f"rows: expected [N_recv={plan.num_recv}, ...] received rows, got {list(rows.shape)}"
        )
    back = all_to_all_rows(rows, plan.recv_splits, plan.send_splits, plan.group)
    rest = tuple(rows.shape[1:])
    out = back.new_zeros((plan.num_tokens * plan.top_k, *rest))
    out = out.index_copy(0, plan.send_routes, back)
    return out.view(plan.num_tokens, plan.top_k, *rest)


def sum_over_k(per_route: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k w_tk row_tk`` (or ``sum_k row_tk``) in the fixed order ``k = 0 .. K-1``.

    Args:
        per_route: ``[T, K, *rest]``.
        weights: optional ``[T, K]``, broadcast over ``rest``.

    Returns:
        ``[T, *rest]`` in the dtype of ``per_route`` (promoted with ``weights``).
    """
    tokens, top_k = per_route.shape[:2]
    total = None
    for k in range(top_k):
        term = per_route[:, k]
        if weights is not None:
            term = weights[:, k].reshape(tokens, *([1] * (per_route.dim() - 2))) * term
        total = term if total is None else total + term
    return total


def reduce_shared_grads(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """All-reduce (SUM) the shared-factor gradients over the EP group, in place.

    One collective per dtype (the tensors are flattened into one buffer; a lone
    contiguous tensor that may be written in place is reduced where it is). Every rank
    gets the same bits (the backend reduces once and distributes), so the shared grads
    are equal on every rank. ``group=None``: returned unchanged.
    """
    grads = list(grads)
    if group is None or not grads:
        return grads
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for members in by_dtype.values():
        lone = grads[members[0]]
        # Reduced where it is only where the copy back below would be allowed too.
        writable = not lone.requires_grad and (
            not lone.is_inference() or torch.is_inference_mode_enabled()
        )
        if len(members) == 1 and lone.is_contiguous() and writable:
            dist.all_reduce(lone, op=dist.ReduceOp.SUM, group=group)
            # A collective writes without bumping the version counter (copy_ does): a
            # backward that saved this tensor must see the write and refuse.
            torch.autograd.graph.increment_version(lone)
            continue
        flat = torch.cat([grads[i].reshape(-1) for i in members])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for i in members:
            n = grads[i].numel()
            grads[i].copy_(flat[offset : offset + n].view_as(grads[i]))
            offset += n
    return grads
