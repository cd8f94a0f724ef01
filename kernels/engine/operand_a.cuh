// A-operand policies: how the producer loads a K step of A into a stage, and the wgmma
// descriptor of one consumer warpgroup's 64 rows of it.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "engine_params.h"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

// The pool, K-major: one [BLOCK_M rows][64] box per K step. The K side segment (GEMM1's
// [q1 | q3], dgrad2's s dout b2^T) is the pool's columns from k_base on, so side step s
// reads columns k_base + 64 s; base step s reads columns 64 s.
template <int BlockM>
struct PoolOperandA {
  static constexpr bool kMNMajor = false;
  static constexpr int kBytes = BlockM * kRowBytes;

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
    const int col =
        step < tile.side_steps ? p.k_base + step * kBlockK : (step - tile.side_steps) * kBlockK;
    cute::SM90_TMA_LOAD_2D::copy(&p.a, bar, kCacheHint, dst, col, tile.row0);
  }

  __device__ __forceinline__ static uint64_t descriptor(const uint8_t* stage_a, int consumer) {
    return descriptor_k_major(stage_a + consumer * 64 * kRowBytes);
  }
};

// The K-grouped weight gradient's A: the pool rows are the reduction, A's columns the
// output rows, so a K step is 64 pool rows of BLOCK_M columns: BLOCK_M / 64 boxes of
// [64 rows][64 columns] side by side, read MN-major. Consumer warpgroup c owns box c.
template <int BlockM>
struct RowsOperandA {
  static constexpr bool kMNMajor = true;
  static constexpr int kBoxes = BlockM / 64;
  static constexpr int kBytes = kBoxes * kBoxBytes;

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box)
      cute::SM90_TMA_LOAD_2D::copy(&p.a, bar, kCacheHint, dst + box * kBoxBytes,
                                   tile.m_block * BlockM + 64 * box, tile.row0 + step * kBlockK);
  }

  __device__ __forceinline__ static uint64_t descriptor(const uint8_t* stage_a, int consumer) {
    return descriptor_mn_major(stage_a + consumer * kBoxBytes);
  }
};

}  // namespace megamoe::kernels::engine
