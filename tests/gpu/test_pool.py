"""The pool gather / side-sum / combine kernels vs the torch references, bit for bit.

The kernels and the references do the same float32 operations in the same order
(k = 0..K-1, product and sum rounded separately, round-to-nearest-even to BF16), so
every comparison here is exact. References run on the CPU copies of the same inputs
and of the GPU-built route plan.
"""

import dataclasses

import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import pool

pytestmark = pytest.mark.gpu

EDGE_TOKENS = [1, 15, 16, 17, 90, 91, 2048]
SENTINEL = 3.0  # pre-fill of gather outputs: rows past the rows in use must keep it


def assert_bitwise(actual, expected):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype
    a, e = actual.cpu(), expected.cpu()
    if a.dtype == torch.bfloat16:
        a, e = a.view(torch.int16), e.view(torch.int16)
    if not torch.equal(a, e):
        mismatch = (a != e).nonzero()
        raise AssertionError(f"{mismatch.shape[0]} elements differ, first at {mismatch[:5]}")


def plan_on(plan, device):
    fields = ("expert_counts", "expert_pool_offsets", "route_to_pool_row", "pool_row_to_route")
    return dataclasses.replace(plan, **{f: getattr(plan, f).to(device) for f in fields})


def random_bf16(shape, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)


@dataclasses.dataclass
class Case:
    plan: mm.RoutePlan  # built on the GPU by the route-plan kernels
    plan_cpu: mm.RoutePlan  # the same index maps on the CPU
    weights: torch.Tensor  # [T, K] float32 on the GPU

    @property
    def num_tokens(self):
        return self.plan.route_to_pool_row.shape[0]


def make_case(
    num_tokens,
    top_k,
    *,
    num_experts=16,
    kind="masked",
    seed=0,
    num_local=None,
    expert_begin=0,
    block_m=None,
    **routing_kwargs,
):
    ids, weights = make_routing(
        num_tokens, num_experts, top_k, kind=kind, seed=seed, **routing_kwargs
    )
    num_local = num_experts if num_local is None else num_local
    if block_m is None:
        block_m = mm.get_block_m(num_tokens, top_k, num_experts)
    plan = mm.plan_routes(ids.cuda(), num_local, block_m, expert_begin=expert_begin)
    return Case(plan, plan_on(plan, "cpu"), weights.cuda())


def check_gather(case, hidden, side_cols, seed=0):
    x = random_bf16((case.num_tokens, hidden), seed)
    side = random_bf16((case.num_tokens, side_cols), seed + 1) if side_cols else None
    shape = (case.plan.pool_capacity, hidden + side_cols)
    out = torch.full(shape, SENTINEL, dtype=torch.bfloat16, device="cuda")
    result = pool.gather_pool(x, side, case.plan, out)
    assert result is out
    expected = pool.gather_pool_reference(
        x.cpu(),
        None if side is None else side.cpu(),
        case.plan_cpu,
        torch.full(shape, SENTINEL, dtype=torch.bfloat16),
    )
    assert_bitwise(out, expected)
    rows_used = int(case.plan_cpu.expert_pool_offsets[-1])
    assert (out[rows_used:] == SENTINEL).all()
    return out


def check_side_sum(case, hidden, side_rank, seed=0):
    pool_output = random_bf16((case.plan.pool_capacity, hidden + side_rank), seed)
    result = pool.side_sum(pool_output, case.plan, case.weights, hidden)
    expected = pool.side_sum_reference(pool_output.cpu(), case.plan_cpu, case.weights.cpu(), hidden)
    assert_bitwise(result, expected)
    return result


def check_combine(case, hidden, side_rank, scale, seed=0):
    pool_output = random_bf16((case.plan.pool_capacity, hidden + side_rank), seed)
    side_expand = random_bf16((case.num_tokens, hidden), seed + 1) if scale is not None else None
    scale = 0.0 if scale is None else scale
    result = pool.combine(pool_output, case.plan, case.weights, side_expand, scale, hidden=hidden)
    expected = pool.combine_reference(
        pool_output.cpu(),
        case.plan_cpu,
        case.weights.cpu(),
        None if side_expand is None else side_expand.cpu(),
        scale,
        hidden=hidden,
    )
    assert_bitwise(result, expected)
    return result


# ------------------------------------------------------------------ edge matrix


@pytest.mark.parametrize("num_tokens", EDGE_TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_gather_edge_token_counts(num_tokens, top_k):
    case = make_case(num_tokens, top_k, seed=num_tokens + top_k)
    check_gather(case, hidden=256, side_cols=0, seed=1)
    check_gather(case, hidden=256, side_cols=32, seed=2)


@pytest.mark.parametrize("num_tokens", EDGE_TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("side_rank", [16, 64, 256])
def test_side_sum_edge_token_counts(num_tokens, top_k, side_rank):
    case = make_case(num_tokens, top_k, seed=num_tokens * 3 + top_k)
    check_side_sum(case, hidden=128, side_rank=side_rank, seed=3)


@pytest.mark.parametrize("num_tokens", EDGE_TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize(("side_rank", "scale"), [(0, None), (16, None), (16, 0.25)])
def test_combine_edge_token_counts(num_tokens, top_k, side_rank, scale):
    case = make_case(num_tokens, top_k, seed=num_tokens * 5 + top_k)
    check_combine(case, hidden=256, side_rank=side_rank, scale=scale, seed=4)


@pytest.mark.parametrize("hidden", [8, 64, 200, 264, 1024])
def test_row_widths_that_do_not_fill_a_warp(hidden):
    # 1..128 vectors per row: lane groups of 1..32 lanes, partial last steps.
    case = make_case(300, 4, seed=hidden)
    check_gather(case, hidden=hidden, side_cols=8, seed=5)
    check_side_sum(case, hidden=hidden, side_rank=8, seed=6)
    check_side_sum(case, hidden=hidden, side_rank=24, seed=7)
    check_combine(case, hidden=hidden, side_rank=8, scale=-1.5, seed=8)


@pytest.mark.parametrize("num_tokens", [1, 128, 700])
@pytest.mark.parametrize("hidden", [800, 4000, 4096])
def test_few_tokens_split_each_row_over_warps(num_tokens, hidden):
    # Few tokens: the combine splits each row into slices (one lane group each) so the
    # grid fills the GPU; slice counts that do not divide the row (4000 = 500 vectors,
    # 800 = 100) leave a short last slice.
    case = make_case(num_tokens, 6, num_experts=64, kind="balanced", seed=num_tokens + hidden)
    check_gather(case, hidden=hidden, side_cols=256, seed=8)  # the gather splits rows too
    check_side_sum(case, hidden=hidden, side_rank=128, seed=9)
    check_combine(case, hidden=hidden, side_rank=128, scale=0.25, seed=10)
    check_combine(case, hidden=hidden, side_rank=0, scale=None, seed=11)


@pytest.mark.parametrize("side_rank", [8, 256])
def test_side_sum_of_whole_rows(side_rank):
    # hidden = 0: the backward sums its [sg | su] shrink rows this way.
    case = make_case(700, 6, seed=side_rank)
    check_side_sum(case, hidden=0, side_rank=side_rank, seed=13)


@pytest.mark.parametrize("top_k", [7, 8, 9, 17])
def test_top_k_beyond_one_batch(top_k):
    # The combine kernel loads routes in batches of 8.
    case = make_case(500, top_k, num_experts=32, seed=top_k)
    check_side_sum(case, hidden=64, side_rank=32, seed=9)
    check_combine(case, hidden=512, side_rank=32, scale=0.5, seed=10)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "masked", "empty"])
def test_routing_kinds(kind):
    case = make_case(3000, 6, num_experts=32, kind=kind, seed=11)
    check_gather(case, hidden=512, side_cols=64, seed=12)
    check_side_sum(case, hidden=512, side_rank=32, seed=13)
    check_combine(case, hidden=512, side_rank=32, scale=0.25, seed=14)


def test_empty_experts_first_middle_last_and_remote_routes():
    # Experts 32..63 are local; 32, 47 and 63 get nothing; the other half is remote.
    case = make_case(
        2000,
        6,
        num_experts=64,
        kind="masked",
        seed=15,
        num_local=32,
        expert_begin=32,
        empty_experts=(32, 47, 63),
    )
    counts = case.plan_cpu.expert_counts
    assert counts[0] == counts[15] == counts[31] == 0
    check_gather(case, hidden=256, side_cols=32, seed=16)
    check_side_sum(case, hidden=256, side_rank=16, seed=17)
    out = check_combine(case, hidden=256, side_rank=16, scale=None, seed=18)
    # Tokens whose routes are all remote or masked get exact (+0) zeros.
    none_local = (case.plan_cpu.route_to_pool_row < 0).all(dim=1)
    assert none_local.any()
    assert (out.cpu()[none_local].view(torch.int16) == 0).all()


def test_all_routes_masked():
    ids = torch.full((100, 2), -1, dtype=torch.int32, device="cuda")
    plan = mm.plan_routes(ids, 4, 64)
    weights = torch.rand(100, 2, device="cuda")
    x = random_bf16((100, 64), 19)
    out = torch.full((plan.pool_capacity, 64), SENTINEL, dtype=torch.bfloat16, device="cuda")
    pool.gather_pool(x, None, plan, out)
    assert (out == SENTINEL).all()  # no rows in use: nothing written
    pool_output = random_bf16((plan.pool_capacity, 64 + 16), 20)
    assert (pool.side_sum(pool_output, plan, weights, 64).view(torch.int16) == 0).all()
    assert (pool.combine(pool_output, plan, weights, hidden=64).view(torch.int16) == 0).all()


# ------------------------------------------------------------------ production shape


def test_production_rows():
    # H = 4096, r = 128 (pool input [x | s q1 | s q3] = 4352 columns, pool output
    # [y | p] = 4224 columns), T = 8192, K = 6 over 64 local experts.
    hidden, rank = 4096, 128
    case = make_case(8192, 6, num_experts=64, kind="balanced", seed=21)
    check_gather(case, hidden=hidden, side_cols=2 * rank, seed=22)
    check_side_sum(case, hidden=hidden, side_rank=rank, seed=23)
    check_combine(case, hidden=hidden, side_rank=rank, scale=0.25, seed=24)
    check_combine(case, hidden=hidden, side_rank=rank, scale=None, seed=25)


# ------------------------------------------------------------------ contracts


def test_scale_zero_is_bitwise_the_no_side_output():
    case = make_case(2048, 6, num_experts=32, seed=26)
    pool_output = random_bf16((case.plan.pool_capacity, 1024 + 32), 27)
    side_expand = random_bf16((2048, 1024), 28)
    side_expand[0, 0] = float("inf")  # 0 * inf would be NaN: the term must be skipped
    side_expand[5, 7] = float("nan")
    no_side = pool.combine(pool_output, case.plan, case.weights, hidden=1024)
    zero = pool.combine(pool_output, case.plan, case.weights, side_expand, 0.0)
    negative_zero = pool.combine(pool_output, case.plan, case.weights, side_expand, -0.0)
    assert_bitwise(zero, no_side)
    assert_bitwise(negative_zero, no_side)


def test_repeated_runs_are_bitwise_identical():
    case = make_case(5000, 6, num_experts=64, kind="skewed", seed=29)
    x = random_bf16((5000, 1024), 30)
    side = random_bf16((5000, 64), 31)
    pool_output = random_bf16((case.plan.pool_capacity, 1024 + 32), 32)
    side_expand = random_bf16((5000, 1024), 33)
    first = (
        pool.gather_pool(x, side, case.plan).clone(),
        pool.side_sum(pool_output, case.plan, case.weights, 1024),
        pool.combine(pool_output, case.plan, case.weights, side_expand, 0.25),
    )
    rows_used = int(case.plan.expert_pool_offsets[-1])
    for _ in range(3):
        assert_bitwise(pool.gather_pool(x, side, case.plan)[:rows_used], first[0][:rows_used])
        assert_bitwise(pool.side_sum(pool_output, case.plan, case.weights, 1024), first[1])
        assert_bitwise(
            pool.combine(pool_output, case.plan, case.weights, side_expand, 0.25), first[2]
        )


def test_reused_output_buffers():
    case = make_case(700, 6, seed=34)
    out = torch.full((700, 256), SENTINEL, dtype=torch.bfloat16, device="cuda")
    p_sum = torch.full((700, 16), SENTINEL, dtype=torch.bfloat16, device="cuda")
    for seed in (35, 36):
        pool_output = random_bf16((case.plan.pool_capacity, 256 + 16), seed)
        assert pool.combine(pool_output, case.plan, case.weights, out=out) is out
        assert pool.side_sum(pool_output, case.plan, case.weights, 256, p_sum) is p_sum
        cpu_out = pool_output.cpu()
        assert_bitwise(
            out, pool.combine_reference(cpu_out, case.plan_cpu, case.weights.cpu(), hidden=256)
        )
        assert_bitwise(
            p_sum, pool.side_sum_reference(cpu_out, case.plan_cpu, case.weights.cpu(), 256)
        )


def test_runs_on_a_non_default_stream():
    case = make_case(4000, 6, num_experts=32, seed=37)
    x = random_bf16((4000, 512), 38)
    pool_output = random_bf16((case.plan.pool_capacity, 512 + 16), 39)
    side_expand = random_bf16((4000, 512), 40)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gathered = pool.gather_pool(x, None, case.plan)
        p_sum = pool.side_sum(pool_output, case.plan, case.weights, 512)
        out = pool.combine(pool_output, case.plan, case.weights, side_expand, 0.5)
    stream.synchronize()
    rows_used = int(case.plan_cpu.expert_pool_offsets[-1])
    expected = pool.gather_pool_reference(x.cpu(), None, case.plan_cpu)
    assert_bitwise(gathered[:rows_used], expected[:rows_used])
    cpu = pool_output.cpu()
    weights = case.weights.cpu()
    assert_bitwise(p_sum, pool.side_sum_reference(cpu, case.plan_cpu, weights, 512))
    assert_bitwise(out, pool.combine_reference(cpu, case.plan_cpu, weights, side_expand.cpu(), 0.5))


@pytest.mark.cuda_graph
def test_under_cuda_graph_capture():
    # No host synchronisation: the rows in use are read on the device, so a captured
    # gather follows a new routing on replay.
    num_tokens, top_k, experts = 3000, 6, 32
    ids, weights = make_routing(num_tokens, experts, top_k, kind="masked", seed=41)
    static_ids, static_weights = ids.cuda(), weights.cuda()
    x = random_bf16((num_tokens, 256), 42)
    side_expand = random_bf16((num_tokens, 256), 43)
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())  # inputs made on the default stream

    def step():
        plan = mm.plan_routes(static_ids, experts, 64, check_ids=False)
        gathered = pool.gather_pool(x, None, plan)
        # Stand-in for the GEMMs: the pool output is the gathered input plus 16 columns.
        pool_output = torch.cat([gathered, gathered[:, :16]], dim=1)
        out = pool.combine(pool_output, plan, static_weights, side_expand, 0.25)
        return plan, pool_output, out

    with torch.cuda.stream(capture_stream):
        step()  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream):
            plan, pool_output, out = step()
    new_ids, new_weights = make_routing(num_tokens, experts, top_k, kind="skewed", seed=44)
    static_ids.copy_(new_ids)
    static_weights.copy_(new_weights)
    graph.replay()
    torch.cuda.synchronize()
    plan_cpu = plan_on(plan, "cpu")
    rows_used = int(plan_cpu.expert_pool_offsets[-1])
    expected_gather = pool.gather_pool_reference(x.cpu(), None, plan_cpu)
    assert_bitwise(pool_output[:rows_used, :256], expected_gather[:rows_used])
    expected = pool.combine_reference(
        pool_output.cpu(), plan_cpu, new_weights, side_expand.cpu(), 0.25, hidden=256
    )
    assert_bitwise(out, expected)


# ------------------------------------------------------------------ launcher checks


def test_native_gather_checks_its_arguments():
    from megamoe import _C
    from megamoe.wrappers._native import current_stream, dlpack

    case = make_case(8, 2, seed=45)
    plan = case.plan
    good = dict(
        x=random_bf16((8, 64), 46),
        side=random_bf16((8, 16), 47),
        p2r=plan.pool_row_to_route,
        offsets=plan.expert_pool_offsets,
        top_k=2,
        out=torch.zeros(plan.pool_capacity, 80, dtype=torch.bfloat16, device="cuda"),
    )

    def call(**overrides):
        a = {**good, **overrides}
        _C.pool_gather(
            dlpack(a["x"]),
            None if a["side"] is None else dlpack(a["side"]),
            dlpack(a["p2r"]),
            dlpack(a["offsets"]),
            a["top_k"],
            dlpack(a["out"]),
            current_stream(a["x"].device),
        )

    call()
    torch.cuda.synchronize()
    misaligned = torch.zeros(8 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(8, 64)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        call(x=good["x"].float())
    with pytest.raises(ValueError, match="x: expected a data pointer aligned to 16 bytes"):
        call(x=misaligned)
    with pytest.raises(ValueError, match="x: expected the hidden size"):
        call(x=random_bf16((8, 60), 0), out=good["out"][:, :76].contiguous())
    with pytest.raises(ValueError, match="side: expected shape"):
        call(side=random_bf16((7, 16), 0))
    with pytest.raises(ValueError, match="pool_input: expected shape"):
        call(side=None)  # pool_input still has the 16 side columns
    with pytest.raises(ValueError, match="pool_input: expected a contiguous"):
        wide = torch.zeros(plan.pool_capacity, 160, dtype=torch.bfloat16, device="cuda")
        call(out=wide[:, :80])
    with pytest.raises(TypeError, match="pool_row_to_route: expected dtype int32"):
        call(p2r=plan.pool_row_to_route.long())
    with pytest.raises(ValueError, match="expert_pool_offsets: expected"):
        call(offsets=plan.expert_pool_offsets[:1])
    with pytest.raises(ValueError, match="top_k: expected >= 1"):
        call(top_k=0)
    with pytest.raises(ValueError, match="route_to_pool_row: expected shape"):
        _C.pool_gather(
            dlpack(good["x"]), dlpack(good["side"]), dlpack(good["p2r"]),
            dlpack(good["offsets"]), 2, dlpack(good["out"]), current_stream(good["x"].device),
            dlpack(plan.route_to_pool_row[:7]),
        )  # fmt: skip


def test_rows_the_index_maps_disagree_on_are_zeroed_once():
    # A corrupt plan: two routes' pool rows swapped in route_to_pool_row only. Neither
    # row is claimed by both maps, so both are zeroed (as the reference does), and every
    # other row still holds its token: each row in use has exactly one writer.
    case = make_case(300, 4, seed=51)
    r2p = case.plan.route_to_pool_row.clone()
    flat = r2p.view(-1)
    routed = (flat >= 0).nonzero().flatten()
    a, b = int(routed[3]), int(routed[40])
    flat[a], flat[b] = flat[b].clone(), flat[a].clone()
    corrupt = dataclasses.replace(case.plan, route_to_pool_row=r2p)
    corrupt_cpu = dataclasses.replace(case.plan_cpu, route_to_pool_row=r2p.cpu())
    x = random_bf16((300, 128), 52)
    runs = [pool.gather_pool(x, None, corrupt) for _ in range(2)]
    expected = pool.gather_pool_reference(x.cpu(), None, corrupt_cpu)
    rows = int(case.plan_cpu.expert_pool_offsets[-1])
    assert_bitwise(runs[0][:rows], expected[:rows])
    assert_bitwise(runs[1][:rows], runs[0][:rows])
    for route in (a, b):
        row = int(case.plan_cpu.route_to_pool_row.view(-1)[route])
        assert (runs[0][row].view(torch.int16) == 0).all()


def test_native_gather_tokens_checks_its_arguments():
    from megamoe import _C
    from megamoe.wrappers._native import current_stream, dlpack

    case = make_case(8, 2, seed=45)
    plan = case.plan
    good = dict(
        x=random_bf16((8, 64), 46),
        side=random_bf16((8, 16), 47),
        r2p=plan.route_to_pool_row,
        p2r=plan.pool_row_to_route,
        offsets=plan.expert_pool_offsets,
        out=torch.zeros(plan.pool_capacity, 80, dtype=torch.bfloat16, device="cuda"),
    )

    def call(**overrides):
        a = {**good, **overrides}
        _C.pool_gather_tokens(
            dlpack(a["x"]),
            None if a["side"] is None else dlpack(a["side"]),
            dlpack(a["r2p"]),
            dlpack(a["p2r"]),
            dlpack(a["offsets"]),
            dlpack(a["out"]),
            current_stream(a["x"].device),
        )

    call()
    torch.cuda.synchronize()
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        call(x=good["x"].float())
    with pytest.raises(ValueError, match="x: expected the hidden size"):
        call(x=random_bf16((8, 60), 0), out=good["out"][:, :76].contiguous())
    with pytest.raises(ValueError, match="side: expected shape"):
        call(side=random_bf16((7, 16), 0))
    with pytest.raises(ValueError, match="route_to_pool_row: expected shape"):
        call(r2p=plan.route_to_pool_row[:7])
    with pytest.raises(TypeError, match="route_to_pool_row: expected dtype int32"):
        call(r2p=plan.route_to_pool_row.long())
    with pytest.raises(TypeError, match="pool_row_to_route: expected dtype int32"):
        call(p2r=plan.pool_row_to_route.long())
    with pytest.raises(ValueError, match="expert_pool_offsets: expected"):
        call(offsets=plan.expert_pool_offsets[:1])
    with pytest.raises(ValueError, match="pool_input: expected shape"):
        call(side=None)


def test_native_combine_and_side_sum_check_their_arguments():
    from megamoe import _C
    from megamoe.wrappers._native import current_stream, dlpack

    case = make_case(8, 2, seed=48)
    plan = case.plan
    stream = current_stream(torch.device("cuda", torch.cuda.current_device()))
    good = dict(
        pool_output=random_bf16((plan.pool_capacity, 64 + 16), 49),
        r2p=plan.route_to_pool_row,
        weights=case.weights,
        side_expand=random_bf16((8, 64), 50),
        out=torch.zeros(8, 64, dtype=torch.bfloat16, device="cuda"),
        p_sum=torch.zeros(8, 16, dtype=torch.bfloat16, device="cuda"),
    )

    def combine(**overrides):
        a = {**good, **overrides}
        _C.pool_combine(
            dlpack(a["pool_output"]),
            dlpack(a["r2p"]),
            dlpack(a["weights"]),
            None if a["side_expand"] is None else dlpack(a["side_expand"]),
            0.5,
            dlpack(a["out"]),
            stream,
        )

    def side_sum(hidden=64, **overrides):
        a = {**good, **overrides}
        _C.pool_side_sum(
            dlpack(a["pool_output"]),
            dlpack(a["r2p"]),
            dlpack(a["weights"]),
            hidden,
            dlpack(a["p_sum"]),
            stream,
        )

    combine()
    combine(side_expand=None)
    side_sum()
    torch.cuda.synchronize()
    with pytest.raises(TypeError, match="pool_output: expected dtype bfloat16"):
        combine(pool_output=good["pool_output"].float())
    with pytest.raises(TypeError, match="route_to_pool_row: expected dtype int32"):
        combine(r2p=plan.route_to_pool_row.long())
    with pytest.raises(TypeError, match="topk_weights: expected dtype float32"):
        combine(weights=case.weights.to(torch.bfloat16))
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        combine(weights=case.weights[:4].contiguous())
    with pytest.raises(ValueError, match="side_expand: expected shape"):
        combine(side_expand=random_bf16((8, 72), 0))
    misaligned = torch.zeros(8 * 64 + 4, dtype=torch.bfloat16, device="cuda")[4:].view(8, 64)
    with pytest.raises(ValueError, match="side_expand: expected a data pointer aligned"):
        combine(side_expand=misaligned)
    with pytest.raises(ValueError, match="out: expected shape"):
        combine(out=torch.zeros(7, 64, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="pool_output: expected its side columns"):
        combine(
            out=torch.zeros(8, 56, dtype=torch.bfloat16, device="cuda"),
            side_expand=random_bf16((8, 56), 0),
            pool_output=random_bf16((plan.pool_capacity, 60), 0),
        )
    with pytest.raises(ValueError, match="hidden: expected 0 to 80"):
        side_sum(hidden=88)
    with pytest.raises(ValueError, match="hidden: expected the hidden size"):
        side_sum(hidden=60)
    with pytest.raises(ValueError, match="p_sum: expected shape"):
        side_sum(p_sum=torch.zeros(8, 8, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="p_sum: expected a contiguous"):
        side_sum(p_sum=torch.zeros(16, 8, dtype=torch.bfloat16, device="cuda").t())


def test_python_wrappers_check_alignment_on_cuda():
    case = make_case(8, 2, seed=51)
    misaligned = torch.zeros(8 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(8, 64)
    with pytest.raises(ValueError, match="x: expected a data pointer aligned to 16 bytes"):
        pool.gather_pool(misaligned, None, case.plan)
    with pytest.raises(ValueError, match="x: expected device"):
        pool.gather_pool(random_bf16((8, 64), 0, device="cpu"), None, case.plan)


def test_gather_rows_is_index_select():
    gen = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randn(1000, 264, device="cuda", generator=gen).bfloat16()
    rows = torch.randint(0, 1000, (1500,), device="cuda", generator=gen).to(torch.int32)
    assert torch.equal(pool.gather_rows(src, rows), src.index_select(0, rows.long()))
