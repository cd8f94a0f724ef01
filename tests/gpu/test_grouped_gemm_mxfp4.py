"""The GEMM engine's MXFP4 B, decoded inside the pipeline (kernels/mxfp4_tile_decode.cuh),
for every kind that reads the base weights: GEMM1 (gated), GEMM2 (store, K-major),
dgrad1 (store, MN-major) and dgrad2 (activation backward, MN-major).

Two oracles: the same engine GEMM on the BF16 decode of the same codes
(:func:`~megamoe.wrappers.mxfp4_decode.decode_mxfp4_bf16`): the decoded shared-memory tile must
be the same bits and the summation order is the same, so the outputs must be too, NaN
and Inf included; and the float64 per-expert reference on the decoded values at the
DESIGN §6 gates.

The wrappers pick the path by shape (megamoe.heuristics): above 448 pool rows per
expert a transient BF16 decode (then the twin is the same computation and cannot
differ), and where the weight-streaming kernels take the shape (tests/gpu/
test_weight_stream.py) those. So every case here has at most 448 rows per expert and a
shape the streaming kernels do not take (an ``I`` or ``N`` not in whole streaming
tiles), and asserts from the native launches (:func:`launches`) that the engine decoded
the codes in its pipeline; the few streaming cases say so.
"""

import pytest
import torch

import megamoe as mm
from megamoe.testing import assert_close_to_oracle
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import _native
from megamoe.wrappers.grouped_gemm import (
    gated_grouped_gemm,
    gated_grouped_gemm_reference,
    grouped_gemm,
    grouped_gemm_reference,
)
from megamoe.wrappers.mxfp4_decode import decode_mxfp4_bf16

pytestmark = pytest.mark.gpu

ENGINE_MXFP4 = "engine-mxfp4"  # the engine, the codes decoded in its pipeline

# BLOCK_M of the pool variants: every kind exists at both, in BF16 and MXFP4.
BLOCK_MS = [64, 128]


def pool_for(num_tokens, experts, top_k, block_m, cols, *, kind="skewed", seed=0):
    ids, _ = make_routing(num_tokens, experts, top_k, kind=kind, seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(plan.pool_capacity, cols, device="cuda", generator=generator)
    # Padding rows are zeros, as the gather writes them: the weight-streaming GEMMs (few
    # rows per expert) write a chunk of padding rows as zeros without reading it.
    a[plan.pool_row_to_route < 0] = 0
    return plan, a.bfloat16()


def mxfp4_operand(experts, rows, k, *, seed, scale_low=112, scale_high=136):
    """Random codes (every code value) and scale bytes in [scale_low, scale_high): both
    decode paths (scale <= 128 and above) with values of at most 6 x 2^8."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(
        0, 256, (experts, rows, k // 2), dtype=torch.uint8, device="cuda", generator=generator
    )
    scales = torch.randint(
        scale_low,
        scale_high,
        (experts, rows, k // 32),
        dtype=torch.uint8,
        device="cuda",
        generator=generator,
    )
    return codes, scales


def same_bits(actual, expected):
    return torch.equal(actual.view(torch.int16), expected.view(torch.int16))


@pytest.fixture
def launches(monkeypatch):
    """The native launches of the MXFP4 GEMMs, in order: ``ENGINE_MXFP4`` (an engine
    launcher given scales), ``"engine"`` (given none: BF16), ``"stream"`` (a
    weight-streaming kernel), ``"decode"`` (a transient BF16 decode). Clear it before the
    call a test checks."""
    native = _native.native()
    calls: list[str] = []

    def record(name: str) -> None:
        real = getattr(native, name)

        def launch(*args):
            if name.startswith("engine_"):  # (a, k, b, scales, ...): scales is the 4th
                calls.append(ENGINE_MXFP4 if args[3] is not None else "engine")
            else:
                calls.append("stream" if name.startswith("weight_stream_") else "decode")
            return real(*args)

        monkeypatch.setattr(native, name, launch)

    for name in ("engine_gated", "engine_store", "engine_activation_backward", "mxfp4_decode"):
        record(name)
    for kind in ("gated", "store", "store_mn", "activation_backward"):
        record(f"weight_stream_{kind}")
    return calls


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [(1, 8, 1, 320, 128), (517, 8, 2, 704, 640), (700, 16, 6, 1088, 1024)],
)
@pytest.mark.parametrize("extra", [0, 64])
def test_store_decode_is_the_engine_on_the_decoded_weights(
    launches, block_m, tokens, experts, top_k, hidden, inter, extra
):
    """GEMM2's shape: [pool, I] x [E, H, I]^T (H = 320, 704, 1088: a partial 256-wide N
    tile), with the BF16 a2 segment as extra columns (a2 as given [E, I, N_x], read
    MN-major)."""
    plan, a = pool_for(tokens, experts, top_k, block_m, inter, seed=tokens)
    codes, scales = mxfp4_operand(experts, hidden, inter, seed=tokens + 1)
    b_extra = None
    if extra:
        b_extra = torch.randn(experts, inter, extra, device="cuda").bfloat16()
    launches.clear()
    out = grouped_gemm(a, codes, plan, b_scales=scales, b_extra=b_extra)
    assert launches == [ENGINE_MXFP4]
    decoded = decode_mxfp4_bf16(codes, scales)
    twin = grouped_gemm(a, decoded, plan, b_extra=b_extra)
    rows = int(plan.expert_pool_offsets[-1])
    assert out.shape == (plan.pool_capacity, hidden + extra)
    assert same_bits(out[:rows], twin[:rows])
    expected = grouped_gemm_reference(a, decoded, plan, b_extra=b_extra)
    assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [0, 64])
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", 7.0)])
def test_gated_decode_is_the_engine_on_the_decoded_weights(
    launches, block_m, rank, activation, clamp
):
    """GEMM1 on w13 in the user's layout (a tile's gate rows and up rows: two boxes of
    codes and scales), the BF16 side segment, the pre-activations g | u (I = 576: not
    whole 128-wide streaming tiles)."""
    tokens, experts, top_k, hidden, inter = 300, 8, 3, 1024, 576
    plan, a = pool_for(tokens, experts, top_k, block_m, hidden + 2 * rank, seed=rank + 3)
    codes, scales = mxfp4_operand(experts, 2 * inter, hidden, seed=rank + 4, scale_high=124)
    side = {}
    if rank:
        side = dict(
            side_b_gate=torch.randn(experts, rank, inter, device="cuda").bfloat16(),  # b1 [E, r, I]
            side_b_up=torch.randn(experts, rank, inter, device="cuda").bfloat16(),
            side_scale=0.75,
        )
    kwargs = dict(k=hidden, activation=activation, activation_clamp=clamp)
    preact = torch.empty(a.shape[0], 2 * inter, dtype=torch.bfloat16, device="cuda")
    launches.clear()
    h = gated_grouped_gemm(a, codes, plan, w13_scales=scales, preact_out=preact, **kwargs, **side)
    assert launches == [ENGINE_MXFP4]
    decoded = decode_mxfp4_bf16(codes, scales)
    twin_preact = torch.empty_like(preact)
    twin = gated_grouped_gemm(a, decoded, plan, preact_out=twin_preact, **kwargs, **side)
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(h[:rows], twin[:rows])
    assert same_bits(preact[:rows], twin_preact[:rows])
    expected = gated_grouped_gemm_reference(
        a, decoded, plan, k=hidden, activation=activation, activation_clamp=clamp, **side
    )
    assert_close_to_oracle("h", h[:rows], expected)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("hidden,path", [(320, ENGINE_MXFP4), (256, "stream")])
def test_every_code_and_scale_byte(launches, block_m, hidden, path):
    """Scale bytes 0..255 (0 = 2^-127, subnormal products, 0xFF = NaN, overflow to Inf)
    with every code, -0 codes and all-zero blocks: the same bits as the engine on the
    decoded weights on every data row, NaN and Inf outputs included, through the engine's
    decode (N = 320) and the weight-streaming kernel's (N = 256). Padding rows hold the
    engine's bits too, except in a chunk of padding rows only, which the weight-streaming
    kernel writes as zeros without reading it (where the engine's zero rows meet NaN or
    Inf weights, its products are NaN)."""
    experts, inter = 4, 512
    plan, a = pool_for(300, experts, 2, block_m, inter, seed=9)
    codes, _ = mxfp4_operand(experts, hidden, inter, seed=10)
    scales = torch.arange(experts * hidden * inter // 32, device="cuda") % 256
    scales = scales.to(torch.uint8).view(experts, hidden, inter // 32)
    codes[0, :4] = 0  # all-zero blocks
    codes[1, :4] = 0x88  # -0 codes
    launches.clear()
    out = grouped_gemm(a, codes, plan, b_scales=scales)
    assert launches == [path]
    twin = grouped_gemm(a, decode_mxfp4_bf16(codes, scales), plan)
    rows = int(plan.expert_pool_offsets[-1])
    data = plan.pool_row_to_route[:rows] >= 0
    assert bool(torch.isnan(out[:rows][data]).any())
    assert same_bits(out[:rows][data], twin[:rows][data])
    padding, twin_padding = out[:rows][~data], twin[:rows][~data]
    differ = padding.view(torch.int16) != twin_padding.view(torch.int16)
    assert bool((padding[differ] == 0).all()) and bool(torch.isnan(twin_padding[differ]).all())
    if path == ENGINE_MXFP4:  # the engine reads its padding rows as the twin does
        assert not bool(differ.any())
    # Tiny scales only (0 .. 8): subnormal decoded values, finite results.
    small = scales % 9
    out = grouped_gemm(a, codes, plan, b_scales=small)
    twin = grouped_gemm(a, decode_mxfp4_bf16(codes, small), plan)
    assert same_bits(out[:rows], twin[:rows])


@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_engine_decode_is_deterministic(launches, block_m):
    plan, a = pool_for(700, 16, 4, block_m, 1024, seed=21)
    codes, scales = mxfp4_operand(16, 1088, 1024, seed=22)
    rows = int(plan.expert_pool_offsets[-1])  # rows past it are not written
    launches.clear()
    first = grouped_gemm(a, codes, plan, b_scales=scales)[:rows]
    assert launches == [ENGINE_MXFP4]
    for _ in range(3):
        again = grouped_gemm(a, codes, plan, b_scales=scales)[:rows]
        assert torch.equal(again, first)


def test_mxfp4_operand_is_checked():
    plan, a = pool_for(64, 4, 2, 128, 256, seed=1)
    codes, scales = mxfp4_operand(4, 256, 256, seed=2)
    with pytest.raises(ValueError, match="b_scales: expected shape"):
        grouped_gemm(a, codes[:, :, :16].contiguous(), plan, b_scales=scales, b_major="mn")
    with pytest.raises(ValueError, match="b_scales"):
        grouped_gemm(a, codes, plan, b_scales=scales[:, :, :4])
    with pytest.raises(TypeError, match=r"^b: expected dtype uint8"):
        grouped_gemm(a, codes.view(torch.int8), plan, b_scales=scales)
    short_codes, short_scales = codes[:, :, :16].contiguous(), scales[:, :, :1].contiguous()
    with pytest.raises(ValueError, match="multiple of 64"):
        grouped_gemm(a, short_codes, plan, b_scales=short_scales)
    with pytest.raises(ValueError, match=r"^k: an MXFP4 B reduces over all its K=256"):
        grouped_gemm(a, codes, plan, b_scales=scales, k=128)
    # MN-major (the dgrads): N is quantized in blocks of 32.
    narrow_codes, narrow_scales = codes[:, :, :8].contiguous(), scales[:, :, :1].contiguous()
    with pytest.raises(ValueError, match="N a multiple of 32"):
        grouped_gemm(a, narrow_codes, plan, b_scales=narrow_scales, b_major="mn")


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,k,n",
    [(1, 8, 1, 256, 128), (700, 8, 2, 512, 704), (700, 16, 4, 2048, 1088)],
)
def test_mn_major_decode_is_the_engine_on_the_decoded_weights(
    launches, block_m, tokens, experts, top_k, k, n
):
    """The dgrads' view: codes [E, K, N/2] as stored (quantized along N), decoded into the
    MN-major tile (N = 704, 1088: a partial 256-wide N tile)."""
    plan, a = pool_for(tokens, experts, top_k, block_m, k, seed=tokens + 5)
    codes, scales = mxfp4_operand(experts, k, n, seed=tokens + 6)
    launches.clear()
    out = grouped_gemm(a, codes, plan, b_major="mn", b_scales=scales)
    assert launches == [ENGINE_MXFP4]
    decoded = decode_mxfp4_bf16(codes, scales)  # [E, K, N]
    twin = grouped_gemm(a, decoded, plan, b_major="mn")
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(out[:rows], twin[:rows])
    expected = grouped_gemm_reference(a, decoded.transpose(1, 2).contiguous(), plan)
    assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [48, 128])  # both blocks in the low half; r = BLOCK_N / 2
def test_mn_major_decode_with_bf16_extra_columns(launches, block_m, rank):
    """dgrad1 with an adapter on an MXFP4 base: the base tiles decode codes, the BF16
    extra blocks (the b1/b3 shrinks as given, K-major) do not."""
    plan, a = pool_for(700, 8, 3, block_m, 512, seed=31)
    codes, scales = mxfp4_operand(8, 512, 704, seed=32)
    gen = torch.Generator(device="cuda").manual_seed(33)
    blocks = tuple(
        (torch.randn(8, rank, 256, device="cuda", generator=gen) * 0.05).bfloat16() for _ in "lh"
    )
    launches.clear()
    out = grouped_gemm(a, codes, plan, b_major="mn", b_scales=scales, b_extra_blocks=blocks)
    assert launches == [ENGINE_MXFP4]
    decoded = decode_mxfp4_bf16(codes, scales)
    twin = grouped_gemm(a, decoded, plan, b_major="mn", b_extra_blocks=blocks)
    rows = int(plan.expert_pool_offsets[-1])
    assert out.shape[1] == 704 + 2 * rank
    assert same_bits(out[:rows], twin[:rows])
    expected = grouped_gemm_reference(
        a, decoded.transpose(1, 2).contiguous(), plan, b_extra_blocks=blocks
    )
    assert_close_to_oracle("out", out[:rows], expected)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("inter", [384, 576])  # partial 256-wide tiles (whole ones stream)
@pytest.mark.parametrize("weighted_h", [True, False])
def test_fused_dgrad2_decode_is_the_engine_on_the_decoded_weights(
    launches, weighted_h, inter, rank, block_m
):
    """dgrad2 + activation backward on MXFP4 w2 ([E, H, I/2] codes), with the BF16 a2
    side K segment (as given [E, I, r], read K-major) or without: dg | du, w h and the
    router dot of the same engine on the BF16 decode, bit for bit."""
    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward

    tokens, top_k, experts, hidden = 1000, 2, 8, 512
    ids, weights = make_routing(tokens, experts, top_k, kind="masked", seed=3)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    gen = torch.Generator(device="cuda").manual_seed(4)
    preact = (
        torch.randn(plan.pool_capacity, 2 * inter, device="cuda", generator=gen) * 2
    ).bfloat16()
    dout_pool = torch.randn(
        plan.pool_capacity, hidden + rank, device="cuda", generator=gen
    ).bfloat16()
    side_a2 = None
    if rank:
        side_a2 = (torch.randn(experts, inter, rank, device="cuda", generator=gen) / 8).bfloat16()
    codes, scales = mxfp4_operand(experts, hidden, inter, seed=5, scale_high=124)
    args = dict(activation="swiglu", weighted_h=weighted_h, side_a2=side_a2)
    launches.clear()
    fused = fused_dgrad2_activation_backward(
        dout_pool, codes, preact, weights.cuda(), plan, w2_scales=scales, **args
    )
    assert launches == [ENGINE_MXFP4]
    twin = fused_dgrad2_activation_backward(
        dout_pool, decode_mxfp4_bf16(codes, scales), preact, weights.cuda(), plan, **args
    )
    rows = int(plan.expert_pool_offsets[-1])
    assert same_bits(fused[0][:rows], twin[0][:rows])
    assert (fused[1] is None) == (not weighted_h)
    if weighted_h:
        assert same_bits(fused[1][:rows], twin[1][:rows])
    assert torch.equal(fused[2][:rows], twin[2][:rows])


@pytest.mark.parametrize(
    "hidden,inter,path",
    [(1088, 576, ENGINE_MXFP4), (1024, 512, "stream")],  # not whole streaming tiles; whole
)
@pytest.mark.parametrize("with_side", [True, False])
def test_layer_on_mxfp4_is_the_layer_on_the_decoded_weights(
    launches, hidden, inter, path, with_side
):
    """mm.moe on an MXFP4 base (frozen; side-LoRA, or no adapters): output and every
    gradient are those of mm.moe on a BF16 base holding the decoded values, bit for bit,
    with every GEMM that reads the base (GEMM1, GEMM2, dgrad2, dgrad1) decoding inside the
    engine's pipeline, or all four in the weight-streaming kernels. (A BLOCK_M 128 pool
    has more rows per expert than the in-pipeline decode takes: a transient decode.)"""
    from megamoe.testing import make_layer

    tokens = 300
    layer = make_layer(
        hidden, inter, 16, 4, 32, num_tokens=tokens, seed=5, device="cuda", requires_grad=True,
        format="mxfp4",
    )  # fmt: skip
    assert mm.get_block_m(tokens, 4, 16) == 64
    decoded = mm.prepare_base_weights(layer.base.w13_for_gemm(), layer.base.w2_for_gemm())
    assert decoded.format == "bf16"
    side = layer.side if with_side else None
    dout = torch.randn(tokens, hidden, device="cuda").bfloat16()
    leaves = [layer.x, layer.topk_weights] + ([] if side is None else list(side.tensors()))
    results = []
    for base in (layer.base, decoded):
        launches.clear()
        out = mm.moe(layer.x, layer.topk_ids, layer.topk_weights, base, side)
        results.append((out, torch.autograd.grad(out, leaves, dout)))
        if base is layer.base:  # the four GEMMs that read the base, nothing decoded aside
            assert sorted(launches) == [path] * 4, launches
    (out, grads), (twin_out, twin_grads) = results
    assert torch.equal(out, twin_out)
    for got, want in zip(grads, twin_grads, strict=True):
        assert torch.equal(got, want)
