// MXFP4 -> BF16 decode of base weights (kernels/mxfp4_decode_params.h for the math).
//
// Memory-bound: 0.27 B read per 2 B written. Each thread decodes 32-bit code words (8
// codes -> one 16-byte store); lane l of a warp owns word base + l, so every load
// instruction of a warp reads 128 contiguous bytes and every store writes 512. One word
// per thread and pass, with the device full of threads: batches of 2 to 8 loads per
// thread were 2-5% slower (docs/PERFORMANCE.md, thirty-seventh session). A word's four
// BF16 pairs come from the weight-streaming GEMM's placement (engine/fragment_decode.cuh:
// PRMT, shift, mask, then one exact BF16x2 multiply by 2^(scale - 1)); scale bytes from
// 128 up (rare; 0xFF is NaN) take the FP32 path.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "engine/fragment_decode.cuh"
#include "mxfp4_decode_params.h"

namespace megamoe::kernels {

namespace mxfp4_decode {

constexpr int kWordsPerBlock = kMxfp4Block / 8;  // 8 codes per 32-bit word

// The 8 BF16 values of one code word under its block's scale byte.
__device__ __forceinline__ uint4 decode_word(uint32_t word, uint32_t scale) {
  uint32_t pairs[4];
#pragma unroll
  for (int c = 0; c < 4; ++c)
    pairs[c] = mxfp4::pair_bits_times_2_pow_minus_126(word, mxfp4::fragment_selector(c));
  if (scale < 128u) {
    const uint32_t factors = mxfp4::row_factors(scale);  // low half: 2^(scale - 1)
#pragma unroll
    for (int c = 0; c < 4; ++c) pairs[c] = mxfp4::pair_times_factor<0>(pairs[c], factors);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) pairs[c] = mxfp4::pair_any_scale(pairs[c], scale);
  }
  return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

}  // namespace mxfp4_decode

// Templated only so that the translation unit including this header owns the
// instantiation (a plain __global__ in a header would clash between units).
template <int kUnused>
__global__ void __launch_bounds__(kMxfp4DecodeThreads) mxfp4_decode_words(Mxfp4DecodeParams p) {
  using namespace mxfp4_decode;
  const int64_t num_words = p.num_blocks * kWordsPerBlock;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint32_t* __restrict__ words = reinterpret_cast<const uint32_t*>(p.packed);
  uint4* __restrict__ out = static_cast<uint4*>(p.out);
  for (int64_t word = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; word < num_words;
       word += stride)
    out[word] = decode_word(__ldg(words + word), __ldg(p.scales + word / kWordsPerBlock));
}

inline Mxfp4DecodeKernels mxfp4_decode_kernels() {
  return Mxfp4DecodeKernels{&mxfp4_decode_words<0>};
}

}  // namespace megamoe::kernels
