// MXFP4 -> BF16 decode of one K block of a grouped-GEMM B tile, in shared memory.
//
// The producer's TMA puts a K block's codes (BLOCK_N rows x 32 bytes, unswizzled) and
// scales (BLOCK_N x uint16: the two UE8M0 bytes of the block's two 32-column halves)
// into the stage's staging area; the consumer threads decode them into the stage's B
// tile in the layout TMA writes for a BF16 B (K-major, 128-byte swizzle), so the wgmma
// descriptors stay those of the BF16 engine. Values are those of the transient decode
// kernel (kernels/mxfp4_decode.cuh) bit for bit: E2M1 x 2^(scale - 127), exact in FP32,
// then rounded (exactly) to BF16.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp4_values.cuh"

namespace megamoe::kernels::mxfp4 {

// Bytes of one K block (64 columns) of one B row: 32 code bytes, one 16-byte unit per
// 32-column half, each half with its own scale byte.
constexpr int kCodeBytesPerRow = 32;
constexpr int kUnitBytes = 16;
constexpr int kUnitsPerRow = 2;

// FP32 bits of code `index` (0..7) of an 8-code word, times 2^-126: the sign to bit 31
// and the three magnitude bits (exponent e, mantissa m) to bits 22..24, which reads as
// 2^(e-127) (1 + m/2) for e > 0 and as the subnormal m 2^-127 for e = 0, i.e. the
// E2M1 value times 2^-126 in every case (code 1, 0.5, becomes the subnormal 2^-127).
// One shift left puts the code's top bit at bit 31; an arithmetic shift right by 6
// moves the magnitude to bits 22..24 (the copies of the sign bit it drags along are
// masked off).
__host__ __device__ constexpr uint32_t e2m1_bits_times_2_pow_minus_126(uint32_t word, int index) {
  return static_cast<uint32_t>(static_cast<int32_t>(word << (28 - 4 * index)) >> 6) & 0x81C00000u;
}

static_assert(e2m1_bits_times_2_pow_minus_126(0x0u, 0) == 0x00000000u, "+0");
static_assert(e2m1_bits_times_2_pow_minus_126(0x1u, 0) == 0x00400000u, "0.5: 2^-127");
static_assert(e2m1_bits_times_2_pow_minus_126(0x2u, 0) == 0x00800000u, "1: 2^-126");
static_assert(e2m1_bits_times_2_pow_minus_126(0x7u, 0) == 0x01C00000u, "6: 1.5 x 2^-124");
static_assert(e2m1_bits_times_2_pow_minus_126(0x8u, 0) == 0x80000000u, "-0");
static_assert(e2m1_bits_times_2_pow_minus_126(0xB0000000u, 7) == 0x80C00000u, "-1.5, top code");
static_assert(e2m1_bits_times_2_pow_minus_126(0x00000500u, 2) == 0x01400000u, "3, code 2");

// Byte offset of 16-byte chunk `chunk` (8 BF16 along K) of row `row` in a K-major B
// tile with 128-byte rows and the 128-byte swizzle (the chunk index XOR the row's
// position in its 8-row swizzle atom), from a 1024-byte-aligned tile start.
__host__ __device__ constexpr int swizzled_chunk_offset(int row, int chunk) {
  return row * 128 + ((chunk ^ (row % 8)) * 16);
}

// Eight codes -> eight BF16 (one 16-byte chunk) at scale byte `scale`.
__device__ __forceinline__ uint4 decode_word(uint32_t word, uint32_t scale) {
  uint4 chunk;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&chunk);
  auto code = [&](int index) {
    return __uint_as_float(e2m1_bits_times_2_pow_minus_126(word, index));
  };
  if (scale <= 128u) {
    // One multiply by 2^(scale - 1) = 2^126 x 2^(scale - 127), a normal FP32 for these
    // scales; the product is exact (subnormal inputs and outputs are kept: no FTZ).
    const float factor = __uint_as_float((scale + 126u) << 23);
#pragma unroll
    for (int pair = 0; pair < 4; ++pair)
      pairs[pair] = __floats2bfloat162_rn(code(2 * pair) * factor, code(2 * pair + 1) * factor);
  } else {
    // 2^(scale - 1) overflows FP32: first the exact E2M1 value, then the scale (0xFF:
    // NaN), as the transient decode does.
    const float factor = ue8m0(scale);
    const float two_pow_126 = __uint_as_float((126u + 127u) << 23);
#pragma unroll
    for (int pair = 0; pair < 4; ++pair)
      pairs[pair] = __floats2bfloat162_rn(code(2 * pair) * two_pow_126 * factor,
                                          code(2 * pair + 1) * two_pow_126 * factor);
  }
  return chunk;
}

// Decode one K block of a B tile: `codes` [BlockN][32] bytes and `scales` [BlockN]
// uint16 (staging) -> `b_tile` [BlockN][64] BF16, swizzled. `thread` is this thread's
// index among the `Threads` decoding threads. Units are (row, 32-column half), in
// order, so a warp reads 512 contiguous code bytes and a quarter warp's 16-byte
// stores hit 8 different bank groups (conflict-free).
template <int BlockN, int Threads>
__device__ __forceinline__ void decode_b_block(const uint8_t* codes, const uint16_t* scales,
                                               uint8_t* b_tile, int thread) {
  constexpr int kUnits = BlockN * kUnitsPerRow;
  static_assert(kUnits % Threads == 0, "every thread decodes the same number of units");
#pragma unroll
  for (int i = 0; i < kUnits / Threads; ++i) {
    const int unit = thread + i * Threads;
    const int row = unit / kUnitsPerRow, half = unit % kUnitsPerRow;
    const uint4 unit_codes = *reinterpret_cast<const uint4*>(codes + unit * kUnitBytes);
    const uint32_t scale = (static_cast<uint32_t>(scales[row]) >> (8 * half)) & 0xFFu;
    const uint32_t words[4] = {unit_codes.x, unit_codes.y, unit_codes.z, unit_codes.w};
#pragma unroll
    for (int w = 0; w < 4; ++w)
      *reinterpret_cast<uint4*>(b_tile + swizzled_chunk_offset(row, 4 * half + w)) =
          decode_word(words[w], scale);
  }
}

}  // namespace megamoe::kernels::mxfp4
