// Gated-activation epilogue of GEMM1: the staged tile holds the BF16 pre-activations, its
// first half g (gate rows of w13) and second half u (the matching up rows). The epilogue
// warps store them as g | u of `preact` (optional: the backward's activation derivative
// needs them), then compute h = act(min(g, c)) * clamp(u, -c, c) in place of g and store
// h. The math runs on the epilogue warps while the consumers run the next tile's MMAs.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "activation_math.cuh"
#include "engine_params.h"
#include "pipeline.cuh"
#include "staging_tile.cuh"
#include "tile_scheduler.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN, int EpilogueWarps>
struct GatedEpilogue {
  static constexpr int kThreads = EpilogueWarps * 32;
  using Tile = StagingTile<BlockM, BlockN>;
  static constexpr int kHalf = BlockN / 2;       // h columns of a tile
  static constexpr int kHalfBoxes = kHalf / 64;  // boxes of g (then of u)
  static constexpr int kVectorsPerRow = kHalf / 8;

  __device__ __forceinline__ static float transform(float v, const EpilogueParams&) { return v; }

  __device__ __forceinline__ static void store_boxes(const CUtensorMap* map, uint8_t* from,
                                                     int col0, int row0) {
#pragma unroll
    for (int box = 0; box < kHalfBoxes; ++box)
      cute::SM90_TMA_STORE_2D::copy(map, from + box * Tile::kBoxBytes, col0 + 64 * box, row0);
  }

  // h = act(min(g, c)) * clamp(u, -c, c) over the staged tile, written over g.
  template <bool kGeGLU, bool kClamp>
  __device__ __forceinline__ static void activate_in_place(const EpilogueParams& p,
                                                           uint8_t* staging, int thread) {
    const uint32_t base = shared_address(staging);
    const float clamp = p.activation_clamp;
    for (int unit = thread; unit < BlockM * kVectorsPerRow; unit += kThreads) {
      const int row = unit / kVectorsPerRow, col = 8 * (unit % kVectorsPerRow);
      const uint32_t at_g = base + Tile::offset(row, col);
      float g[8], u[8], h[8];
      unpack8(load_shared_16(at_g), g);
      unpack8(load_shared_16(base + Tile::offset(row, col + kHalf)), u);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float gc = kClamp ? fminf(g[c], clamp) : g[c];
        const float uc = kClamp ? fminf(fmaxf(u[c], -clamp), clamp) : u[c];
        h[c] = activation<kGeGLU>(gc) * uc;
      }
      store_shared_16(at_g, pack8(h));
    }
  }

  __device__ __forceinline__ static void finish(const EpilogueParams& p, const TileInfo& tile,
                                                uint8_t* staging, int thread) {
    const int i0 = tile.n_block * kHalf;
    if (p.store_preact && thread == 0) {
      store_boxes(&p.preact_gate, staging, i0, tile.row0);
      store_boxes(&p.preact_up, staging + kHalfBoxes * Tile::kBoxBytes, i0, tile.row0);
      commit_stores();
      wait_store_reads();  // g may be overwritten from here on
    }
    named_barrier_sync(kEpilogueBarrier, kThreads);
    // One branch per tile: the per-element math below has none.
    const bool clamped = is_clamped(p.activation_clamp);
    with_activation(p.activation == static_cast<int>(Activation::GeGLU), clamped,
                    [&](auto kGeGLU, auto kClamp) {
                      activate_in_place<decltype(kGeGLU)::value, decltype(kClamp)::value>(
                          p, staging, thread);
                    });
    fence_generic_to_async();
    named_barrier_sync(kEpilogueBarrier, kThreads);
    if (thread == 0) {
      store_boxes(&p.out, staging, i0, tile.row0);
      commit_stores();
      wait_store_reads();
    }
  }
};

}  // namespace megamoe::kernels::engine
