// The staged output tile: where the consumer warpgroups leave a finished tile's
// accumulators (as BF16) for the epilogue warps, and where TMA stores read from.
//
// Layout: BLOCK_N / 64 boxes of [BLOCK_M rows][64 columns] BF16, each 128-byte swizzled
// (16-byte chunk c of row r at chunk c ^ (r % 8)): the layout a TMA store of a
// [BLOCK_M, 64] box with SWIZZLE_128B reads, and one in which 8 rows' stores of the same
// column chunk (stmatrix) or 8 chunks of one row (the epilogue warps) hit 8 different
// bank groups.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "pipeline.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN, class Transform>
__device__ __forceinline__ void stage_accumulators(const float (&acc)[BlockN / 2], uint8_t* staging,
                                                   int consumer, Transform transform);

template <int BlockM, int BlockN>
struct StagingTile {
  static constexpr int kBoxColumns = 64;
  static constexpr int kBoxes = BlockN / kBoxColumns;
  static constexpr int kBoxBytes = BlockM * kRowBytes;
  static constexpr int kBytes = kBoxes * kBoxBytes;

  // Byte offset of column `col` (a multiple of 8: one 16-byte chunk) of row `row`.
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return (col / 64) * kBoxBytes + row * kRowBytes + (((col % 64) / 8) ^ (row % 8)) * 16;
  }

  // One consumer warpgroup's accumulators into its rows of the tile (the consumers'
  // hand-over; each staging tile kind has one).
  template <class Transform>
  __device__ __forceinline__ static void stage(const float (&acc)[BlockN / 2], uint8_t* staging,
                                               int consumer, Transform transform) {
    stage_accumulators<BlockM, BlockN>(acc, staging, consumer, transform);
  }
};

__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ uint4 load_shared_16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

__device__ __forceinline__ void store_shared_16(uint32_t address, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// One consumer warpgroup's accumulators (m64 x BLOCK_N, FP32) into its 64 rows of the
// staged tile as BF16 of transform(acc), with stmatrix: the m64nNk16 accumulator layout
// (register 4j + {0,1}: row warp*16 + lane/4, columns 8j + 2(lane%4) + {0,1}; 4j + {2,3}:
// the row 8 below) is four 8x8 matrices per pair of column groups j, j + 1, each lane
// giving one matrix row's address.
template <int BlockM, int BlockN, class Transform>
__device__ __forceinline__ void stage_accumulators(const float (&acc)[BlockN / 2], uint8_t* staging,
                                                   int consumer, Transform transform) {
  using Tile = StagingTile<BlockM, BlockN>;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int matrix = lane / 8;
  const int row = consumer * 64 + warp * 16 + (matrix % 2) * 8 + lane % 8;
  const uint32_t base = shared_address(staging);
#pragma unroll
  for (int j = 0; j < BlockN / 8; j += 2) {
    uint32_t r[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      r[q] = pack_bf16(transform(acc[4 * j + 2 * q]), transform(acc[4 * j + 2 * q + 1]));
    const uint32_t address = base + Tile::offset(row, 8 * (j + matrix / 2));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
  }
}

// Element `index` (0: low half) of a BF16 pair, as FP32.
__device__ __forceinline__ float bf16_bits_to_float(uint32_t pair, int index) {
  return __uint_as_float(index == 0 ? pair << 16 : pair & 0xFFFF0000u);
}

// Eight BF16 of a 16-byte chunk to FP32 and back.
__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  return make_uint4(pack_bf16(in[0], in[1]), pack_bf16(in[2], in[3]), pack_bf16(in[4], in[5]),
                    pack_bf16(in[6], in[7]));
}

}  // namespace megamoe::kernels::engine
