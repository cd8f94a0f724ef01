"""The K-grouped weight-gradient GEMM vs the float64 oracle (DESIGN §6 gates), with
the tail masking checked directly: padding rows and the next expert's rows hold NaN or
data that must not reach an expert's sum."""

import math

import pytest
import torch

import megamoe as mm
from megamoe.testing import assert_close_to_oracle
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.k_grouped_gemm import (
    k_grouped_gemm,
    k_grouped_gemm_reference,
    launch_k_grouped,
)
from megamoe.wrappers.routing import RoutePlan

pytestmark = pytest.mark.gpu


def bf16(rows, cols, seed, scale=1.0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, cols, device="cuda", generator=generator) * scale).bfloat16()


def routed_plan(tokens, experts, top_k, block_m, kind, seed=0):
    ids, _ = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    return mm.plan_routes(ids.cuda(), experts, block_m)


def hand_plan(counts, segment_rows, capacity=None):
    """A plan whose segments hold ``counts`` data rows each and are ``segment_rows``
    long (any length: unaligned starts, or no padding at all)."""
    offsets = [0]
    for length in segment_rows:
        offsets.append(offsets[-1] + length)
    capacity = offsets[-1] if capacity is None else capacity
    row_to_route = torch.full((capacity,), -1, dtype=torch.int32)
    return RoutePlan(
        expert_counts=torch.tensor(counts, dtype=torch.int32, device="cuda"),
        expert_pool_offsets=torch.tensor(offsets, dtype=torch.int32, device="cuda"),
        route_to_pool_row=torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
        pool_row_to_route=row_to_route.cuda(),
        block_m=1,
    )


def use_sms(num_sms, monkeypatch):
    """Run on ``num_sms`` SMs (None: the device's budget as configured)."""
    if num_sms is not None:
        monkeypatch.setenv("MEGAMOE_NUM_SMS", num_sms)
        monkeypatch.delenv("MEGAMOE_SM_HEADROOM", raising=False)


def data_row_mask(plan):
    mask = torch.zeros(plan.pool_capacity, dtype=torch.bool)
    offsets = plan.expert_pool_offsets.tolist()
    for e, count in enumerate(plan.expert_counts.tolist()):
        mask[offsets[e] : offsets[e] + count] = True
    return mask.cuda()


def check(out, a, b, plan, scale=1.0):
    expected = k_grouped_gemm_reference(a, b, plan, scale=scale)
    empty = plan.expert_counts == 0
    if bool(empty.any()):
        assert bool((out[empty] == 0).all()), "an expert without rows must get exact zeros"
        assert not bool(torch.signbit(out[empty].float()).any()), "zeros must be +0"
    if bool((~empty).any()):
        assert_close_to_oracle("out", out[~empty], expected[~empty])


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "masked"])
@pytest.mark.parametrize(
    "m,n",
    [
        (32, 256),  # db1/db3: [2r, 2I]
        (256, 16),  # da2: [I, r]
        (512, 384),  # dw13: [2I, H]
        (200, 136),  # M and N tails
    ],
)
def test_matches_reference(m, n, kind, block_m):
    plan = routed_plan(700, 8, 2, block_m, kind)
    a = bf16(plan.pool_capacity, m, 1)
    b = bf16(plan.pool_capacity, n, 2)
    check(k_grouped_gemm(a, b, plan), a, b, plan)


@pytest.mark.parametrize("n", [128, 512])
def test_padding_rows_are_never_read(n):
    """NaN in every row that is not an expert's data: the result stays the oracle's."""
    plan = routed_plan(333, 8, 3, 128, "skewed", seed=4)
    a = bf16(plan.pool_capacity, 256, 5)
    b = bf16(plan.pool_capacity, n, 6)
    padding = ~data_row_mask(plan)
    assert bool(padding.any())
    a[padding] = float("nan")
    b[padding] = float("nan")
    out = k_grouped_gemm(a, b, plan)
    assert bool(torch.isfinite(out).all())
    check(out, a, b, plan)


def test_unaligned_segments_do_not_mix_experts():
    """Segments back to back at any row: a K step's rows past one expert's data are the
    next expert's data, and must not enter the first expert's sum."""
    counts = [0, 1, 63, 64, 65, 200, 0, 129, 7]
    plan = hand_plan(counts, counts, capacity=sum(counts) + 40)
    a = bf16(plan.pool_capacity, 192, 7)
    b = bf16(plan.pool_capacity, 256, 8)
    a[sum(counts) :] = float("nan")  # rows past the last segment
    b[sum(counts) :] = float("inf")
    check(k_grouped_gemm(a, b, plan), a, b, plan)


def test_counts_shorter_than_segments_and_gaps():
    # Segments longer than their data, with odd lengths and starts.
    counts = [5, 0, 130, 64, 1]
    segments = [9, 3, 131, 100, 1]
    plan = hand_plan(counts, segments)
    a = bf16(plan.pool_capacity, 128, 9)
    b = bf16(plan.pool_capacity, 136, 10)
    padding = ~data_row_mask(plan)
    a[padding] = float("nan")
    b[padding] = -float("inf")
    check(k_grouped_gemm(a, b, plan), a, b, plan)


@pytest.mark.parametrize("scale", [0.5, 3.0, -1.5, 0.0])
def test_scale(scale):
    plan = routed_plan(400, 8, 2, 128, "empty", seed=2)
    a = bf16(plan.pool_capacity, 64, 11)
    b = bf16(plan.pool_capacity, 256, 12)
    out = k_grouped_gemm(a, b, plan, scale=scale)
    if scale == 0.0:
        assert bool((out == 0).all()) and not bool(torch.signbit(out.float()).any())
    else:
        check(out, a, b, plan, scale=scale)  # empty experts: +0 even for a negative scale


def test_scale_is_applied_before_the_one_rounding():
    """Small integers make the FP32 sums exact: the output must be bf16(3 * sum), which
    differs from 3 * bf16(sum) wherever the sum needs more than 8 significant bits."""
    plan = routed_plan(600, 4, 2, 128, "skewed", seed=8)
    generator = torch.Generator(device="cuda").manual_seed(20)
    a = torch.randint(-3, 4, (plan.pool_capacity, 64), device="cuda", generator=generator)
    b = torch.randint(-3, 4, (plan.pool_capacity, 128), device="cuda", generator=generator)
    a, b = a.bfloat16(), b.bfloat16()
    out = k_grouped_gemm(a, b, plan, scale=3.0)
    exact = k_grouped_gemm_reference(a, b, plan)
    assert torch.equal(out, (3.0 * exact).bfloat16())
    rounded_twice = (3.0 * exact.bfloat16().double()).bfloat16()
    assert not torch.equal(out, rounded_twice), "the inputs must tell the two orders apart"


def test_corrupt_plans_stay_in_bounds():
    """Counts past their segment, negative and decreasing offsets, offsets past the
    pool: the kernel clamps each expert to its segment and the pool (like the twin)."""
    capacity = 300
    plan = RoutePlan(
        expert_counts=torch.tensor([500, 10, 40, 7, 64], dtype=torch.int32, device="cuda"),
        expert_pool_offsets=torch.tensor(
            [-50, 100, 90, 200, 10_000, 10_100], dtype=torch.int32, device="cuda"
        ),
        route_to_pool_row=torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
        pool_row_to_route=torch.full((capacity,), -1, dtype=torch.int32, device="cuda"),
        block_m=1,
    )
    a = bf16(capacity, 64, 21)
    b = bf16(capacity, 128, 22)
    out = k_grouped_gemm(a, b, plan)
    expected = k_grouped_gemm_reference(a, b, plan)
    # Clamped: expert 0 rows [0, 100); 1 none (100 > 90); 2 rows [90, 130); 3 rows
    # [200, 207); 4 none (past the pool).
    assert bool((out[1] == 0).all()) and bool((out[4] == 0).all())
    for e in (0, 2, 3):
        assert_close_to_oracle(f"out[{e}]", out[e], expected[e])
    manual = a[90:130].double().T @ b[90:130].double()
    assert torch.allclose(expected[2], manual)


def test_empty_pool_gives_zeros():
    plan = hand_plan([0, 0, 0], [0, 0, 0])
    a = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.empty(0, 128, dtype=torch.bfloat16, device="cuda")
    out = k_grouped_gemm(a, b, plan, out=torch.full((3, 64, 128), 7.0, device="cuda").bfloat16())
    assert bool((out == 0).all())


def test_column_slice_of_a_wider_pool():
    """dout's columns of the ``[dout | s dout b2^T]`` pool: rows wider than the operand."""
    plan = routed_plan(500, 8, 2, 128, "skewed", seed=3)
    wide = bf16(plan.pool_capacity, 384 + 16, 13)
    b = bf16(plan.pool_capacity, 256, 14)
    for a in (wide[:, :384], wide[:, 384:]):
        check(k_grouped_gemm(a, b, plan), a, b, plan)


def test_every_value_is_the_rounded_fp32_sum():
    """Elementwise: small integers make every partial sum exact in FP32, so each output
    is exactly the rounded float64 result."""
    plan = routed_plan(600, 8, 2, 128, "skewed", seed=5)
    generator = torch.Generator(device="cuda").manual_seed(15)
    a = torch.randint(-3, 4, (plan.pool_capacity, 128), device="cuda", generator=generator)
    b = torch.randint(-3, 4, (plan.pool_capacity, 256), device="cuda", generator=generator)
    a, b = a.bfloat16(), b.bfloat16()
    out = k_grouped_gemm(a, b, plan)
    expected = k_grouped_gemm_reference(a, b, plan).bfloat16()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_sms", ["2", None], ids=["two-ctas", "all-sms"])
def test_repeatable_bit_for_bit(num_sms, monkeypatch):
    # Two CTAs wrap the stage ring and its phases many times.
    use_sms(num_sms, monkeypatch)
    plan = routed_plan(900, 8, 3, 128, "skewed", seed=6)
    a = bf16(plan.pool_capacity, 256, 16)
    b = bf16(plan.pool_capacity, 512, 17)
    first = k_grouped_gemm(a, b, plan)
    for _ in range(3):
        assert torch.equal(k_grouped_gemm(a, b, plan), first)
    check(first, a, b, plan)


def test_matches_torch_grouped_mm_on_zero_padded_segments():
    """Against torch._grouped_mm over whole segments (zero padding rows): the same sums."""
    plan = routed_plan(2048, 16, 6, 128, "balanced", seed=7)
    a = bf16(plan.pool_capacity, 256, 18)
    b = bf16(plan.pool_capacity, 1024, 19)
    padding = ~data_row_mask(plan)
    a[padding] = 0
    b[padding] = 0
    ours = k_grouped_gemm(a, b, plan)
    theirs = torch._grouped_mm(a.T, b, offs=plan.expert_pool_offsets[1:])
    check(ours, a, b, plan)
    assert_close_to_oracle("torch", theirs.double(), ours.double(), min_cosine=1 - 1e-4)


@pytest.mark.parametrize("bad", ["dtype", "rows", "stride", "out_shape"])
def test_bad_input_is_rejected_before_any_launch(bad):
    plan = routed_plan(100, 4, 2, 128, "balanced")
    a = bf16(plan.pool_capacity, 64, 1)
    b = bf16(plan.pool_capacity, 128, 2)
    kwargs = {}
    if bad == "dtype":
        a, match = a.float(), "a: expected dtype"
    elif bad == "rows":
        b, match = b[:-1], "b: expected shape"
    elif bad == "stride":
        a, match = bf16(plan.pool_capacity, 66, 3)[:, :64], "a: TMA needs"
    else:
        kwargs["out"] = torch.empty(4, 64, 64, dtype=torch.bfloat16, device="cuda")
        match = "out: expected shape"
    with pytest.raises((TypeError, ValueError), match=match):
        k_grouped_gemm(a, b, plan, **kwargs)


def test_non_finite_scale_is_rejected():
    plan = routed_plan(100, 4, 2, 128, "balanced")
    a = bf16(plan.pool_capacity, 64, 1)
    with pytest.raises(ValueError, match="scale"):
        k_grouped_gemm(a, a, plan, scale=math.inf)


@pytest.mark.parametrize("num_sms", [None, "2"], ids=["all-sms", "two-ctas"])
@pytest.mark.parametrize("n", [32, 128, 200])
def test_float_out_sums_only_the_data_rows(n, num_sms, monkeypatch):
    """The FP32 kind (the token sums' partials): only each group's data rows enter its
    sum (the rest of a segment holds NaN), an empty group gets +0, the sum is not rounded
    (relative L2 1e-5 against float64), and where the BF16 kind has the same tile
    (N <= 128) the BF16 result is this one rounded once, bit for bit. On two CTAs each
    reuses its staging tile for several tiles."""
    use_sms(num_sms, monkeypatch)
    counts, segments = [70, 0, 1, 200, 129], [128, 64, 64, 256, 192]
    plan = hand_plan(counts, segments)
    offsets = plan.expert_pool_offsets.tolist()
    m = 192
    a, b = bf16(offsets[-1], m, 6), bf16(offsets[-1], n, 7)
    for e, count in enumerate(counts):  # poison every row past a group's data
        a[offsets[e] + count : offsets[e + 1]] = float("nan")
        b[offsets[e] + count : offsets[e + 1]] = float("nan")
    out = torch.empty(len(counts), m, n, dtype=torch.float32, device="cuda")
    launch_k_grouped(a, b, plan.expert_pool_offsets, plan.expert_counts, out, scale=0.5)
    expected = k_grouped_gemm_reference(a, b, plan, scale=0.5)
    for e, count in enumerate(counts):
        if count == 0:
            assert bool((out[e] == 0).all()) and not bool(torch.signbit(out[e]).any())
            continue
        error = float((out[e].double() - expected[e]).norm() / expected[e].norm())
        assert error <= 1e-5, (e, error)
    if n <= 128:
        assert torch.equal(k_grouped_gemm(a, b, plan, scale=0.5), out.bfloat16())
