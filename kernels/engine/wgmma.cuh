// wgmma on 128-byte-swizzled shared-memory tiles: the descriptors of the K-major and
// MN-major tile layouts TMA writes, the m64nNk16 instruction, and the accumulator fence.
#pragma once

#include <cuda.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "gemm_tile_constants.h"

namespace megamoe::kernels::engine {

constexpr int kWarpgroupThreads = 128;
constexpr int kBlockK = kGemmBlockK;       // K of one pipeline stage
constexpr int kRowBytes = kBlockK * 2;     // one K-block row of BF16: one 128-byte swizzle span
constexpr int kBoxBytes = 64 * kRowBytes;  // a [64 rows][64 BF16] box: 8 KB
static_assert(kRowBytes == 128, "a K-block row must be one 128-byte swizzle span");

// K-major tile: rows of 128 bytes (64 BF16 along K); 8-row swizzle atoms are 1024 bytes
// apart (the stride byte offset).
__device__ __forceinline__ uint64_t descriptor_k_major(uint32_t smem_address) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(smem_address >> 4);
  desc.bitfield.leading_byte_offset_ = 1;  // unused for swizzled K-major layouts
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// MN-major tile made of [64 K rows][64 MN] boxes placed side by side along MN: CuTe's
// canonical MN-major SW128 layout ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-byte units, with
// LBO = the 8 KB between boxes and SBO = the 1 KB between 8-row K groups.
__device__ __forceinline__ uint64_t descriptor_mn_major(uint32_t smem_address) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(smem_address >> 4);
  desc.bitfield.leading_byte_offset_ = kBoxBytes >> 4;
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// The same from a generic pointer into shared memory.
__device__ __forceinline__ uint64_t descriptor_k_major(const void* smem) {
  return descriptor_k_major(cute::cast_smem_ptr_to_uint(smem));
}
__device__ __forceinline__ uint64_t descriptor_mn_major(const void* smem) {
  return descriptor_mn_major(cute::cast_smem_ptr_to_uint(smem));
}

template <bool kMNMajor>
__device__ __forceinline__ uint64_t tile_descriptor(const void* smem) {
  return kMNMajor ? descriptor_mn_major(smem) : descriptor_k_major(smem);
}

// The descriptor of K sub-step k16 (16 elements) of a stage: inside the swizzle span for
// K-major (the hardware swizzles the computed address, so a plain 32-byte offset is
// right), 16 rows of 128 bytes further for MN-major.
template <bool kMNMajor>
__device__ __forceinline__ uint64_t advance_k16(uint64_t desc, int k16) {
  const int bytes = kMNMajor ? k16 * 16 * kRowBytes : k16 * 32;
  return desc + static_cast<uint64_t>(bytes >> 4);
}

// The same, adding to the descriptor's low word only: the start-address field (bits
// 0-13, shared addresses >> 4) never carries past bit 13, and a 32-bit add leaves the
// constant high word to one move where a 64-bit add costs an add with carry per sub-step.
template <bool kMNMajor>
__device__ __forceinline__ uint64_t advance_k16_low_word(uint64_t desc, int k16) {
  const int bytes = kMNMajor ? k16 * 16 * kRowBytes : k16 * 32;
  const uint32_t low = static_cast<uint32_t>(desc) + static_cast<uint32_t>(bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | low;
}

template <int N, cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp;
template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp<128, A, B> {
  using type = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<A, B>;
};
template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B>
struct WgmmaOp<256, A, B> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<A, B>;
};

// One warpgroup's m64 x N x k16 MMA into N / 2 FP32 accumulators per thread, always
// accumulating (tiles start from zeroed accumulators: one code path, no predicate that
// could make ptxas serialize the batch).
template <int N, bool kAMajorMN, bool kBMajorMN>
struct Wgmma {
  static constexpr auto kMajorA =
      kAMajorMN ? cute::SM90::GMMA::Major::MN : cute::SM90::GMMA::Major::K;
  static constexpr auto kMajorB =
      kBMajorMN ? cute::SM90::GMMA::Major::MN : cute::SM90::GMMA::Major::K;
  static constexpr bool kReadsBMNMajor = kBMajorMN;
  template <size_t... I>
  __device__ __forceinline__ static void run(uint64_t a, uint64_t b, float* d,
                                             std::index_sequence<I...>) {
    WgmmaOp<N, kMajorA, kMajorB>::type::fma(a, b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
  }
  // The four k16 MMAs of one 64-wide K step.
  __device__ __forceinline__ static void step(uint64_t desc_a, uint64_t desc_b, float* d) {
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      run(advance_k16<kAMajorMN>(desc_a, k16), advance_k16<kBMajorMN>(desc_b, k16), d,
          std::make_index_sequence<N / 2>{});
  }
};

// Keeps the compiler from moving accumulator reads or writes across the asynchronous
// wgmma that own the registers.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

}  // namespace megamoe::kernels::engine
