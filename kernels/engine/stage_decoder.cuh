// MXFP4 B operand: one thread's share of decoding each landed stage's codes into the
// stage's BF16 B tile (kernels/mxfp4_tile_decode.cuh), shared by the decode warpgroup and
// the consumer warpgroup. Both decode: with few rows per expert the consumer's MMAs take
// a fraction of a step, and a second warp per scheduler hides the decode's latencies that
// one decode warp per scheduler left exposed (docs/ENGINE.md).
//
// Contract per K step (every decoding thread, in ring order): the stage's `full` has
// completed; `step` loads the thread's codes (their own area of the stage), decodes
// and stores them, and fences for the async proxy; the caller then arrives on the
// stage's `decoded` (one arrival per warp). No barrier among the decoding threads: the
// decode warpgroup may run ahead of the consumer by up to the ring's depth. The
// scale bytes come from global memory (the caller's layout), loaded one step ahead so
// their latency hides behind the current step's decode.
#pragma once

#include <type_traits>

#include "engine_params.h"
#include "mxfp4_tile_decode.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"

namespace megamoe::kernels::engine {

template <class C>
struct StageDecoder {
  static constexpr int kThreads = C::kDecodingThreads;
  using Decode = std::conditional_t<C::B::kMNMajor, mxfp4::MNMajorTileDecode<C::kBlockN, kThreads>,
                                    mxfp4::KMajorTileDecode<C::kBlockN, kThreads>>;
  using Schedule = typename C::Schedule;
  static constexpr int kUnits = Decode::kPerThread;

  const OperandParams& operands;
  const int thread;  // 0 .. kThreads - 1 over every decoding thread
  const int32_t scale_step;
  uint32_t scale[kUnits] = {};                  // the next decoding step's scale bytes
  int32_t offset[kUnits], next_offset[kUnits];  // units' scale offsets in this / the next tile

  __device__ __forceinline__ StageDecoder(const OperandParams& ops, int decoding_thread)
      : operands(ops), thread(decoding_thread), scale_step(C::B::scale_step(ops)) {}

  // Where this thread's units' scales of `tile` start.
  __device__ __forceinline__ void offsets_of(const TileInfo& tile, int32_t (&out)[kUnits]) const {
    Decode::for_each_unit(thread, [&](int i, int row, int block) {
      out[i] = C::B::scale_offset(operands, tile, row, block);
    });
  }

  // This thread's scale bytes of `step` of `tile` (nothing to load where it does not
  // decode: a BF16 side or extra step).
  __device__ __forceinline__ void load_scales(const TileInfo& tile, const int32_t (&at)[kUnits],
                                              int step) {
    if (step >= tile.k_steps || !C::B::decodes(tile, step)) return;
    const int32_t shift = (step - tile.side_steps) * scale_step;
#pragma unroll
    for (int i = 0; i < kUnits; ++i) scale[i] = C::B::scale_at(operands.scales, at[i], shift);
  }

  // Before a tile's first step. `prefetched`: the previous tile's last step already
  // loaded this tile's offsets and first scales (it had steps).
  __device__ __forceinline__ void begin_tile(const TileInfo& tile, bool prefetched) {
    if (prefetched) {
#pragma unroll
      for (int i = 0; i < kUnits; ++i) offset[i] = next_offset[i];
    } else {
      offsets_of(tile, offset);
      load_scales(tile, offset, 0);
    }
  }

  // Step `step` of `tile` into the B tile `b`; `next_t` is the tile this CTA runs next
  // (>= num_tiles: none), whose first scales the last step prefetches.
  __device__ __forceinline__ void step(uint8_t* b, const Schedule& schedule, const TileInfo& tile,
                                       int step, int next_t) {
    uint32_t now[kUnits];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) now[i] = scale[i];
    auto prefetch = [&] {
      if (step + 1 < tile.k_steps) {
        load_scales(tile, offset, step + 1);
      } else if (next_t < schedule.num_tiles()) {
        const TileInfo next = schedule.tile(next_t);
        offsets_of(next, next_offset);
        load_scales(next, next_offset, 0);
      }
    };
    if (!C::B::decodes(tile, step)) {
      prefetch();
      return;
    }
    Decode decode;
    decode.load(b + C::B::kCodeOffset, thread);
    prefetch();
    decode.store(b, thread, now);
    fence_generic_to_async();  // the decoded tile is read by wgmma (async proxy)
  }
};

// A BF16 B: nothing to decode.
struct NoDecoder {
  __device__ __forceinline__ NoDecoder(const OperandParams&, int) {}
  __device__ __forceinline__ void begin_tile(const TileInfo&, bool) {}
};

}  // namespace megamoe::kernels::engine
