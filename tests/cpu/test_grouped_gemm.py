"""The engine's store GEMM on the host (python/megamoe/wrappers/grouped_gemm.py): dgrad1's
extra blocks (the b1/b3 shrinks read as given) in the CPU twin and the float64 reference,
and the checks that run before any kernel."""

import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.grouped_gemm import grouped_gemm, grouped_gemm_reference

EXPERTS, HIDDEN, INTER, RANK = 3, 64, 128, 16


def _setup():
    ids, _ = make_routing(40, EXPERTS, 2, seed=0)
    plan = mm.plan_routes(ids, EXPERTS, 64)
    gen = torch.Generator().manual_seed(1)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    dgu = bf16(plan.pool_capacity, 2 * INTER)  # (dg | du)
    w13 = bf16(EXPERTS, 2 * INTER, HIDDEN)  # as stored: [E, K = 2I, N = H]
    b1, b3 = bf16(EXPERTS, RANK, INTER), bf16(EXPERTS, RANK, INTER)  # [E, r, I] as given
    return plan, dgu, w13, b1, b3


def test_extra_blocks_are_dg_b1t_then_du_b3t():
    """The extra columns are (dg b1_e^T | du b3_e^T): lo over K rows 0..I, hi over I..2I,
    checked per expert against float64 products computed here (not the reference)."""
    plan, dgu, w13, b1, b3 = _setup()
    out = grouped_gemm(dgu, w13, plan, b_major="mn", b_extra_blocks=(b1, b3))
    assert out.shape == (plan.pool_capacity, HIDDEN + 2 * RANK)
    offsets = plan.expert_pool_offsets.tolist()
    counts = plan.expert_counts.tolist()
    for e in range(EXPERTS):
        rows = slice(offsets[e], offsets[e] + counts[e])
        dg, du = dgu[rows, :INTER].double(), dgu[rows, INTER:].double()
        dx = dgu[rows].double() @ w13[e].double()
        torch.testing.assert_close(out[rows, :HIDDEN].double(), dx, rtol=1e-2, atol=5e-2)
        dq1, dq3 = dg @ b1[e].double().T, du @ b3[e].double().T
        torch.testing.assert_close(
            out[rows, HIDDEN : HIDDEN + RANK].double(), dq1, rtol=1e-2, atol=5e-2
        )
        torch.testing.assert_close(out[rows, HIDDEN + RANK :].double(), dq3, rtol=1e-2, atol=5e-2)


def test_reference_extra_blocks_match_a_dense_block_diagonal():
    """The float64 reference's blocks equal a dense [[b1^T, 0], [0, b3^T]] extra operand
    (what the kernel computes, with the zero blocks never stored)."""
    plan, dgu, w13, b1, b3 = _setup()
    dense = torch.zeros(EXPERTS, 2 * INTER, 2 * RANK, dtype=torch.bfloat16)
    dense[:, :INTER, :RANK] = b1.transpose(1, 2)
    dense[:, INTER:, RANK:] = b3.transpose(1, 2)
    b_k_major = w13.transpose(1, 2)  # the reference takes [E, N, K]
    blocks = grouped_gemm_reference(dgu, b_k_major, plan, b_extra_blocks=(b1, b3))
    want = grouped_gemm_reference(dgu, b_k_major, plan, b_extra=dense)
    torch.testing.assert_close(blocks, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(b_extra="dense"), ValueError, r"^b_extra: with b_major='mn'"),
        (dict(b_major="k"), ValueError, r"^b_extra_blocks: only with b_major='mn'"),
        (dict(b_extra_blocks="list"), TypeError, r"^b_extra_blocks: expected a tuple"),
        (dict(k_lo=96), ValueError, r"^b_extra_blocks\[0\]: expected K_lo a multiple of 64"),
        (dict(hi_k=64), ValueError, r"^b_extra_blocks\[1\]: expected shape"),
        (dict(hi_rank=12), ValueError, r"^b_extra_blocks: expected N_x a multiple of 8"),
    ],
)
def test_extra_block_errors_name_the_argument(kwargs, error, message):
    plan, dgu, w13, b1, _ = _setup()
    lo = b1 if "k_lo" not in kwargs else torch.zeros(EXPERTS, RANK, kwargs["k_lo"]).bfloat16()
    hi_shape = (EXPERTS, kwargs.get("hi_rank", RANK), kwargs.get("hi_k", 2 * INTER - lo.shape[2]))
    hi = torch.zeros(hi_shape).bfloat16()
    call = dict(b_major="mn", b_extra_blocks=(lo, hi))
    if kwargs.get("b_extra") == "dense":
        call = dict(b_major="mn", b_extra=torch.zeros(EXPERTS, 2 * INTER, 2 * RANK).bfloat16())
    if kwargs.get("b_extra_blocks") == "list":
        call["b_extra_blocks"] = [lo, hi]
    if kwargs.get("b_major") == "k":
        w13 = w13.transpose(1, 2).contiguous()  # [E, N, K]
        call["b_major"] = "k"
    with pytest.raises(error, match=message):
        grouped_gemm(dgu, w13, plan, **call)


def test_streaming_predicate_answers_false_on_malformed_extra_columns():
    """The MXFP4 decode decision reads the extra columns before their checks run: where
    they are not well formed it answers False (the checks then name them), else the
    streaming kernel's own shape rule (GEMM2: N a multiple of 256, N_x up to 256)."""
    from megamoe.wrappers.grouped_gemm import _extra_columns, _store_streams

    plan, *_ = _setup()
    codes = torch.zeros(EXPERTS, 256, 32, dtype=torch.uint8)  # [E, N, K/2]
    scales = torch.full((EXPERTS, 256, 2), 127, dtype=torch.uint8)
    extra = torch.zeros(EXPERTS, 64, 16, dtype=torch.bfloat16)
    assert _extra_columns(None, None) == 0 and _extra_columns(extra, None) == 16
    assert _extra_columns(extra[0], None) is None
    assert _extra_columns(None, [extra, extra]) is None
    assert _extra_columns(None, (extra, extra)) == 128
    assert _store_streams(plan, "k", extra, None)(codes, scales)
    assert not _store_streams(plan, "k", extra[0], None)(codes, scales)
    assert not _store_streams(plan, "k", None, None)(codes[:, :192], scales[:, :192])


@pytest.mark.parametrize(
    "kind,expected",
    [
        # (chunk, tile columns) at 16 / 48 / 100 / 160 / 200 rows per expert
        ("Gated", [(32, 128), (64, 128), (128, 128), (192, 64), (256, 64)]),
        ("Store", [(32, 256), (64, 256), (128, 256), (192, 128), (256, 128)]),
        ("StoreMN", [(32, 256), (64, 256), (128, 256), (192, 128), (256, 128)]),
        ("ActivationBackward", [(32, 256), (64, 256), (128, 256), (128, 256), (128, 256)]),
    ],
)
def test_stream_chunk_takes_whole_tiles_of_the_chunks_variant(kind, expected):
    """Each kind's chunk by rows per expert (GEMM1, GEMM2 and dgrad1 up to 256 rows,
    dgrad2 up to 128) and the tile columns its variant needs (variants.toml): whole tiles
    stream, one and a half tiles do not; nor do scales off their producer's alignment
    (4 bytes for the dgrads, 8 for the forward)."""
    from megamoe.wrappers.grouped_gemm import _stream_chunk

    experts, top_k = 8, 2
    scales = torch.zeros(16, dtype=torch.uint8)
    for rows, (chunk, tile) in zip((16, 48, 100, 160, 200), expected, strict=True):
        tokens = rows * experts // top_k
        ids, _ = make_routing(tokens, experts, top_k, kind="balanced", seed=0)
        plan = mm.plan_routes(ids, experts, mm.get_block_m(tokens, top_k, experts))
        assert _stream_chunk(kind, 3 * tile, scales, plan, experts) == chunk
        assert _stream_chunk(kind, 3 * tile // 2, scales, plan, experts) is None
        assert _stream_chunk(kind, 3 * tile, scales[1:], plan, experts) is None
        # The dgrads' producer copies the aligned 4-byte word that holds a step's bytes, the
        # forward's the aligned 8-byte chunk that holds four steps' bytes of a row.
        assert _stream_chunk(kind, 3 * tile, scales[2:], plan, experts) is None
        past_a_word = _stream_chunk(kind, 3 * tile, scales[4:], plan, experts)
        assert past_a_word == (chunk if kind in ("StoreMN", "ActivationBackward") else None)


def test_stream_widest_chunks_by_kind():
    """The widest chunk of each streaming kind: 256 rows for GEMM1, GEMM2 and dgrad1;
    128 for dgrad2, whose one-tile chunks measured slower and were deleted (the same
    dict test_heuristics reads off the registry's variants)."""
    from megamoe.wrappers.grouped_gemm import stream_widest_chunks

    widest = stream_widest_chunks()
    assert widest == {"Gated": 256, "Store": 256, "StoreMN": 256, "ActivationBackward": 128}


def test_dgrad2_streaming_predicate_reads_i_from_the_codes_as_stored():
    """dgrad2's predicate: w2's codes as stored, [E, H, I/2], stream where I is whole
    256-column tiles."""
    from megamoe.wrappers.activation_backward import _dgrad2_streams

    plan, *_ = _setup()
    scales = torch.zeros(4, dtype=torch.uint8)
    streams = _dgrad2_streams(plan)
    assert streams(torch.zeros(EXPERTS, 64, 128, dtype=torch.uint8), scales)  # I = 256
    assert not streams(torch.zeros(EXPERTS, 64, 192, dtype=torch.uint8), scales)  # I = 384


def _wrapper_case():
    from megamoe.wrappers.routing import plan_routes

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = 4, 64, 64
    ids = torch.randint(0, experts, (10, 2), generator=gen, dtype=torch.int32)
    plan = plan_routes(ids, experts, 64)
    a = torch.randn(plan.pool_capacity, hidden, generator=gen).bfloat16()
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).bfloat16()
    w2 = torch.randn(experts, hidden, inter, generator=gen).bfloat16()
    return plan, a, w13, w2


def test_the_wrappers_name_what_the_launchers_refuse():
    """The CPU twins checked less than the CUDA launchers: a ``k`` past ``a``'s columns,
    a wrong ``out`` and a bad clamp were accepted (or failed unnamed) on the CPU."""
    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
    from megamoe.wrappers.grouped_gemm import gated_grouped_gemm

    plan, a, w13, w2 = _wrapper_case()
    b = w2.transpose(1, 2).contiguous()  # [E, I, H]: the K-major B of a pool x H -> I GEMM
    rows = plan.pool_capacity
    with pytest.raises(ValueError, match=r"^k: expected a multiple of 8 in \[8, a.shape\[1\]"):
        grouped_gemm(a, b, plan, k=128)
    with pytest.raises(ValueError, match=r"^k: expected a multiple of 8"):
        grouped_gemm(a, b, plan, k=60)
    with pytest.raises(ValueError, match=r"^b: expected N a multiple of 8"):
        grouped_gemm(a, b[:, :60].contiguous(), plan)
    with pytest.raises(ValueError, match=r"^k: expected a multiple of 64"):
        gated_grouped_gemm(
            torch.zeros(rows, 96, dtype=torch.bfloat16), w13[:, :, :32].contiguous(), plan, k=32
        )
    with pytest.raises(ValueError, match=r"^w2: expected H and I multiples of 64"):
        fused_dgrad2_activation_backward(
            a, w2[:, :, :32].contiguous(), torch.zeros(rows, 64, dtype=torch.bfloat16),
            torch.rand(10, 2), plan,
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"^out: expected dtype bfloat16"):
        grouped_gemm(a, b, plan, out=torch.empty(rows, 64))
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        grouped_gemm(a, b, plan, out=torch.empty(3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^k: expected w13's K=64, got 32"):
        gated_grouped_gemm(a, w13, plan, k=32)
    with pytest.raises(ValueError, match=r"^activation_clamp: expected a positive finite"):
        gated_grouped_gemm(a, w13, plan, k=64, activation_clamp=-1.0)
    preact = torch.zeros(rows, 128, dtype=torch.bfloat16)
    weights = torch.rand(10, 2)
    with pytest.raises(TypeError, match=r"^activation_clamp: expected a positive finite"):
        fused_dgrad2_activation_backward(a, w2, preact, weights, plan, activation_clamp="x")


def test_an_mxfp4_b_is_decoded_only_after_every_check(monkeypatch):
    """The transient decode (a full-weight kernel on the GPU) ran before the pool operand
    and the outputs were checked: a wrong call paid for it before being refused."""
    from megamoe.wrappers import grouped_gemm as wrappers
    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward

    decodes = []
    decode = wrappers._dequantized
    monkeypatch.setattr(wrappers, "_dequantized", lambda c, s: decodes.append(1) or decode(c, s))
    plan, a, w13, w2 = _wrapper_case()
    codes13, scales13 = mm.quantize_mxfp4(w13.float(), axis=-1)
    codes2, scales2 = mm.quantize_mxfp4(w2.float(), axis=-1)  # [E, H, I/2]: w2 as stored
    bad_a = torch.zeros(plan.pool_capacity + 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^a: expected plan.pool_capacity"):
        wrappers.gated_grouped_gemm(bad_a, codes13, plan, k=64, w13_scales=scales13)
    codes_b, scales_b = mm.quantize_mxfp4(w2.transpose(1, 2).float(), axis=-1)  # [E, I, H/2]
    with pytest.raises(ValueError, match=r"^a: expected plan.pool_capacity"):
        wrappers.grouped_gemm(bad_a, codes_b, plan, b_scales=scales_b)
    preact = torch.zeros(plan.pool_capacity, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^dout_pool: expected"):
        fused_dgrad2_activation_backward(
            bad_a, codes2, preact, torch.rand(10, 2), plan, w2_scales=scales2
        )
    assert decodes == []
    out = wrappers.grouped_gemm(a, codes_b, plan, b_scales=scales_b)  # a good call decodes
    assert decodes == [1] and out.shape == (plan.pool_capacity, 64)


def test_the_wrappers_check_the_plan_and_tma_needs_before_any_launch():
    """What the launchers (or nothing) refused, named by the checked wrappers on every
    device (a review): a plan relabelled with another registry BLOCK_M (the kernels would
    pair rows with the wrong expert's weights), an unknown BLOCK_M, the plan's maps on
    another device, pool rows that are not 16-byte strides, a ``k`` other than a K-major
    ``b``'s, empty extra columns or side ranks, and scales past float32."""
    import dataclasses

    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
    from megamoe.wrappers.grouped_gemm import gated_grouped_gemm

    plan, a, w13, w2 = _wrapper_case()
    b = w2.transpose(1, 2).contiguous()
    rows = plan.pool_capacity
    relabelled = dataclasses.replace(plan, block_m=128)
    planned = r"^plan.block_m: expected the BLOCK_M its pool was planned with; 128 gives"
    with pytest.raises(ValueError, match=planned):
        grouped_gemm(a, b, relabelled)
    with pytest.raises(ValueError, match=planned):
        gated_grouped_gemm(a, w13, relabelled, k=64)
    with pytest.raises(ValueError, match=planned):
        fused_dgrad2_activation_backward(
            a, w2, torch.zeros(rows, 128, dtype=torch.bfloat16), torch.rand(10, 2), relabelled
        )
    for bad in (32, "x", True):
        with pytest.raises(ValueError, match=r"^plan.block_m: expected one of \[64, 128\]"):
            grouped_gemm(a, b, dataclasses.replace(plan, block_m=bad))
    meta_plan = dataclasses.replace(
        plan, **{f.name: getattr(plan, f.name).to("meta") for f in dataclasses.fields(plan)
                 if f.name != "block_m"}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^plan.expert_counts: expected device cpu, got meta"):
        grouped_gemm(a, b, meta_plan)
    with pytest.raises(ValueError, match=r"^a: expected a column count that is a multiple of 8"):
        grouped_gemm(torch.zeros(rows, 68, dtype=torch.bfloat16), b, plan)
    with pytest.raises(ValueError, match=r"^k: expected b's K = b.shape\[2\] = 64, got 56"):
        grouped_gemm(torch.zeros(rows, 128, dtype=torch.bfloat16), b, plan, k=56)
    with pytest.raises(ValueError, match=r"^b_extra: expected at least one column"):
        grouped_gemm(a, b, plan, b_extra=torch.zeros(4, 64, 0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^side_b_gate: rank 0 must be a positive multiple"):
        empty = torch.zeros(4, 0, 64, dtype=torch.bfloat16)
        gated_grouped_gemm(a, w13, plan, k=64, side_b_gate=empty, side_b_up=empty)
    for scale, match in ((float("nan"), "a finite float"), (1e39, "a float finite in float32")):
        with pytest.raises(ValueError, match=rf"^side_scale: expected {match}"):
            gated_grouped_gemm(a, w13, plan, k=64, side_scale=scale)
    with pytest.raises(TypeError, match=r"^side_scale: expected a float, got str"):
        gated_grouped_gemm(a, w13, plan, k=64, side_scale="0.5")


def test_the_wrappers_check_the_weights_experts_and_the_plan_type():
    """A review: weights with more experts than the plan were computed with their first
    experts and fewer raised IndexError on the CPU (on the GPU the native check named the
    offsets, after an MXFP4 decode); a plan or ``preact`` of another type raised
    AttributeError; a float ``k`` failed as a slice index."""
    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
    from megamoe.wrappers.grouped_gemm import gated_grouped_gemm

    plan, a, w13, w2 = _wrapper_case()
    b = w2.transpose(1, 2).contiguous()
    rows = plan.pool_capacity
    preact = torch.zeros(rows, 128, dtype=torch.bfloat16)
    weights = torch.rand(10, 2)
    for experts in (3, 5):
        with pytest.raises(
            ValueError, match=rf"^b: expected the plan's E_l = 4 experts, got {experts}"
        ):
            grouped_gemm(a, torch.zeros(experts, 64, 64, dtype=torch.bfloat16), plan)
        with pytest.raises(
            ValueError, match=rf"^w13: expected the plan's E_l = 4 experts, got {experts}"
        ):
            gated_grouped_gemm(a, torch.zeros(experts, 128, 64, dtype=torch.bfloat16), plan, k=64)
        with pytest.raises(
            ValueError, match=rf"^w2: expected the plan's E_l = 4 experts, got {experts}"
        ):
            fused_dgrad2_activation_backward(
                a, torch.zeros(experts, 64, 64, dtype=torch.bfloat16), preact, weights, plan
            )
        codes, scales = mm.quantize_mxfp4(torch.zeros(experts, 64, 64), axis=-1)
        with pytest.raises(
            ValueError, match=rf"^b: expected the plan's E_l = 4 experts, got {experts}"
        ):
            grouped_gemm(a, codes, plan, b_scales=scales)
    for bad_plan in (None, "plan"):
        with pytest.raises(TypeError, match=r"^plan: expected a megamoe.RoutePlan, got"):
            grouped_gemm(a, b, bad_plan)
        with pytest.raises(TypeError, match=r"^plan: expected a megamoe.RoutePlan, got"):
            gated_grouped_gemm(a, w13, bad_plan, k=64)
        with pytest.raises(TypeError, match=r"^plan: expected a megamoe.RoutePlan, got"):
            fused_dgrad2_activation_backward(a, w2, preact, weights, bad_plan)
    with pytest.raises(TypeError, match=r"^preact: expected a torch.Tensor, got NoneType"):
        fused_dgrad2_activation_backward(a, w2, None, weights, plan)
    with pytest.raises(TypeError, match=r"^weighted_h: expected a bool, got str"):
        fused_dgrad2_activation_backward(a, w2, preact, weights, plan, weighted_h="no")
    with pytest.raises(TypeError, match=r"^check_ids: expected a bool, got str"):
        mm.plan_routes(torch.zeros(4, 2, dtype=torch.int32), 4, 64, check_ids="no")
    with pytest.raises(TypeError, match=r"^k: expected an int, got float"):
        grouped_gemm(a, b, plan, k=64.0)
    with pytest.raises(TypeError, match=r"^k: expected an int, got float"):
        gated_grouped_gemm(a, w13, plan, k=64.0)
    # The same weights and plan pass, with the experts as the plan has them.
    assert grouped_gemm(a, b, plan).shape == (rows, 64)
