// The weight-streaming GEMMs' MMAs (m64 x N x k16, register or shared-memory A) and
// the accumulators' layout, which every streaming epilogue reads.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "weight_stream_operand_a.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

// ---- the MMAs: m64 x TOKENS x k16 into TOKENS / 2 accumulators per thread ----

// kSideMN: the segment steps' A (the adapter factor's box) is MN-major (Gated, Store) or
// K-major (the transposed kinds, StoreMN and ActivationBackward).
template <int N, bool kSideMN>
struct StreamMmaOps;
#define MEGAMOE_STREAM_MMA_OPS(N)                                                              \
  template <bool kSideMN>                                                                      \
  struct StreamMmaOps<N, kSideMN> {                                                            \
    using Side =                                                                               \
        cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<kSideMN ? cute::SM90::GMMA::Major::MN \
                                                                 : cute::SM90::GMMA::Major::K, \
                                                         cute::SM90::GMMA::Major::K>;          \
    using Registers =                                                                          \
        cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,           \
                                                         cute::SM90::GMMA::Major::K>;          \
  };
MEGAMOE_STREAM_MMA_OPS(32)
MEGAMOE_STREAM_MMA_OPS(64)
MEGAMOE_STREAM_MMA_OPS(128)
MEGAMOE_STREAM_MMA_OPS(192)
MEGAMOE_STREAM_MMA_OPS(256)
#undef MEGAMOE_STREAM_MMA_OPS

template <int N, bool kSideMN>
struct StreamMma {
  using Ops = StreamMmaOps<N, kSideMN>;
  template <size_t... I>
  __device__ __forceinline__ static void side(uint64_t a, uint64_t b, float* d,
                                              std::index_sequence<I...>) {
    Ops::Side::fma(a, b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
  }
  template <size_t... I>
  __device__ __forceinline__ static void registers(const uint32_t (&a)[4], uint64_t b, float* d,
                                                   std::index_sequence<I...>) {
    Ops::Registers::fma(a[0], a[1], a[2], a[3], b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
  }
  // A segment step: the factor's box against the pool tile.
  __device__ __forceinline__ static void side_step(uint64_t desc_a, uint64_t desc_b, float* d) {
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      side(advance_k16_low_word<kSideMN>(desc_a, k16), advance_k16_low_word<false>(desc_b, k16), d,
           std::make_index_sequence<N / 2>{});
  }
  // Half a base step: one weight's decoded fragment against the pool tile.
  __device__ __forceinline__ static void base_half_step(const Fragment& a, uint64_t desc_b,
                                                        float* acc) {
#pragma unroll
    for (int k16 = 0; k16 < kBlockK / 16; ++k16)
      registers(a[k16], advance_k16_low_word<false>(desc_b, k16), acc,
                std::make_index_sequence<N / 2>{});
  }
};

// `op` gets the width for `rows` data rows (stream_wide_width, at most Max: the chunk)
// as an integral constant. The width is uniform over the warpgroup and fixed for a tile.
template <int Max, int Width, int... Wider, class Op>
__device__ __forceinline__ void with_mma_width(int rows,
                                               std::integer_sequence<int, Width, Wider...>,
                                               Op&& op) {
  if constexpr (sizeof...(Wider) == 0 || Width >= Max) {
    op(std::integral_constant<int, Width>{});
  } else if (rows <= Width) {
    op(std::integral_constant<int, Width>{});
  } else {
    with_mma_width<Max>(rows, std::integer_sequence<int, Wider...>{}, std::forward<Op>(op));
  }
}

// The accumulators the epilogues read: accumulator i of a thread is A row r (i % 4 < 2)
// or r + 8 of its half, chunk row 8 (i / 4) + 2 (lane % 4) + i % 2.
template <int Tokens>
struct StreamFragmentRows {
  int lane, row;  // row: r of the warpgroup's 64
  __device__ __forceinline__ explicit StreamFragmentRows(int thread)
      : lane(thread % 32), row(16 * (thread / 32) + (thread % 32) / 4) {}
  __device__ __forceinline__ int token(int i) const { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; }
  __device__ __forceinline__ int row_of(int i) const { return row + 8 * ((i % 4) / 2); }
};

}  // namespace megamoe::kernels::engine
