"""The route plan reference: a stable counting sort into the BLOCK_M-padded pool."""

import pytest
import torch

import megamoe as mm
from megamoe.wrappers.routing import _check_plan_args, plan_routes_reference, pool_capacity


def naive_plan(topk_ids, num_local_experts, block_m, expert_begin=0):
    """Python loop over routes: the independent oracle of the planner."""
    flat = topk_ids.reshape(-1).tolist()
    per_expert = [[] for _ in range(num_local_experts)]
    for route, expert in enumerate(flat):
        local = expert - expert_begin
        if expert >= 0 and 0 <= local < num_local_experts:
            per_expert[local].append(route)
    route_to_row = [-1] * len(flat)
    row_to_route = [-1] * mm.pool_capacity(len(flat), num_local_experts, block_m)
    offsets = [0]
    for routes in per_expert:
        start = offsets[-1]
        for rank, route in enumerate(routes):
            route_to_row[route] = start + rank
            row_to_route[start + rank] = route
        offsets.append(start + -(-len(routes) // block_m) * block_m)
    return [len(r) for r in per_expert], offsets, route_to_row, row_to_route


def check_against_naive(ids, num_local_experts, block_m, expert_begin=0):
    plan = mm.plan_routes(ids, num_local_experts, block_m, expert_begin=expert_begin)
    counts, offsets, route_to_row, row_to_route = naive_plan(
        ids, num_local_experts, block_m, expert_begin
    )
    assert plan.expert_counts.tolist() == counts
    assert plan.expert_pool_offsets.tolist() == offsets
    assert plan.route_to_pool_row.reshape(-1).tolist() == route_to_row
    assert plan.pool_row_to_route.tolist() == row_to_route
    for tensor in (
        plan.expert_counts,
        plan.expert_pool_offsets,
        plan.route_to_pool_row,
        plan.pool_row_to_route,
    ):
        assert tensor.dtype == torch.int32
    return plan


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 90, 91, 177])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("block_m", [64, 128])
def test_matches_naive_loop(num_tokens, top_k, block_m):
    generator = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    ids = torch.randint(-1, 8, (num_tokens, top_k), generator=generator, dtype=torch.int32)
    check_against_naive(ids, 8, block_m)


def test_int64_ids_and_remote_experts():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 32, (200, 4), generator=generator, dtype=torch.int64)
    plan = check_against_naive(ids, 8, 64, expert_begin=16)
    remote = (ids < 16) | (ids >= 24)
    assert (plan.route_to_pool_row[remote] == -1).all()


def test_segments_are_aligned_and_padding_is_marked():
    ids = torch.tensor([[0, 2], [2, 0], [2, 2]], dtype=torch.int32)
    plan = check_against_naive(ids, 4, 64)
    offsets = plan.expert_pool_offsets.tolist()
    assert offsets == [0, 64, 64, 128, 128]  # expert 1 and 3 empty: zero-length segments
    assert all(o % 64 == 0 for o in offsets)
    # Stable: expert 0 rows hold routes 0 then 3; expert 2 rows hold routes 1, 2, 4, 5.
    assert plan.pool_row_to_route[:2].tolist() == [0, 3]
    assert plan.pool_row_to_route[64:68].tolist() == [1, 2, 4, 5]
    assert (plan.pool_row_to_route[2:64] == -1).all()


def test_all_masked():
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    plan = check_against_naive(ids, 3, 64)
    assert plan.expert_pool_offsets.tolist() == [0, 0, 0, 0]
    assert (plan.pool_row_to_route == -1).all()


def test_capacity_bounds_the_worst_case():
    # Every expert with one route: each segment is a full block.
    ids = torch.arange(8, dtype=torch.int32).view(8, 1)
    plan = check_against_naive(ids, 8, 128)
    assert plan.expert_pool_offsets[-1] == 8 * 128
    assert plan.pool_capacity >= 8 * 128


@pytest.mark.parametrize(
    "ids,kwargs,error,match",
    [
        (torch.zeros(4, dtype=torch.int32), {}, ValueError, "topk_ids"),
        (torch.zeros(4, 2, dtype=torch.float32), {}, TypeError, "topk_ids"),
        (torch.zeros(4, 2, dtype=torch.int32).t(), {}, ValueError, "contiguous"),
        (torch.zeros(0, 2, dtype=torch.int32), {}, ValueError, "at least one route"),
        (torch.full((2, 2), -2, dtype=torch.int32), {}, ValueError, ">= -1"),
        (torch.zeros(2, 2, dtype=torch.int32), {"block_m": 96}, ValueError, "block_m"),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            {"num_local_experts": 0},
            ValueError,
            "num_local_experts",
        ),
        (torch.zeros(2, 2, dtype=torch.int32), {"expert_begin": -1}, ValueError, "expert_begin"),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            {"num_local_experts": 1025},
            ValueError,
            r"^num_local_experts: expected at most 1024 local experts",
        ),
    ],
)
def test_bad_input(ids, kwargs, error, match):
    args = {"num_local_experts": 4, "block_m": 64, **kwargs}
    with pytest.raises(error, match=match):
        mm.plan_routes(ids, args.pop("num_local_experts"), args.pop("block_m"), **args)


@pytest.mark.parametrize("plan", [mm.plan_routes, plan_routes_reference])
def test_pools_past_int32_rows_are_refused(plan):
    """Pool rows are int32 in the maps and kernels: the largest routing whose whole-block
    pool (T*K + E_l*(BLOCK_M-1), rounded up) still fits passes the checks, one more
    route does not. Meta ids: the checks read no values and allocate nothing."""
    experts, block_m = 2, 128
    fits = (2**31 - 1) // block_m * block_m - experts * (block_m - 1)
    assert pool_capacity(fits, experts, block_m) <= 2**31 - 1
    assert pool_capacity(fits + 1, experts, block_m) > 2**31 - 1
    _check_plan_args(torch.empty(fits, 1, dtype=torch.int32, device="meta"), experts, block_m, 0)
    too_many = torch.empty(fits + 1, 1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"^topk_ids: .* pool rows are int32 indices"):
        plan(too_many, experts, block_m)


def test_a_plan_refuses_a_top_k_the_pool_kernels_cannot_step_through():
    """The pool kernels walk a token's routes with an int counter stepping by 8: at K
    within 7 of 2^31 it wraps (a hang, reads past the maps; a review of the device
    code). Meta maps: nothing is allocated."""
    from megamoe.wrappers.routing import MAX_TOP_K, RoutePlan

    def plan(top_k: int) -> RoutePlan:
        def i32(*shape):
            return torch.empty(*shape, dtype=torch.int32, device="meta")

        return RoutePlan(i32(2), i32(3), i32(1, top_k), i32(128), 64)

    assert plan(MAX_TOP_K).route_to_pool_row.shape[1] == 2**31 - 8
    with pytest.raises(ValueError, match=r"^plan.route_to_pool_row: expected at most 2147483640"):
        plan(MAX_TOP_K + 1)


def test_a_plan_checks_its_expert_counts():
    """A review: ``expert_counts`` was the one map a plan did not check, so a float
    ``[3]`` beside four experts' offsets was taken, and the GEMM wrappers (which read E_l
    from it) then blamed ``plan.block_m``."""
    from megamoe.wrappers.routing import RoutePlan

    def i32(*shape):
        return torch.zeros(*shape, dtype=torch.int32)

    with pytest.raises(ValueError, match=r"^plan.expert_counts: expected shape \[4\], got \[3\]"):
        RoutePlan(i32(3), i32(5), i32(1, 2), i32(64), 64)
    with pytest.raises(TypeError, match=r"^plan.expert_counts: expected dtype int32"):
        RoutePlan(torch.zeros(4), i32(5), i32(1, 2), i32(64), 64)
    with pytest.raises(ValueError, match=r"^plan.expert_counts: expected device cpu, got meta"):
        RoutePlan(i32(4).to("meta"), i32(5), i32(1, 2), i32(64), 64)
    assert RoutePlan(i32(4), i32(5), i32(1, 2), i32(64), 64).expert_counts.shape == (4,)


@pytest.mark.parametrize("plan", [mm.plan_routes, plan_routes_reference])
def test_a_plan_of_meta_or_fake_ids_is_refused_by_name(plan):
    """The plan is made from the ids' values: meta ids failed in ``nonzero`` and fake ids
    with DynamicOutputShapeException (a review), where the docstring said any device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    expected = r"^topk_ids: the route plan is made from the ids' values"
    with pytest.raises(ValueError, match=expected):
        plan(torch.zeros(4, 2, dtype=torch.int32, device="meta"), 4, 64)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(4, 2, dtype=torch.int32))
        with pytest.raises(ValueError, match=expected):
            plan(fake, 4, 64)


def test_pool_capacity_names_a_bad_argument():
    """A review: block_m=0 divided by zero and a negative block_m gave a pool size."""
    with pytest.raises(ValueError, match=r"^block_m: expected an int >= 1, got 0"):
        pool_capacity(10, 2, 0)
    with pytest.raises(ValueError, match=r"^block_m: expected an int >= 1, got -1"):
        pool_capacity(10, 2, -1)
    with pytest.raises(ValueError, match=r"^num_local_experts: expected an int >= 1"):
        pool_capacity(10, 0, 64)
    with pytest.raises(TypeError, match=r"^num_routes: expected an int, got float"):
        pool_capacity(10.0, 2, 64)
    assert pool_capacity(10, 2, 64) == 192
