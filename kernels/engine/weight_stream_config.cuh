// The weight-streaming GEMMs' compile-time configuration (StreamConfig: one per kind
// and chunk), the shared-memory layout of the stage ring and each role's place in it, and
// the per-tile facts every role derives alike (segment steps).
#pragma once

#include <cstdint>
#include <type_traits>

#include "pipeline.cuh"
#include "weight_stream_params.h"
#include "weight_stream_schedule.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

template <StreamKind kKind, int Tokens>
struct StreamConfig {
  static_assert(Tokens == 32 || Tokens == 64 || Tokens == 128 || Tokens == 192 || Tokens == 256,
                "wgmma N of the chunk");
  static constexpr StreamKind kStreamKind = kKind;
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
  // fragment buffer per tile fits beside them. 192- and 256-row chunks hold one m64 tile
  // per consumer warpgroup, so their 96 or 128 accumulators and two fragment buffers (32)
  // fit; a thread's rows r and r + 8 are a gated tile's gate and up rows of one h column.
  static constexpr bool kOneTile = kWide && stream_one_tile(Tokens);
  // dgrad2's one-tile chunks (its 256-column tile as two sub-tiles of 128 in turn, the
  // router dot's pieces exchanged through shared memory) measured slower than its 128-row
  // chunks at every token count (docs/PERFORMANCE.md, fortieth session).
  static_assert(!(kOneTile && kActivation), "dgrad2's widest chunk is 128 rows");
  // One-tile StoreMN: the extra tile's two blocks (lo, hi) are two tiles, each one m64 tile
  // per warpgroup over its own K steps.
  static constexpr bool kExtraTilePerBlock = kOneTile && kKind == StreamKind::StoreMN;
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
  // the gate and up rows of 64 h columns, or 128 rows); StoreMN: 64 rows of 128 bytes
  // (one tile: 64 bytes, both warpgroups' tiles).
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
  // Base steps whose scale loads are in flight in the producer warpgroup (their loads
  // issued this many steps before the words are written).
  static constexpr int kScaleStepsAhead = 4;
  // The transposed kinds' scale loads land in shared memory (cp.async, StreamScaleColumns):
  // per producer thread kScaleStepsAhead slots of two 4-byte words, after the dots.
  static constexpr int kScaleStagingBytes =
      kTransposed ? kWarpgroupThreads * kScaleStepsAhead * 8 : 0;
  static constexpr int kStagesFit =
      (kSmemLimit - 1024 - kBarrierBytes - kDotBytes - kScaleStagingBytes) / kStageBytes;
  // Six stages, not as many as fit: shared memory takes its room from L1 (one 256 KB
  // array per SM), and deeper rings measured slower (docs/ENGINE.md, "The ring's depth");
  // the wide 256-row chunks fit four (Store) or five (Gated), and three stages measured
  // no faster there; the 192-row chunks fit five (Store) or six (Gated).
  static constexpr int kStages = kStagesFit > 6 ? 6 : kStagesFit;
  static_assert(kStages >= 3, "a ring deep enough to overlap the loads");
  static constexpr int kSmemBytes =
      1024 + kStages * kStageBytes + kDotBytes + kScaleStagingBytes + kBarrierBytes;
  static_assert(2 * kStages * 8 <= kBarrierBytes, "a full and an empty barrier per stage");
  // The transposed decode's multiplies before the step's scale check (64-row chunks) or
  // inside its fast branch (32-row chunks): each measured faster where it is used
  // (docs/ENGINE.md, "The transposed decode's multiplies and the scale check").
  static constexpr bool kValuesBeforeCheck = kTransposed && Tokens == 64;
  // setmaxnreg: the producer's warpgroup gives its registers to the two consumers.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 3 * 168, "the launch's registers");
};

template <class C>
struct StreamStorage {
  uint8_t* stages;
  uint8_t* dots;           // dgrad2's router-dot sums (C::kDotBytes)
  uint8_t* scale_staging;  // the transposed kinds' scale loads (C::kScaleStagingBytes)
  uint64_t* full;
  uint64_t* empty;
  __device__ __forceinline__ explicit StreamStorage(uint8_t* raw) {
    stages =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    dots = stages + C::kStages * C::kStageBytes;
    scale_staging = dots + C::kDotBytes;
    full = reinterpret_cast<uint64_t*>(scale_staging + C::kScaleStagingBytes);
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

// A value ptxas must keep in a register: it cannot recompute what it cannot see.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// One-tile StoreMN: whether a tile is the extra tile of hi's block (block 1; block 0 is
// lo's), from its first column (`Columns` a tile).
template <int Columns>
__device__ __forceinline__ bool stream_extra_tile_is_hi(const WeightStreamParams& p,
                                                        const StreamTile& tile) {
  return tile.extra && tile.n0 > p.n_base_blocks * Columns;
}

// A tile's segment steps [first, last): every tile's (GEMM1's side, dgrad2's a2) or an
// extra tile's; one-tile StoreMN's extra block 0 runs lo's K steps, block 1 hi's.
template <class C>
__device__ __forceinline__ int2 stream_segment_steps(const WeightStreamParams& p,
                                                     const StreamTile& tile) {
  const int steps = C::kSegmentEveryTile || tile.extra ? p.segment_steps : 0;
  if constexpr (C::kExtraTilePerBlock) {
    if (stream_extra_tile_is_hi<C::kColumns>(p, tile)) return make_int2(p.segment_half, steps);
    return make_int2(0, min(p.segment_half, steps));
  }
  return make_int2(0, steps);
}

}  // namespace megamoe::kernels::engine
