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
// 2^(scale - 1) is a BF16 for scale <= 128 (`fast`); larger scales take FP32 math.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

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
// mul.rn.bf16x2 compiles to an FMA adding +0, which turns a -0 code into +0.
__device__ __forceinline__ uint32_t pair_times_factor(uint32_t bits, uint32_t factor) {
  uint32_t out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(factor), "r"(0x80008000u));
  return out;
}

// Any scale: the transient decode's FP32 arithmetic (code x 2^126 x 2^(scale - 127),
// exact, then one rounding to BF16; scale 0xFF gives NaN).
__device__ __forceinline__ uint32_t pair_any_scale(uint32_t bits, uint32_t scale) {
  const float two_pow_126 = __uint_as_float((126u + 127u) << 23), factor = ue8m0(scale);
  const float low = __uint_as_float(bits << 16) * two_pow_126 * factor;
  const float high = __uint_as_float(bits & 0xFFFF0000u) * two_pow_126 * factor;
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

}  // namespace megamoe::kernels::mxfp4
