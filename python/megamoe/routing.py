"""The route plan: routes sorted by local expert into the BLOCK_M-padded pool.

Every route ``(t, k)`` whose expert is local gets one pool row. Experts own
contiguous segments, each starting at a multiple of ``block_m``; inside a segment
rows follow ascending route index ``t * K + k`` (a stable sort), so the plan and
everything gathered through it are deterministic. Padding rows map to -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _native
from ._checks import check_int, check_tensor
from .registry import registry


@dataclass(frozen=True)
class RoutePlan:
    """Index maps of one routing (all int32, on the routing's device).

    - ``expert_counts`` ``[E_l]``: routes per local expert.
    - ``expert_pool_offsets`` ``[E_l + 1]``: segment starts; the last entry is the
      number of pool rows in use.
    - ``route_to_pool_row`` ``[T, K]``: pool row of each route, -1 if masked/remote.
    - ``pool_row_to_route`` ``[pool_capacity]``: flat route index ``t*K + k`` of each
      pool row, -1 for padding and unused rows.
    """

    expert_counts: torch.Tensor
    expert_pool_offsets: torch.Tensor
    route_to_pool_row: torch.Tensor
    pool_row_to_route: torch.Tensor
    block_m: int

    @property
    def pool_capacity(self) -> int:
        return self.pool_row_to_route.shape[0]


def pool_capacity(num_routes: int, num_local_experts: int, block_m: int) -> int:
    """Pool rows that hold any routing of ``num_routes`` routes, known without a sync.

    Worst case: every expert's segment wastes ``block_m - 1`` rows of padding.
    Rounded up to a whole block.
    """
    worst = num_routes + num_local_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def route_plan_num_tiles(num_routes: int) -> int:
    """Tiles of the route-plan kernels (rows of their per-tile scratch)."""
    per_tile = registry().route_plan_routes_per_tile
    return -(-num_routes // per_tile)


def _check_plan_args(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, expert_begin: int
) -> None:
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), contiguous=True)
    if topk_ids.numel() == 0:
        raise ValueError(f"topk_ids: expected at least one route, got shape {list(topk_ids.shape)}")
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_int("expert_begin", expert_begin, minimum=0)
    check_int("block_m", block_m, minimum=1)
    if block_m not in registry().block_m_choices:
        raise ValueError(
            f"block_m: expected one of {list(registry().block_m_choices)}, got {block_m}"
        )


def plan_routes_reference(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, *, expert_begin: int = 0
) -> RoutePlan:
    """The route plan with plain torch ops (any device): the oracle of the kernel."""
    _check_plan_args(topk_ids, num_local_experts, block_m, expert_begin)
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    local = flat - expert_begin
    is_local = (flat >= 0) & (local >= 0) & (local < num_local_experts)
    # Non-local routes sort after every expert; stable sort keeps route order per expert.
    key = torch.where(is_local, local, torch.full_like(local, num_local_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key[is_local], minlength=num_local_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    num_local_routes = int(is_local.sum())
    sorted_routes = order[:num_local_routes]
    sorted_experts = key[sorted_routes]
    starts = torch.zeros(num_local_experts, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    rank_in_expert = torch.arange(num_local_routes, device=device) - starts[sorted_experts]
    rows = offsets[sorted_experts] + rank_in_expert
    capacity = pool_capacity(flat.numel(), num_local_experts, block_m)
    route_to_row = torch.full((flat.numel(),), -1, dtype=torch.int32, device=device)
    route_to_row[sorted_routes] = rows.to(torch.int32)
    row_to_route = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    row_to_route[rows] = sorted_routes.to(torch.int32)
    return RoutePlan(
        expert_counts=counts.to(torch.int32),
        expert_pool_offsets=offsets.to(torch.int32),
        route_to_pool_row=route_to_row.view(num_tokens, top_k),
        pool_row_to_route=row_to_route,
        block_m=block_m,
    )


def plan_routes(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    *,
    expert_begin: int = 0,
    check_ids: bool = True,
) -> RoutePlan:
    """Plan ``topk_ids`` ``[T, K]`` (int32/int64, -1 = masked) for local experts
    ``expert_begin .. expert_begin + num_local_experts - 1``.

    On CUDA this runs the route-plan kernels on the current stream (no host sync
    unless ``check_ids``); on CPU it runs :func:`plan_routes_reference`.

    ``check_ids=True`` rejects ids below -1 with a ``ValueError`` before any launch;
    it reads one value back to the host, so pass ``False`` inside CUDA-graph capture.
    """
    _check_plan_args(topk_ids, num_local_experts, block_m, expert_begin)
    if check_ids and int(topk_ids.min()) < -1:
        raise ValueError(
            f"topk_ids: expected expert ids >= -1 (-1 = masked), got {int(topk_ids.min())}"
        )
    if not topk_ids.is_cuda:
        return plan_routes_reference(
            topk_ids, num_local_experts, block_m, expert_begin=expert_begin
        )
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_routes = num_tokens * top_k
    capacity = pool_capacity(num_routes, num_local_experts, block_m)

    def int32(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    scratch = int32(route_plan_num_tiles(num_routes), num_local_experts)
    plan = RoutePlan(
        expert_counts=int32(num_local_experts),
        expert_pool_offsets=int32(num_local_experts + 1),
        route_to_pool_row=int32(num_tokens, top_k),
        pool_row_to_route=int32(capacity),
        block_m=block_m,
    )
    dl = _native.dlpack
    with torch.cuda.device(device):
        _native.native().route_plan(
            dl(topk_ids),
            expert_begin,
            num_local_experts,
            block_m,
            dl(scratch),
            dl(plan.expert_counts),
            dl(plan.expert_pool_offsets),
            dl(plan.route_to_pool_row.view(-1)),
            dl(plan.pool_row_to_route),
            _native.current_stream(device),
        )
    return plan
