"""The weight-streaming GEMMs (kernels/engine/weight_stream_kernel.cuh): an MXFP4 base
decoded into the wgmma's A registers, the pool's rows in chunks of 32 or 64 as N (also
128, 192 and 256: the wide form, whose chunks start at each segment's start; a 128-row
chunk's MMAs are 64 or 128 wide, by its rows);
GEMM1 (gated, side K segment), GEMM2 (store, a2 extra columns), dgrad1 (the weights as
stored, decoded transposed; the b1/b3 shrinks as extra columns) and dgrad2 (w2 as stored,
decoded transposed; the a2 side segment; the activation backward).

Oracles: the engine's GEMM on the BF16 decode of the same codes
(:func:`~megamoe.wrappers.mxfp4_decode.decode_mxfp4_bf16`), which sums the same products
in the same order, so h and g | u must be the same bits; the float64 per-expert reference
at the DESIGN §6 gates; and, for the decode alone, one-hot rows whose pre-activations are
the decoded weights themselves.
"""

import math

import pytest
import torch

import megamoe as mm
from megamoe.env import resolve_num_sms
from megamoe.testing import assert_close_to_oracle
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import _native
from megamoe.wrappers.activation_backward import (
    activation_backward_reference,
    fused_dgrad2_activation_backward,
)
from megamoe.wrappers.grouped_gemm import (
    gated_grouped_gemm,
    gated_grouped_gemm_reference,
    grouped_gemm,
    grouped_gemm_reference,
)
from megamoe.wrappers.mxfp4_decode import decode_mxfp4_bf16

pytestmark = pytest.mark.gpu

CHUNKS = [32, 64, 128, 192, 256]  # GEMM1, GEMM2, dgrad1: the narrow and the wide form
DGRAD2_CHUNKS = [32, 64, 128]  # dgrad2: no one-tile chunks (they measured slower)
ACTIVATIONS = {"swiglu": 0, "geglu": 1}


def stream_gemm1(a, codes, scales, plan, *, k, chunk, activation="swiglu", clamp=None,
                 side=None, preact=None):  # fmt: skip
    """The native launcher with an explicit chunk (the layer picks it by routes/expert)."""
    inter = codes.shape[1] // 2
    h = torch.full((a.shape[0], inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    dl = _native.dlpack
    side = side or {}
    b1, b3 = side.get("side_b_gate"), side.get("side_b_up")
    _native.native().weight_stream_gated(
        dl(a),
        k,
        dl(codes),
        dl(scales),
        dl(plan.expert_pool_offsets),
        dl(plan.expert_counts),
        dl(h),
        None if preact is None else dl(preact),
        None if b1 is None else dl(b1),
        None if b3 is None else dl(b3),
        float(side.get("side_scale", 0.0)),
        ACTIVATIONS[activation],
        math.inf if clamp is None else float(clamp),
        plan.block_m,
        chunk,
        resolve_num_sms(torch.cuda.get_device_properties(0).multi_processor_count),
        torch.cuda.current_stream().cuda_stream,
    )
    return h


def stream_gemm2(a, codes, scales, plan, *, chunk, b_extra=None):
    """GEMM2's native launcher with an explicit chunk."""
    n = codes.shape[1] + (0 if b_extra is None else b_extra.shape[2])
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    dl = _native.dlpack
    _native.native().weight_stream_store(
        dl(a),
        codes.shape[2] * 2,
        dl(codes),
        dl(scales),
        None if b_extra is None else dl(b_extra),
        dl(plan.expert_pool_offsets),
        dl(plan.expert_counts),
        dl(out),
        plan.block_m,
        chunk,
        resolve_num_sms(torch.cuda.get_device_properties(0).multi_processor_count),
        torch.cuda.current_stream().cuda_stream,
    )
    return out


def operands(tokens, experts, top_k, hidden, inter, rank, *, block_m=64, kind="skewed", seed=0,
             scale_low=112, scale_high=136):  # fmt: skip
    ids, _ = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(plan.pool_capacity, hidden + 2 * rank, device="cuda", generator=g).bfloat16()
    a[plan.pool_row_to_route < 0] = 0  # the gather's zero padding rows
    codes = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8,
                          device="cuda", generator=g)  # fmt: skip
    scales = torch.randint(scale_low, scale_high, (experts, 2 * inter, hidden // 32),
                           dtype=torch.uint8, device="cuda", generator=g)  # fmt: skip
    side = None
    if rank:
        side = dict(
            side_b_gate=torch.randn(experts, rank, inter, device="cuda", generator=g).bfloat16(),
            side_b_up=torch.randn(experts, rank, inter, device="cuda", generator=g).bfloat16(),
            side_scale=0.75,
        )
    return plan, a, codes, scales, side


def same_bits(actual, expected):
    return torch.equal(actual.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,rank,block_m",
    [
        (1, 8, 1, 0, 64),  # one row: seven empty experts
        (40, 8, 2, 16, 64),  # ~10 rows per expert, r = 16: side steps straddle q1 | q3
        (300, 8, 2, 64, 64),  # ~75 rows: several chunks per expert
        (700, 16, 6, 128, 128),  # pool padded to 128
        (96, 4, 4, 48, 64),  # every token on every expert
    ],
)
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", 7.0), ("swiglu", 0.5)])
def test_stream_is_the_engine_on_the_decoded_weights(
    chunk, tokens, experts, top_k, rank, block_m, activation, clamp
):
    hidden, inter = 512, 256
    plan, a, codes, scales, side = operands(
        tokens, experts, top_k, hidden, inter, rank, block_m=block_m, seed=tokens + rank
    )
    preact = torch.empty(a.shape[0], 2 * inter, dtype=torch.bfloat16, device="cuda")
    h = stream_gemm1(a, codes, scales, plan, k=hidden, chunk=chunk, activation=activation,
                     clamp=clamp, side=side, preact=preact)  # fmt: skip
    decoded = decode_mxfp4_bf16(codes, scales)
    twin_preact = torch.empty_like(preact)
    kwargs = dict(k=hidden, activation=activation, activation_clamp=clamp, **(side or {}))
    twin = gated_grouped_gemm(a, decoded, plan, preact_out=twin_preact, **kwargs)
    rows = int(plan.expert_pool_offsets[-1])
    # Every row in use, padding rows (exact zeros) included; none past them.
    assert same_bits(h[:rows], twin[:rows])
    assert same_bits(preact[:rows], twin_preact[:rows])
    assert bool(torch.isnan(h[rows:].float()).all())
    data = plan.pool_row_to_route[:rows] >= 0
    assert not bool(h[:rows][~data].any())
    expected = gated_grouped_gemm_reference(a, decoded, plan, **kwargs)  # [rows in use, I]
    assert_close_to_oracle("h", h[:rows][data], expected[data])


def one_hot_pool(experts, columns):
    """``(plan, a [P, columns], token of each row in use)``: token t goes to expert t % E
    with a 1.0 at column t // E (every column of every expert once), so its output row
    is one stored weight row or column."""
    tokens = experts * columns
    ids = (torch.arange(tokens, device="cuda") % experts).view(tokens, 1)
    plan = mm.plan_routes(ids, experts, 64)
    route = plan.pool_row_to_route
    a = torch.zeros(plan.pool_capacity, columns, dtype=torch.bfloat16, device="cuda")
    used = route >= 0
    a[used, route[used] // experts] = 1.0
    rows = used.nonzero().squeeze(1)
    return plan, a, rows, route[rows]


def assert_one_hot_outputs(got, expected, token, codes, scales, *, transposed):
    """``got`` [rows, N] bit for bit ``expected``; else fail naming the first differing
    weight (expert, stored row and column, code, scale). Output column n of token t is
    stored element (n, t // E) of expert t % E, or (t // E, n) when ``transposed`` (the
    weights as stored, dgrad1)."""
    wrong = (got.view(torch.int16) != expected.view(torch.int16)).nonzero()
    if wrong.numel():
        r, n = (int(v) for v in wrong[0])
        experts = codes.shape[0]
        e, k = int(token[r]) % experts, int(token[r]) // experts
        row, col = (k, n) if transposed else (n, k)
        code = int(codes[e, row, col // 2]) >> (4 * (col % 2)) & 0xF
        pytest.fail(
            f"{wrong.shape[0]} of {got.numel()} values differ; first: expert {e} row {row} "
            f"column {col} code {code:#x} scale {int(scales[e, row, col // 32])}: "
            f"{got[r, n].item()!r} != {expected[r, n].item()!r}"
        )


@pytest.mark.parametrize("chunk", CHUNKS)
def test_decode_of_every_code_and_scale_byte(chunk):
    """One-hot pool rows: each pre-activation is one decoded weight (a product with 1.0,
    exact; -0 as +0), for every code in every byte position and scale bytes 2..252 (2^-125 ..
    2^125: every product an FP32 normal, the FP32 path above 128), bit for bit the
    transient decode. (Scale bytes 0 and 1 give values below FP32's normal range, which
    the tensor cores' FP32 sums flush: the next test compares those with the engine.)"""
    experts, hidden, inter = 2, 512, 128
    plan, a, rows, token = one_hot_pool(experts, hidden)
    g = torch.Generator(device="cuda").manual_seed(5)
    codes = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8,
                          device="cuda", generator=g)  # fmt: skip
    scales = (torch.arange(experts * 2 * inter * hidden // 32, device="cuda") % 251 + 2).to(
        torch.uint8
    )
    scales = scales.view(experts, 2 * inter, hidden // 32)
    preact = torch.empty(a.shape[0], 2 * inter, dtype=torch.bfloat16, device="cuda")
    stream_gemm1(a, codes, scales, plan, k=hidden, chunk=chunk, preact=preact)
    decoded = decode_mxfp4_bf16(codes, scales)  # [E, 2I, H]
    # A -0 weight times 1 added to the zero-initialized FP32 sum is +0 in any GEMM.
    expected = decoded[token % experts, :, token // experts] + 0.0  # [rows, 2I]
    assert_one_hot_outputs(preact[rows], expected, token, codes, scales, transposed=False)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("scale_mod", [256, 3])
def test_every_scale_byte_matches_the_engine(chunk, scale_mod):
    """Every scale byte (0 = 2^-127, subnormal values; 254: overflow to Inf; 0xFF = NaN)
    and, separately, only bytes 0..2: the same bits as the engine on the decoded
    weights, NaN and Inf included."""
    plan, a, codes, scales, _ = operands(200, 4, 2, 256, 128, 0, seed=3)
    scales = (torch.arange(scales.numel(), device="cuda") % scale_mod).to(torch.uint8)
    scales = scales.view(4, 256, 256 // 32)
    preact = torch.empty(a.shape[0], 256, dtype=torch.bfloat16, device="cuda")
    h = stream_gemm1(a, codes, scales, plan, k=256, chunk=chunk, preact=preact)
    twin_preact = torch.empty_like(preact)
    twin = gated_grouped_gemm(
        a, decode_mxfp4_bf16(codes, scales), plan, k=256, preact_out=twin_preact
    )
    rows = int(plan.expert_pool_offsets[-1])
    # Data rows: the engine's bits. Padding rows: a chunk of them is written as zeros
    # without the MMAs (the engine multiplies their zeros, 0 x Inf = NaN here).
    data = plan.pool_row_to_route[:rows] >= 0
    if scale_mod == 256:
        assert bool(torch.isnan(h[:rows][data].float()).any())
    assert same_bits(preact[:rows][data], twin_preact[:rows][data])
    assert same_bits(h[:rows][data], twin[:rows][data])


@pytest.mark.parametrize(
    "tokens,chunk", [(512, 64), (1024, 128), (2048, 192), (2560, 256)]
)  # 48 .. 240 rows per expert
def test_repeated_runs_are_bitwise_equal(monkeypatch, tokens, chunk):
    native = _native.native()
    launches = []
    stream = native.weight_stream_gated
    monkeypatch.setattr(
        native, "weight_stream_gated", lambda *a: launches.append(a[-3]) or stream(*a)
    )
    plan, a, codes, scales, side = operands(tokens, 64, 6, 1024, 512, 128, kind="balanced", seed=8)
    rows = int(plan.expert_pool_offsets[-1])  # rows past it are not written
    first = gated_grouped_gemm(a, codes, plan, k=1024, w13_scales=scales, **side)[:rows]
    for _ in range(3):
        again = gated_grouped_gemm(a, codes, plan, k=1024, w13_scales=scales, **side)[:rows]
        assert same_bits(again, first)
    assert launches == [chunk] * 4, "the layer's routing took the weight-streaming GEMM1"


def test_launcher_rejects_a_pool_not_in_whole_chunks():
    plan, a, codes, scales, _ = operands(10, 2, 1, 256, 128, 0, seed=1)
    with pytest.raises(ValueError, match="tokens: no weight-stream variant"):
        stream_gemm1(a, codes, scales, plan, k=256, chunk=48)
    with pytest.raises(ValueError, match="not a multiple of BLOCK_M"):
        stream_gemm1(a[:-32], codes, scales, plan, k=256, chunk=64)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,extra,block_m",
    [
        (1, 8, 1, 0, 64),
        (40, 8, 2, 16, 64),
        (300, 8, 2, 128, 64),  # a2 columns in the extra tile's first half only
        (700, 16, 6, 200, 128),  # ... and in both halves
    ],
)
def test_store_is_the_engine_on_the_decoded_weights(chunk, tokens, experts, top_k, extra, block_m):
    """GEMM2: [pool, I] x [E, N, I]^T (N = 512: two 256-column tiles) with the BF16 a2
    segment as extra columns (a2 as given [E, I, N_x], read MN-major)."""
    n, k = 512, 384
    plan, a, _, _, _ = operands(tokens, experts, top_k, k, 64, 0, block_m=block_m, seed=tokens)
    g = torch.Generator(device="cuda").manual_seed(tokens + 1)
    codes = torch.randint(
        0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=g
    )
    scales = torch.randint(
        112, 136, (experts, n, k // 32), dtype=torch.uint8, device="cuda", generator=g
    )
    b_extra = None
    if extra:
        b_extra = torch.randn(experts, k, extra, device="cuda", generator=g).bfloat16()
    out = stream_gemm2(a, codes, scales, plan, chunk=chunk, b_extra=b_extra)
    decoded = decode_mxfp4_bf16(codes, scales)
    twin = grouped_gemm(a, decoded, plan, b_extra=b_extra)
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])
    assert bool(torch.isnan(out[rows:].float()).all())
    data = plan.pool_row_to_route[:rows] >= 0
    assert not bool(out[:rows][~data].any())
    expected = grouped_gemm_reference(a, decoded, plan, b_extra=b_extra)
    assert_close_to_oracle("out", out[:rows][data], expected[data])


def test_store_launcher_checks():
    plan, a, _, _, _ = operands(10, 2, 1, 256, 64, 0, seed=1)
    codes = torch.zeros(2, 384, 128, dtype=torch.uint8, device="cuda")
    scales = torch.full((2, 384, 8), 127, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="N a multiple of 256"):
        stream_gemm2(a, codes, scales, plan, chunk=32)
    codes, scales = codes[:, :256].contiguous(), scales[:, :256].contiguous()
    wide = torch.zeros(2, 256, 264, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="up to 256"):
        stream_gemm2(a, codes, scales, plan, chunk=32, b_extra=wide)
    # 128-row chunks keep the 256-column tiles; 256-row chunks' tiles are 128 columns.
    codes = torch.zeros(2, 320, 128, dtype=torch.uint8, device="cuda")
    scales = torch.full((2, 320, 8), 127, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="N a multiple of 256"):
        stream_gemm2(a, codes, scales, plan, chunk=128)
    with pytest.raises(ValueError, match="N a multiple of 128"):
        stream_gemm2(a, codes, scales, plan, chunk=256)
    # The producer loads the aligned 8-byte chunk that holds four steps' scale bytes of a
    # row: scales that start 4 bytes past a chunk are refused before any kernel runs.
    codes = torch.zeros(2, 256, 128, dtype=torch.uint8, device="cuda")
    buffer = torch.full((2 * 256 * 8 + 4,), 127, dtype=torch.uint8, device="cuda")
    shifted = buffer[4:].view(2, 256, 8)
    with pytest.raises(ValueError, match="b_scales: expected a data pointer aligned to 8 bytes"):
        stream_gemm2(a, codes, shifted, plan, chunk=32)
    with pytest.raises(ValueError, match="w13_scales: expected a data pointer aligned to 8 bytes"):
        stream_gemm1(a, codes, shifted, plan, k=256, chunk=32)


@pytest.fixture(params=[None, 5], ids=["all-sms", "5-sms"])
def sms(request, monkeypatch):
    """The launches' SM count: all, or five, so that each CTA runs several tiles and a tile
    after the loop's tail (or a stage of fewer steps) starts where the ring was left."""
    if request.param is not None:
        monkeypatch.setenv("MEGAMOE_NUM_SMS", str(request.param))
    return request.param


@pytest.mark.parametrize("chunk", CHUNKS)
# One K step; an odd count (the loop's tail); three chunks of the scale bytes (K a
# multiple of 256: the producer loads four steps' bytes of a row at once).
@pytest.mark.parametrize("k", [64, 320, 768])
def test_odd_step_counts(chunk, k, sms):
    plan, a, codes, scales, side = operands(150, 8, 2, k, 128, 16, seed=k)
    h = stream_gemm1(a, codes, scales, plan, k=k, chunk=chunk, side=side)
    decoded = decode_mxfp4_bf16(codes, scales)
    twin = gated_grouped_gemm(a, decoded, plan, k=k, **side)
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(h[:rows], twin[:rows])
    g = torch.Generator(device="cuda").manual_seed(k + 1)
    codes2 = torch.randint(0, 256, (8, 256, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    scales2 = torch.randint(
        112, 136, (8, 256, k // 32), dtype=torch.uint8, device="cuda", generator=g
    )
    pool2 = a[:, :k].contiguous()
    out = stream_gemm2(pool2, codes2, scales2, plan, chunk=chunk)
    twin2 = grouped_gemm(pool2, decode_mxfp4_bf16(codes2, scales2), plan)
    assert same_bits(out[:rows], twin2[:rows])


def test_launchers_reject_chunks_across_segments():
    plan, a, codes, scales, _ = operands(10, 2, 1, 256, 128, 0, block_m=64, seed=2)
    dl = _native.dlpack
    h = torch.empty(a.shape[0], 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="block_m: the pool's segment padding 32"):
        _native.native().weight_stream_gated(
            dl(a), 256, dl(codes), dl(scales), dl(plan.expert_pool_offsets),
            dl(plan.expert_counts), dl(h), None, None, None, 0.0, 0, math.inf, 32, 64,
            resolve_num_sms(torch.cuda.get_device_properties(0).multi_processor_count),
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip


# ---- dgrad1: (dg | du) . [w13_e | blockdiag(b1_e^T, b3_e^T)], w13 as stored ----


def stream_dgrad1(a, codes, scales, plan, *, chunk, extra=None, out=None):
    """dgrad1's native launcher with an explicit chunk: ``a [P, K] . b_e`` (codes
    ``[E, K, N/2]``, the weights as stored) and ``extra`` = (lo ``[E, N_lo, K_lo]``, hi
    ``[E, N_hi, K - K_lo]``) or None, into ``out`` (None: a new NaN-filled one)."""
    n = 2 * codes.shape[2] + (0 if extra is None else extra[0].shape[1] + extra[1].shape[1])
    if out is None:
        out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    dl = _native.dlpack
    lo, hi = (None, None) if extra is None else (dl(extra[0]), dl(extra[1]))
    _native.native().weight_stream_store_mn(
        dl(a),
        dl(codes),
        dl(scales),
        lo,
        hi,
        dl(plan.expert_pool_offsets),
        dl(plan.expert_counts),
        dl(out),
        plan.block_m,
        chunk,
        resolve_num_sms(torch.cuda.get_device_properties(0).multi_processor_count),
        torch.cuda.current_stream().cuda_stream,
    )
    return out


def dgrad1_operands(tokens, experts, top_k, k, n, rank, *, block_m=64, k_lo=None, seed=0,
                    scale_low=112, scale_high=136, rank_hi=None):  # fmt: skip
    """The pool ``dg | du`` ``[P, k]`` (zero padding rows), ``w13`` as stored (codes
    ``[E, k, n/2]``, scales ``[E, k, n/32]``, quantized along n) and the shrinks (lo
    ``[E, r, k_lo]``, hi ``[E, r_hi, k - k_lo]``; k_lo = k / 2 and r_hi = r unless given)
    or None."""
    ids, _ = make_routing(tokens, experts, top_k, kind="skewed", seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(plan.pool_capacity, k, device="cuda", generator=g).bfloat16()
    a[plan.pool_row_to_route < 0] = 0
    codes = torch.randint(0, 256, (experts, k, n // 2), dtype=torch.uint8, device="cuda",
                          generator=g)  # fmt: skip
    scales = torch.randint(scale_low, scale_high, (experts, k, n // 32), dtype=torch.uint8,
                           device="cuda", generator=g)  # fmt: skip
    extra = None
    if rank:
        k_lo = k // 2 if k_lo is None else k_lo
        extra = (
            torch.randn(experts, rank, k_lo, device="cuda", generator=g).bfloat16(),
            torch.randn(experts, rank_hi or rank, k - k_lo, device="cuda", generator=g).bfloat16(),
        )
    return plan, a, codes, scales, extra


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,rank,block_m",
    [
        (1, 8, 1, 0, 64),  # one row: seven empty experts, no shrinks
        (40, 8, 2, 16, 64),  # r = 16: the shrinks' boxes mostly past their rows
        (300, 8, 2, 128, 64),  # several chunks per expert, r = 128 (the production rank)
        (700, 16, 6, 128, 128),  # pool padded to 128
        (96, 4, 4, 48, 64),  # every token on every expert
    ],
)
def test_dgrad1_is_the_engine_on_the_decoded_weights(chunk, tokens, experts, top_k, rank, block_m):
    """[pool, 2I] x [E, 2I, H] as stored (H = 512: two 256-column tiles, or four of 128 in
    192- and 256-row chunks) with the shrinks' blocks as extra columns: the engine's bits
    on the BF16 decode (MN-major), every row in use, and the float64 oracle."""
    k, n = 512, 512
    plan, a, codes, scales, extra = dgrad1_operands(
        tokens, experts, top_k, k, n, rank, block_m=block_m, seed=tokens + rank
    )
    out = stream_dgrad1(a, codes, scales, plan, chunk=chunk, extra=extra)
    decoded = decode_mxfp4_bf16(codes, scales)  # [E, K, N]
    twin = grouped_gemm(a, decoded, plan, b_major="mn", b_extra_blocks=extra)
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])
    assert bool(torch.isnan(out[rows:].float()).all())
    data = plan.pool_row_to_route[:rows] >= 0
    assert not bool(out[:rows][~data].any())
    expected = grouped_gemm_reference(a, decoded.transpose(1, 2), plan, k=k, b_extra_blocks=extra)
    assert_close_to_oracle("out", out[:rows][data], expected[data])


@pytest.mark.parametrize("chunk", CHUNKS)
def test_dgrad1_shrink_blocks_of_different_widths(chunk):
    """lo's 16 columns and hi's 120 (hi's start and its rows past 64 on the second
    consumer warpgroup; in 192- and 256-row chunks each block an extra tile of its own):
    the engine's bits on the decoded weights on every row in use."""
    plan, a, codes, scales, extra = dgrad1_operands(
        300, 8, 2, 512, 256, 16, k_lo=192, rank_hi=120, seed=12
    )
    out = stream_dgrad1(a, codes, scales, plan, chunk=chunk, extra=extra)
    twin = grouped_gemm(
        a, decode_mxfp4_bf16(codes, scales), plan, b_major="mn", b_extra_blocks=extra
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])
    assert not bool(torch.isnan(out[:rows]).any()), "every column of every row is written"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_dgrad1_decode_of_every_code_and_scale_byte(chunk):
    """One-hot pool rows: each output row is one stored row of the decoded weight (a
    product with 1.0, exact; -0 as +0), for every code of every byte position and scale
    bytes 2..252 (the FP32 path above 128), bit for bit the transient decode."""
    experts, k, n = 2, 256, 512
    plan, a, rows, token = one_hot_pool(experts, k)
    g = torch.Generator(device="cuda").manual_seed(6)
    codes = torch.randint(0, 256, (experts, k, n // 2), dtype=torch.uint8, device="cuda",
                          generator=g)  # fmt: skip
    scales = (torch.arange(experts * k * n // 32, device="cuda") % 251 + 2).to(torch.uint8)
    scales = scales.view(experts, k, n // 32)
    out = stream_dgrad1(a, codes, scales, plan, chunk=chunk)
    decoded = decode_mxfp4_bf16(codes, scales)  # [E, K, N]
    expected = decoded[token % experts, token // experts] + 0.0  # [rows, N]
    assert_one_hot_outputs(out[rows], expected, token, codes, scales, transposed=True)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("scale_mod", [256, 3])
def test_dgrad1_every_scale_byte_matches_the_engine(chunk, scale_mod):
    """Every scale byte (subnormal values, Inf, NaN) and, separately, bytes 0..2 only: the
    engine's bits on the decoded weights on every data row."""
    plan, a, codes, scales, extra = dgrad1_operands(200, 4, 2, 256, 256, 32, seed=4)
    scales = (torch.arange(scales.numel(), device="cuda") % scale_mod).to(torch.uint8)
    scales = scales.view(codes.shape[0], 256, 256 // 32)
    out = stream_dgrad1(a, codes, scales, plan, chunk=chunk, extra=extra)
    twin = grouped_gemm(
        a, decode_mxfp4_bf16(codes, scales), plan, b_major="mn", b_extra_blocks=extra
    )
    rows = int(plan.expert_pool_offsets[-1])
    # Padding rows: a chunk of them is written as zeros without the MMAs.
    data = plan.pool_row_to_route[:rows] >= 0
    if scale_mod == 256:
        assert bool(torch.isnan(out[:rows][data].float()).any())
    assert same_bits(out[:rows][data], twin[:rows][data])


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("k,k_lo", [(64, None), (320, 64)])  # one K step; an odd count
def test_dgrad1_odd_step_counts(chunk, k, k_lo, sms):
    rank = 0 if k_lo is None else 24
    plan, a, codes, scales, extra = dgrad1_operands(150, 8, 2, k, 256, rank, k_lo=k_lo, seed=k)
    out = stream_dgrad1(a, codes, scales, plan, chunk=chunk, extra=extra)
    twin = grouped_gemm(
        a, decode_mxfp4_bf16(codes, scales), plan, b_major="mn", b_extra_blocks=extra
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])


# 48, 96, 192 and 240 rows per expert
@pytest.mark.parametrize("tokens,chunk", [(512, 64), (1024, 128), (2048, 192), (2560, 256)])
def test_dgrad1_layer_path_streams_and_repeats_bitwise(monkeypatch, tokens, chunk):
    """grouped_gemm's MXFP4 MN-major B with few rows per expert takes the transposed
    streaming kernel (ep4rank-like proportions) in the chunk the rows call for, and
    repeated runs give the same bits."""
    native = _native.native()
    launches = []
    stream = native.weight_stream_store_mn
    monkeypatch.setattr(
        native, "weight_stream_store_mn", lambda *a: launches.append(a[-3]) or stream(*a)
    )
    plan, a, codes, scales, extra = dgrad1_operands(tokens, 64, 6, 1024, 1024, 128, seed=9)
    rows = int(plan.expert_pool_offsets[-1])
    kwargs = dict(b_major="mn", b_scales=scales, b_extra_blocks=extra)
    first = grouped_gemm(a, codes, plan, **kwargs)[:rows]
    for _ in range(3):
        assert same_bits(grouped_gemm(a, codes, plan, **kwargs)[:rows], first)
    assert launches == [chunk] * 4, "grouped_gemm took the transposed weight-streaming kernel"
    twin = grouped_gemm(a, decode_mxfp4_bf16(codes, scales), plan, b_major="mn",
                        b_extra_blocks=extra)  # fmt: skip
    assert same_bits(first, twin[:rows])


def test_dgrad1_launcher_checks():
    plan, a, codes, scales, extra = dgrad1_operands(10, 2, 1, 256, 256, 16, seed=1)
    narrow = codes[:, :, :64].contiguous(), scales[:, :, :4].contiguous()
    with pytest.raises(ValueError, match="N a multiple of 256"):
        stream_dgrad1(a, *narrow, plan, chunk=32)
    wide = (torch.zeros(2, 136, 128, dtype=torch.bfloat16, device="cuda"), extra[1])
    with pytest.raises(ValueError, match="extra_lo: expected a multiple of 8 up to 128"):
        stream_dgrad1(a, codes, scales, plan, chunk=32, extra=wide)
    uneven = (torch.zeros(2, 16, 96, dtype=torch.bfloat16, device="cuda"),
              torch.zeros(2, 16, 160, dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    with pytest.raises(ValueError, match="K_lo a multiple of 64"):
        stream_dgrad1(a, codes, scales, plan, chunk=32, extra=uneven)
    with pytest.raises(ValueError, match="tokens: no weight-stream variant"):
        stream_dgrad1(a, codes, scales, plan, chunk=48)
    # 128-row chunks keep the 256-column tiles; 192- and 256-row chunks' tiles are 128 (N =
    # 384 here: three).
    g = torch.Generator(device="cuda").manual_seed(5)
    odd = torch.randint(0, 256, (2, 256, 192), dtype=torch.uint8, device="cuda", generator=g)
    odd_scales = torch.full((2, 256, 12), 127, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="N a multiple of 256"):
        stream_dgrad1(a, odd, odd_scales, plan, chunk=128)
    out = stream_dgrad1(a, odd, odd_scales, plan, chunk=192)
    twin = grouped_gemm(a, decode_mxfp4_bf16(odd, odd_scales), plan, b_major="mn")
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])
    # A base tile writes 8 bytes a store: an out 2 bytes past an 8-byte boundary is refused.
    columns = 256 + 2 * 16
    buffer = torch.zeros(a.shape[0] * columns + 1, dtype=torch.bfloat16, device="cuda")
    shifted = buffer[1:].view(a.shape[0], columns)
    with pytest.raises(ValueError, match="out: expected an 8-byte aligned address"):
        stream_dgrad1(a, codes, scales, plan, chunk=32, extra=extra, out=shifted)
    assert not buffer.any(), "nothing was written"


# ---- dgrad2 + activation backward: z = [dout | s dout b2^T] . [w2_e ; a2_e^T] ----


def stream_dgrad2(dout_pool, codes, scales, side_a2, preact, weights, plan, *, chunk,
                  activation="swiglu", clamp=None, dgrad_out=None, raw=False):  # fmt: skip
    """The native launcher with an explicit chunk: ``(dg | du, w h, drouter)`` as the
    wrapper returns them (rows past the rows in use NaN in dg | du and w h); ``raw``: the
    router partials ``[P, I / 256]`` instead of their sum."""
    capacity, inter = plan.pool_capacity, 2 * codes.shape[2]
    nan = float("nan")
    dgrad = dgrad_out
    if dgrad is None:
        dgrad = torch.full((capacity, 2 * inter), nan, dtype=torch.bfloat16, device="cuda")
    weighted = torch.full((capacity, inter), nan, dtype=torch.bfloat16, device="cuda")
    partials = torch.zeros(capacity, inter // 256, dtype=torch.float32, device="cuda")
    flat = weights.reshape(-1)
    row_weights = flat[plan.pool_row_to_route] if flat.numel() else flat.new_zeros(capacity)
    dl = _native.dlpack
    _native.native().weight_stream_activation_backward(
        dl(dout_pool),
        dl(codes),
        dl(scales),
        None if side_a2 is None else dl(side_a2),
        dl(plan.expert_pool_offsets),
        dl(plan.expert_counts),
        dl(preact),
        dl(row_weights),
        flat.numel(),
        dl(plan.pool_row_to_route),
        dl(dgrad),
        dl(weighted),
        dl(partials),
        ACTIVATIONS[activation],
        math.inf if clamp is None else float(clamp),
        plan.block_m,
        chunk,
        resolve_num_sms(torch.cuda.get_device_properties(0).multi_processor_count),
        torch.cuda.current_stream().cuda_stream,
    )
    return dgrad, weighted, partials if raw else partials.sum(dim=1)


def dgrad2_operands(tokens, experts, top_k, hidden, inter, rank, *, block_m=64, seed=0,
                    scale_low=112, scale_high=136):  # fmt: skip
    """``(plan, weights, dout_pool [P, H + r], codes [E, H, I/2], scales [E, H, I/32],
    side_a2 [E, I, r] or None, preact [P, 2I])``; padding rows hold values too (the
    kernel must give them zeros whatever they hold)."""
    ids, weights = make_routing(tokens, experts, top_k, kind="skewed", seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = plan.pool_capacity
    dout_pool = torch.randn(rows, hidden + rank, device="cuda", generator=g).bfloat16()
    codes = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8,
                          device="cuda", generator=g)  # fmt: skip
    scales = torch.randint(scale_low, scale_high, (experts, hidden, inter // 32),
                           dtype=torch.uint8, device="cuda", generator=g)  # fmt: skip
    side_a2 = None
    if rank:
        side_a2 = (torch.randn(experts, inter, rank, device="cuda", generator=g) * 0.1).bfloat16()
    preact = (torch.randn(rows, 2 * inter, device="cuda", generator=g) * 2).bfloat16()
    return plan, weights.cuda(), dout_pool, codes, scales, side_a2, preact


def engine_dgrad2(dout_pool, decoded, side_a2, preact, weights, plan, **kwargs):
    """The engine's fused dgrad2 on the BF16 decode (its own copy of ``preact``)."""
    return fused_dgrad2_activation_backward(
        dout_pool, decoded, preact.clone(), weights, plan, side_a2=side_a2, weighted_h=True,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("chunk", DGRAD2_CHUNKS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,rank,block_m",
    [
        (1, 8, 1, 0, 64),  # one row: seven empty experts, no side
        (40, 8, 2, 16, 64),  # r = 16: one side step per tile half, mostly zero-filled
        (300, 8, 2, 128, 64),  # several chunks per expert, r = 128
        (700, 16, 6, 128, 128),  # pool padded to 128
        (96, 4, 4, 48, 64),  # every token on every expert
    ],
)
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", 7.0), ("swiglu", 0.5)])
def test_dgrad2_is_the_engine_on_the_decoded_weights(
    chunk, tokens, experts, top_k, rank, block_m, activation, clamp
):
    """dg | du, w h and the router gradient: the engine's bits on the BF16 decode (the
    same z, the same pair math, the router dot in the same order), every row in use; and
    the float32 reference on the engine's z."""
    hidden, inter = 512, 512
    plan, weights, dout_pool, codes, scales, side_a2, preact = dgrad2_operands(
        tokens, experts, top_k, hidden, inter, rank, block_m=block_m, seed=tokens + rank
    )
    kwargs = dict(activation=activation, activation_clamp=clamp)
    dgrad, weighted, partials = stream_dgrad2(
        dout_pool, codes, scales, side_a2, preact, weights, plan, chunk=chunk,
        activation=activation, clamp=clamp, raw=True,
    )  # fmt: skip
    drouter = partials.sum(dim=1)
    decoded = decode_mxfp4_bf16(codes, scales)  # [E, H, I]
    twin = engine_dgrad2(dout_pool, decoded, side_a2, preact, weights, plan, **kwargs)
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(dgrad[:rows], twin[0][:rows])
    assert same_bits(weighted[:rows], twin[1][:rows])
    assert torch.equal(drouter[:rows], twin[2][:rows])
    assert bool(torch.isnan(dgrad[rows:].float()).all())
    data = plan.pool_row_to_route[:rows] >= 0
    assert not bool(dgrad[:rows][~data].any())
    b = decoded if side_a2 is None else torch.cat([decoded, side_a2.transpose(1, 2)], dim=1)
    z = grouped_gemm(dout_pool, b, plan, b_major="mn")
    expected, _, expected_router = activation_backward_reference(preact, z, weights, plan, **kwargs)
    assert_close_to_oracle("dg | du", dgrad[:rows][data], expected[:rows][data])
    assert_close_to_oracle("drouter", drouter[:rows][data], expected_router[:rows][data])
    # Each 256-column tile's partial in its own column (a sum of the columns hides a swap).
    g, u = preact.split(inter, dim=1)
    for tile in range(inter // 256):
        cols = slice(256 * tile, 256 * (tile + 1))
        tile_preact = torch.cat([g[:, cols], u[:, cols]], dim=1)
        *_, tile_router = activation_backward_reference(
            tile_preact, z[:, cols].contiguous(), weights, plan, **kwargs
        )
        assert_close_to_oracle(
            f"partials[:, {tile}]", partials[:rows, tile][data], tile_router[:rows][data]
        )


@pytest.mark.parametrize("chunk", DGRAD2_CHUNKS)
@pytest.mark.parametrize("scale_mod", [256, 3])
def test_dgrad2_every_scale_byte_matches_the_engine(chunk, scale_mod):
    """Every scale byte (subnormal values, Inf, NaN) and, separately, bytes 0..2 only: the
    engine's bits on the decoded weights on every data row."""
    plan, weights, dout_pool, codes, scales, side_a2, preact = dgrad2_operands(
        200, 4, 2, 256, 256, 32, seed=5
    )
    scales = (torch.arange(scales.numel(), device="cuda") % scale_mod).to(torch.uint8)
    scales = scales.view(codes.shape[0], 256, 256 // 32)
    dgrad, weighted, drouter = stream_dgrad2(
        dout_pool, codes, scales, side_a2, preact, weights, plan, chunk=chunk
    )
    twin = engine_dgrad2(dout_pool, decode_mxfp4_bf16(codes, scales), side_a2, preact, weights,
                         plan)  # fmt: skip
    rows = int(plan.expert_pool_offsets[-1])
    data = plan.pool_row_to_route[:rows] >= 0
    if scale_mod == 256:
        assert bool(torch.isnan(dgrad[:rows][data].float()).any())
    assert same_bits(dgrad[:rows][data], twin[0][:rows][data])
    assert same_bits(weighted[:rows][data], twin[1][:rows][data])
    # Bits, not values: a NaN scale puts NaN in the router dot, and NaN != NaN.
    assert torch.equal(
        drouter[:rows][data].view(torch.int32), twin[2][:rows][data].view(torch.int32)
    )


@pytest.mark.parametrize("chunk", DGRAD2_CHUNKS)
@pytest.mark.parametrize("hidden,rank", [(64, 0), (320, 24)])  # one K step; an odd count
def test_dgrad2_odd_step_counts(chunk, hidden, rank, sms):
    """A base-step count with a tail (the last step's fragment buffer) before the next
    tile: the engine's bits on the decoded weights on every row in use."""
    plan, weights, dout_pool, codes, scales, side_a2, preact = dgrad2_operands(
        150, 8, 2, hidden, 512, rank, seed=hidden
    )
    dgrad, weighted, drouter = stream_dgrad2(
        dout_pool, codes, scales, side_a2, preact, weights, plan, chunk=chunk
    )
    twin = engine_dgrad2(
        dout_pool, decode_mxfp4_bf16(codes, scales), side_a2, preact, weights, plan
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(dgrad[:rows], twin[0][:rows])
    assert same_bits(weighted[:rows], twin[1][:rows])
    assert torch.equal(drouter[:rows], twin[2][:rows])


# 48, 96 and 192 rows per expert (dgrad2's widest chunk is 128)
@pytest.mark.parametrize("tokens,chunk", [(512, 64), (1024, 128), (2048, 128)])
def test_dgrad2_layer_path_streams_in_place_and_repeats_bitwise(monkeypatch, tokens, chunk):
    """fused_dgrad2_activation_backward with an MXFP4 w2 and few rows per expert takes the
    streaming kernel in the chunk the rows call for, in place over preact too, and repeats
    bit for bit."""
    native = _native.native()
    launches = []
    stream = native.weight_stream_activation_backward
    monkeypatch.setattr(
        native,
        "weight_stream_activation_backward",
        lambda *a: launches.append(a[-3]) or stream(*a),
    )
    plan, weights, dout_pool, codes, scales, side_a2, preact = dgrad2_operands(
        tokens, 64, 6, 1024, 1024, 128, seed=10
    )
    rows = int(plan.expert_pool_offsets[-1])

    def run(dgrad_out=None, source=preact):
        return fused_dgrad2_activation_backward(
            dout_pool, codes, source, weights, plan, side_a2=side_a2, w2_scales=scales,
            dgrad_out=dgrad_out,
        )  # fmt: skip

    first = run()
    again = run()
    assert all(same_bits(a[:rows], b[:rows]) for a, b in zip(first[:2], again[:2]))
    assert torch.equal(first[2], again[2])
    in_place = preact.clone()
    third = run(dgrad_out=in_place, source=in_place)
    assert same_bits(third[0][:rows], first[0][:rows])
    assert launches == [chunk] * 3, "the streaming dgrad2 ran"


def test_dgrad2_launcher_checks():
    plan, weights, dout_pool, codes, scales, side_a2, preact = dgrad2_operands(
        10, 2, 1, 256, 256, 16, seed=2
    )
    narrow = codes[:, :, :64].contiguous(), scales[:, :, :4].contiguous()
    with pytest.raises(ValueError, match="I a multiple of 256"):
        stream_dgrad2(dout_pool, *narrow, side_a2, preact[:, :256].contiguous(), weights, plan,
                      chunk=32)  # fmt: skip
    with pytest.raises(ValueError, match="columns"):
        stream_dgrad2(dout_pool[:, :256].contiguous(), codes, scales, side_a2, preact, weights,
                      plan, chunk=32)  # fmt: skip
    with pytest.raises(ValueError, match="tokens: no weight-stream variant"):
        stream_dgrad2(dout_pool, codes, scales, side_a2, preact, weights, plan, chunk=48)
    with pytest.raises(ValueError, match="tokens: no weight-stream variant"):
        stream_dgrad2(dout_pool, codes, scales, side_a2, preact, weights, plan, chunk=192)
