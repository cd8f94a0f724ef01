// Store epilogue: the staged BF16 tile goes to `out` (or, for an N extra tile, to
// `out_extra`) by TMA stores of [BLOCK_M, 64] boxes; the tensor maps clip the N tail.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "engine_params.h"
#include "pipeline.cuh"
#include "staging_tile.cuh"
#include "tile_scheduler.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN, int EpilogueWarps>
struct StoreEpilogue {
  static constexpr int kThreads = EpilogueWarps * 32;
  using Tile = StagingTile<BlockM, BlockN>;

  __device__ __forceinline__ static float transform(float v, const EpilogueParams&) { return v; }

  // `thread`: this epilogue thread's index (0 .. kThreads - 1).
  __device__ __forceinline__ static void finish(const EpilogueParams& p, const TileInfo& tile,
                                                uint8_t* staging, int thread) {
    if (thread != 0) return;
    const CUtensorMap* map = tile.extra ? &p.out_extra : &p.out;
#pragma unroll
    for (int box = 0; box < Tile::kBoxes; ++box)
      cute::SM90_TMA_STORE_2D::copy(map, staging + box * Tile::kBoxBytes,
                                    tile.n_local * BlockN + 64 * box, tile.row0);
    commit_stores();
    wait_store_reads();
  }
};

}  // namespace megamoe::kernels::engine
