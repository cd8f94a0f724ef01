// MXFP4 codes -> BF16 pairs in the registers of a wgmma A fragment (the weight-streaming
// GEMM, weight_stream_kernel.cuh, where the weights are the A operand).
//
// A thread of an m64nNk16 A fragment holds, per k16 step and per row, the pairs (2c,
// 2c + 1) and (2c + 8, 2c + 9), c = lane % 4: byte c of each 8-code word of its row.
// So every thread reads its rows' whole words (its quad reads the same words) and
// decodes one byte of each into one BF16 pair, in four integer instructions and one
// BF16 multiply:
//  1. PRMT builds a word with the low code in bits 4..7, copies of its sign in bits
//     8..15 (PRMT's sign-replicate mode), the high code in bits 20..23 and copies of its
//     sign in bits 24..31;
//  2. a shift left by 2 moves both magnitudes to bits 6..8 and 22..24 of their 16-bit
//     halves and a copy of each sign to bits 15 and 31 (a left shift, which ptxas may
//     issue as IMAD.SHL on the FMA pipe: the ALU pipe is the decode's busiest);
//  3. a mask keeps those bits: each half is the E2M1 value times 2^-126 as a BF16 (the
//     three magnitude bits are exponent e and mantissa m; e = 0 reads as the subnormal
//     m x 2^-127, which is E2M1's 0.5 x 2^-126);
//  4. one BF16x2 multiply by 2^(scale - 1) (exact: two significant bits, subnormals
//     kept; an FMA adding -0, so -0 codes stay -0) gives E2M1 x 2^(scale - 127), the
//     transient decode's value bit for bit.
// A row's two factors of a step (one per 32 codes) share one register, and the multiply
// reads the half it needs (the .H0_H0 / .H1_H1 operand of HMUL2, no copy). The fast path
// takes scale bytes below 128; a step with any byte from 128 up takes FP32 math
// (scale_word, StepScales).
// decode_rows is a thread's whole step (its rows' words to its A-fragment registers);
// everything here also runs on the host, for tests/cpu/test_fragment_decode.py.
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

// The PRMT selector of the thread owning byte `c` (0..3) of each word: byte 0 = byte c
// of word << 4 (the low code in its top nibble), byte 1 = that byte's sign replicated,
// byte 2 = byte c of the word (the high code in its top nibble), byte 3 = its sign
// replicated. (c | (c | 8) << 4 | (4 + c) << 8 | (12 + c) << 12, as one multiply-add:
// ptxas recomputes it where registers are short.)
__host__ __device__ constexpr uint32_t fragment_selector(uint32_t c) {
  return c * 0x1111u + 0xC480u;
}

// Codes 2c (low half) and 2c + 1 (high half) of `word` as BF16x2 bits, times 2^-126.
__host__ __device__ __forceinline__ uint32_t pair_bits_times_2_pow_minus_126(uint32_t word,
                                                                             uint32_t selector) {
  const uint32_t placed = prmt(word << 4, word, selector);
  return (placed << 2) & 0x81C081C0u;
}

// A row's scale bytes of a step (bits 0-7: its words 0-3, bits 8-15: its words 4-7, as
// loaded) as the BF16 pair [2^(b0 - 1) | 2^(b1 - 1)] (bytes below 128): PRMT puts each
// byte in its own half, then the exponent field is b + 126.
__host__ __device__ __forceinline__ uint32_t row_factors(uint32_t scales) {
  return (prmt(scales, 0u, 0x4140u) << 7) + 0x3F003F00u;
}

// The fast path's product with one half of `factors` in both lanes (exact here,
// subnormals kept), as an FMA with a -0 addend: mul.rn.bf16x2 compiles to an FMA adding
// +0, which turns a -0 code into +0. The half is split off in PTX, which ptxas folds into
// the multiply's operand. On the host (tests) the same exact product in FP32, its sign
// kept.
template <int Half>
__host__ __device__ __forceinline__ uint32_t pair_times_factor(uint32_t bits, uint32_t factors) {
#ifdef __CUDA_ARCH__
  uint32_t out;
  if constexpr (Half == 0)
    asm("{.reg .b16 lo, hi; .reg .b32 f; mov.b32 {lo, hi}, %2; mov.b32 f, {lo, lo};"
        " fma.rn.bf16x2 %0, %1, f, %3;}"
        : "=r"(out)
        : "r"(bits), "r"(factors), "r"(0x80008000u));
  else
    asm("{.reg .b16 lo, hi; .reg .b32 f; mov.b32 {lo, hi}, %2; mov.b32 f, {hi, hi};"
        " fma.rn.bf16x2 %0, %1, f, %3;}"
        : "=r"(out)
        : "r"(bits), "r"(factors), "r"(0x80008000u));
  return out;
#else
  const float factor = float_from_bits(((factors >> (16 * Half)) & 0xFFFFu) << 16);
  uint32_t out = 0;
  for (int half = 0; half < 2; ++half) {
    const float product = float_from_bits(((bits >> (16 * half)) & 0xFFFFu) << 16) * factor;
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

// A row's scale bytes of a step (bits 0-7: words 0-3, bits 8-15: words 4-7, as loaded)
// as the word the decode reads: its factor pair (row_factors, bits 15 and 31 clear) when
// both bytes are below 128, the fast path's range, else the bytes themselves under bit 31
// (the FP32 path's; rare in real weights: |w| >= 8 in a block). The weight-streaming
// GEMM's scale loaders write these words; the consumers only test and multiply.
__host__ __device__ __forceinline__ uint32_t scale_word(uint32_t loaded) {
  return (loaded & 0x8080u) != 0u ? 0x80000000u | loaded : row_factors(loaded);
}

// A step's scale words for `Rows` rows (scale_word): whether the step takes the fast
// path (no word has bit 31: two instructions for a step), and each row's byte for the
// FP32 path.
template <int Rows>
struct StepScales {
  uint32_t words[Rows];
  bool fast;
  __host__ __device__ __forceinline__ explicit StepScales(const uint32_t (&scale_words)[Rows]) {
    uint32_t any = 0;
#pragma unroll
    for (int row = 0; row < Rows; ++row) {
      words[row] = scale_words[row];
      any |= scale_words[row];
    }
    fast = (any & 0x80000000u) == 0u;
  }
  // The scale byte of `row`'s words 0-3 (Half 0) or 4-7 (Half 1): as loaded under bit 31,
  // else from its factor's exponent field b + 126.
  template <int Half>
  __host__ __device__ __forceinline__ uint32_t byte(int row) const {
    const uint32_t word = words[row];
    return (word & 0x80000000u) != 0u ? (word >> (8 * Half)) & 0xFFu
                                      : ((word >> (16 * Half + 7)) & 0xFFu) - 126u;
  }
};

// A thread's A-fragment registers of one step for `Weights` weights (the streaming
// GEMM's gate and up halves: two) from its rows' codes: `words[2j]` the eight code words
// of weight j's row r (16 warp + lane / 4 of the warpgroup's 64), `words[2j + 1]` those
// of its row r + 8; `scales` rows 2j and 2j + 1 those rows' scale words (StepScales);
// `selector` the lane's (fragment_selector(lane % 4)).
// Word 2i / 2i + 1 is k16 step i's first / second eight columns: a0 / a2 from row r,
// a1 / a3 from row r + 8 (the PTX ISA's wgmma A-fragment layout for 16-bit types). One
// scale check covers every row, so the common path has all 16 x Weights pairs
// independent to interleave.
template <int Weights>
__host__ __device__ __forceinline__ void decode_rows(const uint32_t (&words)[2 * Weights][8],
                                                     const StepScales<2 * Weights>& scales,
                                                     uint32_t selector,
                                                     StepFragment (&fragments)[Weights]) {
  constexpr int kRows = 2 * Weights;
  uint32_t out[kRows][8];
  // Scale bytes from 128 up are rare: one branch for the step.
  if (scales.fast) {
#pragma unroll
    for (int row = 0; row < kRows; ++row)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        out[row][w] = pair_times_factor<0>(pair_bits_times_2_pow_minus_126(words[row][w], selector),
                                           scales.words[row]);
        out[row][w + 4] = pair_times_factor<1>(
            pair_bits_times_2_pow_minus_126(words[row][w + 4], selector), scales.words[row]);
      }
  } else {
#pragma unroll
    for (int row = 0; row < kRows; ++row)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        out[row][w] = pair_any_scale(pair_bits_times_2_pow_minus_126(words[row][w], selector),
                                     scales.template byte<0>(row));
        out[row][w + 4] =
            pair_any_scale(pair_bits_times_2_pow_minus_126(words[row][w + 4], selector),
                           scales.template byte<1>(row));
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

// ---- the transposed step (the dgrads: the weights as stored are the A operand, M along
// their packed columns and K along their rows) ----
// A fragment register holds a K pair, here two stored rows n and n + 1 at one column, and
// a stored byte holds two adjacent columns. The dgrad orders its output columns so that
// fragment rows g and g + 8 are the low and high codes of one byte (columns 2b and 2b +
// 1): then row g's register holds the low codes of bytes (n, b) and (n + 1, b), row g +
// 8's their high codes, both under the factor pair [2^(s(n) - 1) | 2^(s(n + 1) - 1)] (one
// 32-column block). Two m64 tiles of a warpgroup take bytes 2q and 2q + 1, so a thread's
// codes of one stored row are 16 bits, and `ldmatrix.trans` (8x8 matrices of 16-bit
// elements, the rows stored rows) hands each thread rows n and n + 1 of its 16-bit column
// as one register: row n in bits 0-15, row n + 1 in bits 16-31. That register gives the
// four registers of a K pair with the forward's three-instruction placement: PRMT puts
// row n's byte where the forward's low code goes and row n + 1's where its high code
// does (bits 20..23: the byte's high nibble as loaded, its low nibble after a left shift
// by 4, as row n's goes to bits 4..7).

// The PRMT selector of tile t's byte (2q + t) in a row pair (bytes 0, 1: row n's bytes 2q,
// 2q + 1; bytes 2, 3: row n + 1's): row n's byte into byte 0 and its sign into byte 1,
// row n + 1's into byte 2 and its sign into byte 3 (the forward's placement).
__host__ __device__ constexpr uint32_t column_pair_selector(uint32_t tile) {
  return tile * 0x1111u + 0xA280u;
}

// Codes of one column at rows n (low half) and n + 1 (high half) as BF16x2 bits times
// 2^-126, from their row pair (shifted left by 4 for the low codes, columns 2b; a byte's
// low nibble then holds its neighbour's high nibble, which the mask drops) with
// column_pair_selector(t) for tile t.
__host__ __device__ __forceinline__ uint32_t
column_pair_bits_times_2_pow_minus_126(uint32_t row_pair, uint32_t selector) {
  return (prmt(row_pair, row_pair, selector) << 2) & 0x81C081C0u;
}

// The same bits placed the other way: row n's byte into byte 1 and its sign into byte 2,
// row n + 1's into byte 3 (byte 0 is shifted out), then an arithmetic shift right by 6
// (which copies the high code's sign from bit 31). For the rare FP32 path's second
// placement in decode_column_pairs<true> (64-row chunks): with the left shift's IMAD.SHL
// there too, ptxas spilled those kernels.
__host__ __device__ constexpr uint32_t column_pair_selector_high(uint32_t tile) {
  return tile * 0x1111u + 0x2800u;
}
__host__ __device__ __forceinline__ uint32_t
column_pair_bits_times_2_pow_minus_126_high(uint32_t row_pair, uint32_t selector) {
  return static_cast<uint32_t>(static_cast<int32_t>(prmt(row_pair, row_pair, selector)) >> 6) &
         0x81C081C0u;
}

// The fast path's product with a factor per half (rows n and n + 1), as an FMA with a -0
// addend (see pair_times_factor); on the host the same exact product in FP32.
__host__ __device__ __forceinline__ uint32_t pair_times_factors(uint32_t bits, uint32_t factors) {
#ifdef __CUDA_ARCH__
  uint32_t out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(factors), "r"(0x80008000u));
  return out;
#else
  uint32_t out = 0;
  for (int half = 0; half < 2; ++half) {
    const float product = float_from_bits(((bits >> (16 * half)) & 0xFFFFu) << 16) *
                          float_from_bits(((factors >> (16 * half)) & 0xFFFFu) << 16);
    uint32_t product_bits;
    std::memcpy(&product_bits, &product, sizeof(product_bits));
    out |= (product_bits >> 16) << (16 * half);
  }
  return out;
#endif
}

// Any scales: pair_any_scale with a scale per half.
__host__ __device__ __forceinline__ uint32_t pair_any_scales(uint32_t bits, uint32_t scale_lo,
                                                             uint32_t scale_hi) {
  const float two_pow_126 = float_from_bits((126u + 127u) << 23);
  const float low = float_from_bits(bits << 16) * two_pow_126 * ue8m0(scale_lo);
  const float high = float_from_bits(bits & 0xFFFF0000u) * two_pow_126 * ue8m0(scale_hi);
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  uint32_t out;
  std::memcpy(&out, &pair, sizeof(out));
  return out;
}

// A value the compiler cannot identify with its earlier uses (an empty asm on the GPU),
// so work redone on it is redone, not kept live from before: the rare FP32 path
// recomputes what the fast path formed instead of holding its registers across the check.
__host__ __device__ __forceinline__ uint32_t recomputed(uint32_t v) {
#ifdef __CUDA_ARCH__
  asm volatile("" : "+r"(v));
#endif
  return v;
}

// A transposed step's placements: [2 k16 + j][2 tile + high] from the row pairs, by
// the left shift's placement or the right shift's (the same bits).
template <bool kLeftShift>
__host__ __device__ __forceinline__ void place_column_pairs(const uint32_t (&row_pairs)[8],
                                                            uint32_t (&placed)[8][4]) {
#pragma unroll
  for (int pair = 0; pair < 8; ++pair) {
    const uint32_t row_pair = row_pairs[pair];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      if constexpr (kLeftShift) {
        const uint32_t selector = column_pair_selector(tile);
        placed[pair][2 * tile] = column_pair_bits_times_2_pow_minus_126(row_pair << 4, selector);
        placed[pair][2 * tile + 1] = column_pair_bits_times_2_pow_minus_126(row_pair, selector);
      } else {
        const uint32_t selector = column_pair_selector_high(tile);
        placed[pair][2 * tile] =
            column_pair_bits_times_2_pow_minus_126_high(row_pair << 4, selector);
        placed[pair][2 * tile + 1] =
            column_pair_bits_times_2_pow_minus_126_high(row_pair, selector);
      }
    }
  }
}

// A transposed step's values from its placements: the fast path (factor pairs) and the
// FP32 path (any scales).
__host__ __device__ __forceinline__ void column_pairs_times_factors(const uint32_t (&placed)[8][4],
                                                                    const StepScales<8>& scales,
                                                                    uint32_t (&out)[8][4]) {
#pragma unroll
  for (int pair = 0; pair < 8; ++pair)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      out[pair][r] = pair_times_factors(placed[pair][r], scales.words[pair]);
}
__host__ __device__ __forceinline__ void column_pairs_any_scales(const uint32_t (&placed)[8][4],
                                                                 const StepScales<8>& scales,
                                                                 uint32_t (&out)[8][4]) {
#pragma unroll
  for (int pair = 0; pair < 8; ++pair)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      out[pair][r] = pair_any_scales(placed[pair][r], scales.byte<0>(pair), scales.byte<1>(pair));
}

// A thread's A-fragment registers of one transposed step: its two tiles' (bytes 2q and
// 2q + 1) over 64 stored rows. `row_pairs[2 k16 + j]` holds the thread's 16 bits of stored
// rows 16 k16 + 2c + 8 j (bits 0-15) and + 1 (bits 16-31), c = lane % 4, as ldmatrix.trans
// delivers them; `scales` word 2 k16 + j the scale word
// (scale_word) of rows 16 k16 + 2c + 8 j and + 1 at the thread's column block. Register
// a0 / a1 / a2 / a3 of tile t and k16 step k16: fragment row g (low codes) / g + 8 (high
// codes) of rows 2c, 2c + 1, then of rows 2c + 8, 2c + 9 (the PTX ISA's A layout).
// kValuesBeforeCheck: the multiplies come before the step's scale check (the FP32 path
// then redoes the step), else inside its fast branch; the same bits either way. Which
// runs faster depends on the chunk (StreamConfig::kValuesBeforeCheck).
template <bool kValuesBeforeCheck>
__host__ __device__ __forceinline__ void decode_column_pairs(const uint32_t (&row_pairs)[8],
                                                             const StepScales<8>& scales,
                                                             StepFragment (&fragments)[2]) {
  uint32_t placed[8][4], out[8][4];  // [2 k16 + j][2 tile + high]
  place_column_pairs<true>(row_pairs, placed);
  if constexpr (kValuesBeforeCheck) {
    // The fast path's values first, whatever the scales (no branch between the loads
    // and the multiplies); a step with a scale byte from 128 up (rare) places its codes
    // again from the row pairs (8 registers kept, not the 32 placed ones) and recomputes
    // its values through FP32.
    column_pairs_times_factors(placed, scales, out);
    if (!scales.fast) {
      uint32_t again[8];
#pragma unroll
      for (int pair = 0; pair < 8; ++pair) again[pair] = recomputed(row_pairs[pair]);
      place_column_pairs<false>(again, placed);
      column_pairs_any_scales(placed, scales, out);
    }
  } else if (scales.fast) {
    column_pairs_times_factors(placed, scales, out);
  } else {
    column_pairs_any_scales(placed, scales, out);
  }
#pragma unroll
  for (int pair = 0; pair < 8; ++pair)
#pragma unroll
    for (int r = 0; r < 4; ++r) fragments[r / 2][pair / 2][2 * (pair % 2) + r % 2] = out[pair][r];
}

// One tile's fragment of decode_column_pairs (the tile of PRMT selector `selector`:
// column_pair_selector(t) for byte 2q + t), the same bits: the 128-row transposed chunks
// decode and multiply a tile at a time, so that only one tile's fragment is written while
// the other tile's MMAs run; the one-tile chunks (192 and 256 rows) give consumer
// warpgroup t the tile of byte 2q + t.
__host__ __device__ __forceinline__ void decode_column_pair_tile(const uint32_t (&row_pairs)[8],
                                                                 const StepScales<8>& scales,
                                                                 uint32_t selector,
                                                                 StepFragment& fragment) {
  if (scales.fast) {
#pragma unroll
    for (int pair = 0; pair < 8; ++pair) {
      const uint32_t low = column_pair_bits_times_2_pow_minus_126(row_pairs[pair] << 4, selector);
      const uint32_t high = column_pair_bits_times_2_pow_minus_126(row_pairs[pair], selector);
      fragment[pair / 2][2 * (pair % 2)] = pair_times_factors(low, scales.words[pair]);
      fragment[pair / 2][2 * (pair % 2) + 1] = pair_times_factors(high, scales.words[pair]);
    }
  } else {
#pragma unroll
    for (int pair = 0; pair < 8; ++pair) {
      const uint32_t low = column_pair_bits_times_2_pow_minus_126(row_pairs[pair] << 4, selector);
      const uint32_t high = column_pair_bits_times_2_pow_minus_126(row_pairs[pair], selector);
      fragment[pair / 2][2 * (pair % 2)] =
          pair_any_scales(low, scales.byte<0>(pair), scales.byte<1>(pair));
      fragment[pair / 2][2 * (pair % 2) + 1] =
          pair_any_scales(high, scales.byte<0>(pair), scales.byte<1>(pair));
    }
  }
}

// Tile `kTile` with its selector a constant (the two-tile chunks).
template <int kTile>
__host__ __device__ __forceinline__ void decode_column_pair_tile(const uint32_t (&row_pairs)[8],
                                                                 const StepScales<8>& scales,
                                                                 StepFragment& fragment) {
  decode_column_pair_tile(row_pairs, scales, column_pair_selector(kTile), fragment);
}

}  // namespace megamoe::kernels::mxfp4
