// Shared-memory tiles for wgmma and the stage ring, shared by the grouped GEMM engine
// (grouped_gemm.cuh) and the K-grouped weight-gradient GEMM (k_grouped_gemm.cuh): the
// 128-byte-swizzled tile layouts TMA writes, their wgmma descriptors, the wgmma
// instructions, and the ring position producers and consumers walk in lock step.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "gemm_tile_constants.h"

namespace megamoe::kernels::gemm {

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

constexpr int kWarpgroupThreads = 128;
constexpr int kSwizzleBytes = 128;          // TMA + wgmma 128-byte swizzle
constexpr int kRowBytes = kGemmBlockK * 2;  // one K-block row of BF16
// TMA's L2 cache-policy operand must be a valid policy word (0 is not one).
constexpr uint64_t kCacheHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
static_assert(kRowBytes == kSwizzleBytes, "a K-block row must be one swizzle span");

// wgmma shared-memory descriptor of a K-major, 128-byte-swizzled tile whose rows are
// 128 bytes: 8-row swizzle atoms are 1024 bytes apart (stride byte offset).
__device__ __forceinline__ uint64_t smem_descriptor(const void* smem) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  desc.bitfield.leading_byte_offset_ = 1;  // unused for swizzled K-major layouts
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// wgmma descriptor of an MN-major, 128-byte-swizzled B tile made of TMA boxes of
// 64 K rows x 64 N columns (128-byte rows, 8 KB per box) placed side by side along N.
// CuTe's canonical MN-major SW128 layout ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-byte
// units: LBO = the 8 KB between 64-column chunks, SBO = the 1 KB between 8-row K groups.
__device__ __forceinline__ uint64_t smem_descriptor_mn(const void* smem) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  desc.bitfield.leading_byte_offset_ = (kGemmBlockK * kRowBytes) >> 4;
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// Advance an MN-major descriptor along K by 16 rows (16 x 128 bytes).
__device__ __forceinline__ uint64_t advance_k16_mn(uint64_t desc, int k16) {
  return desc + static_cast<uint64_t>((k16 * 16 * kRowBytes) >> 4);
}

// Advance a descriptor along K by 16 elements (32 bytes) inside the swizzle span: the
// hardware applies the swizzle to the computed address, so a plain offset is right.
__device__ __forceinline__ uint64_t advance_k16(uint64_t desc, int k16) {
  return desc + static_cast<uint64_t>((k16 * 32) >> 4);
}

// The wgmma instruction of an m64 x N x k16 tile, FP32 accumulate, both operands from
// shared memory: K-major or MN-major A and B (16-bit types may be either).
template <int N, cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp;
template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp<64, A, B> {
  using type = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<A, B>;
};
template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp<128, A, B> {
  using type = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<A, B>;
};
template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp<256, A, B> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<A, B>;
};

// One m64xNx16 wgmma on N/2 accumulator registers per thread (d[0 .. N/2)); A and B
// K-major unless their flag says MN-major.
template <int N, bool kBMajorMN = false, bool kAMajorMN = false>
struct Wgmma {
  static constexpr auto kMajorA =
      kAMajorMN ? cute::SM90::GMMA::Major::MN : cute::SM90::GMMA::Major::K;
  static constexpr auto kMajorB =
      kBMajorMN ? cute::SM90::GMMA::Major::MN : cute::SM90::GMMA::Major::K;
  template <size_t... I>
  __device__ __forceinline__ static void run(uint64_t a, uint64_t b, float* d, bool accumulate,
                                             std::index_sequence<I...>) {
    WgmmaOp<N, kMajorA, kMajorB>::type::fma(
        a, b, d[I]...,
        accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
  }
  __device__ __forceinline__ static void mma(uint64_t a, uint64_t b, float* d, bool accumulate) {
    run(a, b, d, accumulate, std::make_index_sequence<N / 2>{});
  }
};

// Stage ring position shared by producer and consumers.
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  template <int Stages>
  __device__ __forceinline__ void advance() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

}  // namespace megamoe::kernels::gemm
