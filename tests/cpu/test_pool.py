"""Pool gather / side sum / combine references vs naive Python loops (CPU)."""

import numpy as np
import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import pool

NUM_EXPERTS = 12


def bf16_bits_to_float32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy()


def round_to_bf16(values: np.ndarray) -> torch.Tensor:
    """float32 -> bfloat16, round to nearest even on the bit pattern (finite values):
    an oracle independent of torch's conversion."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return torch.from_numpy(rounded.view(np.int16).copy()).view(torch.bfloat16)


def random_bf16(shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def make_plan(num_tokens, top_k, kind="masked", block_m=64, seed=0, num_local=NUM_EXPERTS):
    ids, weights = make_routing(num_tokens, NUM_EXPERTS, top_k, kind=kind, seed=seed)
    return mm.plan_routes_reference(ids, num_local, block_m), weights


# ------------------------------------------------------------------ naive oracles


def naive_gather(x, side, plan, out):
    out = out.clone()
    top_k = plan.route_to_pool_row.shape[1]
    rows_used = int(plan.expert_pool_offsets[-1])
    hidden = x.shape[1]
    for row in range(rows_used):
        route = int(plan.pool_row_to_route[row])
        if route < 0:
            out[row] = 0
            continue
        token = route // top_k
        out[row, :hidden] = x[token]
        if side is not None:
            out[row, hidden:] = side[token]
    return out


def naive_weighted_sum(pool_output, plan, weights, columns):
    """float32 sum over k in order, product and sum each rounded: numpy float32 scalars
    per route, vectorised over columns only."""
    data = bf16_bits_to_float32(pool_output[:, columns])
    rows = plan.route_to_pool_row.tolist()
    w = weights.numpy().astype(np.float32)
    acc = np.zeros((len(rows), data.shape[1]), dtype=np.float32)
    for t, token_rows in enumerate(rows):
        for k, row in enumerate(token_rows):
            if row >= 0:
                acc[t] = (acc[t] + (np.float32(w[t, k]) * data[row]).astype(np.float32)).astype(
                    np.float32
                )
    return acc


def naive_combine(pool_output, plan, weights, hidden, side_expand=None, scale=0.0):
    acc = naive_weighted_sum(pool_output, plan, weights, slice(0, hidden))
    if side_expand is not None and scale != 0.0:
        side = bf16_bits_to_float32(side_expand)
        acc = (acc + (np.float32(scale) * side).astype(np.float32)).astype(np.float32)
    return round_to_bf16(acc)


# ------------------------------------------------------------------ gather


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 90])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("side_cols", [0, 32])
def test_gather_matches_naive(num_tokens, top_k, side_cols):
    plan, _ = make_plan(num_tokens, top_k, seed=num_tokens * 7 + top_k)
    hidden = 64
    x = random_bf16((num_tokens, hidden), 1)
    side = random_bf16((num_tokens, side_cols), 2) if side_cols else None
    sentinel = torch.full((plan.pool_capacity, hidden + side_cols), 3.0, dtype=torch.bfloat16)
    expected = naive_gather(x, side, plan, sentinel)
    out = sentinel.clone()
    result = pool.gather_pool(x, side, plan, out=out)
    assert result is out
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # The public entry on CPU is the reference.
    again = pool.gather_pool_reference(x, side, plan, sentinel.clone())
    assert torch.equal(again.view(torch.int16), out.view(torch.int16))


def test_gather_zeroes_padding_and_leaves_the_tail_untouched():
    ids = torch.tensor([[0, 2], [2, 0], [2, 2]], dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 4, 64)
    assert plan.expert_pool_offsets.tolist() == [0, 64, 64, 128, 128]
    x = random_bf16((3, 16), 3)
    side = random_bf16((3, 8), 4)
    out = torch.full((plan.pool_capacity, 24), 7.0, dtype=torch.bfloat16)
    pool.gather_pool(x, side, plan, out)
    assert torch.equal(out[0], torch.cat([x[0], side[0]]))  # route 0 = (t0, k0)
    assert torch.equal(out[1], torch.cat([x[1], side[1]]))  # route 3 = (t1, k1)
    assert torch.equal(out[64:68, :16], x[[0, 1, 2, 2]])  # routes 1, 2, 4, 5
    assert (out[2:64] == 0).all() and (out[68:128] == 0).all()  # padding zeroed
    assert (out[128:] == 7.0).all()  # past the rows in use: untouched


def test_gather_empty_experts_and_remote_routes():
    ids, _ = make_routing(200, NUM_EXPERTS, 4, kind="empty", seed=5, empty_experts=(0, 5, 11))
    plan = mm.plan_routes_reference(ids, 6, 64, expert_begin=3)  # experts 3..8 local
    assert plan.expert_counts[2] == 0  # global expert 5
    x = random_bf16((200, 32), 6)
    sentinel = torch.full((plan.pool_capacity, 32), -1.0, dtype=torch.bfloat16)
    out = pool.gather_pool(x, None, plan, sentinel.clone())
    assert torch.equal(
        out.view(torch.int16), naive_gather(x, None, plan, sentinel).view(torch.int16)
    )


def test_gather_zeroes_the_rows_the_index_maps_disagree_on():
    # The token-major kernel writes a row from its token only where both maps name the
    # pair; the reference follows the same rule, so a corrupt plan (two routes' rows
    # swapped in route_to_pool_row only) zeroes both rows instead of copying either.
    import dataclasses

    plan, _ = make_plan(40, 2, seed=9)
    x = random_bf16((40, 16), 10)
    flat = plan.route_to_pool_row.clone().view(-1)
    a, b = (flat >= 0).nonzero().flatten()[[1, 7]].tolist()
    row_a, row_b = int(flat[a]), int(flat[b])
    flat[a], flat[b] = row_b, row_a
    corrupt = dataclasses.replace(plan, route_to_pool_row=flat.view(40, 2))
    out = pool.gather_pool(x, None, corrupt)
    consistent = pool.gather_pool(x, None, plan)
    assert (out[row_a].view(torch.int16) == 0).all() and (out[row_b].view(torch.int16) == 0).all()
    others = torch.ones(plan.pool_capacity, dtype=torch.bool)
    others[[row_a, row_b]] = False
    rows = int(plan.expert_pool_offsets[-1])
    assert torch.equal(out[:rows][others[:rows]], consistent[:rows][others[:rows]])
    assert consistent[row_a].abs().amax() > 0  # the consistent plan copies the token row


def test_gather_all_masked_writes_nothing():
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 3, 64)
    out = torch.full((plan.pool_capacity, 8), 5.0, dtype=torch.bfloat16)
    pool.gather_pool(random_bf16((5, 8), 7), None, plan, out)
    assert (out == 5.0).all()


def test_gather_allocates_when_out_is_none():
    plan, _ = make_plan(10, 2)
    x = random_bf16((10, 16), 8)
    out = pool.gather_pool(x, None, plan)
    assert out.shape == (plan.pool_capacity, 16) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------ side sum / combine


def make_pool_output(plan, columns, seed):
    return random_bf16((plan.pool_capacity, columns), seed)


@pytest.mark.parametrize("num_tokens", [1, 15, 17, 90])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("side_rank", [16, 128])
def test_side_sum_matches_naive(num_tokens, top_k, side_rank):
    plan, weights = make_plan(num_tokens, top_k, seed=num_tokens + 100 * top_k)
    hidden = 32
    pool_output = make_pool_output(plan, hidden + side_rank, 9)
    expected = round_to_bf16(naive_weighted_sum(pool_output, plan, weights, slice(hidden, None)))
    result = pool.side_sum(pool_output, plan, weights, hidden)
    assert result.shape == (num_tokens, side_rank) and result.dtype == torch.bfloat16
    assert torch.equal(result.view(torch.int16), expected.view(torch.int16))
    out = torch.empty(num_tokens, side_rank, dtype=torch.bfloat16)
    assert pool.side_sum_reference(pool_output, plan, weights, hidden, out) is out
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("num_tokens", [1, 16, 91])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("side_rank", [0, 16])
@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_combine_matches_naive(num_tokens, top_k, side_rank, scale):
    plan, weights = make_plan(num_tokens, top_k, kind="skewed", seed=num_tokens + top_k)
    hidden = 64
    pool_output = make_pool_output(plan, hidden + side_rank, 10)
    side_expand = random_bf16((num_tokens, hidden), 11)
    expected = naive_combine(pool_output, plan, weights, hidden, side_expand, scale)
    result = pool.combine(pool_output, plan, weights, side_expand, scale, hidden=hidden)
    assert result.shape == (num_tokens, hidden)
    assert torch.equal(result.view(torch.int16), expected.view(torch.int16))


def test_float32_accumulator_is_sequential_in_k():
    # The unrounded accumulator, bit for bit: catches a float64 or reordered sum that
    # the final BF16 rounding would hide.
    plan, weights = make_plan(90, 6, seed=12)
    pool_output = make_pool_output(plan, 64, 13)
    acc = pool._weighted_route_sum(pool_output, slice(0, 64), plan, weights)
    expected = naive_weighted_sum(pool_output, plan, weights, slice(0, 64))
    assert np.array_equal(acc.numpy().view(np.uint32), expected.view(np.uint32))


def test_order_matters_and_is_k_ascending():
    # One token, three routes: 1 + 2^-24 + 2^-24 is 1 in float32 summed in order, but
    # 2^-24 + 2^-24 + 1 = 1 + 2^-23 if summed in reverse.
    ids = torch.tensor([[0, 0, 0]], dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 1, 64)
    pool_output = torch.zeros(plan.pool_capacity, 8, dtype=torch.bfloat16)
    pool_output[0] = 1.0
    pool_output[1] = 2.0**-24
    pool_output[2] = 2.0**-24
    weights = torch.ones(1, 3)
    acc = pool._weighted_route_sum(pool_output, slice(0, 8), plan, weights)
    assert (acc == 1.0).all()


def test_scale_zero_is_bitwise_the_no_side_output():
    plan, weights = make_plan(40, 6, seed=14)
    pool_output = make_pool_output(plan, 64 + 16, 15)
    side_expand = random_bf16((40, 64), 16)
    side_expand[0, 0] = float("inf")  # would turn into NaN if multiplied by 0
    side_expand[1, 1] = float("nan")
    no_side = pool.combine(pool_output, plan, weights, hidden=64)
    zero = pool.combine(pool_output, plan, weights, side_expand, 0.0)
    assert torch.equal(no_side.view(torch.int16), zero.view(torch.int16))
    with_side = pool.combine(pool_output, plan, weights, side_expand, 0.5)
    assert not torch.equal(with_side[2:], no_side[2:])
    # The kernel takes the scale as float32: 1e39 would be inf there (a review).
    with pytest.raises(ValueError, match=r"^scale: expected a float finite in float32"):
        pool.combine(pool_output, plan, weights, side_expand, 1e39)


def test_tokens_without_local_routes_get_zeros_or_the_side_term():
    ids = torch.tensor([[0, 1], [-1, -1], [5, 6], [1, -1]], dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 2, 64)  # experts 0, 1 local; token 1, 2 have none
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))
    pool_output = make_pool_output(plan, 32 + 16, 17)
    assert (pool.side_sum(pool_output, plan, weights, 32)[1:3] == 0).all()
    out = pool.combine(pool_output, plan, weights, hidden=32)
    assert (out[1:3].view(torch.int16) == 0).all()  # +0, not -0
    side_expand = random_bf16((4, 32), 18)
    out = pool.combine(pool_output, plan, weights, side_expand, 0.25)
    expected = (side_expand[1:3].float() * torch.tensor(0.25)).to(torch.bfloat16)
    assert torch.equal(out[1:3], expected)


def test_masked_weights_are_ignored():
    # A router may leave garbage (even NaN) in the weight of a masked route.
    ids = torch.tensor([[0, -1], [-1, 1]], dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 2, 64)
    weights = torch.tensor([[0.5, float("nan")], [float("inf"), 0.25]])
    pool_output = make_pool_output(plan, 16, 19)
    out = pool.combine(pool_output, plan, weights)
    assert torch.isfinite(out.float()).all()
    expected = naive_combine(pool_output, plan, weights, 16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_combine_hidden_inference():
    plan, weights = make_plan(8, 2)
    pool_output = make_pool_output(plan, 64 + 16, 20)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    pool.combine(pool_output, plan, weights, out=out)  # H from out
    by_hidden = pool.combine(pool_output, plan, weights, hidden=64)
    assert torch.equal(out, by_hidden)
    side_expand = random_bf16((8, 64), 21)
    by_side = pool.combine(pool_output, plan, weights, side_expand, 0.0)  # H from side
    assert torch.equal(by_side, by_hidden)
    assert pool.combine(pool_output, plan, weights).shape == (8, 80)  # r = 0 assumed


# ------------------------------------------------------------------ validation


def test_gather_validation_names_the_argument():
    plan, _ = make_plan(8, 2)
    x = random_bf16((8, 16), 0)
    with pytest.raises(TypeError, match="plan: expected a megamoe.RoutePlan"):
        pool.gather_pool(x, None, object())
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        pool.gather_pool(x.float(), None, plan)
    with pytest.raises(ValueError, match="x: expected the hidden size .* multiple of 8"):
        pool.gather_pool(random_bf16((8, 12), 0), None, plan)
    with pytest.raises(ValueError, match=r"x: expected 2 dimensions"):
        pool.gather_pool(x[0], None, plan)
    with pytest.raises(ValueError, match="side: expected shape"):
        pool.gather_pool(x, random_bf16((7, 8), 0), plan)
    with pytest.raises(ValueError, match="side: expected its column count"):
        pool.gather_pool(x, random_bf16((8, 4), 0), plan)
    with pytest.raises(ValueError, match="plan.route_to_pool_row: expected 9 rows"):
        pool.gather_pool(random_bf16((9, 16), 0), None, plan)
    with pytest.raises(ValueError, match="out: expected shape"):
        pool.gather_pool(x, None, plan, torch.empty(plan.pool_capacity, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        pool.gather_pool(random_bf16((16, 8), 0).t(), None, plan)


def test_combine_and_side_sum_validation_names_the_argument():
    plan, weights = make_plan(8, 2)
    pool_output = make_pool_output(plan, 48, 0)
    with pytest.raises(TypeError, match="topk_weights: expected dtype float32"):
        pool.combine(pool_output, plan, weights.to(torch.bfloat16), hidden=32)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        pool.combine(pool_output, plan, weights[:, :1].contiguous(), hidden=32)
    with pytest.raises(TypeError, match="pool_output: expected dtype bfloat16"):
        pool.side_sum(pool_output.float(), plan, weights, 32)
    with pytest.raises(ValueError, match="hidden: expected at most 48"):
        pool.side_sum(pool_output, plan, weights, 64)
    with pytest.raises(ValueError, match="hidden: expected an int >= 0"):
        pool.side_sum(pool_output, plan, weights, -8)
    with pytest.raises(ValueError, match="hidden: expected the hidden size .* multiple of 8"):
        pool.side_sum(pool_output, plan, weights, 36)
    with pytest.raises(ValueError, match="pool_output: expected its side columns"):
        pool.side_sum(make_pool_output(plan, 44, 0), plan, weights, 32)
    with pytest.raises(ValueError, match="out: expected shape"):
        pool.side_sum(pool_output, plan, weights, 32, torch.empty(8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="side_expand: expected shape"):
        pool.combine(pool_output, plan, weights, random_bf16((8, 40), 0), 1.0, hidden=32)
    with pytest.raises(ValueError, match="scale: expected a finite float"):
        pool.combine(pool_output, plan, weights, scale=float("nan"), hidden=32)
    with pytest.raises(TypeError, match="scale: expected a float"):
        pool.combine(pool_output, plan, weights, scale="1", hidden=32)
    with pytest.raises(ValueError, match="out: expected shape"):
        pool.combine(
            pool_output, plan, weights, out=torch.empty(8, 40, dtype=torch.bfloat16), hidden=32
        )


def test_combine_and_side_sum_refuse_a_pool_output_of_other_rows():
    """A review: a pool output shorter than the plan's pool was accepted and its missing
    rows read as masked routes (routes silently dropped); a longer one is refused too, as
    the gather and GEMM wrappers refuse theirs."""
    plan, weights = make_plan(8, 2)
    pool_output = make_pool_output(plan, 48, 0)
    for rows in (64, plan.pool_capacity + 64):
        other = make_pool_output(plan, 48, 0).new_zeros(rows, 48)
        expected = rf"^pool_output: expected shape \[{plan.pool_capacity}, \*\]"
        with pytest.raises(ValueError, match=expected):
            pool.combine(other, plan, weights, hidden=32)
        with pytest.raises(ValueError, match=expected):
            pool.side_sum(other, plan, weights, 32)
    assert pool.combine(pool_output, plan, weights, hidden=32).shape == (8, 32)
