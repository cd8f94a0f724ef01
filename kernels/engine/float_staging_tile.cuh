// The staged output tile in FP32, for sums that leave the kernel unrounded (the token
// sums' partials, summed again outside the kernel): what the consumer warpgroups leave
// for the epilogue warps and what TMA stores read.
//
// Layout: BLOCK_N / 32 boxes of [BLOCK_M rows][32 columns] FP32, each row 128 bytes and
// 128-byte swizzled (16-byte chunk c of row r at chunk c ^ (r % 8)): the layout a TMA
// store of a [BLOCK_M, 32] FP32 box with SWIZZLE_128B reads. A warp's stores of one
// column group (8 rows, 32 bytes each) then spread over the bank groups.
#pragma once

#include <cstdint>

#include "pipeline.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN>
struct FloatStagingTile {
  static constexpr int kBoxColumns = 32;
  static constexpr int kBoxes = BlockN / kBoxColumns;
  static constexpr int kBoxBytes = BlockM * 128;
  static constexpr int kBytes = kBoxes * kBoxBytes;

  // Byte offset of the FP32 at column `col` of row `row`.
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return (col / 32) * kBoxBytes + row * 128 + ((((col % 32) / 4) ^ (row % 8)) * 16) +
           (col % 4) * 4;
  }

  // One consumer warpgroup's m64 x BLOCK_N accumulators, as FP32 transform(acc), into its
  // 64 rows: register 4j + {0,1} is row warp * 16 + lane / 4, columns 8j + 2 (lane % 4) +
  // {0,1}; 4j + {2,3} the row 8 below (the m64nNk16 accumulator layout). A pair of
  // columns is 8 bytes in one 16-byte chunk, so one vector store each.
  template <class Transform>
  __device__ __forceinline__ static void stage(const float (&acc)[BlockN / 2], uint8_t* staging,
                                               int consumer, Transform transform) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row = consumer * 64 + warp * 16 + lane / 4;
    const uint32_t base = shared_address(staging);
#pragma unroll
    for (int j = 0; j < BlockN / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float low = transform(acc[4 * j + 2 * half]);
        const float high = transform(acc[4 * j + 2 * half + 1]);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + offset(row + 8 * half, col)),
                     "f"(low), "f"(high)
                     : "memory");
      }
    }
  }
};

}  // namespace megamoe::kernels::engine
