// Scaled store epilogue of the K-grouped sums: out[e] = scale * sum, the scale applied in
// FP32 by the consumers as they stage the tile, then TMA stores into the 3-D map
// [E][M][N], which clips the M and N tails. The staging tile sets the output's type: BF16
// (the weight gradients, one rounding after the scale) or FP32 (the token sums' partials,
// not rounded).
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "engine_params.h"
#include "float_staging_tile.cuh"
#include "pipeline.cuh"
#include "staging_tile.cuh"
#include "tile_scheduler.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN, int EpilogueWarps, class StagedTile = StagingTile<BlockM, BlockN>>
struct ScaledStoreEpilogue {
  static constexpr int kThreads = EpilogueWarps * 32;
  using Tile = StagedTile;

  // + 0.0f: a negative scale times an empty sum is -0; the contract says +0.
  __device__ __forceinline__ static float transform(float v, const EpilogueParams& p) {
    return p.scale * v + 0.0f;
  }

  __device__ __forceinline__ static void finish(const EpilogueParams& p, const TileInfo& tile,
                                                uint8_t* staging, int thread) {
    if (thread != 0) return;
#pragma unroll
    for (int box = 0; box < Tile::kBoxes; ++box)
      cute::SM90_TMA_STORE_3D::copy(&p.out, staging + box * Tile::kBoxBytes,
                                    tile.n_block * BlockN + Tile::kBoxColumns * box,
                                    tile.m_block * BlockM, tile.expert);
    commit_stores();
    wait_store_reads();
  }
};

}  // namespace megamoe::kernels::engine
