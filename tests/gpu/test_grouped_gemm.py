"""The engine's pool GEMMs vs float64 per-expert references (DESIGN §6 gates)."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import assert_close_to_oracle
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.grouped_gemm import (
    gated_grouped_gemm,
    gated_grouped_gemm_reference,
    grouped_gemm,
    grouped_gemm_reference,
)

pytestmark = pytest.mark.gpu


def pool_for(num_tokens, experts, top_k, block_m, cols, *, kind="balanced", seed=0, **kw):
    ids, _ = make_routing(num_tokens, experts, top_k, kind=kind, seed=seed, **kw)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(plan.pool_capacity, cols, device="cuda", generator=generator)
    return plan, a.bfloat16()


def weights(*shape, seed=1, scale=None):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scale = scale if scale is not None else shape[-1] ** -0.5
    return (torch.randn(*shape, device="cuda", generator=generator) * scale).bfloat16()


# BLOCK_M of the registry's pool variants (every pool kind has 256-wide tiles).
BLOCK_MS = [64, 128]


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [
        (1, 8, 1, 256, 128),
        (17, 8, 2, 256, 128),
        (1029, 16, 6, 1536, 768),
        (700, 8, 2, 2880, 2880),
        (4096, 32, 6, 4096, 2048),
    ],
)
def test_store_matches_reference(block_m, tokens, experts, top_k, hidden, inter):
    # GEMM2 shape: [pool, I] x [E, H, I]^T, H may have a tail (2880 = 11.25 tiles).
    plan, a = pool_for(tokens, experts, top_k, block_m, inter, kind="skewed")
    b = weights(experts, hidden, inter)
    out = grouped_gemm(a, b, plan)
    rows = int(plan.expert_pool_offsets[-1])
    assert_close_to_oracle("out", out[:rows], grouped_gemm_reference(a, b, plan))


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [16, 64, 128, 256, 264])
def test_store_with_extra_columns(rank, block_m):
    """GEMM2 with the a2 shrink: b_extra as given [E, K, N_x], read MN-major (N_x below
    a box, whole tiles, a tail), its columns after b's."""
    plan, a = pool_for(600, 8, 2, block_m, 768, kind="masked")
    b = weights(8, 1536, 768)
    b_extra = weights(8, 768, rank, seed=2, scale=768**-0.5)
    out = grouped_gemm(a, b, plan, b_extra=b_extra)
    rows = int(plan.expert_pool_offsets[-1])
    assert out.shape[1] == 1536 + rank
    assert_close_to_oracle("out", out[:rows], grouped_gemm_reference(a, b, plan, b_extra=b_extra))


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,k,n",
    [
        (1, 8, 1, 128, 256),
        (700, 8, 2, 2048 + 16, 1024),  # a K tail (K = 2080: the last step half empty)
        (1029, 16, 6, 1536, 768 + 64),  # an N tail
        (4096, 32, 6, 4096, 2048),  # dgrad1 of a small layer: [P, 2I] x [E, 2I, H]
    ],
)
def test_store_with_an_mn_major_b(block_m, tokens, experts, top_k, k, n):
    """b [E, K, N] read as stored (the dgrads' transposed weights): TMA boxes of 64 K
    rows x 64 N columns, wgmma with an MN-major B; K rows past an expert's K are
    zero-filled by the 3-D tensor map, not read from the next expert."""
    plan, a = pool_for(tokens, experts, top_k, block_m, k, kind="skewed")
    b = weights(experts, k, n)
    out = grouped_gemm(a, b, plan, b_major="mn")
    rows = int(plan.expert_pool_offsets[-1])
    expected = grouped_gemm_reference(a, b.transpose(1, 2), plan)
    assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "k,k_lo,n_lo,n_hi",
    [
        # both blocks in the low half (half-width MMAs throughout); extra_hi from row -16
        (512, 256, 16, 16),
        (512, 256, 64, 64),  # both blocks exactly fill the low half
        (512, 256, 128, 128),  # the production split (r = 128): lo half-width, hi whole
        (512, 192, 128, 128),  # the same with K_lo not half of K
        (520, 256, 128, 128),  # a partial last K step, in the hi block
        (512, 192, 256, 8),  # a whole tile of lo, then hi in a tail tile (whole MMAs)
        (512, 320, 40, 136),  # unequal blocks straddling the low half's edge
    ],
)
def test_mn_major_b_with_extra_blocks(block_m, k, k_lo, n_lo, n_hi):
    """dgrad1 with the b1/b3 shrinks read as given: b_extra_blocks (lo [E, N_lo, K_lo],
    hi [E, N_hi, K - K_lo], K-major) are the extra columns [[lo^T, 0], [0, hi^T]] after
    b's; the zero blocks come from the maps' zero fill, never from memory, and a block
    within the first extra tile's low half runs half-width MMAs."""
    experts, n = 8, 384
    plan, a = pool_for(1029, experts, 6, block_m, k, kind="empty", empty_experts=(2,))
    b = weights(experts, k, n)
    lo = weights(experts, n_lo, k_lo, seed=3)
    hi = weights(experts, n_hi, k - k_lo, seed=4)
    out = grouped_gemm(a, b, plan, b_major="mn", b_extra_blocks=(lo, hi))
    assert out.shape == (plan.pool_capacity, n + n_lo + n_hi)
    rows = int(plan.expert_pool_offsets[-1])
    expected = grouped_gemm_reference(a, b.transpose(1, 2), plan, b_extra_blocks=(lo, hi))
    assert_close_to_oracle("out", out[:rows, :n], expected[:, :n])
    assert_close_to_oracle("extra lo", out[:rows, n : n + n_lo], expected[:, n : n + n_lo])
    assert_close_to_oracle("extra hi", out[:rows, n + n_lo :], expected[:, n + n_lo :])


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", None), ("swiglu", 0.5)])
@pytest.mark.parametrize("rank", [0, 16, 48, 128, 256])
@pytest.mark.parametrize("inter", [256, 192])  # 192: a half-empty last tile (I % 128 = 64)
def test_gated_matches_reference(block_m, activation, clamp, rank, inter):
    hidden, experts = 512, 8
    plan, a = pool_for(
        900, experts, 4, block_m, hidden + 2 * rank, kind="empty", empty_experts=(0, 3, 7)
    )
    w13 = weights(experts, 2 * inter, hidden)
    side = {}
    if rank:
        side = dict(
            side_b_gate=weights(experts, rank, inter, seed=3, scale=rank**-0.5),  # b1 [E, r, I]
            side_b_up=weights(experts, rank, inter, seed=4, scale=rank**-0.5),
            side_scale=0.25,
        )
    h = gated_grouped_gemm(
        a,
        w13,
        plan,
        k=hidden,
        activation=activation,
        activation_clamp=clamp,
        **side,
    )
    expected = gated_grouped_gemm_reference(
        a, w13, plan, k=hidden, activation=activation, activation_clamp=clamp, **side
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert_close_to_oracle("h", h[:rows], expected)
    # Past the gates, which a wrong formula of about the right size passes (an erf GELU
    # for the tanh form moves h by ~2e-4 relative and 8% of its BF16 values): almost
    # every entry is the oracle's value rounded to nearest.
    exact = (h[:rows].double() == expected.to(torch.bfloat16).double()).double().mean()
    assert exact > 0.99, float(exact)


# Rows per expert whose 128-row blocks (2, 0, 1, 3, 1, 0, 2: nine) put expert boundaries
# at odd and even blocks, with empty experts between and one a row past a block.
BOUNDARY_COUNTS = [130, 0, 128, 300, 5, 0, 129]


def exact_plan(counts, block_m=128):
    """A top-1 plan with exactly `counts` rows per expert (the pool operands below are
    made in pool layout, so only the plan's offsets matter)."""
    experts = torch.arange(len(counts), dtype=torch.int32)
    ids = torch.repeat_interleave(experts, torch.tensor(counts))
    return mm.plan_routes(ids.view(-1, 1).cuda(), len(counts), block_m)


@pytest.mark.parametrize(
    "counts", [BOUNDARY_COUNTS, BOUNDARY_COUNTS[::-1], [1, 257, 0, 0, 127, 128]]
)
def test_exact_expert_counts(counts):
    """The 128-row pool kinds (K-major b with an extra, MN-major b, gated with the side
    segment) against the oracle on expert counts chosen block by block; the rows past
    the pool's rows in use stay as they were."""
    experts, hidden, inter, rank = len(counts), 512, 384, 64
    plan = exact_plan(counts)
    rows = int(plan.expert_pool_offsets[-1])
    generator = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(plan.pool_capacity, hidden + 2 * rank, device="cuda", generator=generator)
    a = a.bfloat16()
    # GEMM2-like (K-major b with an MN-major extra), dgrad1-like (MN-major b).
    b = weights(experts, 2 * inter, hidden)
    b_extra = weights(experts, hidden, rank, seed=2)
    sentinel = torch.full((plan.pool_capacity, 2 * inter + rank), 7.0, device="cuda").bfloat16()
    out = grouped_gemm(a, b, plan, k=hidden, b_extra=b_extra, out=sentinel.clone())
    expected = grouped_gemm_reference(a, b, plan, k=hidden, b_extra=b_extra)
    assert_close_to_oracle("k-major out", out[:rows], expected)
    assert torch.equal(out[rows:], sentinel[rows:])
    b_mn = weights(experts, hidden, 2 * inter, seed=3)
    out = grouped_gemm(a, b_mn, plan, k=hidden, b_major="mn", out=sentinel[:, : 2 * inter].clone())
    expected = grouped_gemm_reference(a, b_mn.transpose(1, 2), plan, k=hidden)
    assert_close_to_oracle("mn-major out", out[:rows], expected)
    assert torch.equal(out[rows:], sentinel[rows:, : 2 * inter])
    # GEMM1 with the side segment.
    side = dict(
        side_b_gate=weights(experts, rank, inter, seed=4, scale=rank**-0.5),
        side_b_up=weights(experts, rank, inter, seed=6, scale=rank**-0.5),
        side_scale=0.25,
    )
    h = gated_grouped_gemm(a, b, plan, k=hidden, out=sentinel[:, :inter].clone(), **side)
    expected = gated_grouped_gemm_reference(a, b, plan, k=hidden, **side)
    assert_close_to_oracle("h", h[:rows], expected)
    assert torch.equal(h[rows:], sentinel[rows:, :inter])


def test_gated_zero_scale_is_bitwise_the_no_side_result():
    plan, a = pool_for(300, 8, 2, 128, 256 + 2 * 64)
    w13 = weights(8, 256, 256)
    plain = gated_grouped_gemm(a, w13, plan, k=256)
    zero = gated_grouped_gemm(
        a,
        w13,
        plan,
        k=256,
        side_b_gate=weights(8, 64, 128, scale=64**-0.5),
        side_b_up=weights(8, 64, 128, scale=64**-0.5),
        side_scale=0.0,
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert torch.equal(plain[:rows], zero[:rows])


def test_repeated_runs_are_bitwise_identical():
    plan, a = pool_for(2000, 16, 6, 128, 1024)
    b = weights(16, 2048, 1024)
    rows = int(plan.expert_pool_offsets[-1])  # rows past this are never written
    first = grouped_gemm(a, b, plan)[:rows]
    for _ in range(3):
        assert torch.equal(grouped_gemm(a, b, plan)[:rows], first)


def test_launcher_rejects_bad_operands():
    plan, a = pool_for(100, 8, 2, 128, 256)
    b = weights(8, 512, 256)
    with pytest.raises(TypeError, match="b: expected dtype"):
        grouped_gemm(a, b.half(), plan)
    with pytest.raises(ValueError, match=r"^b: expected the plan's E_l = 8 experts, got 7"):
        grouped_gemm(a, weights(7, 512, 256), plan)
    # k past a's 256 columns: the wrapper's check, before the launcher's (k_base).
    with pytest.raises(ValueError, match=r"^k: expected a multiple of 8 in \[8, a.shape\[1\]"):
        grouped_gemm(a, weights(8, 512, 264), plan, k=264)
