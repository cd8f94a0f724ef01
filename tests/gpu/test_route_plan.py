"""The route-plan kernels vs the torch reference planner, bit for bit."""

import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.registry import registry

pytestmark = pytest.mark.gpu


def assert_same_plan(actual, expected):
    for field in ("expert_counts", "expert_pool_offsets", "route_to_pool_row", "pool_row_to_route"):
        a, e = getattr(actual, field), getattr(expected, field)
        assert a.dtype == e.dtype == torch.int32, field
        assert torch.equal(a.cpu(), e.cpu()), field


def plan_both(ids, num_local_experts, block_m, expert_begin=0):
    gpu = mm.plan_routes(ids.cuda(), num_local_experts, block_m, expert_begin=expert_begin)
    cpu = mm.plan_routes_reference(ids.cpu(), num_local_experts, block_m, expert_begin=expert_begin)
    assert_same_plan(gpu, cpu)
    return gpu


@pytest.mark.parametrize(
    "num_tokens", [1, 15, 16, 17, 90, 91, 176, 177, 346, 347, 688, 689, 1029, 1030, 2048]
)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_matches_reference_on_edge_token_counts(num_tokens, top_k):
    ids, _ = make_routing(num_tokens, 16, top_k, kind="masked", seed=num_tokens + top_k)
    for block_m in registry().block_m_choices:
        plan_both(ids, 16, block_m)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "masked"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_production_shape(kind, id_dtype):
    # ep4rank: 65,536 tokens x top-6 over 64 local experts: 192 tiles per pass.
    ids, _ = make_routing(65536, 64, 6, kind=kind, seed=1, id_dtype=id_dtype)
    plan_both(ids, 64, 128)


def test_empty_experts_first_middle_last():
    ids, _ = make_routing(3000, 32, 4, kind="empty", empty_experts=(0, 15, 31), seed=2)
    plan = plan_both(ids, 32, 64)
    counts = plan.expert_counts.cpu()
    assert counts[0] == counts[15] == counts[31] == 0


def test_remote_routes_with_expert_begin():
    ids, _ = make_routing(5000, 256, 6, kind="masked", seed=3, id_dtype=torch.int64)
    plan = plan_both(ids, 64, 128, expert_begin=128)
    assert plan.expert_counts.sum() == ((ids >= 128) & (ids < 192)).sum()


@pytest.mark.parametrize("num_local_experts", [1, 255, 1024])
def test_expert_count_limits(num_local_experts):
    generator = torch.Generator().manual_seed(num_local_experts)
    ids = torch.randint(-1, num_local_experts, (4096, 2), generator=generator, dtype=torch.int32)
    plan_both(ids, num_local_experts, 64)


def test_all_routes_to_one_expert_stays_stable():
    ids = torch.full((9000, 2), 5, dtype=torch.int32)
    plan = plan_both(ids, 8, 128)
    assert torch.equal(plan.pool_row_to_route[:18000].cpu(), torch.arange(18000, dtype=torch.int32))


def test_repeated_runs_are_bitwise_identical():
    ids, _ = make_routing(20000, 64, 6, kind="skewed", seed=4)
    ids = ids.cuda()
    first = mm.plan_routes(ids, 64, 128)
    for _ in range(5):
        assert_same_plan(mm.plan_routes(ids, 64, 128), first)


@pytest.mark.cuda_graph
def test_runs_on_the_current_stream_and_under_graph_capture():
    ids, _ = make_routing(4000, 32, 6, kind="masked", seed=5)
    ids = ids.cuda()
    expected = mm.plan_routes_reference(ids.cpu(), 32, 64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan = mm.plan_routes(ids, 32, 64)
    stream.synchronize()
    assert_same_plan(plan, expected)

    static_ids = ids.clone()
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):
        mm.plan_routes(static_ids, 32, 64, check_ids=False)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=capture_stream):
            captured = mm.plan_routes(static_ids, 32, 64, check_ids=False)
    new_ids, _ = make_routing(4000, 32, 6, kind="skewed", seed=6)
    static_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_plan(captured, mm.plan_routes_reference(new_ids, 32, 64))


def test_native_launcher_checks_its_arguments():
    from megamoe import _C
    from megamoe.wrappers._native import current_stream, dlpack

    ids = torch.zeros(8, 2, dtype=torch.int32, device="cuda")
    num_tiles = _C.route_plan_num_tiles(16)

    def i32(*shape):
        return torch.zeros(shape, dtype=torch.int32, device="cuda")

    good = dict(
        tile=i32(num_tiles, 4),
        counts=i32(4),
        offsets=i32(5),
        r2p=i32(16),
        p2r=i32(mm.pool_capacity(16, 4, 64)),
    )

    def call(topk_ids=ids, block_m=64, **overrides):
        args = {**good, **overrides}
        _C.route_plan(
            dlpack(topk_ids),
            0,
            4,
            block_m,
            dlpack(args["tile"]),
            dlpack(args["counts"]),
            dlpack(args["offsets"]),
            dlpack(args["r2p"]),
            dlpack(args["p2r"]),
            None if args.get("extremes") is None else dlpack(args["extremes"]),
            args.get("host", 0),
            current_stream(ids.device),
        )

    call()
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32 or int64"):
        call(topk_ids=ids.float())
    with pytest.raises(ValueError, match="block_m"):
        call(block_m=32)
    with pytest.raises(ValueError, match="expert_pool_offsets: expected shape"):
        call(offsets=i32(4))
    with pytest.raises(ValueError, match="pool_row_to_route: pool capacity"):
        call(p2r=i32(16))
    with pytest.raises(TypeError, match="expert_counts: expected dtype int32"):
        call(counts=torch.zeros(4, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="route_to_pool_row: expected a contiguous"):
        call(r2p=i32(32)[::2])
    # The id check's buffers: both or neither, the scratch's shape, pinned host memory.
    extremes = torch.zeros(num_tiles, 2, dtype=torch.int64, device="cuda")
    pinned = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    with pytest.raises(ValueError, match="tile_id_extremes/id_extremes_host: give both"):
        call(extremes=extremes)
    with pytest.raises(ValueError, match="tile_id_extremes: expected shape"):
        call(extremes=torch.zeros(num_tiles + 1, 2, dtype=torch.int64, device="cuda"),
             host=pinned.data_ptr())  # fmt: skip
    pageable = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="id_extremes_host: expected pinned host memory"):
        call(extremes=extremes, host=pageable.data_ptr())
    call(extremes=extremes, host=pinned.data_ptr())
    torch.cuda.synchronize()
    assert pinned.tolist() == [0, 0]  # the ids are all 0


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [1, 700, 5000, 400_000])
def test_route_plan_records_the_id_extremes(id_dtype, tokens):
    """The plan's id check: all ids' [min, max] (over one tile, several and partial ones,
    and more tiles than the offsets pass has threads), in pinned host memory, against
    torch.aminmax."""
    from megamoe import _C
    from megamoe.wrappers._native import current_stream, dlpack

    experts, top_k, block_m = 16, 6, 64
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, experts, (tokens, top_k), generator=gen).to(id_dtype)
    ids.view(-1)[(3 * tokens + 1) % ids.numel()] = -(2**30) if id_dtype == torch.int32 else -(2**40)
    ids.view(-1)[(7 * tokens) % ids.numel()] = 3 * experts
    routes = ids.numel()
    num_tiles = _C.route_plan_num_tiles(routes)
    assert tokens < 400_000 or num_tiles > 1024  # the offsets pass's 1024 threads stride

    def i32(*shape):
        return torch.zeros(shape, dtype=torch.int32, device="cuda")

    pinned = torch.full((2,), 99, dtype=torch.int64, pin_memory=True)
    cuda_ids = ids.cuda()
    _C.route_plan(
        *(dlpack(cuda_ids), 0, experts, block_m, dlpack(i32(num_tiles, experts))),
        *(dlpack(i32(experts)), dlpack(i32(experts + 1)), dlpack(i32(routes))),
        dlpack(i32(mm.pool_capacity(routes, experts, block_m))),
        # A sentinel no id reaches: a tile the count pass skipped would show.
        dlpack(torch.full((num_tiles, 2), 2**62, dtype=torch.int64, device="cuda")),
        pinned.data_ptr(),
        current_stream(cuda_ids.device),
    )
    torch.cuda.synchronize()
    low, high = torch.aminmax(ids.long())
    assert pinned.tolist() == [int(low), int(high)]
