// MXFP4 element and scale values (kernels/mxfp4_decode_params.h for the format),
// shared by the transient decode kernel and the grouped GEMM's in-tile decode.
#pragma once

#include <cstdint>
#include <cstring>

namespace megamoe::kernels {

namespace mxfp4 {

// FP32 from its bits, on the device and on the host (the host tests run these).
__host__ __device__ __forceinline__ float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// E2M1 code -> FP32 by bits (no table: an indexed local array would live in local
// memory): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7 are exponent field
// e = code >> 1 (bias 1), mantissa bit m = code & 1; code 1 (e = 0, m = 1) is the
// subnormal 0.5. Bit 3 is the sign.
__host__ __device__ __forceinline__ float e2m1(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  uint32_t bits = e == 0u ? (m ? 0x3F000000u : 0u) : ((e + 126u) << 23) | (m << 22);
  bits |= (code & 8u) << 28;
  return float_from_bits(bits);
}

// 2^(byte - 127) from its FP32 bits: byte 0 is the subnormal 2^-127, 0xFF is NaN.
__host__ __device__ __forceinline__ float ue8m0(uint32_t byte) {
  const uint32_t bits = byte == 0u ? 0x00400000u : (byte == 0xFFu ? 0x7FC00000u : byte << 23);
  return float_from_bits(bits);
}

}  // namespace mxfp4

}  // namespace megamoe::kernels
