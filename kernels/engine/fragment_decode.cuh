// MXFP4 codes -> BF16 pairs in the registers of a wgmma A fragment (the weight-streaming
// GEMM, weight_stream_kernel.cuh, where the weights are the A operand).
//
// A thread of an m64nNk16 A fragment holds, per k16 step and per row, the pairs (2c,
// 2c + 1) and (2c + 8, 2c + 9), c = lane % 4: byte c of each 8-code word of its row.
// So every thread reads its rows' whole words (its quad reads the same words) and
// decodes one byte of each into one BF16 pair, in four integer instructions and one
// BF16 multiply:
//  1. PRMT builds a word with the low code in bits 12..15, copies of its sign in bits
//     16..23 (PRMT's sign-replicate mode) and the high code in bits 28..31;
//  2. an arithmetic shift right by 6 moves both magnitudes to bits 6..8 and 22..24 of
//     their 16-bit halves and the low code's sign to bit 15 (the high code's stays at 31);
//  3. a mask keeps those bits: each half is the E2M1 value times 2^-126 as a BF16 (the
//     three magnitude bits are exponent e and mantissa m; e = 0 reads as the subnormal
//     m x 2^-127, which is E2M1's 0.5 x 2^-126);
//  4. one BF16x2 multiply by 2^(scale - 1) (exact: two significant bits, subnormals
//     kept; an FMA adding -0, so -0 codes stay -0) gives E2M1 x 2^(scale - 127), the
//     transient decode's value bit for bit.
// 2^(scale - 1) is a BF16 for scale <= 128; larger scales take FP32 math. decode_rows is
// a thread's whole step (its rows' words to its A-fragment registers); everything here
// also runs on the host, for tests/cpu/test_fragment_decode.py.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "../mxfp4_values.cuh"

namespace megamoe::kernels::mxfp4 {

// PRMT in its default mode, sign-replicate bit included (selector nibble bit 3: the
// selected byte's bit 7 fills the byte); the same selection on the host for tests.
__host__ __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    out |= byte << (8 * i);
  }
  return out;
#endif
}

// The PRMT selector of the thread owning byte `c` (0..3) of each word: byte 1 = byte c
// of word << 4 (the low code in its top nibble), byte 2 = that byte's sign replicated,
// byte 3 = byte c of the word (the high code in its top nibble); byte 0 is shifted out.
__host__ __device__ constexpr uint32_t fragment_selector(uint32_t c) {
  return c | (c << 4) | ((c | 8u) << 8) | ((4u + c) << 12);
}

// Codes 2c (low half) and 2c + 1 (high half) of `word` as BF16x2 bits, times 2^-126.
__host__ __device__ __forceinline__ uint32_t pair_bits_times_2_pow_minus_126(uint32_t word,
                                                                             uint32_t selector) {
  const uint32_t placed = prmt(word << 4, word, selector);
  return static_cast<uint32_t>(static_cast<int32_t>(placed) >> 6) & 0x81C081C0u;
}

// The BF16x2 factor 2^(scale - 1) for both halves (scale <= 128).
__host__ __device__ __forceinline__ uint32_t pair_factor(uint32_t scale) {
  return ((scale + 126u) << 7) * 0x00010001u;
}

// The fast path's product (exact here, subnormals kept), as an FMA with a -0 addend:
// mul.rn.bf16x2 compiles to an FMA adding +0, which turns a -0 code into +0. On the host
// (tests) the same exact product in FP32, its sign kept.
__host__ __device__ __forceinline__ uint32_t pair_times_factor(uint32_t bits, uint32_t factor) {
#ifdef __CUDA_ARCH__
  uint32_t out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(factor), "r"(0x80008000u));
  return out;
#else
  uint32_t out = 0;
  for (int half = 0; half < 2; ++half) {
    const float product = float_from_bits(((bits >> (16 * half)) & 0xFFFFu) << 16) *
                          float_from_bits(((factor >> (16 * half)) & 0xFFFFu) << 16);
    uint32_t product_bits;
    std::memcpy(&product_bits, &product, sizeof(product_bits));
    out |= (product_bits >> 16) << (16 * half);
  }
  return out;
#endif
}

// Any scale: the transient decode's FP32 arithmetic (code x 2^126 x 2^(scale - 127),
// exact, then one rounding to BF16; scale 0xFF gives NaN).
__host__ __device__ __forceinline__ uint32_t pair_any_scale(uint32_t bits, uint32_t scale) {
  const float two_pow_126 = float_from_bits((126u + 127u) << 23), factor = ue8m0(scale);
  const float low = float_from_bits(bits << 16) * two_pow_126 * factor;
  const float high = float_from_bits(bits & 0xFFFF0000u) * two_pow_126 * factor;
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  uint32_t out;
  std::memcpy(&out, &pair, sizeof(out));
  return out;
}

// One weight's A fragment of a 64-deep step (four m64nNk16 MMAs): [k16][a0..a3].
using StepFragment = uint32_t[4][4];

// Whether every scale byte of `pairs` is at most 128 (2^(s - 1) a BF16): a byte is above
// 128 when bit 7 and a lower bit are set, and (byte & 0x7F) + 0x7F carries into bit 7
// exactly when a lower bit is set (no carry leaves the byte). Plain integer math, the
// same on the host: fewer instructions than a per-byte compare (__vcmpgtu4 is emulated).
template <int Weights>
__host__ __device__ __forceinline__ bool scales_at_most_128(const uint32_t (&pairs)[Weights]) {
  uint32_t above = 0;
#pragma unroll
  for (int j = 0; j < Weights; ++j) above |= ((pairs[j] & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & pairs[j];
  return (above & 0x80808080u) == 0u;
}

// A thread's A-fragment registers of one step for `Weights` weights (the streaming
// GEMM's gate and up halves: two) from its rows' codes: `words[2j]` the eight code words
// of weight j's row r (16 warp + lane / 4 of the warpgroup's 64), `words[2j + 1]` those
// of its row r + 8; `pairs[j]` their scale bytes (bits 0-7: row r's words 0-3, 8-15: its
// words 4-7, 16-31: row r + 8's likewise); `selector` the lane's (fragment_selector(lane
// % 4)). Word 2i / 2i + 1 is k16 step i's first / second eight columns: a0 / a2 from row
// r, a1 / a3 from row r + 8 (the PTX ISA's wgmma A-fragment layout for 16-bit types).
// One scale check covers every row, so the common path has all 16 x Weights pairs
// independent to interleave.
template <int Weights>
__host__ __device__ __forceinline__ void decode_rows(const uint32_t (&words)[2 * Weights][8],
                                                     const uint32_t (&pairs)[Weights],
                                                     uint32_t selector,
                                                     StepFragment (&fragments)[Weights]) {
  constexpr int kRows = 2 * Weights;
  uint32_t out[kRows][8];
  // Scale bytes above 128 (2^(s - 1) is no BF16) are rare: one branch for the step.
  if (scales_at_most_128(pairs)) {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      const uint32_t pair = (pairs[row / 2] >> (16 * (row % 2))) & 0xFFFFu;
      const uint32_t factor[2] = {pair_factor(pair & 0xFFu), pair_factor(pair >> 8)};
#pragma unroll
      for (int w = 0; w < 8; ++w)
        out[row][w] = pair_times_factor(pair_bits_times_2_pow_minus_126(words[row][w], selector),
                                        factor[w / 4]);
    }
  } else {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      const uint32_t pair = (pairs[row / 2] >> (16 * (row % 2))) & 0xFFFFu;
#pragma unroll
      for (int w = 0; w < 8; ++w)
        out[row][w] = pair_any_scale(pair_bits_times_2_pow_minus_126(words[row][w], selector),
                                     w < 4 ? pair & 0xFFu : pair >> 8);
    }
  }
#pragma unroll
  for (int row = 0; row < kRows; ++row)
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16) {
      fragments[row / 2][k16][row % 2] = out[row][2 * k16];
      fragments[row / 2][k16][2 + row % 2] = out[row][2 * k16 + 1];
    }
}

}  // namespace megamoe::kernels::mxfp4
