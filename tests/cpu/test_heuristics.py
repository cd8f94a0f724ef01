"""Host heuristics: get_block_m (choices from the registry, monotone, agreed transitions),
the weight-streaming chunk, and where an MXFP4 base is decoded."""

import itertools

import pytest
import torch

import megamoe as mm
from megamoe.wrappers.registry import registry
from megamoe.wrappers.routing import pool_capacity


def transitions(top_k, num_experts, ep_size=1, max_tokens=70_000):
    """Token counts where the heuristic's choice changes (first token count of the new one)."""
    found = []
    previous = mm.get_block_m(1, top_k, num_experts, ep_size)
    for tokens in range(2, max_tokens):
        current = mm.get_block_m(tokens, top_k, num_experts, ep_size)
        if current != previous:
            found.append((tokens, previous, current))
            previous = current
    return found


@pytest.mark.parametrize(
    "top_k,num_experts,ep_size", [(1, 8, 1), (2, 64, 1), (6, 256, 1), (6, 256, 4), (6, 64, 2)]
)
def test_block_m_is_a_registry_choice_and_monotone(top_k, num_experts, ep_size):
    choices = registry().block_m_choices
    last = 0
    for tokens in [0, 1, 15, 16, 17, 90, 91, 1029, 2048, 8192, 65536, 262144]:
        block_m = mm.get_block_m(tokens, top_k, num_experts, ep_size)
        assert block_m in choices
        assert block_m >= last
        last = block_m


def test_small_batches_take_the_smallest_block():
    assert mm.get_block_m(1, 6, 256) == registry().block_m_choices[0]


def test_production_ep4_rank_takes_the_largest_block():
    # ep4rank: 65,536 tokens per rank, 256 experts over 4 ranks: 6,144 rows per expert.
    assert mm.get_block_m(65536, 6, 256, ep_size=4) == registry().block_m_choices[-1]


def test_transition_follows_the_padding_rule():
    # One transition for two choices: at rows per expert == min_blocks * 128.
    config = mm.BlockMConfig()
    found = transitions(top_k=2, num_experts=8)
    assert len(found) == len(registry().block_m_choices) - 1
    tokens, before, after = found[-1]
    assert (before, after) == (64, 128)
    assert tokens * 2 / 8 >= config.min_blocks_per_expert * 128
    assert (tokens - 1) * 2 / 8 < config.min_blocks_per_expert * 128


def test_ep_rows_scale_with_ep_size():
    # Same per-rank tokens, more ranks sending: more rows per local expert.
    single = transitions(top_k=6, num_experts=256, ep_size=1)
    ep4 = transitions(top_k=6, num_experts=256, ep_size=4)
    assert ep4[0][0] < single[0][0]


def test_custom_config_moves_the_threshold():
    loose = mm.BlockMConfig(min_blocks_per_expert=1)
    assert mm.get_block_m(128 * 8 // 2, 2, 8, config=loose) == 128
    assert mm.get_block_m(128 * 8 // 2, 2, 8) == 64


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_tokens=-1, top_k=1, num_experts=8), "num_tokens"),
        (dict(num_tokens=1, top_k=0, num_experts=8), "top_k"),
        (dict(num_tokens=1, top_k=1, num_experts=0), "num_experts"),
        (dict(num_tokens=1, top_k=1, num_experts=10, ep_size=4), "num_experts"),
        (dict(num_tokens=1, top_k=1, num_experts=8, ep_size=0), "ep_size"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mm.get_block_m(**kwargs)


def test_more_routes_than_experts_is_a_choice():
    # One rank's layer under a trainer's own expert parallelism: K = 8 routes per token,
    # 4 local experts, the other ranks' routes masked. Each expert sees each token at
    # most once, so the rows per expert are those of K = E = 4.
    choices = registry().block_m_choices
    for tokens in (1, 64, 100, 200, 4096, 65_536):
        assert mm.get_block_m(tokens, 8, 4) in choices
        assert mm.get_block_m(tokens, 8, 4) == mm.get_block_m(tokens, 4, 4)
    assert mm.get_block_m(65_536, 8, 4) == choices[-1]


def test_non_int_is_a_type_error():
    with pytest.raises(TypeError, match="num_tokens"):
        mm.get_block_m(1.5, 1, 8)


def test_block_m_transitions_sit_on_the_heuristic_changes():
    from megamoe.testing import block_m_transitions

    found = block_m_transitions(6, 8)
    assert found and len(found) % 3 == 0
    for below, at, above in zip(found[::3], found[1::3], found[2::3], strict=True):
        assert below + 1 == at == above - 1
        assert mm.get_block_m(below, 6, 8) != mm.get_block_m(at, 6, 8)
        assert mm.get_block_m(at, 6, 8) == mm.get_block_m(above, 6, 8)


def test_mxfp4_schedule_transitions_sit_on_its_changes():
    from megamoe.heuristics import WEIGHT_STREAM_NARROW_MAX_ROWS, WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS
    from megamoe.testing import mxfp4_schedule_transitions
    from megamoe.testing.inputs import mxfp4_schedule

    top_k, experts = 6, 64  # ep4rank
    found = mxfp4_schedule_transitions(top_k, experts, max_tokens=9000)
    assert found and len(found) % 3 == 0
    middles = found[1::3]
    for below, at, above in zip(found[::3], middles, found[2::3], strict=True):
        assert below + 1 == at == above - 1
        assert mxfp4_schedule(below, top_k, experts) != mxfp4_schedule(at, top_k, experts)
        assert mxfp4_schedule(at, top_k, experts) == mxfp4_schedule(above, top_k, experts)
    # Nothing changes between two transitions.
    for lo, hi in itertools.pairwise(middles):
        for tokens in (lo + 2, (lo + hi) // 2, hi - 2):
            if lo < tokens < hi:
                assert mxfp4_schedule(tokens, top_k, experts) == mxfp4_schedule(lo, top_k, experts)
    # The chunk steps from 32 to 64 rows past 24 routes per expert, to the wide form past 64
    # (T = rows x E / K), and BLOCK_M's transition is among them.
    assert WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS * experts // top_k + 1 in middles
    assert WEIGHT_STREAM_NARROW_MAX_ROWS * experts // top_k + 1 in middles
    block_m = [
        t
        for t in range(2, 9000)
        if mm.get_block_m(t, top_k, experts) != mm.get_block_m(t - 1, top_k, experts)
    ]
    assert set(block_m) <= set(middles)
    # Past the streaming limit (the transient decode) the chunks no longer change it.
    last = mxfp4_schedule(middles[-1], top_k, experts)
    assert last[3] is False and all(chunk is None for _, chunk in last[1])


def _stream_variants() -> set[tuple[str, int]]:
    return {(v.params["kind"], v.params["tokens"]) for v in registry().family("weight_stream")}


@pytest.mark.parametrize("experts", [8, 64, 256])
def test_weight_stream_chunk_steps_up_with_the_rows_per_expert(experts):
    # Rows per expert at the thresholds and one route past them.
    def chunk(rows, widest, kind="Gated"):
        return mm.heuristics.weight_stream_chunk(rows * experts, experts, widest=widest, kind=kind)

    small = mm.heuristics.WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS
    narrow = mm.heuristics.WEIGHT_STREAM_NARROW_MAX_ROWS
    assert small < narrow
    rows = (0, small, small + 1, narrow, narrow + 1, 128, 129, 192, 193, 256, 257, 384, 385)
    assert [chunk(r, 256) for r in rows] == [32, 32, 64, 64, 128, 128, 192, 192, 256, 256, 192,
                                             192, 256]  # fmt: skip
    # dgrad1: one-tile chunks where one chunk holds an expert's rows.
    assert [chunk(r, 256, "StoreMN") for r in rows] == [32, 32, 64, 64, 128, 128, 192, 192,
                                                        256, 256, 128, 128, 256]  # fmt: skip
    # dgrad2's wide form is 128 rows.
    assert [chunk(r, 128, None) for r in rows] == [32, 32, 64, 64] + [128] * 9
    # No wide form.
    assert [chunk(r, 64, None) for r in (small, small + 1, narrow + 1, 10_000)] == [32, 64, 64, 64]
    # Up to 256 rows per expert the chunk only grows.
    for widest, kind in ((128, None), (256, "Gated"), (256, "StoreMN")):
        last = 0
        for routes in range(0, 256 * experts + 1, max(1, experts // 4)):
            current = mm.heuristics.weight_stream_chunk(routes, experts, widest=widest, kind=kind)
            assert current >= last
            last = current


def test_wide_chunk_has_the_least_cost_by_the_kinds_costs():
    """Each kind's chunk above 128 rows per expert: the least ceil(rows / c) * cost(c)
    over 128 / 192 / 256, by counts written out here; with the widest 128, 128."""
    costs = mm.heuristics.WEIGHT_STREAM_CHUNK_COSTS
    assert costs["Gated"] == costs["Store"] == {128: 0.50, 192: 0.69, 256: 0.85}
    assert costs["StoreMN"] == {128: 0.43, 192: 0.72, 256: 0.85}
    assert "ActivationBackward" not in costs
    expected = {
        # rows per expert: (GEMM1 and GEMM2's, dgrad1's); GEMM1's costs of the three chunks
        # 0.50 k, 0.69 k, 0.85 k; dgrad1's 0.43 k, 0.72 k, 0.85 k
        144: (192, 192),  # 1.00, 0.69, 0.85; 0.86, 0.72, 0.85 (T = 1536 at ep4rank)
        240: (256, 256),  # 1.00, 1.38, 0.85; 0.86, 1.44, 0.85 (T = 2560)
        288: (192, 128),  # 1.50, 1.38, 1.70; 1.29, 1.44, 1.70 (T = 3072)
        384: (192, 128),  # 1.50, 1.38, 1.70; 1.29, 1.44, 1.70 (T = 4096)
        480: (256, 256),  # 2.00, 2.07, 1.70; 1.72, 2.16, 1.70 (T = 5120)
        576: (192, 128),  # 2.50, 2.07, 2.55; 2.15, 2.16, 2.55 (T = 6144)
        600: (128, 128),  # 2.50, 2.76, 2.55; 2.15, 2.88, 2.55
        700: (256, 256),  # 3.00, 2.76, 2.55; 2.58, 2.88, 2.55
    }
    for rows, (forward, dgrad1) in expected.items():
        for kind, chunk in (("Gated", forward), ("Store", forward), ("StoreMN", dgrad1)):
            got = mm.heuristics.weight_stream_chunk(rows * 64, 64, widest=256, kind=kind)
            assert got == chunk, (rows, kind)
        assert mm.heuristics.weight_stream_chunk(rows * 64, 64, widest=128) == 128


@pytest.mark.parametrize("widest", [0, 32, 96, 512, True])
def test_weight_stream_chunk_rejects_other_widths(widest):
    with pytest.raises(ValueError, match="widest"):
        mm.heuristics.weight_stream_chunk(1_000, 64, widest=widest, kind="Gated")


@pytest.mark.parametrize("kind", [None, "ActivationBackward", "gated"])
def test_weight_stream_chunk_needs_a_kind_with_costs_for_256(kind):
    with pytest.raises(ValueError, match="kind"):
        mm.heuristics.weight_stream_chunk(1_000, 64, widest=256, kind=kind)


def test_every_weight_stream_chunk_has_its_variants():
    variants = _stream_variants()
    widest = {}
    for kind, tokens in variants:
        widest[kind] = max(widest.get(kind, 0), tokens)
    assert widest == {"Gated": 256, "Store": 256, "StoreMN": 256, "ActivationBackward": 128}
    for routes in range(0, 60_000, 250):
        for kind, w in widest.items():
            chunk = mm.heuristics.weight_stream_chunk(routes, 64, widest=w, kind=kind)
            assert (kind, chunk) in variants, (routes, kind)


def test_mxfp4_decodes_in_pipeline_up_to_each_limit():
    engine = mm.heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT
    stream = mm.heuristics.MXFP4_STREAM_MAX_ROWS_PER_EXPERT
    assert engine < stream
    decodes = mm.heuristics.mxfp4_decodes_in_pipeline
    for experts in (1, 64):
        assert decodes(engine * experts, experts) and not decodes(engine * experts + 1, experts)
        assert decodes(stream * experts, experts, streams=True)
        assert not decodes(stream * experts + 1, experts, streams=True)
    with pytest.raises(TypeError, match="streams"):
        decodes(1_000, 64, streams=1)


def test_a_trainable_mxfp4_master_decodes_once_past_the_in_pipeline_limit():
    engine = mm.heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT
    once = mm.heuristics.mxfp4_master_decodes_once
    for experts in (1, 64):
        assert not once(0, experts) and not once(engine * experts, experts)
        assert once(engine * experts + 1, experts)
    # ep4rank (E_l = 64, K = 6): pool rows per expert at T = 2048 and 6144 (704: streamed
    # by a frozen base's GEMMs at these dims, not by every shape's).
    for tokens, want in ((2048, False), (6144, True)):
        rows = pool_capacity(tokens * 6, 64, mm.get_block_m(tokens, 6, 64))
        assert once(rows, 64) == want, tokens


def _mxfp4_w13(experts, inter, hidden):
    """Zero codes [E, 2I, H/2] and scales [E, 2I, H/32] (CPU)."""
    codes = torch.zeros(experts, 2 * inter, hidden // 2, dtype=torch.uint8)
    return codes, torch.full((experts, 2 * inter, hidden // 32), 127, dtype=torch.uint8)


@pytest.mark.parametrize("inter,streams", [(256, True), (160, False)])
def test_gemm1_decodes_in_pipeline_to_the_streaming_limit_where_it_streams(inter, streams):
    """GEMM1 over a pool of 704 rows per expert (T = 6144 at ep4rank's routing): decoded
    in the pipeline where the streaming kernel takes I (a multiple of its chunk's tile
    columns: 64 in the 192-row chunks it takes there), else from a transient decode (the
    engine's in-pipeline limit is below it)."""
    from megamoe.testing.inputs import make_routing
    from megamoe.wrappers.grouped_gemm import _gated_streams, mxfp4_b_unchecked

    experts, tokens, top_k = 64, 6144, 6
    ids, _ = make_routing(tokens, experts, top_k, kind="balanced", seed=0)
    plan = mm.plan_routes(ids, experts, mm.get_block_m(tokens, top_k, experts))
    rows_per_expert = plan.pool_capacity / experts
    assert rows_per_expert > mm.heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT
    assert rows_per_expert <= mm.heuristics.MXFP4_STREAM_MAX_ROWS_PER_EXPERT
    codes, scales = _mxfp4_w13(experts, inter, 128)
    assert _gated_streams(plan)(codes, scales) is streams
    k, values, kept_scales = mxfp4_b_unchecked(codes, scales, plan, streams=_gated_streams(plan))
    assert k == 128
    if streams:  # the codes as given, decoded in the kernel
        assert values is codes and kept_scales is scales
    else:  # the exact BF16 decode: 2^(127 - 127) x 0
        assert kept_scales is None and values.dtype == torch.bfloat16
        assert values.shape == (experts, 2 * inter, 128) and not values.any()


@pytest.mark.parametrize("value,error", [(0, ValueError), (-1, ValueError), ("4", TypeError)])
def test_block_m_config_refuses_what_would_pick_blindly(value, error):
    """A threshold of 0 or less made every token count take the largest BLOCK_M; a
    string failed later with an unnamed TypeError."""
    with pytest.raises(error, match=r"^min_blocks_per_expert: expected an int"):
        mm.BlockMConfig(min_blocks_per_expert=value)
