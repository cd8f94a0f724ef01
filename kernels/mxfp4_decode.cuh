// MXFP4 -> BF16 decode of base weights (kernels/mxfp4_decode_params.h for the math).
//
// Memory-bound: each thread reads one block's 16 code bytes (one 16-byte load) and
// its scale byte, and writes 64 bytes (four 16-byte stores); consecutive threads own
// consecutive blocks, so loads and stores are fully coalesced.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp4_decode_params.h"
#include "mxfp4_values.cuh"

namespace megamoe::kernels {

// Templated only so that the translation unit including this header owns the
// instantiation (a plain __global__ in a header would clash between units).
template <int kUnused>
__global__ void __launch_bounds__(kMxfp4DecodeThreads) mxfp4_decode_blocks(Mxfp4DecodeParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4* __restrict__ packed = reinterpret_cast<const uint4*>(p.packed);
  uint4* __restrict__ out = static_cast<uint4*>(p.out);
  for (int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       block < p.num_blocks; block += stride) {
    const uint4 codes = __ldg(packed + block);
    const float scale = mxfp4::ue8m0(__ldg(p.scales + block));
    const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      // One 32-bit word = 8 codes = 8 BF16 = one 16-byte store.
      uint4 values;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&values);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (words[w] >> (8 * b)) & 0xFFu;
        pairs[b] =
            __floats2bfloat162_rn(mxfp4::e2m1(byte & 0xFu) * scale, mxfp4::e2m1(byte >> 4) * scale);
      }
      out[block * 4 + w] = values;
    }
  }
}

inline Mxfp4DecodeKernels mxfp4_decode_kernels() {
  return Mxfp4DecodeKernels{&mxfp4_decode_blocks<0>};
}

}  // namespace megamoe::kernels
