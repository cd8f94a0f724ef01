"""Every kernel family at small shapes, for compute-sanitizer (memcheck, racecheck,
initcheck, synccheck): route plan, pool gather / side sum / combine, grouped GEMM
(Store with the N extra segment, GatedActivation with the K side segment and the
pre-activation store), the K-grouped weight gradients, the activation backward, and the
fused forward and backward of ``mm.moe``, at the edges where indexing goes wrong: one token, BLOCK_M
boundaries, empty experts, masked and remote routes, tile tails, persistent CTAs that
walk several tiles, and the rejection of undersized buffers before any launch.

Shapes are small because racecheck and initcheck slow kernels down by orders of
magnitude. Each case also checks its result (bitwise where the kernel and reference
do the same float32 operations, else against the float64 oracle), and reads only what
the kernel wrote: initcheck would flag a comparison that reads the unwritten tail of
a pool buffer, and rightly so.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import megamoe as mm
from megamoe import pool
from megamoe.activation_backward import (
    activation_backward,
    activation_backward_reference,
    fused_dgrad2_activation_backward,
)
from megamoe.grouped_gemm import (
    gated_grouped_gemm,
    gated_grouped_gemm_reference,
    grouped_gemm,
    grouped_gemm_reference,
)
from megamoe.k_grouped_gemm import k_grouped_gemm, k_grouped_gemm_reference
from megamoe.mxfp4_decode import decode_mxfp4_bf16
from megamoe.registry import registry
from megamoe.testing import GRAD_MIN_COSINE, assert_close_to_oracle, make_layer, make_routing
from megamoe.testing.sanitizer import UNDER_SANITIZER_ENV

pytestmark = pytest.mark.gpu

REG = registry()
BLOCK_MS = REG.block_m_choices
# (BLOCK_M, BLOCK_N) of every grouped GEMM variant in the registry.
GEMM_TILES = sorted(
    {(v.params["block_m"], v.params["block_n"]) for v in REG.family("grouped_gemm")}
)
PLAN_FIELDS = ("expert_counts", "expert_pool_offsets", "route_to_pool_row", "pool_row_to_route")


def bf16(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).cuda()


def on_cpu(plan: mm.RoutePlan) -> mm.RoutePlan:
    return dataclasses.replace(plan, **{f: getattr(plan, f).cpu() for f in PLAN_FIELDS})


def rows_used(plan: mm.RoutePlan) -> int:
    return int(plan.expert_pool_offsets[-1])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.cpu(), expected.cpu()
    assert a.shape == e.shape and a.dtype == e.dtype
    if a.dtype == torch.bfloat16:
        a, e = a.view(torch.int16), e.view(torch.int16)
    assert torch.equal(a, e)


def skip_if_torch_gemm_under_init_or_race(runs_torch_bf16_gemm: bool) -> None:
    """Cases that run torch's Hopper BF16 GEMMs (cuBLAS nvjet, CUTLASS grouped) are left
    to memcheck and synccheck; the cases that run only our kernels (and torch's
    elementwise ones) stay under all four tools. Measured on the H200 (2026-11-29):

    - initcheck does not see those GEMMs' output stores, so every later read of the
      output is reported, by torch's kernels and ours alike (1.5 M records over the
      suite). tools/initcheck_tma_probe.py shows it with torch alone: a BF16 GEMM, then
      ``.clone()``, against a clean fill-then-clone control.
    - racecheck reports shared-memory hazards inside two cuBLAS nvjet kernels at these
      tiny shapes (2 records, none in ours); leaving nvjet uninstrumented instead
      (``--kernel-name-exclude kns=nvjet``) made the tool abort on a hardware exception.
    """
    tool = os.environ.get(UNDER_SANITIZER_ENV)
    if runs_torch_bf16_gemm and tool in ("initcheck", "racecheck"):
        pytest.skip(f"runs a torch BF16 GEMM, which {tool} cannot judge (see the docstring)")


def gpu_plan(
    tokens: int,
    experts: int,
    top_k: int,
    block_m: int,
    *,
    kind: str = "masked",
    seed: int = 0,
    local: int | None = None,
    expert_begin: int = 0,
    id_dtype: torch.dtype = torch.int32,
) -> tuple[mm.RoutePlan, torch.Tensor, torch.Tensor]:
    """(plan on the GPU, topk_ids on the CPU, topk_weights on the GPU)."""
    ids, weights = make_routing(tokens, experts, top_k, kind=kind, seed=seed, id_dtype=id_dtype)
    plan = mm.plan_routes(
        ids.cuda(), experts if local is None else local, block_m, expert_begin=expert_begin
    )
    return plan, ids, weights.cuda()


# ------------------------------------------------------------------- route plan


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "tokens,top_k,experts,local,expert_begin,kind,id_dtype",
    [
        pytest.param(1, 1, 8, 8, 0, "balanced", torch.int32, id="one-token"),
        pytest.param(17, 2, 8, 8, 0, "masked", torch.int64, id="masked-int64"),
        # 2,400 routes: more than one 2,048-route tile of the counting sort.
        pytest.param(400, 6, 16, 16, 0, "empty", torch.int32, id="empty-experts-two-tiles"),
        pytest.param(300, 4, 32, 8, 8, "skewed", torch.int64, id="remote-experts"),
    ],
)
def test_route_plan(tokens, top_k, experts, local, expert_begin, kind, id_dtype, block_m):
    plan, ids, _ = gpu_plan(
        tokens,
        experts,
        top_k,
        block_m,
        kind=kind,
        local=local,
        expert_begin=expert_begin,
        id_dtype=id_dtype,
    )
    expected = mm.plan_routes_reference(ids, local, block_m, expert_begin=expert_begin)
    for name in PLAN_FIELDS:
        assert torch.equal(getattr(plan, name).cpu(), getattr(expected, name)), name


def test_route_plan_all_masked():
    ids = torch.full((5, 2), -1, dtype=torch.int32, device="cuda")
    plan = mm.plan_routes(ids, 4, BLOCK_MS[0])
    assert rows_used(plan) == 0
    assert bool((plan.pool_row_to_route == -1).all())


# ----------------------------------------------------------------- pool kernels


@pytest.mark.parametrize("side_cols", [0, 32])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (90, 2), (17, 6)])
def test_pool_gather(tokens, top_k, side_cols):
    # 16 experts: kind="empty" leaves three of them without routes, top-6 needs 6 more.
    plan, _, _ = gpu_plan(tokens, 16, top_k, BLOCK_MS[0], kind="empty", seed=tokens)
    x = bf16((tokens, 64), 1)
    side = bf16((tokens, side_cols), 2) if side_cols else None
    out = pool.gather_pool(x, side, plan)
    expected = pool.gather_pool_reference(
        x.cpu(), None if side is None else side.cpu(), on_cpu(plan)
    )
    rows = rows_used(plan)
    assert_bitwise(out[:rows], expected[:rows])


@pytest.mark.parametrize("scale", [0.0, 0.5])
@pytest.mark.parametrize("tokens,top_k,rank", [(1, 1, 16), (91, 2, 16), (33, 6, 0)])
def test_pool_side_sum_and_combine(tokens, top_k, rank, scale):
    hidden = 64
    plan, _, weights = gpu_plan(tokens, 8, top_k, BLOCK_MS[-1], kind="masked", seed=tokens)
    # Every row initialised: the kernels read only rows with a route, but the
    # references index the whole buffer.
    pool_output = bf16((plan.pool_capacity, hidden + rank), 3)
    side_expand = bf16((tokens, hidden), 4) if rank else None
    cpu_plan = on_cpu(plan)
    if rank:
        p_sum = pool.side_sum(pool_output, plan, weights, hidden)
        expected = pool.side_sum_reference(pool_output.cpu(), cpu_plan, weights.cpu(), hidden)
        assert_bitwise(p_sum, expected)
    out = pool.combine(pool_output, plan, weights, side_expand, scale, hidden=hidden)
    expected = pool.combine_reference(
        pool_output.cpu(),
        cpu_plan,
        weights.cpu(),
        None if side_expand is None else side_expand.cpu(),
        scale,
        hidden=hidden,
    )
    assert_bitwise(out, expected)


# ------------------------------------------------------------------ grouped GEMM


@pytest.mark.parametrize("extra", [0, 16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (100, 2)])
@pytest.mark.parametrize("block_m,block_n", GEMM_TILES)
def test_grouped_gemm_store(block_m, block_n, tokens, top_k, extra):
    # N = 192: a partial last tile for both BLOCK_N 128 and 256 (TMA reads past an
    # expert's N land in the next expert's rows or are zero-filled; never stored).
    # 8 experts: kind="empty" leaves three without routes and top-2 needs two more.
    experts, k, n = 8, 128, 192
    plan, _, _ = gpu_plan(tokens, experts, top_k, block_m, kind="empty", seed=tokens)
    a = bf16((plan.pool_capacity, k), 5)
    b = bf16((experts, n, k), 6, k**-0.5)
    b_extra = bf16((experts, extra, k), 7, k**-0.5) if extra else None
    out = grouped_gemm(a, b, plan, b_extra=b_extra, block_n=block_n)
    rows = rows_used(plan)
    assert out.shape == (plan.pool_capacity, n + extra)
    if rows:
        expected = grouped_gemm_reference(a, b, plan, b_extra=b_extra)
        assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize(
    "activation,clamp,rank",
    [("swiglu", None, 0), ("swiglu", None, 16), ("geglu", 0.5, 16)],
)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (100, 2)])
@pytest.mark.parametrize("block_m,block_n", GEMM_TILES)
def test_grouped_gemm_gated(block_m, block_n, tokens, top_k, activation, clamp, rank):
    # 2I = 256: one N tile of 256 or two of 128; r = 16: the K side segment's only
    # step reads 16 of 64 TMA columns (the rest is zero-filled past r).
    experts, hidden, inter = 4, 128, 128
    plan, _, _ = gpu_plan(tokens, experts, top_k, block_m, kind="masked", seed=tokens)
    a = bf16((plan.pool_capacity, hidden + 2 * rank), 8)
    w13 = bf16((experts, 2 * inter, hidden), 9, hidden**-0.5)
    side = {}
    if rank:
        side = dict(
            side_b_gate=bf16((experts, inter, rank), 10, rank**-0.5),
            side_b_up=bf16((experts, inter, rank), 11, rank**-0.5),
            side_scale=0.25,
        )
    h = gated_grouped_gemm(
        a,
        w13,
        plan,
        k=hidden,
        activation=activation,
        activation_clamp=clamp,
        block_n=block_n,
        **side,
    )
    rows = rows_used(plan)
    if rows:
        expected = gated_grouped_gemm_reference(
            a, w13, plan, k=hidden, activation=activation, activation_clamp=clamp, **side
        )
        assert_close_to_oracle("h", h[:rows], expected)


@pytest.mark.parametrize("block_m,block_n", GEMM_TILES)
def test_grouped_gemm_persistent_ctas_walk_many_tiles(block_m, block_n, monkeypatch):
    # Two CTAs for a few dozen tiles: every CTA wraps the stage ring and the mbarrier
    # phases several times, the part of a persistent pipeline races hide in.
    monkeypatch.setenv("MEGAMOE_NUM_SMS", "2")
    monkeypatch.delenv("MEGAMOE_SM_HEADROOM", raising=False)
    experts, k, n = 4, 256, 256
    plan, _, _ = gpu_plan(600, experts, 2, block_m, kind="skewed", seed=12)
    a = bf16((plan.pool_capacity, k), 13)
    b = bf16((experts, n, k), 14, k**-0.5)
    out = grouped_gemm(a, b, plan, block_n=block_n)
    rows = rows_used(plan)
    assert_close_to_oracle("out", out[:rows], grouped_gemm_reference(a, b, plan))


@pytest.mark.parametrize("num_sms", [None, "2"], ids=["all-sms", "two-ctas"])
@pytest.mark.parametrize("gated", [False, True], ids=["store", "gated"])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (150, 2)])
@pytest.mark.parametrize("block_m,block_n", GEMM_TILES)
def test_grouped_gemm_mxfp4_b(block_m, block_n, tokens, top_k, gated, num_sms, monkeypatch):
    # MXFP4 B: codes and scales land in a staging area by TMA, the consumers decode a K
    # block into the swizzled B tile one step ahead of the wgmma, behind a named barrier
    # and a proxy fence. K = 192: three K steps; N = 192 (Store): a partial N tile whose
    # code rows past the expert read the next expert's or are zero-filled. Two CTAs:
    # each wraps the ring (3 to 7 stages) many times. Bitwise the BF16 engine on the
    # transient decode.
    if num_sms:
        monkeypatch.setenv("MEGAMOE_NUM_SMS", num_sms)
        monkeypatch.delenv("MEGAMOE_SM_HEADROOM", raising=False)
    experts, k = 8, 192
    n = 256 if gated else 192
    plan, _, _ = gpu_plan(tokens, experts, top_k, block_m, kind="empty", seed=tokens)
    a = bf16((plan.pool_capacity, k), 17)
    codes, scales = mm.quantize_mxfp4(bf16((experts, n, k), 18, k**-0.5), axis=-1)
    decoded = decode_mxfp4_bf16(codes, scales)
    if gated:
        out = gated_grouped_gemm(a, codes, plan, k=k, block_n=block_n, w13_scales=scales)
        want = gated_grouped_gemm(a, decoded, plan, k=k, block_n=block_n)
    else:
        out = grouped_gemm(a, codes, plan, block_n=block_n, b_scales=scales)
        want = grouped_gemm(a, decoded, plan, block_n=block_n)
    rows = rows_used(plan)
    assert_bitwise(out[:rows], want[:rows])


@pytest.mark.parametrize("num_sms", [None, "2"], ids=["all-sms", "two-ctas"])
@pytest.mark.parametrize("fused_dgrad2", [False, True], ids=["store", "actbwd"])
@pytest.mark.parametrize("block_n", [128, 256])
def test_grouped_gemm_mxfp4_b_mn_major(block_n, fused_dgrad2, num_sms, monkeypatch):
    # MXFP4 weights read MN-major (the dgrads): codes [E, K, N/2] by 64-row TMA boxes,
    # scales transposed, decoded into 64-column swizzled boxes. N = 192: a partial tile
    # at BLOCK_N 256. The Store and the ActivationBackward epilogue (dgrad2), bitwise
    # the BF16 engine on the transient decode.
    from megamoe.activation_backward import fused_dgrad2_activation_backward

    if num_sms:
        monkeypatch.setenv("MEGAMOE_NUM_SMS", num_sms)
        monkeypatch.delenv("MEGAMOE_SM_HEADROOM", raising=False)
    # The fused dgrad2 picks its own BLOCK_N from I: I = block_n selects that width.
    experts, k, n = 8, 192, block_n if fused_dgrad2 else 192
    plan, _, weights = gpu_plan(150, experts, 2, 128, kind="empty", seed=19)
    a = bf16((plan.pool_capacity, k), 20)
    codes, scales = mm.quantize_mxfp4(bf16((experts, k, n), 21, k**-0.5), axis=-1)
    decoded = decode_mxfp4_bf16(codes, scales)
    rows = rows_used(plan)
    if fused_dgrad2:
        preact = bf16((plan.pool_capacity, 2 * n), 22)
        got = fused_dgrad2_activation_backward(a, codes, preact, weights, plan, w2_scales=scales)
        want = fused_dgrad2_activation_backward(a, decoded, preact, weights, plan)
        for got_t, want_t in zip(got, want, strict=True):
            assert_bitwise(got_t[:rows], want_t[:rows])
    else:
        out = grouped_gemm(a, codes, plan, b_major="mn", b_scales=scales, block_n=block_n)
        want = grouped_gemm(a, decoded, plan, b_major="mn", block_n=block_n)
        assert_bitwise(out[:rows], want[:rows])


@pytest.mark.parametrize("extra", [0, 32])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (150, 2)])
def test_grouped_gemm_store_mn_major_b(block_n, tokens, top_k, extra):
    # B read transposed ([E, K, N], the dgrads' view of the weights): 64x64 TMA boxes
    # through a 3-D map, K = 200 leaves a partial K step per expert (zero-filled), N =
    # 192 a partial N tile; the extra segment (dgrad1's shrink columns) is narrower than
    # one box. BLOCK_M 128 pools: the MN-major variants that exist.
    experts, k, n = 8, 200, 192
    plan, _, _ = gpu_plan(tokens, experts, top_k, 128, kind="empty", seed=tokens)
    a = bf16((plan.pool_capacity, k), 15)
    b = bf16((experts, k, n), 16, k**-0.5)
    b_extra = bf16((experts, k, extra), 17, k**-0.5) if extra else None
    out = grouped_gemm(a, b, plan, b_major="mn", block_n=block_n, b_extra=b_extra)
    rows = rows_used(plan)
    if rows:
        expected = grouped_gemm_reference(
            a,
            b.transpose(1, 2).contiguous(),
            plan,
            b_extra=None if b_extra is None else b_extra.transpose(1, 2).contiguous(),
        )
        assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize("weighted_h", [True, False])
@pytest.mark.parametrize(
    "activation,clamp", [("swiglu", None), ("geglu", 1.0)], ids=["swiglu", "geglu-clamp"]
)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (150, 6)])
def test_activation_backward(tokens, top_k, activation, clamp, weighted_h):
    experts, inter = 8, 192
    plan, _, weights = gpu_plan(tokens, experts, top_k, BLOCK_MS[-1], kind="masked", seed=tokens)
    preact = bf16((plan.pool_capacity, 2 * inter), 17, 2.0)
    z = bf16((plan.pool_capacity, inter), 18)
    args = dict(activation=activation, activation_clamp=clamp, weighted_h=weighted_h)
    dgu, weighted, drouter = activation_backward(preact, z, weights, plan, **args)
    rows = rows_used(plan)
    want_dgu, want_weighted, want_router = activation_backward_reference(
        preact.cpu(), z.cpu(), weights.cpu(), on_cpu(plan), **args
    )
    # Same FP32 math, tanhf/expf vs torch's: the GPU test file bounds the last ulps;
    # here a loose check that the right rows were written.
    assert_close_to_oracle("dgu", dgu[:rows], want_dgu[:rows].double())
    assert (weighted is None) == (not weighted_h)
    if weighted is not None:
        assert_close_to_oracle("weighted_h", weighted[:rows], want_weighted[:rows].double())
    assert torch.allclose(drouter[:rows].cpu(), want_router[:rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weighted_h", [True, False])
@pytest.mark.parametrize(
    "tokens,top_k,k,inter", [(1, 1, 128, 128), (150, 6, 144, 320), (150, 6, 144, 512)]
)
def test_fused_dgrad2_activation_backward(tokens, top_k, k, inter, weighted_h):
    """dgrad2 with the activation backward as the engine's epilogue (z never stored);
    I = 320 leaves an N tail (128-wide tiles), I = 512 takes the 128x256 variant."""
    experts = 8
    plan, _, weights = gpu_plan(tokens, experts, top_k, 128, kind="masked", seed=tokens)
    preact = bf16((plan.pool_capacity, 2 * inter), 19, 2.0)
    dout_pool = bf16((plan.pool_capacity, k), 20)
    w2 = bf16((experts, k, inter), 23, k**-0.5)
    args = dict(activation="swiglu", activation_clamp=None, weighted_h=weighted_h)
    dgu, weighted, drouter = fused_dgrad2_activation_backward(
        dout_pool, w2, preact, weights, plan, **args
    )
    z = grouped_gemm(dout_pool, w2, plan, b_major="mn", block_n=mm.get_block_n(128, inter))
    want_dgu, want_weighted, want_router = activation_backward(preact, z, weights, plan, **args)
    rows = rows_used(plan)
    assert_close_to_oracle("dgu", dgu[:rows], want_dgu[:rows].double())
    if weighted_h:
        assert_close_to_oracle("weighted_h", weighted[:rows], want_weighted[:rows].double())
    else:
        assert weighted is None
    assert torch.allclose(drouter[:rows], want_router[:rows], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("num_sms", [None, "2"], ids=["all-sms", "two-ctas"])
@pytest.mark.parametrize("m,n", [(200, 16), (32, 264)])  # BLOCK_N 128 and 256, M/N tails
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (150, 2)])
def test_k_grouped_gemm(tokens, top_k, m, n, num_sms, monkeypatch):
    # Weight gradients over each expert's data rows: the last K step of an expert is
    # partial (its padding rows, NaN here, are zeroed in shared memory by the consumers
    # before the MMA; the tools judge those generic stores and the named barrier, while
    # the wgmma reads are async-proxy accesses the NaN check guards), empty experts.
    if num_sms is not None:
        monkeypatch.setenv("MEGAMOE_NUM_SMS", num_sms)
        monkeypatch.delenv("MEGAMOE_SM_HEADROOM", raising=False)
    experts = 8
    plan, _, _ = gpu_plan(tokens, experts, top_k, 128, kind="empty", seed=tokens + 3)
    a = bf16((plan.pool_capacity, m), 21)
    b = bf16((plan.pool_capacity, n), 22)
    padding = plan.pool_row_to_route < 0
    a[padding] = float("nan")
    b[padding] = float("nan")
    out = k_grouped_gemm(a, b, plan, scale=0.5)
    expected = k_grouped_gemm_reference(a, b, plan, scale=0.5)
    empty = plan.expert_counts == 0
    assert bool((out[empty] == 0).all())
    if bool((~empty).any()):
        assert_close_to_oracle("out", out[~empty], expected[~empty])


# ------------------------------------------------------------------ fused forward


def block_m_transition(top_k: int, experts: int) -> int:
    """The first token count at which our heuristic picks a larger BLOCK_M."""
    first = mm.get_block_m(1, top_k, experts)
    for tokens in range(2, 1 << 16):
        if mm.get_block_m(tokens, top_k, experts) != first:
            return tokens
    raise AssertionError("no BLOCK_M transition below 65,536 tokens")


TRANSITION = block_m_transition(2, 8)
# The smallest token count whose pool has BLOCK_M 128 at top-2 and top-6 (8 experts).
ENGINE_TOKENS = next(
    t for t in range(TRANSITION, 1 << 16) if all(mm.get_block_m(t, k, 8) == 128 for k in (2, 6))
)


@pytest.mark.parametrize(
    "tokens,top_k,rank,kwargs",
    [
        pytest.param(1, 1, None, {}, id="one-token-no-side"),
        pytest.param(1, 2, 16, {}, id="one-token-side"),
        pytest.param(TRANSITION - 1, 2, 16, {}, id="below-block-m-transition"),
        pytest.param(TRANSITION, 2, 16, {}, id="at-block-m-transition"),
        pytest.param(200, 2, 16, {"routing": "empty"}, id="empty-experts"),
        pytest.param(
            150,
            6,
            32,
            {"routing": "masked", "activation": "geglu", "activation_clamp": 1.0},
            id="masked-geglu-clamp",
        ),
        pytest.param(64, 2, 16, {"scale": 0.0}, id="zero-scale"),
        pytest.param(50, 4, 16, {"routing": "skewed", "id_dtype": torch.int64}, id="int64-skewed"),
    ],
)
def test_moe_forward(tokens, top_k, rank, kwargs):
    # The adapters run x a1, x a3 and shrink (a1|a3)^T as torch GEMMs.
    skip_if_torch_gemm_under_init_or_race(rank is not None)
    shape = dict(hidden=128, intermediate=128, num_experts=8, top_k=top_k, side_rank=rank)
    fast = make_layer(**shape, num_tokens=tokens, device="cuda", seed=tokens, **kwargs)
    exact = make_layer(
        **shape, num_tokens=tokens, device="cuda", dtype=torch.float64, seed=tokens, **kwargs
    )
    with torch.no_grad():
        out = fast.call(mm.moe)
        expected = exact.call(mm.reference.moe)
    assert out.shape == (tokens, 128)
    assert_close_to_oracle("out", out, expected)


@pytest.mark.parametrize(
    "tokens,top_k,rank,kwargs",
    [
        pytest.param(1, 1, None, {}, id="one-token-no-side"),
        pytest.param(1, 2, 16, {}, id="one-token-side"),
        pytest.param(TRANSITION, 2, 16, {}, id="at-block-m-transition"),
        pytest.param(200, 2, 16, {"routing": "empty"}, id="empty-experts"),
        pytest.param(
            150,
            6,
            32,
            {"routing": "masked", "activation": "geglu", "activation_clamp": 1.0},
            id="masked-geglu-clamp",
        ),
        pytest.param(64, 2, 16, {"scale": 0.0}, id="zero-scale"),
        pytest.param(90, 2, None, {"trainable_base": True}, id="ordinary"),
        pytest.param(90, 2, 16, {"checkpoint": True}, id="activation-checkpoint"),
        # The engine dgrads (MEGAMOE_DGRAD_ENGINE=1, BLOCK_M 128 pools): dgrad2 with the
        # activation backward as its epilogue and dgrad1 on the MN-major Store variant.
        pytest.param(ENGINE_TOKENS, 2, None, {"engine": True}, id="engine-dgrads-no-side"),
        pytest.param(ENGINE_TOKENS, 2, 16, {"engine": True}, id="engine-dgrads-side"),
        pytest.param(
            ENGINE_TOKENS,
            6,
            None,
            {"engine": True, "routing": "masked", "activation": "geglu", "activation_clamp": 1.0},
            id="engine-dgrads-masked-geglu-clamp",
        ),
    ],
)
def test_moe_forward_backward(tokens, top_k, rank, kwargs, monkeypatch):
    """The fused backward (activation backward, pre-activation store, gathers, the
    whole-row side sum, combines) and the torch grouped GEMMs it drives, or the
    engine dgrads."""
    kwargs = dict(kwargs)
    checkpoint = kwargs.pop("checkpoint", False)
    engine = kwargs.pop("engine", False)
    monkeypatch.setenv("MEGAMOE_DGRAD_ENGINE", "1" if engine else "0")
    if engine:
        assert mm.get_block_m(tokens, top_k, 8) == 128
    # Without the engine dgrads z and dx come from torch._grouped_mm; adapters and an
    # ordinary base add torch GEMMs (q13, the side expand, the wgrads).
    skip_if_torch_gemm_under_init_or_race(
        not engine or rank is not None or kwargs.get("trainable_base", False)
    )
    shape = dict(hidden=128, intermediate=128, num_experts=8, top_k=top_k, side_rank=rank)
    common = dict(num_tokens=tokens, device="cuda", seed=tokens, requires_grad=True, **kwargs)
    fast = make_layer(**shape, **common)
    exact = make_layer(**shape, dtype=torch.float64, **common)
    dout = bf16((tokens, 128), 21)
    out = fast.call(mm.moe, activation_checkpoint=checkpoint)
    dx, drouter = torch.autograd.grad(out, [fast.x, fast.topk_weights], dout)
    clamp = kwargs.get("activation_clamp")
    expected = exact.call(mm.reference.moe, round_bf16=clamp is not None)
    ex, erouter = torch.autograd.grad(expected, [exact.x, exact.topk_weights], dout.double())
    assert_close_to_oracle("dx", dx, ex, min_cosine=GRAD_MIN_COSINE)
    assert_close_to_oracle("dtopk_weights", drouter, erouter, min_cosine=GRAD_MIN_COSINE)


@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 5), (257, 4)])
def test_mxfp4_decode(rows, blocks):
    """The decode kernel: one thread per 32-element block, grid-stride tail."""
    from megamoe.mxfp4_decode import decode_mxfp4_bf16

    gen = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (rows, 16 * blocks), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (rows, blocks), generator=gen, dtype=torch.uint8)
    out = decode_mxfp4_bf16(packed.cuda(), scales.cuda()).cpu()
    expected = mm.dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16)
    nan = torch.isnan(expected)  # scale bytes < 255 here: no NaN blocks expected
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (150, 6)])
def test_moe_mxfp4_forward_backward(tokens, top_k):
    skip_if_torch_gemm_under_init_or_race(True)  # adapters and the torch dgrads
    shape = dict(hidden=128, intermediate=128, num_experts=8, top_k=top_k, side_rank=16)
    common = dict(num_tokens=tokens, device="cuda", seed=tokens, requires_grad=True)
    fast = make_layer(**shape, format="mxfp4", routing="masked", **common)
    exact = make_layer(**shape, format="mxfp4", routing="masked", dtype=torch.float64, **common)
    dout = bf16((tokens, 128), 22)
    out = fast.call(mm.moe)
    (dx,) = torch.autograd.grad(out, [fast.x], dout)
    expected = exact.call(mm.reference.moe)
    (ex,) = torch.autograd.grad(expected, [exact.x], dout.double())
    assert_close_to_oracle("out", out, expected.detach())
    assert_close_to_oracle("dx", dx, ex, min_cosine=GRAD_MIN_COSINE)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (150, 6)])
def test_moe_mxfp4_forward_no_side(tokens, top_k):
    """The decode kernel feeding the fused forward (our kernels only: runs under all
    four tools)."""
    shape = dict(hidden=128, intermediate=128, num_experts=8, top_k=top_k, side_rank=None)
    common = dict(num_tokens=tokens, device="cuda", seed=tokens, format="mxfp4")
    fast = make_layer(**shape, routing="masked", **common)
    exact = make_layer(**shape, routing="masked", dtype=torch.float64, **common)
    with torch.no_grad():
        out = fast.call(mm.moe)
        expected = exact.call(mm.reference.moe)
    assert_close_to_oracle("out", out, expected)


def test_mxfp4_quantizer_on_the_gpu():
    # The MXFP4 quantizer on the device (the decode kernel has its own case above):
    # prepare and dequantize on the device, including a NaN block and a zero block.
    w = bf16((4, 256, 128), 15)
    w[0, 0, :32] = 0
    w[1, 3, 5] = float("nan")
    packed, scales = mm.quantize_mxfp4(w, axis=-1)
    back = mm.dequantize_mxfp4(packed, scales, axis=-1)
    assert bool(torch.isnan(back[1, 3, :32]).all()) and bool((back[0, 0, :32] == 0).all())
    base = mm.prepare_base_weights(bf16((4, 256, 128), 16), bf16((4, 128, 128), 17), "mxfp4")
    assert base.w13_linear().shape == (4, 256, 128)


# ------------------------------------------------------- rejection before launch


def test_undersized_workspace_is_rejected_before_any_launch():
    device = torch.device("cuda", torch.cuda.current_device())
    layout = mm.workspace_layout(17, 128, 128, 8, 2, 16)
    small = mm.Workspace(layout.size - 1)
    with pytest.raises(ValueError, match="workspace: expected at least"):
        small.check_fits(layout, device)
    layer = make_layer(128, 128, 8, 2, 16, num_tokens=17, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="workspace"):
        layer.call(mm.moe, workspace=small)
    mm.Workspace(layout.size).check_fits(layout, device)


def test_undersized_buffers_are_rejected_by_the_launchers():
    from megamoe import _C
    from megamoe._native import current_stream, dlpack

    tokens, top_k, experts, block_m = 20, 2, 4, BLOCK_MS[0]
    ids, weights = make_routing(tokens, experts, top_k, seed=18)
    ids, weights = ids.cuda(), weights.cuda()
    stream = current_stream(ids.device)
    routes = tokens * top_k
    capacity = mm.pool_capacity(routes, experts, block_m)

    def i32(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device="cuda")

    scratch = i32(_C.route_plan_num_tiles(routes), experts)
    counts, offsets, r2p = i32(experts), i32(experts + 1), i32(routes)
    # One row below the launcher's worst case (pool_capacity rounds it up to a block).
    worst_case_rows = routes + experts * (block_m - 1)
    with pytest.raises(ValueError, match="pool_row_to_route: pool capacity"):
        _C.route_plan(
            *(dlpack(ids), 0, experts, block_m, dlpack(scratch), dlpack(counts)),
            *(dlpack(offsets), dlpack(r2p), dlpack(i32(worst_case_rows - 1)), stream),
        )
    plan = mm.plan_routes(ids, experts, block_m)
    x = bf16((tokens, 64), 19)
    with pytest.raises(ValueError, match="out: expected shape"):
        pool.gather_pool(x, None, plan, bf16((capacity - block_m, 64), 20))
    pool_input = pool.gather_pool(x, None, plan)
    b = bf16((experts, 64, 64), 21)
    short = torch.empty(capacity - block_m, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="out: expected shape"):
        grouped_gemm(pool_input, b, plan, out=short)
    pool_output = grouped_gemm(pool_input, b, plan)
    with pytest.raises(ValueError, match="out: expected shape"):
        pool.combine(pool_output, plan, weights, out=bf16((tokens - 1, 64), 22))
    # The rejected calls launched nothing and left the context healthy.
    out = pool.combine(pool_output, plan, weights)
    torch.cuda.synchronize()
    assert out.shape == (tokens, 64) and bool(torch.isfinite(out.float()).all())
