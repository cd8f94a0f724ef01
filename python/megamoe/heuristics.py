"""Host heuristics: the pool's BLOCK_M and where an MXFP4 base is decoded (DESIGN §3).

Tests and EP code query :func:`get_block_m` instead of copying its thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .validation.arguments import check_int
from .wrappers.registry import registry


@dataclass(frozen=True)
class BlockMConfig:
    """Tuning knobs of :func:`get_block_m`.

    Each expert's pool segment is padded to BLOCK_M, wasting BLOCK_M/2 rows per expert
    on average. A larger BLOCK_M runs the grouped GEMMs faster per row, so we take the
    largest choice with at least ``min_blocks_per_expert`` blocks of expected rows per
    expert, so padding stays under ``1 / (2 * min_blocks_per_expert)`` of the rows:
    at 4, BLOCK_M 128 needs >= 512 rows per expert (<= 12.5% padding).
    """

    min_blocks_per_expert: int = 4

    def __post_init__(self) -> None:
        # 0 or less would silently give the largest BLOCK_M at any token count.
        check_int("min_blocks_per_expert", self.min_blocks_per_expert, minimum=1)


def get_block_m(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    ep_size: int = 1,
    config: BlockMConfig | None = None,
) -> int:
    """BLOCK_M for the expert pool.

    Args:
        num_tokens: tokens on this rank ``T`` (in EP, the MAX over ranks, so that every
            rank agrees).
        top_k: routes per token ``K``; it may exceed ``num_experts`` where a layer sees
            only its rank's experts and the other routes are masked (``-1``), as a
            trainer's own expert parallelism leaves them.
        num_experts: experts in total ``E`` (all ranks).
        ep_size: expert-parallel degree ``P``; ``E`` must be a multiple of it.
        config: thresholds (default :class:`BlockMConfig`).

    Returns:
        One of the registry's ``block_m_choices``. The expected rows per local expert
        are ``T * P * min(K, E) / E`` (every rank sends ``T * K`` routes spread over
        ``E`` experts, at most one per expert and token); the choice is monotone
        non-decreasing in ``num_tokens``.
    """
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("top_k", top_k, minimum=1)
    check_int("num_experts", num_experts, minimum=1)
    check_int("ep_size", ep_size, minimum=1)
    if num_experts % ep_size != 0:
        raise ValueError(
            f"num_experts: expected a multiple of ep_size={ep_size}, got {num_experts}"
        )
    min_blocks = block_m_threshold(config)
    choices = registry().block_m_choices
    # A token routes to an expert at most once: with more routes than experts (the rest
    # masked) each expert still sees at most every token.
    rows_per_expert = num_tokens * ep_size * min(top_k, num_experts) / num_experts
    fitting = [b for b in choices if rows_per_expert >= min_blocks * b]
    return fitting[-1] if fitting else choices[0]


def block_m_threshold(config: BlockMConfig | None) -> int:
    """``config``'s ``min_blocks_per_expert`` (the default's for None), after checking its
    type; EP groups agree on it (:func:`megamoe.ep.plan.plan_dispatch`)."""
    if config is None:
        return BlockMConfig().min_blocks_per_expert
    if not isinstance(config, BlockMConfig):
        raise TypeError(
            f"config: expected megamoe.BlockMConfig or None, got {type(config).__name__}"
        )
    return config.min_blocks_per_expert


#: Pool rows per expert up to which a GEMM that the weight-streaming kernels do not take
#: decodes an MXFP4 base inside the engine's pipeline (64-row tiles, the decode and
#: consumer warpgroups decoding each K step's codes in shared memory; measured crossover
#: 447-896 rows at ep4rank dims). Above it each GEMM first decodes its weight into a
#: transient BF16 buffer, dropped after it: with many row tiles per expert the
#: in-pipeline decode rewrites the same weight tile once per row tile and, with the MMA's
#: operand reads, exceeds the shared-memory bandwidth, while one decode pass per call is
#: amortised (docs/PERFORMANCE.md, "MXFP4 in the pipeline").
MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT = 448

#: The same limit for a GEMM whose shape the weight-streaming kernels take
#: (:func:`weight_stream_chunk`). Pool rows per expert are its capacity, padding
#: included. Measured on the layer at ep4rank dims (docs/PERFORMANCE.md, thirty-sixth
#: session, replayed F+B): streaming 13% faster than the transient decode at 704 rows per
#: expert (T = 6144), 1% slower at 896 (T = 8192).
MXFP4_STREAM_MAX_ROWS_PER_EXPERT = 768


def mxfp4_decodes_in_pipeline(pool_rows: int, num_experts: int, *, streams: bool = False) -> bool:
    """Whether an MXFP4 GEMM over a pool of ``pool_rows`` rows and ``num_experts``
    experts decodes in its pipeline (True) or from a transient BF16 decode (False); see
    :data:`MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT`, and :data:`MXFP4_STREAM_MAX_ROWS_PER_EXPERT`
    where ``streams`` (the weight-streaming kernels take the GEMM's shape). Host values
    only: no synchronisation."""
    check_int("pool_rows", pool_rows, minimum=0)
    check_int("num_experts", num_experts, minimum=1)
    if not isinstance(streams, bool):
        raise TypeError(f"streams: expected a bool, got {type(streams).__name__}")
    limit = MXFP4_STREAM_MAX_ROWS_PER_EXPERT if streams else MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT
    return pool_rows <= limit * num_experts


def mxfp4_master_decodes_once(pool_rows: int, num_experts: int) -> bool:
    """Whether ordinary mode on an MXFP4 base (a trainable master) decodes the whole
    base once per call and runs the BF16 path on that decode, straight through to the
    master (True), or runs every GEMM on the packed codes as a frozen base does, the
    backward's weight gradients still going to the master (False). The same bits either
    way (every MXFP4 GEMM is bitwise the BF16 GEMM on the exact decode).

    Up to :data:`MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT` pool rows per expert every GEMM
    decodes in its pipeline or streams, whatever the shape, so the whole-base decode is
    pure overhead (1.50 ms of a 5.26 ms F+B's kernels at ep4rank dims and T = 512 on an
    H100, docs/PERFORMANCE.md, forty-eighth session). Above it a GEMM that the streaming
    kernels do not take would make a transient decode of its own, in the forward and
    again in the backward. Host values only: no synchronisation."""
    return not mxfp4_decodes_in_pipeline(pool_rows, num_experts)


#: Expected pool rows per expert up to which the weight-streaming GEMMs walk each
#: expert's rows in chunks of 32 (wgmma N = 32); above it, chunks of 64. A chunk decodes
#: its weight tile once, so the chunk should hold an expert's rows; a narrower MMA costs
#: the tensor cores less beside the decode. Neither this choice nor streaming at all
#: changes a bit of the result (every form sums the same products in the same order:
#: tests/gpu/test_weight_stream.py), so the ranks of an EP group, which see different
#: route counts, may choose differently.
WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS = 24

#: Expected pool rows per expert up to which the weight-streaming GEMMs keep the 64-row
#: chunk; above it they take the wide form, whose chunks of 128, 192 or 256 rows start at
#: each segment's start, so that each weight is decoded once per 128, 192 or 256 rows, not
#: per 64. Every kind keeps two m64 weight tiles per consumer warpgroup in 128-row chunks,
#: a step's tiles decoded and multiplied one at a time; the 192- and 256-row chunks hold
#: one (docs/ENGINE.md, "The wide form", "The 128-row transposed chunks", "GEMM1 and GEMM2
#: in the two-tile 128-row form", "192-row chunks" and "dgrad1 in one-tile chunks").
WEIGHT_STREAM_NARROW_MAX_ROWS = 64

#: The wide chunks' cost per chunk of an expert (ms at ep4rank dims; only their ratios
#: matter), by kind and chunk: a chunk costs about the same whatever its data rows (its
#: MMAs are as wide as the chunk at 192 and 256 rows; a 128-row chunk's last one may be
#: 64), so a kind takes the chunk with the least ceil(rows / c) * cost(c).
#:
#: - GEMM1 and GEMM2 (``Gated``, ``Store``): GEMM1's times, about c + 56 rows of MMA a
#:   chunk (the decode of its weight tiles and its fixed steps), checked against every
#:   forced chunk of GEMM1 and GEMM2 up to 576 rows per expert (docs/PERFORMANCE.md,
#:   thirty-seventh session); they take 192 from 129 to 192 rows and from 257 to 384.
#: - dgrad1 (``StoreMN``): its one-tile chunks cost more per row than GEMM1's (a 192-row
#:   chunk 1.7 times a 128-row one, against 1.4), so it takes them where one chunk holds
#:   an expert's rows (129 to 256) and 128-row chunks from 257 to 384 (fortieth session,
#:   measured from 144 to 384 rows per expert; past that it is extrapolated).
#: - dgrad2 (``ActivationBackward``) has no one-tile chunks: they measured slower than its
#:   128-row ones at every token count (fortieth session).
WEIGHT_STREAM_CHUNK_COSTS: dict[str, dict[int, float]] = {
    "Gated": {128: 0.50, 192: 0.69, 256: 0.85},
    "Store": {128: 0.50, 192: 0.69, 256: 0.85},
    "StoreMN": {128: 0.43, 192: 0.72, 256: 0.85},
}


def weight_stream_chunk(
    num_routes: int, num_experts: int, *, widest: int = 64, kind: str | None = None
) -> int:
    """Pool rows per chunk of the weight-streaming GEMMs for ``num_routes`` routes over
    ``num_experts`` experts: 32 or 64 (see :data:`WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS`),
    and above :data:`WEIGHT_STREAM_NARROW_MAX_ROWS` rows per expert the wide form up to
    ``widest`` rows (64: none; 128: 128-row chunks only; 256: 128, 192 or 256 by ``kind``'s
    :data:`WEIGHT_STREAM_CHUNK_COSTS`, which ``widest`` 256 needs). Host values only: no
    synchronisation."""
    check_int("num_routes", num_routes, minimum=0)
    check_int("num_experts", num_experts, minimum=1)
    if widest not in (64, 128, 256):
        raise ValueError(f"widest: expected 64, 128 or 256 rows, got {widest!r}")
    if widest == 256 and kind not in WEIGHT_STREAM_CHUNK_COSTS:
        raise ValueError(
            f"kind: the widest chunk 256 needs one of {sorted(WEIGHT_STREAM_CHUNK_COSTS)}, "
            f"got {kind!r}"
        )
    rows_per_expert = num_routes / num_experts
    if rows_per_expert <= WEIGHT_STREAM_SMALL_CHUNK_MAX_ROWS:
        return 32
    if widest == 64 or rows_per_expert <= WEIGHT_STREAM_NARROW_MAX_ROWS:
        return 64
    if widest == 128:
        return 128
    costs = WEIGHT_STREAM_CHUNK_COSTS[kind]

    def cost(chunk: int) -> float:
        return math.ceil(rows_per_expert / chunk) * costs[chunk]

    return min((128, 192, 256), key=cost)  # the narrowest of equal costs
