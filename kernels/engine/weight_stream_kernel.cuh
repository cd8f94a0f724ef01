// The weight-streaming GEMMs (an MXFP4 base, few pool rows per expert): the swapped
// form of the engine's forward kinds, where the weights are the wgmma's A operand,
// decoded from their codes straight into the A-fragment registers (fragment_decode.cuh),
// and a chunk of an expert's pool rows is its N (TOKENS = 32 or 64; also 128, and for
// GEMM1 and GEMM2 192 and 256: the wide form, chunks from each segment's start,
// StreamConfig::kWide; 128-row chunks decode and multiply a step's two m64 tiles one at a
// time, 192- and 256-row chunks hold one m64 weight tile per consumer warpgroup). No decoded tile
// passes through shared memory, and every consumer warp decodes: the decode's integer work, which
// bounds an MXFP4 GEMM when each weight meets few rows, spreads over all four schedulers. Four
// kinds (StreamKind):
//  - Gated (GEMM1): a tile is 128 h columns, the gate rows and the up rows of w13 as the
//    two halves of each step's codes; K side steps (b1, then b3, as given) before the
//    base; the gated activation;
//  - Store (GEMM2): a tile is 256 output columns of w2, two 128-row halves; extra tiles
//    over the a2 shrink's columns (a2 as given); a plain store;
//  - StoreMN (dgrad1): the weights as stored, [K][N / 2] codes, read transposed: a tile is
//    256 output columns (128 per consumer, its two m64 tiles on the even and odd bytes:
//    decode_column_pairs), 64 stored rows a step; extra tiles over the two K-major blocks
//    (b1's columns over dg, then b3's over du, as given); a plain store;
//  - ActivationBackward (dgrad2): w2 as stored, read transposed as StoreMN does; the a2
//    side's K steps first (a2 as given, its rows boxed in the transposed column order);
//    the activation backward, with the router dot summed in the engine's order.
//
// Warp roles (384 threads):
//  - producer (warpgroup 0): one thread issues the TMA loads into a ring stage, per base
//    step the step's codes of the tile's two halves ([2][128][32] bytes) and the chunk's
//    [TOKENS][64] pool tile, per segment step (GEMM1's side, GEMM2's extra) one [64][64]
//    BF16 box of the adapter factor per consumer warpgroup and the pool tile; all 128
//    threads write each base step's scale words (the tile's 256 rows' factors) into
//    the stage, from loads issued a few steps ahead;
//  - consumers (warpgroups 1 and 2, 64 rows of each half): per base step, read their
//    rows' codes and scale words, decode both halves' fragments into one of two register
//    buffers while the previous step's MMAs run, then issue the step's MMAs (register A)
//    as one batch (128-row chunks: each tile decoded into its own buffer and its MMAs
//    committed as a batch of their own, while the other tile's run); segment
//    steps are shared-memory wgmma (the factor read MN-major); then the epilogue from
//    registers.
// Contract: `full` completes when the stage's TMA bytes landed and every producer thread
// arrived after writing its words; `empty` when every consumer thread arrived after the
// MMAs that read the stage retired (pipeline.cuh). The producer and the consumers walk
// the same tiles and steps.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "activation_backward_math.cuh"
#include "activation_math.cuh"
#include "engine_params.h"
#include "fragment_decode.cuh"
#include "pipeline.cuh"
#include "weight_stream_params.h"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

// ---- schedule: every base tile (TOKENS-row pool chunk, column block; column blocks
// fastest), then the extra tiles (Store: its extra blocks per chunk). The persistent CTAs
// take tiles round-robin, so the extra tiles (segment steps only, no decode, cheaper than
// a base tile) land first on the CTAs with one base tile fewer. ----
struct StreamTile {
  int expert;
  int row0;    // first pool row of the chunk
  int rows;    // the chunk's data rows (0: padding only, written as zeros, nothing loaded)
  int span;    // the chunk's rows in its segment, the rows written (TOKENS but at a wide
               // chunk's segment end; rows past it are the next expert's)
  int n0;      // first output column (an extra tile: the extra columns' first)
  bool extra;  // Store: the tile of the extra columns (segment steps only)
};

template <int Tokens, int Columns>
struct StreamTiles {
  // Wide chunks start at each segment's start: segments are padded to BLOCK_M only.
  static constexpr bool kFromSegmentStarts = stream_chunks_from_segment_starts(Tokens);
  const WeightStreamParams& p;
  int rows_used, chunks;

  __device__ __forceinline__ explicit StreamTiles(const WeightStreamParams& params)
      : p(params),
        rows_used(
            min(max(__ldg(params.expert_pool_offsets + params.num_experts), 0), params.pool_rows)),
        chunks(kFromSegmentStarts ? segment_chunks_in_use() : rows_used / Tokens) {}

  __device__ __forceinline__ int blocks() const { return p.n_base_blocks + p.n_extra_blocks; }
  __device__ __forceinline__ int num_tiles() const { return chunks * blocks(); }

  __device__ __forceinline__ int start(int e) const {
    return min(max(__ldg(p.expert_pool_offsets + e), 0), rows_used);
  }
  __device__ __forceinline__ int end(int e) const { return max(start(e + 1), start(e)); }
  __device__ __forceinline__ int chunks_of(int e) const {
    return e < p.num_experts ? (end(e) - start(e) + Tokens - 1) / Tokens : 0;
  }

  // Wide chunks: the experts' chunk counts summed a warp at a time (32 experts a round).
  // Every lane of the warp calls it and gets the same count.
  __device__ __forceinline__ int segment_chunks_in_use() const {
    const int lane = threadIdx.x % 32;
    int total = 0;
    for (int e0 = 0; e0 < p.num_experts; e0 += 32)
      total += static_cast<int>(__reduce_add_sync(0xffffffffu, chunks_of(e0 + lane)));
    return total;
  }

  // Wide chunks: chunk c's expert (the first whose running chunk count passes c) and first
  // row, from an inclusive scan of 32 experts' counts a round. Warp-uniform.
  __device__ __forceinline__ void locate(int c, int& expert, int& row0) const {
    const int lane = threadIdx.x % 32;
    int before = 0;  // the chunks of the rounds before
    for (int e0 = 0; e0 < p.num_experts; e0 += 32) {
      const int own = chunks_of(e0 + lane);
      int running = own;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, running, d);
        if (lane >= d) running += v;
      }
      const uint32_t past = __ballot_sync(0xffffffffu, before + running > c);
      if (past != 0u) {
        const int l = __ffs(static_cast<int>(past)) - 1;
        expert = e0 + l;
        row0 = start(expert) + (c - before - __shfl_sync(0xffffffffu, running - own, l)) * Tokens;
        return;
      }
      before += __shfl_sync(0xffffffffu, running, 31);
    }
    expert = p.num_experts - 1;  // not reached for c < chunks
    row0 = rows_used;
  }

  __device__ __forceinline__ StreamTile tile(int t) const {
    const int base_tiles = chunks * p.n_base_blocks;
    StreamTile info;
    info.extra = t >= base_tiles;
    int chunk, block;
    if (!info.extra) {
      chunk = t / p.n_base_blocks;
      block = t - chunk * p.n_base_blocks;
    } else if constexpr (kFromSegmentStarts) {
      chunk = (t - base_tiles) / p.n_extra_blocks;
      block = p.n_base_blocks + (t - base_tiles - chunk * p.n_extra_blocks);
    } else {  // one extra block
      chunk = t - base_tiles;
      block = p.n_base_blocks;
    }
    info.n0 = block * Columns;
    if constexpr (kFromSegmentStarts) {
      locate(chunk, info.expert, info.row0);
    } else {
      info.row0 = chunk * Tokens;
      // The expert whose segment holds the chunk: the last e starting at or before it.
      int lo = 0, hi = p.num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start(mid) <= info.row0)
          lo = mid;
        else
          hi = mid - 1;
      }
      info.expert = lo;
    }
    const int first = start(info.expert), end_row = end(info.expert);
    info.span = kFromSegmentStarts ? min(end_row - info.row0, Tokens) : Tokens;
    const int data_end = min(first + max(__ldg(p.expert_counts + info.expert), 0), end_row);
    info.rows = min(max(data_end - info.row0, 0), Tokens);
    return info;
  }
};

// The wide form's MMA widths (StreamConfig::MmaWidths): a 128-row chunk's data rows
// rounded up to 64 or 128; a 192- or 256-row chunk always as wide as the chunk. The
// tile's loop is instantiated per width, and ptxas serialized the wgmma of the 256-row
// kernels with more than one width (also 192 and 256, and 192 as a 128- and a 64-wide
// MMA), and of the 128-row kernels with widths 32 and 96, for registers: a chunk of 192
// rows is its own kernel (docs/ENGINE.md, "192-row chunks").
using StreamWideWidths128 = std::integer_sequence<int, 64, 128>;
using StreamWideWidths192 = std::integer_sequence<int, 192>;
using StreamWideWidths256 = std::integer_sequence<int, 256>;

// The width for `rows` data rows: the first of Widths that holds them, else the last.
template <int... Widths>
__host__ __device__ constexpr int stream_wide_width(int rows,
                                                    std::integer_sequence<int, Widths...>) {
  constexpr int widths[] = {Widths...};
  for (int width : widths)
    if (rows <= width) return width;
  return widths[sizeof...(Widths) - 1];
}
static_assert(stream_wide_width(1, StreamWideWidths128{}) == 64 &&
                  stream_wide_width(65, StreamWideWidths128{}) == 128 &&
                  stream_wide_width(1, StreamWideWidths192{}) == 192 &&
                  stream_wide_width(1, StreamWideWidths256{}) == 256,
              "a chunk's rows round up to the next width");

template <StreamKind kKind, int Tokens>
struct StreamConfig {
  static_assert(Tokens == 32 || Tokens == 64 || Tokens == 128 || Tokens == 192 || Tokens == 256,
                "wgmma N of the chunk");
  static constexpr bool kGated = kKind == StreamKind::Gated;
  static constexpr bool kActivation = kKind == StreamKind::ActivationBackward;
  // The weights as stored ([K][N / 2] codes): transposed decode, K-major segment factors.
  static constexpr bool kTransposed = kKind == StreamKind::StoreMN || kActivation;
  // Segment steps on every tile (GEMM1's side, dgrad2's a2), not on extra tiles only.
  static constexpr bool kSegmentEveryTile = kGated || kActivation;
  static constexpr int kTokensPerChunk = Tokens;
  // The wide form (chunks of 128, 192 or 256 rows, from each segment's start): each weight is
  // decoded once per wide chunk (docs/ENGINE.md, "The wide form"). A chunk's MMAs are as
  // wide as its data rows rounded up to one of MmaWidths.
  static constexpr bool kWide = stream_chunks_from_segment_starts(Tokens);
  using MmaWidths = std::conditional_t<
      Tokens == 256, StreamWideWidths256,
      std::conditional_t<Tokens == 192, StreamWideWidths192, StreamWideWidths128>>;
  // 128-row chunks keep the narrow form's two m64 tiles per consumer warpgroup (2 x 64
  // accumulators), a step's tiles decoded and multiplied one at a time so that one
  // fragment buffer per tile fits beside them. 192- and 256-row chunks (GEMM1 and GEMM2
  // only) hold one m64 tile per consumer warpgroup, so their 96 or 128 accumulators and
  // two fragment buffers (32) fit; a thread's rows r and r + 8 are a gated tile's gate and
  // up rows of one h column.
  static_assert(!(kWide && kTransposed) || Tokens == 128,
                "the transposed kinds' wide chunks are 128 rows");
  static constexpr bool kOneTile = kWide && Tokens >= 192;
  static constexpr bool kTilesOneAtATime = kWide && !kOneTile;
  static constexpr int kHalves = kOneTile ? 1 : 2;  // m64 tiles per consumer
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  // Output columns per tile: a gated tile's two halves are the gate and up rows of the
  // same 128 h columns (one tile: a warpgroup's rows are 32 h columns' gate and up rows);
  // a store tile's are 256 columns (one tile: 128).
  static constexpr int kColumns = (kGated ? 1 : 2) * 32 * kHalves * kConsumers;
  using Schedule = StreamTiles<Tokens, kColumns>;
  // A base step's codes: Gated and Store: two halves of 128 rows of 32 bytes (one tile:
  // the gate and up rows of 64 h columns, or 128 rows); StoreMN: 64 rows of 128 bytes.
  static constexpr int kCodeBytes = kHalves * 128 * 32;
  // Segment steps' boxes: one per consumer warpgroup (one-tile Gated: one [64 K][64 h]
  // box of b1 or b3, both warpgroups' rows).
  static constexpr int kSideBytes = (kOneTile && kGated ? 1 : kConsumers) * kBoxBytes;
  static constexpr int kABytes = kSideBytes > kCodeBytes ? kSideBytes : kCodeBytes;
  static constexpr int kBBytes = Tokens * kRowBytes;
  // A base step's scale words (mxfp4::scale_word), one per row of the tile's 256 (one
  // tile: 128): 16 bytes per consumer quad (its four lines; one tile: 8, two lines), so a
  // consumer thread reads its own with one load (the dgrads: 32 bytes per quad,
  // StreamScaleColumns). Room for 256 keeps the stages 1024-byte aligned.
  static constexpr int kScaleWordBytes = 256 * 4;
  static constexpr int kScaleWordOffset = kABytes + kBBytes;  // in a stage
  static constexpr int kStageBytes = kScaleWordOffset + kScaleWordBytes;
  static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned (128-byte swizzle)");
  static constexpr int kSmemLimit = 232448;
  static constexpr int kBarrierBytes = 256;
  // dgrad2: the router dot's 32 vector sums of each chunk row, two buffers (by tile
  // parity), after the stages.
  static constexpr int kDotBytes = kActivation ? 2 * Tokens * 32 * 4 : 0;
  static constexpr int kStagesFit = (kSmemLimit - 1024 - kBarrierBytes - kDotBytes) / kStageBytes;
  // Six stages, not as many as fit: shared memory takes its room from L1 (one 256 KB
  // array per SM), and deeper rings measured slower (docs/ENGINE.md, "The ring's depth");
  // the wide 256-row chunks fit four (Store) or five (Gated), and three stages measured
  // no faster there; the 192-row chunks fit five (Store) or six (Gated).
  static constexpr int kStages = kStagesFit > 6 ? 6 : kStagesFit;
  static_assert(kStages >= 3, "a ring deep enough to overlap the loads");
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kDotBytes + kBarrierBytes;
  // The transposed decode's multiplies before the step's scale check (64-row chunks) or
  // inside its fast branch (32-row chunks): each measured faster where it is used
  // (docs/ENGINE.md, "The transposed decode's multiplies and the scale check").
  static constexpr bool kValuesBeforeCheck = kTransposed && Tokens == 64;
  // Base steps whose scale loads are in flight in the producer warpgroup (their loads
  // issued this many steps before the words are written).
  static constexpr int kScaleStepsAhead = 4;
  // setmaxnreg: the producer's warpgroup gives its registers to the two consumers.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 3 * 168, "the launch's registers");
};

template <class C>
struct StreamStorage {
  uint8_t* stages;
  uint8_t* dots;  // dgrad2's router-dot sums (C::kDotBytes)
  uint64_t* full;
  uint64_t* empty;
  __device__ __forceinline__ explicit StreamStorage(uint8_t* raw) {
    stages =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    dots = stages + C::kStages * C::kStageBytes;
    full = reinterpret_cast<uint64_t*>(dots + C::kDotBytes);
    empty = full + C::kStages;
  }
  __device__ __forceinline__ uint8_t* a(int s) const { return stages + s * C::kStageBytes; }
  __device__ __forceinline__ uint8_t* b(int s) const { return a(s) + C::kABytes; }
  __device__ __forceinline__ uint8_t* scale_words(int s) const {
    return a(s) + C::kScaleWordOffset;
  }
};

// The scale words' place in a stage's area: consumer quad `slot` ((consumer x 4 + warp)
// x 8 + lane / 4) reads 16 bytes, the words of its lines 0-3 (rows r, r + 8 of the first
// half, then of the second; r = 64 consumer + 16 warp + lane / 4 of each half's 128).
__host__ __device__ constexpr int stream_scale_slot_row(int slot) {
  return 64 * (slot / 32) + 16 * ((slot / 8) % 4) + slot % 8;
}

// A role's position in the ring as shared addresses: the current stage, its full barrier
// (its empty barrier kStages barriers on) and the phase, all advanced in registers, so a
// step converts no generic pointer and reads no parameter (the producer's TMA issue, one
// thread, takes the stage's generic pointers by index).
template <class C>
struct StreamRing {
  uint32_t stage_address, full, phase = 0;
  int stage = 0;
  __device__ __forceinline__ explicit StreamRing(const StreamStorage<C>& smem)
      : stage_address(shared_address(smem.stages)), full(shared_address(smem.full)) {}
  __device__ __forceinline__ uint32_t a() const { return stage_address; }
  __device__ __forceinline__ uint32_t b() const { return stage_address + C::kABytes; }
  __device__ __forceinline__ uint32_t scale_words() const {
    return stage_address + C::kScaleWordOffset;
  }
  __device__ __forceinline__ uint32_t empty() const { return full + 8 * C::kStages; }
  __device__ __forceinline__ void advance() {
    stage_address += C::kStageBytes;
    full += 8;
    if (++stage == C::kStages) {
      stage = 0;
      stage_address -= C::kStages * C::kStageBytes;
      full -= 8 * C::kStages;
      phase ^= 1u;
    }
  }
};

// ---- producer warpgroup ----
// Thread i of the producer warpgroup writes, per base step, the scale words of two lines
// (scale_word): consumer quad i / 2's lines 2h and 2h + 1 (h = i % 2: rows r and r + 8 of
// half h), 8 bytes of the stage's scale area. It loads their bytes kScaleStepsAhead base
// steps before, so the loads' latency passes while the ring fills; the consumers then
// read ready factors with one shared load and no address math of their own.
struct StreamScaleRows {
  static constexpr int kWords = 2;
  const uint16_t* cursor;  // row r's pair of the next base step to load
  uint32_t eight_rows;     // pairs from row r to row r + 8
  uint32_t store_offset;   // this thread's 8 bytes in a stage's scale area

  __device__ __forceinline__ StreamScaleRows(const WeightStreamParams& p, const StreamTile& tile,
                                             int thread) {
    const int slot = thread / 2, half = thread % 2;
    const uint32_t pairs_per_row = static_cast<uint32_t>(p.k_base / 64);
    const int64_t w_row = static_cast<int64_t>(tile.expert) * p.weight_rows + tile.n0 +
                          stream_scale_slot_row(slot) + half * p.half_rows;
    cursor = reinterpret_cast<const uint16_t*>(p.scales) + w_row * pairs_per_row;
    eight_rows = 8 * pairs_per_row;
    store_offset = static_cast<uint32_t>(16 * slot + 8 * half);
  }

  // The two rows' pairs of the cursor's step when `load`; the cursor moves on either way.
  __device__ __forceinline__ void load_next(bool load, uint32_t (&raw)[2]) {
    if (load) {
      raw[0] = static_cast<uint32_t>(__ldg(cursor));
      raw[1] = static_cast<uint32_t>(__ldg(cursor + eight_rows));
    }
    ++cursor;
  }

  // Row r's bytes of 16 steps share a 32-byte sector: the loads hit L1.
  static constexpr int kPrefetchSteps = 0;
  __device__ __forceinline__ void prefetch(int, bool, int) const {}

  // The step's words of the two lines (scale_word), then into a stage's scale area.
  __device__ __forceinline__ static void words(const uint32_t (&raw)[2], uint32_t (&out)[2]) {
    out[0] = mxfp4::scale_word(raw[0]);
    out[1] = mxfp4::scale_word(raw[1]);
  }
  __device__ __forceinline__ void store(uint32_t scale_area, const uint32_t (&words)[2]) const {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(scale_area + store_offset), "r"(words[0]),
                 "r"(words[1])
                 : "memory");
  }
};

// One tile (192- and 256-row chunks): thread i of the producer warpgroup writes, per base step,
// the scale word of one line, consumer quad i / 2's line i % 2: row r (line 0) or r + 8
// of its warpgroup's m64 tile, Gated the gate and the up row of h column 32 c + 8 warp +
// lane / 4 (the up rows I on). 4 bytes of the stage's scale area, from one 16-bit load.
template <bool kGated>
struct StreamScaleLines {
  static constexpr int kWords = 1;
  const uint16_t* cursor;  // the line's pair of the next base step to load
  uint32_t store_offset;   // this thread's word in a stage's scale area

  __device__ __forceinline__ StreamScaleLines(const WeightStreamParams& p, const StreamTile& tile,
                                              int thread) {
    const int slot = thread / 2, line = thread % 2;
    const int row = kGated ? 32 * (slot / 32) + 8 * (slot / 8 % 4) + slot % 8 + line * p.half_rows
                           : 64 * (slot / 32) + 16 * (slot / 8 % 4) + slot % 8 + 8 * line;
    const int64_t w_row = static_cast<int64_t>(tile.expert) * p.weight_rows + tile.n0 + row;
    cursor = reinterpret_cast<const uint16_t*>(p.scales) + w_row * (p.k_base / 64);
    store_offset = static_cast<uint32_t>(8 * slot + 4 * line);
  }

  __device__ __forceinline__ void load_next(bool load, uint32_t (&raw)[1]) {
    if (load) raw[0] = static_cast<uint32_t>(__ldg(cursor));
    ++cursor;
  }
  static constexpr int kPrefetchSteps = 0;
  __device__ __forceinline__ void prefetch(int, bool, int) const {}
  __device__ __forceinline__ static void words(const uint32_t (&raw)[1], uint32_t (&out)[1]) {
    out[0] = mxfp4::scale_word(raw[0]);
  }
  __device__ __forceinline__ void store(uint32_t scale_area, const uint32_t (&words)[1]) const {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(scale_area + store_offset), "r"(words[0])
                 : "memory");
  }
};

// StoreMN: a consumer thread (consumer c, warp w, lane quad t = lane % 4) reads, per base
// step, the scale words of its column block (n0 / 32 + 4 c + w) for the eight pairs of
// stored rows (16 k16 + 2 t + 8 j, + 1) it decodes: 32 bytes at slot (4 c + w) 4 + t,
// word 2 k16 + j. Thread i of the producer warpgroup writes two of them: pair (k16, j)
// = ((i / 2) % 4, i % 2) for quad t = (i / 8) % 4 of warps w = 2 ((i / 32) % 2) and w +
// 1 of consumer i / 64, from one 16-bit load of each of the two rows (both blocks).
struct StreamScaleColumns {
  static constexpr int kWords = 2;
  const uint16_t* cursor;  // row n's two blocks of the next base step to load
  uint32_t next_row;       // from row n to row n + 1 (16-bit units)
  uint32_t store_offset;   // the first word's place in a stage's scale area (the second's
                           // is 128 bytes on: the next warp's slot)

  __device__ __forceinline__ StreamScaleColumns(const WeightStreamParams& p, const StreamTile& tile,
                                                int thread) {
    const int j = thread % 2, k16 = thread / 2 % 4, quad = thread / 8 % 4,
              warp = 2 * (thread / 32 % 2), consumer = thread / 64;
    const int64_t blocks_per_row = 8 * static_cast<int64_t>(p.n_base_blocks);  // N / 32
    const int64_t row =
        static_cast<int64_t>(tile.expert) * p.weight_rows + 16 * k16 + 2 * quad + 8 * j;
    cursor = reinterpret_cast<const uint16_t*>(p.scales + row * blocks_per_row + tile.n0 / 32 +
                                               4 * consumer + warp);
    next_row = static_cast<uint32_t>(blocks_per_row / 2);
    store_offset =
        static_cast<uint32_t>(32 * ((4 * consumer + warp) * 4 + quad) + 4 * (2 * k16 + j));
  }

  __device__ __forceinline__ void load_next(bool load, uint32_t (&raw)[2]) {
    if (load) {
      raw[0] = static_cast<uint32_t>(__ldg(cursor));
      raw[1] = static_cast<uint32_t>(__ldg(cursor + next_row));
    }
    cursor += 64 * next_row;  // 64 stored rows a step
  }

  // Every step's rows are new sectors (64 rows on), most of them not yet in L2: one thread
  // per row pair (the first warp's: consumer 0's, all 64 rows) asks L2 for the rows of the
  // step `steps_on` steps past the cursor's, kPrefetchSteps steps before their loads, so
  // the loads meet L2's latency, not DRAM's.
  static constexpr int kPrefetchSteps = 16;
  __device__ __forceinline__ void prefetch(int steps_on, bool valid, int thread) const {
    if (valid && thread < 32) {
      const uint16_t* at = cursor + steps_on * 64 * next_row;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(at + next_row));
    }
  }

  // The step's two words: rows n and n + 1 of the first block, then of the second (each
  // row's 16-bit load holds the two blocks' bytes; its bytes 2 and 3 are zero); then into
  // a stage's scale area.
  __device__ __forceinline__ static void words(const uint32_t (&raw)[2], uint32_t (&out)[2]) {
    out[0] = mxfp4::scale_word(mxfp4::prmt(raw[0], raw[1], 0x3240u));
    out[1] = mxfp4::scale_word(mxfp4::prmt(raw[0], raw[1], 0x3251u));
  }
  __device__ __forceinline__ void store(uint32_t scale_area, const uint32_t (&words)[2]) const {
    const uint32_t at = scale_area + store_offset;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(words[0]) : "memory");
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(at + 128), "r"(words[1]) : "memory");
  }
};

template <class C>
__device__ __forceinline__ void stream_produce(const WeightStreamParams& p,
                                               const StreamStorage<C>& smem, int thread) {
  constexpr int kAhead = C::kScaleStepsAhead;
  const typename C::Schedule schedule(p);
  StreamRing<C> ring(smem);
  const bool issues_copies = thread == 0;
  for (int t = blockIdx.x; t < schedule.num_tiles(); t += gridDim.x) {
    const StreamTile tile = schedule.tile(t);
    if (tile.rows == 0) continue;
    const int segment_steps = C::kSegmentEveryTile || tile.extra ? p.segment_steps : 0;
    const int base_steps = C::kSegmentEveryTile || !tile.extra ? p.base_steps : 0;
    // The chunk's pool tile: all of it, or (wide) the rows its MMAs read (its data rows
    // rounded up to their width) in boxes of 64.
    const int pool_boxes =
        C::kWide ? stream_wide_width(tile.rows, typename C::MmaWidths{}) / kStreamWideRowsPerBox
                 : 1;
    const uint32_t pool_bytes =
        C::kWide ? pool_boxes * kStreamWideRowsPerBox * kRowBytes : C::kBBytes;
    auto load_pool = [&](uint64_t* bar, int column) {
      if constexpr (C::kWide) {
        for (int box = 0; box < pool_boxes; ++box)
          cute::SM90_TMA_LOAD_2D::copy(&p.pool, bar, kCacheHint,
                                       smem.b(ring.stage) + box * kStreamWideRowsPerBox * kRowBytes,
                                       column, tile.row0 + box * kStreamWideRowsPerBox);
      } else {
        cute::SM90_TMA_LOAD_2D::copy(&p.pool, bar, kCacheHint, smem.b(ring.stage), column,
                                     tile.row0);
      }
    };
    for (int step = 0; step < segment_steps; ++step) {
      wait_barrier(ring.empty(), ring.phase ^ 1u);
      uint64_t* bar = &smem.full[ring.stage];
      if (issues_copies) {
        // Gated: b1 (then b3) rows 64 j.. at h columns n0..; Store: a2 rows 64 j.. (K)
        // at extra columns 128 half..; StoreMN: lo (then hi) columns 64 j.. (K) at rows
        // 64 wg..; ActivationBackward: a2 columns 64 j.. (K) at the rows of tile `half`
        // of consumer wg's 128 I columns; against the pool's side columns or its K.
        TransactionBarrier::arrive_and_expect_tx(bar, C::kSideBytes + pool_bytes);
        uint8_t* a = smem.a(ring.stage);
        const int half = step >= p.segment_half ? 1 : 0;
        const int j = step - half * p.segment_half;
        const CUtensorMap* map =
            (C::kGated || C::kTransposed) && half ? &p.segment_hi : &p.segment_lo;
        // Store: the extra block's columns (n0 - N on), a half's 128 apart.
        const int column0 = C::kGated ? tile.n0 : tile.n0 - p.weight_rows + 128 * half;
        const int pool_column = C::kGated        ? p.k_base + half * p.side_rank + kBlockK * j
                                : C::kActivation ? p.k_base + kBlockK * j
                                : C::kTransposed ? half * p.segment_k_hi + kBlockK * j
                                                 : kBlockK * j;
#pragma unroll
        for (int wg = 0; wg < C::kSideBytes / kBoxBytes; ++wg) {
          if constexpr (C::kActivation)  // the 5-D view's row pairs: expert, tile, consumer
            cute::SM90_TMA_LOAD_5D::copy(map, bar, kCacheHint, a + wg * kBoxBytes, kBlockK * j, 0,
                                         0, 0,
                                         (tile.expert * p.out_columns + tile.n0 + 128 * wg) / 2);
          else if constexpr (C::kTransposed)
            cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint, a + wg * kBoxBytes, kBlockK * j,
                                         64 * wg, tile.expert);
          else
            cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint, a + wg * kBoxBytes,
                                         column0 + 64 * wg, kBlockK * j, tile.expert);
        }
        load_pool(bar, pool_column);
      }
      arrive_barrier(ring.full);
      ring.advance();
    }
    using ScaleLoads = std::conditional_t<
        C::kTransposed, StreamScaleColumns,
        std::conditional_t<C::kOneTile, StreamScaleLines<C::kGated>, StreamScaleRows>>;
    constexpr int kWords = ScaleLoads::kWords;
    ScaleLoads rows(p, tile, thread);
    uint32_t pending[kAhead][kWords];  // the scale pairs of the next kAhead base steps
#pragma unroll
    for (int d = 0; d < kAhead; ++d) rows.load_next(d < base_steps, pending[d]);
    constexpr int kPrefetch = decltype(rows)::kPrefetchSteps;
    for (int d = 0; d < kPrefetch; ++d) rows.prefetch(d, kAhead + d < base_steps, thread);
    // A base step: its words from the pairs loaded kAhead steps before, formed before
    // those registers take the loads of kAhead steps on (formed after, the loads went to
    // temporaries copied back within the step, so every step waited for the loads it had
    // just issued), then the stage's copies and words.
    auto base_step = [&](int k_step, uint32_t (&pairs)[kWords]) {
      uint32_t words[kWords];
      rows.words(pairs, words);
      rows.load_next(k_step + kAhead < base_steps, pairs);
      rows.prefetch(kPrefetch - 1, k_step + kAhead + kPrefetch < base_steps, thread);
      wait_barrier(ring.empty(), ring.phase ^ 1u);
      uint64_t* bar = &smem.full[ring.stage];
      if (issues_copies) {
        TransactionBarrier::arrive_and_expect_tx(bar, C::kCodeBytes + pool_bytes);
        uint8_t* a = smem.a(ring.stage);
        if constexpr (C::kGated)
          cute::SM90_TMA_LOAD_4D::copy(&p.codes, bar, kCacheHint, a, k_step * (kBlockK / 2),
                                       tile.n0, 0, tile.expert);
        else if constexpr (C::kTransposed)
          cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, tile.n0 / 2, k_step * kBlockK,
                                       tile.expert);
        else
          cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, k_step * (kBlockK / 2),
                                       tile.n0, tile.expert);
        load_pool(bar, k_step * kBlockK);
      }
      rows.store(ring.scale_words(), words);
      arrive_barrier(ring.full);  // release: the words are visible to the consumers' acquire
      ring.advance();
    };
    for (int k_step = 0; k_step < base_steps; k_step += kAhead) {
#pragma unroll
      for (int d = 0; d < kAhead; ++d)
        if (k_step + d < base_steps) base_step(k_step + d, pending[d]);
    }
  }
}

// ---- the MMAs: m64 x TOKENS x k16 into TOKENS / 2 accumulators per thread ----
using Fragment = mxfp4::StepFragment;  // one weight's A fragment of a base step

// kSideMN: the segment steps' A (the adapter factor's box) is MN-major (Gated, Store) or
// K-major (StoreMN).
template <int N, bool kSideMN>
struct StreamMmaOps;
#define MEGAMOE_STREAM_MMA_OPS(N)                                                              \
  template <bool kSideMN>                                                                      \
  struct StreamMmaOps<N, kSideMN> {                                                            \
    using Side =                                                                               \
        cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<kSideMN ? cute::SM90::GMMA::Major::MN \
                                                                 : cute::SM90::GMMA::Major::K, \
                                                         cute::SM90::GMMA::Major::K>;          \
    using Registers =                                                                          \
        cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,           \
                                                         cute::SM90::GMMA::Major::K>;          \
  };
MEGAMOE_STREAM_MMA_OPS(32)
MEGAMOE_STREAM_MMA_OPS(64)
MEGAMOE_STREAM_MMA_OPS(128)
MEGAMOE_STREAM_MMA_OPS(192)
MEGAMOE_STREAM_MMA_OPS(256)
#undef MEGAMOE_STREAM_MMA_OPS

template <int N, bool kSideMN>
struct StreamMma {
  using Ops = StreamMmaOps<N, kSideMN>;
  template <size_t... I>
  __device__ __forceinline__ static void side(uint64_t a, uint64_t b, float* d,
                                              std::index_sequence<I...>) {
    Ops::Side::fma(a, b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
  }
  template <size_t... I>
  __device__ __forceinline__ static void registers(const uint32_t (&a)[4], uint64_t b, float* d,
                                                   std::index_sequence<I...>) {
    Ops::Registers::fma(a[0], a[1], a[2], a[3], b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
  }
  // A segment step: the factor's box against the pool tile.
  __device__ __forceinline__ static void side_step(uint64_t desc_a, uint64_t desc_b, float* d) {
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      side(advance_k16_low_word<kSideMN>(desc_a, k16), advance_k16_low_word<false>(desc_b, k16), d,
           std::make_index_sequence<N / 2>{});
  }
  // Half a base step: one weight's decoded fragment against the pool tile.
  __device__ __forceinline__ static void base_half_step(const Fragment& a, uint64_t desc_b,
                                                        float* acc) {
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      registers(a[k16], advance_k16_low_word<false>(desc_b, k16), acc,
                std::make_index_sequence<N / 2>{});
  }
};

// `op` gets the width for `rows` data rows (stream_wide_width, at most Max: the chunk)
// as an integral constant. The width is uniform over the warpgroup and fixed for a tile.
template <int Max, int Width, int... Wider, class Op>
__device__ __forceinline__ void with_mma_width(int rows,
                                               std::integer_sequence<int, Width, Wider...>,
                                               Op&& op) {
  if constexpr (sizeof...(Wider) == 0 || Width >= Max) {
    op(std::integral_constant<int, Width>{});
  } else if (rows <= Width) {
    op(std::integral_constant<int, Width>{});
  } else {
    with_mma_width<Max>(rows, std::integer_sequence<int, Wider...>{}, std::forward<Op>(op));
  }
}

// ---- the consumer's view of its rows: codes, scales and the decode ----
// A thread holds A rows r and r + 8 (r = 16 warp + lane / 4) of its warpgroup's 64, in
// each half of the tile (Gated: the gate and the up weight): four weight rows ("lines":
// r, r + 8 of the first half, then of the second). Per base step each line's 32 code
// bytes are eight words; word 2j / 2j + 1 feed k16 step j's a0|a1 / a2|a3, and words
// 0-3 / 4-7 share scale bytes 0 / 1 (one 16-bit pair per line and step).

// A consumer thread's places in a stage from its block thread index (consumer c's
// threads are 128 (c + 1) on): its row r's codes, r = 64 c + 16 warp + lane / 4 of each
// half's 128, and its quad's 16 bytes of scale words (slot (4 c + warp) 8 + lane / 4).
// Written in few instructions, since ptxas recomputes them where registers are short;
// checked against the definitions at compile time.
__host__ __device__ constexpr uint32_t stream_code_offset(uint32_t tid) {
  return 16 * (tid & ~31u) + 8 * (tid & 28u) - 2048u;
}
__host__ __device__ constexpr uint32_t stream_scale_offset(uint32_t tid) {
  return 4 * (tid & ~3u) - 512u;
}
constexpr bool stream_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, quad = tid % 32 / 4;
    const uint32_t row = 64 * consumer + 16 * warp + quad, slot = (4 * consumer + warp) * 8 + quad;
    if (stream_code_offset(tid) != 32 * row || stream_scale_offset(tid) != 16 * slot ||
        stream_scale_slot_row(static_cast<int>(slot)) != static_cast<int>(row))
      return false;
  }
  return true;
}
static_assert(stream_offsets_follow_the_layout(), "a consumer reads its own rows and words");

// A value ptxas must keep in a register: it cannot recompute what it cannot see.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// A line's 32 code bytes of a step (its eight words) from shared address `at`.
__device__ __forceinline__ void load_line_codes(uint32_t at, uint32_t (&words)[8]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
               : "r"(at));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[4]), "=r"(words[5]), "=r"(words[6]), "=r"(words[7])
               : "r"(at + 16));
}

// Two lines of a step (rows r and r + 8 of one m64 tile: their codes at shared address
// `first` and `apart` bytes on, their two scale words at `scale_words_at`) into the
// tile's fragment, under their own scale check. The loads first.
__device__ __forceinline__ void decode_line_pair(uint32_t first, uint32_t apart,
                                                 uint32_t scale_words_at, uint32_t selector,
                                                 Fragment (&fragment)[1]) {
  uint32_t scale_words[2];
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(scale_words[0]), "=r"(scale_words[1])
               : "r"(scale_words_at));
  uint32_t words[2][8];
#pragma unroll
  for (int line = 0; line < 2; ++line) load_line_codes(first + line * apart, words[line]);
  const mxfp4::StepScales<2> scales(scale_words);
  mxfp4::decode_rows<1>(words, scales, selector, fragment);
}

struct StreamLines {
  // Line l's codes are at code_offset + line_code_offset(l) in a stage's code area.
  __device__ __forceinline__ static constexpr uint32_t line_code_offset(int line) {
    return (line % 2 ? 8 * 32 : 0) + (line / 2 ? 128 * 32 : 0);
  }
  uint32_t code_offset;
  uint32_t scale_offset;  // the quad's 16 bytes in a stage's scale area
  uint32_t selector;

  __device__ __forceinline__ explicit StreamLines(uint32_t tid)
      : code_offset(opaque(stream_code_offset(tid))),
        scale_offset(opaque(stream_scale_offset(tid))),
        selector(opaque(mxfp4::fragment_selector(tid % 4))) {}

  // Decode a landed stage's codes of the four lines into both halves' fragments with
  // their scale words (the code area at shared address `code_area`, the scale words at
  // `scale_area`). Every load first: 32 independent pairs to interleave.
  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[2]) const {
    const uint32_t base = code_area + code_offset;
    uint32_t scale_words[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(scale_words[0]), "=r"(scale_words[1]), "=r"(scale_words[2]),
                   "=r"(scale_words[3])
                 : "r"(scale_area + scale_offset));
    uint32_t words[4][8];
#pragma unroll
    for (int line = 0; line < 4; ++line)
      load_line_codes(base + line_code_offset(line), words[line]);
    const mxfp4::StepScales<4> scales(scale_words);
    mxfp4::decode_rows<2>(words, scales, selector, fragments);
  }

  // 128-row chunks: one half's two lines (2 Half, 2 Half + 1) into its fragment, with
  // their own scale check; the same values as decode's.
  template <int Half>
  __device__ __forceinline__ void decode_half(uint32_t code_area, uint32_t scale_area,
                                              Fragment& fragment) const {
    const uint32_t base = code_area + code_offset + line_code_offset(2 * Half);
    decode_line_pair(base, line_code_offset(1), scale_area + scale_offset + 8 * Half, selector,
                     *reinterpret_cast<Fragment(*)[1]>(&fragment));
  }
};

// One tile (192- and 256-row chunks): a consumer thread's two lines are rows r and r + 8 (r = 16
// warp + lane / 4) of its warpgroup's m64 tile: Gated the gate and the up row of h column
// 32 c + 8 warp + lane / 4 (the code area is the gate rows' [64][32] bytes, then the up
// rows'); Store rows 64 c + r and + 8 of the tile's 128 ([128][32]). Its quad's scale
// words are 8 bytes at slot (4 c + warp) 8 + lane / 4.
template <bool kGated>
__host__ __device__ constexpr uint32_t stream_line_pair_code_offset(uint32_t tid) {
  return kGated ? 8 * (tid & ~3u) - 1024u : stream_code_offset(tid);
}
__host__ __device__ constexpr uint32_t stream_line_pair_scale_offset(uint32_t tid) {
  return 2 * (tid & ~3u) - 256u;
}
template <bool kGated>
constexpr bool stream_line_pair_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, quad = tid % 32 / 4;
    const uint32_t row =
        kGated ? 32 * consumer + 8 * warp + quad : 64 * consumer + 16 * warp + quad;
    const uint32_t slot = (4 * consumer + warp) * 8 + quad;
    if (stream_line_pair_code_offset<kGated>(tid) != 32 * row ||
        stream_line_pair_scale_offset(tid) != 8 * slot)
      return false;
  }
  return true;
}
static_assert(stream_line_pair_offsets_follow_the_layout<true>() &&
                  stream_line_pair_offsets_follow_the_layout<false>(),
              "a one-tile consumer reads its own rows and words");

template <bool kGated>
struct StreamLinePair {
  static constexpr uint32_t kSecondLine = kGated ? 64 * 32 : 8 * 32;  // row r + 8's codes
  uint32_t code_offset;
  uint32_t scale_offset;
  uint32_t selector;

  __device__ __forceinline__ explicit StreamLinePair(uint32_t tid)
      : code_offset(opaque(stream_line_pair_code_offset<kGated>(tid))),
        scale_offset(opaque(stream_line_pair_scale_offset(tid))),
        selector(opaque(mxfp4::fragment_selector(tid % 4))) {}

  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[1]) const {
    const uint32_t base = code_area + code_offset;
    decode_line_pair(base, kSecondLine, scale_area + scale_offset, selector, fragments);
  }
};

// StoreMN: a consumer thread (consumer c, warp w, lane quad t = lane % 4, g = lane / 4)
// decodes the bytes 2q and 2q + 1 (q = 8 w + g) of its consumer's 64 in each of its 16
// stored rows of a step (16 k16 + 2 t + {0, 1, 8, 9}): output columns 4q .. 4q + 3 of the
// consumer's 128 (decode_column_pairs). The code area is [64 rows][128 bytes] under the
// 128-byte swizzle (16-byte unit u of row n at unit u ^ (n % 8)); a warp's bytes are unit
// 4 c + w of every row. Two ldmatrix.x4.trans read them: matrix m of load x is stored
// rows 32 x + 8 m .. + 7 of that unit, lane L gives row L % 8 of matrix L / 8, and thread
// (g, t) receives rows 2t and 2t + 1 at its 16-bit column g, the row pair 4 x + m of
// decode_column_pairs. One shared-memory instruction per 16 rows instead of one per row:
// the loads no longer fill the memory-input queue. A matrix's eight rows lie in eight
// different units, so a load has no bank conflict.
__host__ __device__ constexpr uint32_t stream_column_lane_offset(uint32_t tid) {
  return 128 * (tid % 32) + 16 * (((tid / 32 - 4) ^ tid) & 7);
}
constexpr bool stream_column_lane_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, lane = tid % 32;
    const uint32_t row = 8 * (lane / 8) + lane % 8, byte = 64 * consumer + 16 * warp;
    const uint32_t swizzled = 128 * row + 16 * ((byte / 16) ^ (row % 8));
    if (stream_column_lane_offset(tid) != swizzled) return false;
  }
  return true;
}
static_assert(stream_column_lane_offsets_follow_the_layout(), "a warp reads its own unit");

template <bool kValuesBeforeCheck>
struct StreamColumnPairs {
  uint32_t lane_offset;   // the row of the code area whose unit this lane points ldmatrix at
  uint32_t scale_offset;  // the thread's 32 bytes of scale words

  __device__ __forceinline__ explicit StreamColumnPairs(uint32_t tid)
      : lane_offset(opaque(stream_column_lane_offset(tid))),
        scale_offset(opaque(32 * ((tid / 32 - 4) * 4 + tid % 4))) {}

  // The thread's scale words and row pairs of a step.
  __device__ __forceinline__ void load(uint32_t code_area, uint32_t scale_area,
                                       uint32_t (&words)[8], uint32_t (&row_pairs)[8]) const {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                 : "r"(scale_area + scale_offset));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(words[4]), "=r"(words[5]), "=r"(words[6]), "=r"(words[7])
                 : "r"(scale_area + scale_offset + 16));
#pragma unroll
    for (int x = 0; x < 2; ++x)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(row_pairs[4 * x]), "=r"(row_pairs[4 * x + 1]), "=r"(row_pairs[4 * x + 2]),
                     "=r"(row_pairs[4 * x + 3])
                   : "r"(code_area + lane_offset + 128 * 32 * x));
  }

  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[2]) const {
    uint32_t words[8], row_pairs[8];
    load(code_area, scale_area, words, row_pairs);
    const mxfp4::StepScales<8> scales(words);
    mxfp4::decode_column_pairs<kValuesBeforeCheck>(row_pairs, scales, fragments);
  }
};

__device__ __forceinline__ void fence_fragment(Fragment& f) {
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(f[k16][i])::"memory");
}

// The one-tile Gated side steps (192- and 256-row chunks): a side step's box is b1's (or b3's)
// [64 K][64 h] (MN-major, 128-byte swizzle), and a thread's A rows r and r + 8 are the
// gate and the up row of one h column, whose side sums run over different pool columns
// (q1, q3). So the side steps are register MMAs over K = 2r: a q1 step's fragment holds
// b1 in the gate rows and zeros in the up rows, a q3 step's the reverse (a zero product
// adds nothing, exactly).
// Two ldmatrix.x4.trans read a warp's 8 h columns (unit 4 c + warp of every K row, the
// StoreMN lane offsets): matrix m of load x is K rows 32 x + 8 m .. + 7, and thread
// (g, t) receives K rows 2t, 2t + 1 (+ 8 m) of its column g: a0 (m even) or a2 of k16
// step 2x + m / 2.
template <bool kUpRows>
__device__ __forceinline__ void side_rows_fragment(uint32_t box, uint32_t lane_offset,
                                                   Fragment& fragment) {
  uint32_t r[8];
#pragma unroll
  for (int x = 0; x < 2; ++x)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[4 * x]), "=r"(r[4 * x + 1]), "=r"(r[4 * x + 2]), "=r"(r[4 * x + 3])
                 : "r"(box + lane_offset + 128 * 32 * x));
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) {
    const uint32_t low = r[2 * k16], high = r[2 * k16 + 1];  // K 2t (+1), K 2t + 8 (+9)
    fragment[k16][0] = kUpRows ? 0u : low;
    fragment[k16][1] = kUpRows ? low : 0u;
    fragment[k16][2] = kUpRows ? 0u : high;
    fragment[k16][3] = kUpRows ? high : 0u;
  }
}

// ---- the epilogues, from registers ----
// Every row of every chunk in use is written, padding rows too, as the engine writes its
// whole tiles: the pool's padding rows are zeros, so theirs are exact zeros and the
// outputs are the engine's bits on every row in use. Accumulator i of a thread: A row r
// (i % 4 < 2) or r + 8 of its half, chunk row 8 (i / 4) + 2 (lane % 4) + i % 2.
template <int Tokens>
struct StreamFragmentRows {
  int lane, row;  // row: r of the warpgroup's 64
  __device__ __forceinline__ explicit StreamFragmentRows(int thread)
      : lane(thread % 32), row(16 * (thread / 32) + (thread % 32) / 4) {}
  __device__ __forceinline__ int token(int i) const { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; }
  __device__ __forceinline__ int row_of(int i) const { return row + 8 * ((i % 4) / 2); }
};

// Gated: g and u rounded to BF16 (stored as g | u when asked), then h = act(min(g, c)) *
// clamp(u, -c, c) in FP32, rounded once, as the engine's gated epilogue. The outputs'
// places are read once per tile (read per element, they cost the 64-row kernel a spill).
template <bool kGeGLU, bool kClamp>
struct GatedOutputs {
  __nv_bfloat16* h;
  __nv_bfloat16* preact;
  int64_t inter;
  float clamp;
  __device__ __forceinline__ explicit GatedOutputs(const WeightStreamParams& p)
      : h(static_cast<__nv_bfloat16*>(p.out)),
        preact(static_cast<__nv_bfloat16*>(p.preact)),
        inter(p.out_columns),
        clamp(p.activation_clamp) {}
  __device__ __forceinline__ void element(int64_t pool_row, int64_t column, float gate,
                                          float up) const {
    const __nv_bfloat16 g = __float2bfloat16_rn(gate);
    const __nv_bfloat16 u = __float2bfloat16_rn(up);
    if (preact != nullptr) {
      preact[pool_row * 2 * inter + column] = g;
      preact[pool_row * 2 * inter + inter + column] = u;
    }
    const float gf = __bfloat162float(g), uf = __bfloat162float(u);
    const float gc = kClamp ? fminf(gf, clamp) : gf;
    const float uc = kClamp ? fminf(fmaxf(uf, -clamp), clamp) : uf;
    h[pool_row * inter + column] = __float2bfloat16_rn(activation<kGeGLU>(gc) * uc);
  }
};

// Two tiles: accumulator i of half 0 is g, of half 1 u, at h column n0 + 64 consumer +
// row_of(i). One tile: accumulator i is g (i % 4 < 2) or u (i + 2) of h column n0 + 32
// consumer + 8 warp + lane / 4. A wide chunk's rows past its span are not written.
template <int Halves, int Tokens, bool kGeGLU, bool kClamp>
__device__ __forceinline__ void gated_epilogue(const WeightStreamParams& p, const StreamTile& tile,
                                               const float (&acc)[Halves][Tokens / 2], int consumer,
                                               int thread) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const StreamFragmentRows<Tokens> at(thread);
  const GatedOutputs<kGeGLU, kClamp> outputs(p);
  if constexpr (Halves == 2) {
#pragma unroll
    for (int i = 0; i < Tokens / 2; ++i)
      if (!kSpan || at.token(i) < tile.span)
        outputs.element(tile.row0 + at.token(i), tile.n0 + 64 * consumer + at.row_of(i), acc[0][i],
                        acc[1][i]);
  } else {
    const int64_t column = tile.n0 + 32 * consumer + 8 * (thread / 32) + at.lane / 4;
#pragma unroll
    for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (at.token(i + e) < tile.span)
          outputs.element(tile.row0 + at.token(i + e), column, acc[0][i + e], acc[0][i + e + 2]);
  }
}

// Store: the sums rounded to BF16, columns past the output's (an extra tile's block past
// N_x) not stored. Two tiles: half 1's columns are 128 on. A wide chunk's rows past its
// span are not written.
template <int Halves, int Tokens>
__device__ __forceinline__ void store_epilogue(const WeightStreamParams& p, const StreamTile& tile,
                                               const float (&acc)[Halves][Tokens / 2], int consumer,
                                               int thread) {
  const StreamFragmentRows<Tokens> at(thread);
  const int64_t columns = p.out_columns;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
  for (int i = 0; i < Tokens / 2; ++i) {
    const int64_t column = tile.n0 + 64 * consumer + at.row_of(i);
    const int64_t pool_row = tile.row0 + at.token(i);
    if (stream_chunks_from_segment_starts(Tokens) && at.token(i) >= tile.span) continue;
#pragma unroll
    for (int half = 0; half < Halves; ++half)
      if (column + 128 * half < columns)
        out[pool_row * columns + column + 128 * half] = __float2bfloat16_rn(acc[half][i]);
  }
}

__device__ __forceinline__ uint2 load_global_8_cg(const void* at) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(at));
  return v;
}
__device__ __forceinline__ void store_global_8(void* at, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(at), "r"(v.x), "r"(v.y) : "memory");
}

// Predicated stores: the StoreMN epilogue picks between a base tile's and an extra tile's
// stores without a branch on the tile (a loaded value), which would cost the base-step
// loop its uniform registers (about 25 more instructions a step, counted in SASS).
__device__ __forceinline__ void store_global_8_if(bool store, void* at, uint2 v) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.v2.u32 [%1], {%2, %3};\n}" ::"r"(
          static_cast<uint32_t>(store)),
      "l"(at), "r"(v.x), "r"(v.y)
      : "memory");
}
__device__ __forceinline__ void store_global_2_if(bool store, void* at, uint16_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.b16 [%1], %2;\n}" ::"r"(
                   static_cast<uint32_t>(store)),
               "l"(at), "h"(v)
               : "memory");
}

// StoreMN: a base tile's accumulator i of tile T (acc_lo: T = 0) is fragment row g (i %
// 4 < 2) or g + 8 of the thread's warp, i.e. column 4q + 2T + (i % 4) / 2 of its
// consumer's 128 (q = 8 warp + g, decode_column_pairs): a thread's four columns of a
// chunk row are adjacent, and go out as one 8-byte store (a warp then writes whole
// sectors; one 2-byte store per column wrote each sector in four partial pieces). An
// extra tile's accumulator is A row r = 64 consumer + 16 warp + g (+ 8) of lo (T = 0:
// columns from N on, below N_lo) or of hi (from N + N_lo on, below N_hi), stored per
// column.
template <int Tokens>
__device__ __forceinline__ void transposed_store_epilogue(const WeightStreamParams& p,
                                                          const StreamTile& tile,
                                                          const float (&acc_lo)[Tokens / 2],
                                                          const float (&acc_hi)[Tokens / 2],
                                                          int consumer, int thread) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const StreamFragmentRows<Tokens> at(thread);
  const bool extra = tile.extra;
  const int64_t columns = p.out_columns;
  const int lo_columns = p.extra_lo_columns;
  const int hi_columns = static_cast<int>(columns) - tile.n0 - lo_columns;
  const int row = 64 * consumer + at.row;  // an extra tile's A row of fragment row g
  // A base tile's first column, or an extra tile's column of fragment row g.
  const int first =
      extra ? tile.n0 + row : tile.n0 + 128 * consumer + 32 * (thread / 32) + 4 * (at.lane / 4);
  bool lo_in[2], hi_in[2];
#pragma unroll
  for (int high = 0; high < 2; ++high) {
    lo_in[high] = extra && row + 8 * high < lo_columns;
    hi_in[high] = extra && row + 8 * high < hi_columns;
  }
  __nv_bfloat16* out =
      static_cast<__nv_bfloat16*>(p.out) + (tile.row0 + 2 * (at.lane % 4)) * columns + first;
#pragma unroll
  for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int low = i + odd;  // fragment row g; low + 2: row g + 8
      // A wide chunk writes its segment's rows only (past its span: the next expert's).
      const bool in = !kSpan || at.token(low) < tile.span;
      __nv_bfloat16* at_row = out + (8 * (i / 4) + odd) * columns;
      const uint2 v = make_uint2(pack_bf16(acc_lo[low], acc_lo[low + 2]),
                                 pack_bf16(acc_hi[low], acc_hi[low + 2]));
      store_global_8_if(in && !extra, at_row, v);
      store_global_2_if(in && lo_in[0], at_row, static_cast<uint16_t>(v.x));
      store_global_2_if(in && lo_in[1], at_row + 8, static_cast<uint16_t>(v.x >> 16));
      store_global_2_if(in && hi_in[0], at_row + lo_columns, static_cast<uint16_t>(v.y));
      store_global_2_if(in && hi_in[1], at_row + lo_columns + 8, static_cast<uint16_t>(v.y >> 16));
    }
}

// dgrad2 (ActivationBackward): a thread's four accumulators of a chunk row are z at its
// four adjacent columns 4q .. 4q + 3 of its consumer's 128 (StoreMN's map), rounded to
// BF16 once as the engine stages z; then per pair of columns the activation backward
// (activation_backward_math.cuh), read from and written to g | u / dg | du with one 8-byte
// access each. The router dot of a row's 256 columns is summed in the engine's order:
// each 8-column vector sequentially (the even-g lane's four columns, then its odd
// neighbour's, which restarts its chain from the even lane's sum), then the tile's 32
// vector sums as the engine's butterfly (v + v ^ 16, then ^ 8, ...), through shared
// memory `dots` (this tile's buffer), one thread per chunk row, after both consumers
// wrote theirs (named barrier 1).

// dgrad2: the tile's g | u (Tokens rows, 256 columns of each half: eight 128-byte lines a
// row), asked of L2 when its main loop starts, so that the epilogue's loads a main loop
// later meet L2's latency rather than DRAM's (the weights' stream evicts them from L2
// between the forward that wrote them and this GEMM).
template <int Tokens>
__device__ __forceinline__ void prefetch_preact_tile(const WeightStreamParams& p,
                                                     const StreamTile& tile, int consumer,
                                                     int thread) {
  const int64_t inter = p.out_columns;
  const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
  // An opaque copy of the thread: derived from it once, ptxas kept the lines' places
  // through the tile loop and spilled them.
  const int self = static_cast<int>(opaque(static_cast<uint32_t>(thread)));
#pragma unroll
  for (int k = 0; k < Tokens / 32; ++k) {
    const int line = 256 * k + 128 * consumer + self;  // of the tile's 8 x Tokens
    // A wide chunk's rows past its segment are not its own.
    if (stream_chunks_from_segment_starts(Tokens) && line / 8 >= tile.span) break;
    const int64_t row = tile.row0 + line / 8;
    const int64_t column = (line / 4 % 2) * inter + tile.n0 + 64 * (line % 4);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(preact + row * 2 * inter + column));
  }
}

template <int Tokens, bool kGeGLU, bool kClamp>
__device__ __forceinline__ void activation_backward_epilogue(
    const WeightStreamParams& p, const StreamTile& tile, const float (&acc_lo)[Tokens / 2],
    const float (&acc_hi)[Tokens / 2], int consumer, int thread, uint32_t dots) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const int64_t inter = p.out_columns;
  const float clamp = p.activation_clamp;
  const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
  __nv_bfloat16* dgrad = static_cast<__nv_bfloat16*>(p.out);
  __nv_bfloat16* weighted = static_cast<__nv_bfloat16*>(p.weighted_h);
  // A thread's rows are (i, e), i = 0, 4, .. and e = 0, 1 (its accumulators i + e and
  // i + e + 2), taken eight at a time (Tokens 64: two groups, within the registers). A
  // group's loads all come before its stores: the stores are volatile with a memory
  // clobber, so a row's loads issued after the previous row's stores would cost every row
  // two round trips (its route, then g | u where it is live); a group waits for two.
  constexpr int kRows = 8;
  // z of every row first, as BF16 pairs: half the accumulators' registers, which the row
  // groups' loads then have (with the 128-row chunks' 128 accumulators live through the
  // rows, the loads spilled).
  uint32_t staged[Tokens / 4][2];  // [row (i, e): i / 2 + e][tile]
#pragma unroll
  for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      staged[i / 2 + e][0] = pack_bf16(acc_lo[i + e], acc_lo[i + e + 2]);
      staged[i / 2 + e][1] = pack_bf16(acc_hi[i + e], acc_hi[i + e + 2]);
    }
  // The 128-row chunks run the row groups in a loop, not unrolled: unrolled, the epilogue
  // was 256 KB of code per activation variant (1.1 MB in all), and the kernel stalled on
  // its instruction fetch (docs/ENGINE.md, "The 128-row transposed chunks"). A group takes
  // its rows' z from the staged registers by a compare per group (constant indices).
  constexpr int kGroups = Tokens / 2 / (2 * kRows);
  auto run_group = [&](int group) {
    const int i0 = group * 2 * kRows;
    // The thread's places from its index, derived in the loop (an opaque copy): derived
    // once, ptxas kept them through the main loop and spilled them.
    const int self = static_cast<int>(opaque(static_cast<uint32_t>(thread)));
    const StreamFragmentRows<Tokens> at(self);
    const int g = at.lane / 4, warp = self / 32;
    const int64_t column = tile.n0 + 128 * consumer + 32 * warp + 4 * g;
    const int vector = 16 * consumer + 4 * warp + g / 2;  // of the tile's 32 (8 columns each)
    uint32_t z_rows[kRows][2];
#pragma unroll
    for (int k = 0; k < kGroups; ++k)
      if (k == group)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          z_rows[r][0] = staged[k * kRows + r][0];
          z_rows[r][1] = staged[k * kRows + r][1];
        }
    // A row's token and pool row are recomputed where used (a few instructions), not
    // held: held, they spilled.
    auto token_of = [&](int r) { return at.token(i0 + 4 * (r / 2) + r % 2); };
    auto row_of = [&](int r) { return tile.row0 + static_cast<int64_t>(token_of(r)); };
    bool live[kRows];
    float weight[kRows];
    bool in[kRows];  // a wide chunk's rows of its own segment (all rows of a narrow one)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      in[r] = !kSpan || token_of(r) < tile.span;
      const int route = in[r] ? static_cast<int>(__ldcg(p.pool_row_to_route + row_of(r))) : -1;
      weight[r] = in[r] ? __ldcg(p.row_weights + row_of(r)) : 0.0f;
      // Padding rows (route -1) give zeros whatever their inputs hold (unsigned compare).
      live[r] = static_cast<uint32_t>(route) < static_cast<uint32_t>(p.num_routes);
    }
    uint2 g2[kRows], u2[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      g2[r] = u2[r] = make_uint2(0u, 0u);
      if (live[r]) {
        g2[r] = load_global_8_cg(preact + row_of(r) * 2 * inter + column);
        u2[r] = load_global_8_cg(preact + row_of(r) * 2 * inter + inter + column);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row_of(r);
      const float w = weight[r];
      const uint32_t (&z)[2] = z_rows[r];
      __nv_bfloat16* dgrad_at = dgrad + row * 2 * inter + column;
      uint2 dg = make_uint2(0u, 0u), du = dg, wh = dg, h = dg;
      if (live[r]) {
        const ActivationBackwardPair lo =
            activation_backward_pair<kGeGLU, kClamp>(z[0], g2[r].x, u2[r].x, w, clamp);
        const ActivationBackwardPair hi =
            activation_backward_pair<kGeGLU, kClamp>(z[1], g2[r].y, u2[r].y, w, clamp);
        dg = make_uint2(lo.dg, hi.dg);
        du = make_uint2(lo.du, hi.du);
        wh = make_uint2(lo.weighted_h, hi.weighted_h);
        h = make_uint2(lo.h, hi.h);
      }
      if (in[r]) {
        store_global_8(dgrad_at, dg);
        store_global_8(dgrad_at + inter, du);
        if (weighted != nullptr) store_global_8(weighted + row * inter + column, wh);
      }
      // The vector's chain: the even lane's four columns from 0, the odd lane's from the
      // even lane's sum (padding rows: zeros, as the engine's).
      float sum = 0.0f;
      if (live[r]) {
        router_dot_add(sum, z[0], h.x);
        router_dot_add(sum, z[1], h.y);
      }
      const float even = __shfl_xor_sync(0xffffffffu, sum, 4);
      if (g % 2 == 1) {
        sum = even;
        if (live[r]) {
          router_dot_add(sum, z[0], h.x);
          router_dot_add(sum, z[1], h.y);
        }
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(dots + 4 * (32 * token_of(r) + vector)),
                     "f"(sum)
                     : "memory");
      }
    }
  };
  if constexpr (kSpan) {
#pragma unroll 1
    for (int group = 0; group < kGroups; ++group) run_group(group);
  } else {  // the 64-row kernels' registers are too few for the rolled loop's (it spilled)
#pragma unroll
    for (int group = 0; group < kGroups; ++group) run_group(group);
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers' vector sums are in
  const int own_row = 128 * consumer + thread;
  if (own_row < (kSpan ? tile.span : Tokens)) {
    float v[32];
#pragma unroll
    for (int k = 0; k < 32; k += 4)
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(v[k]), "=f"(v[k + 1]), "=f"(v[k + 2]), "=f"(v[k + 3])
                   : "r"(dots + 4 * (32 * own_row + k)));
    // The butterfly's sums: v + v ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1 (each level's count fixed,
    // so the array stays in registers).
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = v[k] + v[k + 16];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = v[k] + v[k + 8];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = v[k] + v[k + 4];
#pragma unroll
    for (int k = 0; k < 2; ++k) v[k] = v[k] + v[k + 2];
    v[0] = v[0] + v[1];
    p.drouter_partials[(tile.row0 + own_row) * static_cast<int64_t>(p.n_base_blocks) +
                       tile.n0 / 256] = v[0];
  }
}

// ---- consumers ----
template <class C>
__device__ __forceinline__ void stream_consume(const WeightStreamParams& p,
                                               const StreamStorage<C>& smem, int consumer) {
  constexpr int kTokens = C::kTokensPerChunk;
  constexpr int kHalves = C::kHalves;
  using Mma = StreamMma<kTokens, !C::kTransposed>;
  const typename C::Schedule schedule(p);
  const int thread = threadIdx.x % kWarpgroupThreads;
  // The tile's halves (Gated: g and u; one tile: g and u in rows r and r + 8).
  float acc[kHalves][kTokens / 2];
  Fragment fragments[2][kHalves];  // [buffer][half]
  StreamRing<C> ring(smem);
  const bool clamped = is_clamped(p.activation_clamp);
  const bool geglu = p.activation == static_cast<int>(Activation::GeGLU);
  int tiles_done = 0;  // dgrad2: picks the tile's router-dot buffer
  auto finish = [&](const StreamTile& tile) {
    if constexpr (C::kGated) {
      if (geglu) {
        if (clamped)
          gated_epilogue<kHalves, kTokens, true, true>(p, tile, acc, consumer, thread);
        else
          gated_epilogue<kHalves, kTokens, true, false>(p, tile, acc, consumer, thread);
      } else if (clamped) {
        gated_epilogue<kHalves, kTokens, false, true>(p, tile, acc, consumer, thread);
      } else {
        gated_epilogue<kHalves, kTokens, false, false>(p, tile, acc, consumer, thread);
      }
    } else if constexpr (C::kActivation) {
      // This tile's dot buffer (by tile parity: the barrier of the next tile orders this
      // tile's reads before the writes of the one after).
      const uint32_t dots = shared_address(smem.dots) + (tiles_done & 1) * (C::kDotBytes / 2);
      if (geglu) {
        if (clamped)
          activation_backward_epilogue<kTokens, true, true>(p, tile, acc[0], acc[1], consumer,
                                                            thread, dots);
        else
          activation_backward_epilogue<kTokens, true, false>(p, tile, acc[0], acc[1], consumer,
                                                             thread, dots);
      } else if (clamped) {
        activation_backward_epilogue<kTokens, false, true>(p, tile, acc[0], acc[1], consumer,
                                                           thread, dots);
      } else {
        activation_backward_epilogue<kTokens, false, false>(p, tile, acc[0], acc[1], consumer,
                                                            thread, dots);
      }
      ++tiles_done;
    } else if constexpr (C::kTransposed) {
      transposed_store_epilogue<kTokens>(p, tile, acc[0], acc[1], consumer, thread);
    } else {
      store_epilogue<kHalves, kTokens>(p, tile, acc, consumer, thread);
    }
  };
  auto fence_all_accumulators = [&] {
#pragma unroll
    for (int half = 0; half < kHalves; ++half) fence_accumulators(acc[half]);
  };
  const int num_tiles = schedule.num_tiles();
  int t = blockIdx.x;
  StreamTile tile = t < num_tiles ? schedule.tile(t) : StreamTile{};
  for (; t < num_tiles; t += gridDim.x) {
    // The next tile's lookup (a search over the experts' offsets: dependent loads) runs
    // while this tile's last batch does.
    auto next_tile = [&] {
      return t + static_cast<int>(gridDim.x) < num_tiles ? schedule.tile(t + gridDim.x) : tile;
    };
#pragma unroll
    for (int half = 0; half < kHalves; ++half)
#pragma unroll
      for (int i = 0; i < kTokens / 2; ++i) acc[half][i] = 0.0f;
    fence_all_accumulators();
    if (tile.rows == 0) {  // padding only: its (zero) pool rows give exact zeros
      finish(tile);
      tile = next_tile();
      continue;
    }
    if constexpr (C::kActivation) prefetch_preact_tile<kTokens>(p, tile, consumer, thread);
    const int segment_steps = C::kSegmentEveryTile || tile.extra ? p.segment_steps : 0;
    const int base_steps = C::kSegmentEveryTile || !tile.extra ? p.base_steps : 0;
    // After a step's batch: the previous step's batch retired, its stage (empty barrier
    // `previous`, 0 before the tile's first step) goes back to the producer.
    // Every consumer thread releases the stage itself: the producer rewrites its scale
    // words with plain stores, so each thread's loads must precede that thread's release.
    uint32_t previous = 0;
    auto retire_previous = [&] {
      cute::warpgroup_wait<1>();
      if (previous != 0) arrive_barrier(previous);
      previous = ring.empty();
    };
    // The tile's steps, their MMAs by `ops` (a StreamMma): Tokens wide, or (wide form) as
    // wide as the chunk's data rows rounded up to one of C::MmaWidths, the whole loop
    // instantiated per width (with the width chosen per step, ptxas serialized the wide
    // GEMM1's wgmma for registers).
    auto main_loop = [&](auto ops) {
      auto run_segment = [&](float* sums, int first, int last) {
        for (int step = first; step < last; ++step) {
          wait_barrier(ring.full, ring.phase);
          cute::warpgroup_arrive();
          const uint32_t box = ring.a() + consumer * kBoxBytes;
          const uint64_t desc_a =
              C::kTransposed ? descriptor_k_major(box) : descriptor_mn_major(box);
          const uint64_t desc_b = descriptor_k_major(ring.b());
          ops.side_step(desc_a, desc_b, sums);
          cute::warpgroup_commit_batch();
          retire_previous();
          ring.advance();
        }
      };
      // The one-tile Gated side steps (side_rows_fragment), register MMAs into the m64 tile
      // from one fragment, each retired before the next step: a few steps a tile, and with
      // their batches left in flight ptxas serialized every wgmma of the 256-row kernel for
      // want of registers.
      auto run_side_rows = [&](auto up_rows, int first, int last) {
        const uint32_t lane_offset = stream_column_lane_offset(threadIdx.x);
        Fragment fragment;
        for (int step = first; step < last; ++step) {
          wait_barrier(ring.full, ring.phase);
          side_rows_fragment<decltype(up_rows)::value>(ring.a(), lane_offset, fragment);
          fence_fragment(fragment);
          cute::warpgroup_arrive();
          const uint64_t desc_b = descriptor_k_major(ring.b());
          ops.base_half_step(fragment, desc_b, acc[0]);
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
          retire_previous();
          ring.advance();
        }
      };
      if (segment_steps > 0) {
        if constexpr (C::kOneTile && C::kGated) {
          run_side_rows(std::false_type{}, 0, p.segment_half);
          run_side_rows(std::true_type{}, p.segment_half, segment_steps);
        } else {
          run_segment(acc[0], 0, p.segment_half);
          run_segment(acc[kHalves - 1], p.segment_half, segment_steps);
        }
        if constexpr (C::kGated) {
          // The side sums are complete: scale them before the base adds on (FP32, exact
          // adapter term as in the engine). The wait also retires the side steps' fragments.
          cute::warpgroup_wait<0>();
          fence_all_accumulators();
#pragma unroll
          for (int half = 0; half < kHalves; ++half)
#pragma unroll
            for (int i = 0; i < kTokens / 2; ++i) acc[half][i] *= p.side_scale;
          fence_all_accumulators();
        }
      }
      using Lines = std::conditional_t<
          C::kTransposed, StreamColumnPairs<C::kValuesBeforeCheck>,
          std::conditional_t<C::kOneTile, StreamLinePair<C::kGated>, StreamLines>>;
      const Lines lines(threadIdx.x);
      // A base step: the halves' fragments decoded, then their MMAs as one batch. The
      // fragments alternate between two buffers (by step parity): a buffer is rewritten
      // only after the batch that read it retired, which the step between guarantees (one
      // batch in flight), so a step's decode overlaps the previous step's MMAs.
      auto base_step = [&](Fragment(&halves)[kHalves]) {
        wait_barrier(ring.full, ring.phase);
        lines.decode(ring.a(), ring.scale_words(), halves);
        // Written out, not as loops over the halves: the loops cost the narrow kernels six
        // uniform moves a step (SASS).
        fence_fragment(halves[0]);
        if constexpr (kHalves == 2) fence_fragment(halves[1]);
        cute::warpgroup_arrive();
        const uint64_t desc_b = descriptor_k_major(ring.b());
        ops.base_half_step(halves[0], desc_b, acc[0]);
        if constexpr (kHalves == 2) ops.base_half_step(halves[1], desc_b, acc[1]);
        cute::warpgroup_commit_batch();
        retire_previous();
        ring.advance();
      };
      // 128-row chunks: a step's two tiles decoded and multiplied one at a time, each
      // tile's batch committed on its own. A tile's decode overlaps the other tile's batch,
      // and one fragment buffer per tile suffices (32 registers beside the 128
      // accumulators; with the narrow form's two step buffers ptxas serialized every
      // wgmma, C7511). After tile 0's batch, the wait retires the previous step's batches
      // (its stage goes back); after tile 1's, tile 0's (its buffer is rewritten next).
      int k_step = 0;
      if constexpr (C::kTilesOneAtATime) {
        auto tile_batch = [&](Fragment& tile_fragment, uint64_t desc_b,
                              float (&sums)[kTokens / 2]) {
          fence_fragment(tile_fragment);
          cute::warpgroup_arrive();
          ops.base_half_step(tile_fragment, desc_b, sums);
          cute::warpgroup_commit_batch();
        };
        auto base_step_by_tiles = [&](Fragment(&tiles)[2]) {
          wait_barrier(ring.full, ring.phase);
          if constexpr (C::kTransposed) {
            uint32_t words[8], row_pairs[8];
            lines.load(ring.a(), ring.scale_words(), words, row_pairs);
            const mxfp4::StepScales<8> scales(words);
            const uint64_t desc_b = descriptor_k_major(ring.b());
            mxfp4::decode_column_pair_tile<0>(row_pairs, scales, tiles[0]);
            tile_batch(tiles[0], desc_b, acc[0]);
            retire_previous();
            mxfp4::decode_column_pair_tile<1>(row_pairs, scales, tiles[1]);
            tile_batch(tiles[1], desc_b, acc[1]);
          } else {  // a half's lines are loaded when it is decoded: fewer registers held
            const uint64_t desc_b = descriptor_k_major(ring.b());
            lines.template decode_half<0>(ring.a(), ring.scale_words(), tiles[0]);
            tile_batch(tiles[0], desc_b, acc[0]);
            retire_previous();
            lines.template decode_half<1>(ring.a(), ring.scale_words(), tiles[1]);
            tile_batch(tiles[1], desc_b, acc[1]);
          }
          cute::warpgroup_wait<1>();
          ring.advance();
        };
        for (; k_step < base_steps; ++k_step) base_step_by_tiles(fragments[0]);
      } else {
        for (; k_step + 1 < base_steps; k_step += 2) {
          base_step(fragments[0]);
          base_step(fragments[1]);
        }
        if (k_step < base_steps) base_step(fragments[0]);
      }
    };
    if constexpr (C::kWide)
      with_mma_width<kTokens>(tile.rows, typename C::MmaWidths{}, [&](auto n) {
        main_loop(StreamMma<decltype(n)::value, !C::kTransposed>{});
      });
    else
      main_loop(Mma{});
    const StreamTile next = next_tile();
    cute::warpgroup_wait<0>();
    fence_all_accumulators();
    arrive_barrier(previous);
    finish(tile);
    tile = next;
  }
}

}  // namespace megamoe::kernels::engine

namespace megamoe::kernels {

template <StreamKind kKind, int Tokens>
__global__ void __launch_bounds__(engine::StreamConfig<kKind, Tokens>::kThreads, 1)
    weight_stream_kernel(const __grid_constant__ WeightStreamParams p) {
  using namespace engine;
  using C = engine::StreamConfig<kKind, Tokens>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const StreamStorage<C> smem(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      // The copies' thread (with the byte count), then every producer thread's words.
      TransactionBarrier::init(&smem.full[s], 1 + kWarpgroupThreads);
      Barrier::init(&smem.empty[s], C::kConsumers * kWarpgroupThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegisters>();
    stream_produce<C>(p, smem, threadIdx.x);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegisters>();
  stream_consume<C>(p, smem, warpgroup - 1);
}

template <StreamKind kKind, int Tokens>
WeightStreamKernels weight_stream_kernels() {
  using C = engine::StreamConfig<kKind, Tokens>;
  return WeightStreamKernels{
      &weight_stream_kernel<kKind, Tokens>, kKind, Tokens, C::kColumns, C::kThreads, C::kSmemBytes};
}

}  // namespace megamoe::kernels
