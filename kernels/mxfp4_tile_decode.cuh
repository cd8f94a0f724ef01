// MXFP4 -> BF16 decode of one K block of a grouped-GEMM B tile, in shared memory.
//
// The producer's TMA puts a K block's codes (unswizzled) into the stage and the
// decoding threads read the scales from global memory; they decode into the stage's B
// tile in the layout TMA writes for
// a BF16 B (K-major or MN-major, 128-byte swizzle), so the wgmma descriptors stay those
// of the BF16 engine. Values are those of the transient decode
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

// Eight codes -> eight BF16 (one 16-byte chunk) at scale byte `scale`, by FP32 math:
// the path for scales whose products leave the BF16 normal range (rare; see
// ScaleTables), exactly the transient decode's arithmetic.
__device__ __forceinline__ uint4 decode_word_fp32(uint32_t word, uint32_t scale) {
  uint4 chunk;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&chunk);
  auto code = [&](int index) {
    return __uint_as_float(e2m1_bits_times_2_pow_minus_126(word, index));
  };
  // code x 2^126 is the exact E2M1 value; times the scale (0xFF: NaN) as the transient
  // decode does (exact, subnormals kept: no FTZ).
  const float factor = ue8m0(scale);
  const float two_pow_126 = __uint_as_float((126u + 127u) << 23);
#pragma unroll
  for (int pair = 0; pair < 4; ++pair)
    pairs[pair] = __floats2bfloat162_rn(code(2 * pair) * two_pow_126 * factor,
                                        code(2 * pair + 1) * two_pow_126 * factor);
  return chunk;
}

// PRMT's byte select (selector nibbles with bit 3 clear): `__byte_perm` on the device,
// the same selection on the host, so the table path below can be checked on a CPU.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, selector);
#else
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    out |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return out;
#endif
}

// The BF16 bytes of the eight magnitudes E2M1(m) x 2^(scale - 127), m = 0..7, as
// byte-permute tables (low bytes of m = 0..3 | 4..7, high bytes likewise): one PRMT
// then looks up four codes at once. Built once per 32-value unit. Exact by integer
// arithmetic where every product is a normal BF16 (2 <= scale <= 252): E2M1 magnitude
// m = 2e + f (e >= 1) is 2^(e-1) (1 + f/2), so its BF16 bits are (m << 6) plus the
// exponent (scale - 1) << 7; m = 1 (0.5) is (scale - 1) << 7 alone, m = 0 is zero.
struct ScaleTables {
  uint32_t low[2], high[2];
  static constexpr uint32_t kFastMin = 2, kFastMax = 252;

  __host__ __device__ __forceinline__ static bool fast(uint32_t scale) {
    return scale - kFastMin <= kFastMax - kFastMin;  // unsigned: one compare
  }
  __host__ __device__ __forceinline__ explicit ScaleTables(uint32_t scale) {
    const uint32_t exponent = (scale - 1u) << 7;
    const uint32_t both = exponent | (exponent << 16);  // one copy per 16-bit lane
    // 16-bit lanes (m, m + 1): bits of magnitudes 0|1, 2|3, 4|5, 6|7 (no carry out of
    // a lane: the largest is 252 << 7 + 448 < 2^16).
    const uint32_t m01 = both & 0xFFFF0000u;
    const uint32_t m23 = both + 0x00C00080u;
    const uint32_t m45 = both + 0x01400100u;
    const uint32_t m67 = both + 0x01C00180u;
    low[0] = byte_perm(m01, m23, 0x6420);
    high[0] = byte_perm(m01, m23, 0x7531);
    low[1] = byte_perm(m45, m67, 0x6420);
    high[1] = byte_perm(m45, m67, 0x7531);
  }

  // Eight codes (two per byte, low nibble first) -> eight BF16: 15 integer instructions.
  __host__ __device__ __forceinline__ uint4 decode(uint32_t word) const {
    const uint32_t magnitude = word & 0x77777777u;  // 3-bit selectors, no sign mode
    // Each code's sign goes to bit 7 of its high byte before the bytes are paired, one
    // select per four codes: code 2j's sign (bit 3 of byte j) is bit 7 of byte j of
    // word << 4, code 2j + 1's is bit 7 of byte j of word. (A magnitude's high byte has
    // bit 7 clear: the tables hold no sign.)
    const uint32_t word_shifted = word << 4;
    const uint32_t low_a = byte_perm(low[0], low[1], magnitude);  // codes 0..3
    const uint32_t high_a = byte_perm(high[0], high[1], magnitude) |
                            (byte_perm(word_shifted, word, 0x5140) & 0x80808080u);
    const uint32_t low_b = byte_perm(low[0], low[1], magnitude >> 16);  // codes 4..7
    const uint32_t high_b = byte_perm(high[0], high[1], magnitude >> 16) |
                            (byte_perm(word_shifted, word, 0x7362) & 0x80808080u);
    // BF16 pair j: low and high byte of code 2j, then of code 2j + 1.
    uint4 chunk;
    chunk.x = byte_perm(low_a, high_a, 0x5140);
    chunk.y = byte_perm(low_a, high_a, 0x7362);
    chunk.z = byte_perm(low_b, high_b, 0x5140);
    chunk.w = byte_perm(low_b, high_b, 0x7362);
    return chunk;
  }
};

// Shared-window addresses and explicit LDS/STS: the stage pointers are generic, and
// generic loads/stores cost more than shared ones.
__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// One unit's 16 code bytes: four words of eight codes.
__device__ __forceinline__ void load_unit_codes(uint32_t address, uint32_t (&words)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
               : "r"(address));
}

// A unit's four words -> its four 16-byte BF16 chunks at scale byte `scale`.
__device__ __forceinline__ void decode_unit(const uint32_t (&words)[4], uint32_t scale,
                                            uint4 (&chunks)[4]) {
  if (ScaleTables::fast(scale)) {
    const ScaleTables tables(scale);
#pragma unroll
    for (int w = 0; w < 4; ++w) chunks[w] = tables.decode(words[w]);
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) chunks[w] = decode_word_fp32(words[w], scale);
  }
}

// Whether every one of a thread's units takes the table path. Two decoding warps run per
// scheduler (a decode and a consumer warp), too few to hide latencies by themselves: a
// branch per unit would make each unit its own dependency chain, while one branch over
// all of them lets the compiler interleave every unit's independent words.
template <int Units>
__device__ __forceinline__ bool all_fast(const uint32_t (&scale)[Units]) {
  bool fast = true;
#pragma unroll
  for (int i = 0; i < Units; ++i) fast &= ScaleTables::fast(scale[i]);
  return fast;
}

__device__ __forceinline__ void store_chunk(uint32_t address, const uint4& chunk) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(chunk.x),
               "r"(chunk.y), "r"(chunk.z), "r"(chunk.w)
               : "memory");
}

// The decode of one stage's B tile in two phases: every decoding thread loads its
// units' codes into registers (`load`, all loads in flight together), then decodes and
// stores them (`store`). A unit's scale byte comes from
// the caller (`for_each_unit` names the unit's row or K row and its 32-column block, in
// the order of the thread's units), loaded from global memory a step ahead.
//
// What the two layouts share: unit i of a thread is unit `thread + i * Threads` of the
// tile, read as (line, 32-column block) with `BlocksPerLine` blocks per line, and its
// codes are 16 contiguous bytes. `Layout` gives a unit's four words in store order
// (`unit_words`) and where slot w of unit i lands (`address`).
template <class Layout, int Units, int Threads, int BlocksPerLine>
struct TileDecodeUnits {
  static constexpr int kPerThread = Units / Threads;
  static_assert(Units % Threads == 0, "every thread decodes the same number of units");
  uint32_t words[kPerThread][4];

  // f(i, line, block) for each unit i of `thread`.
  template <class F>
  __device__ __forceinline__ static void for_each_unit(int thread, F f) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int unit = thread + i * Threads;
      f(i, unit / BlocksPerLine, unit % BlocksPerLine);
    }
  }

  __device__ __forceinline__ void load(const uint8_t* codes, int thread) {
    const uint32_t codes_base = shared_address(codes);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      load_unit_codes(codes_base + (thread + i * Threads) * kUnitBytes, words[i]);
  }

  __device__ __forceinline__ void store(uint8_t* b_tile, int thread,
                                        const uint32_t (&scale)[kPerThread]) const {
    const uint32_t tile_base = shared_address(b_tile);
    if (all_fast(scale)) {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        uint32_t w4[4];
        Layout::unit_words(words[i], thread, i, w4);
        const ScaleTables tables(scale[i]);
#pragma unroll
        for (int w = 0; w < 4; ++w)
          store_chunk(Layout::address(tile_base, thread, i, w), tables.decode(w4[w]));
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      uint32_t w4[4];
      Layout::unit_words(words[i], thread, i, w4);
      uint4 chunks[4];
      decode_unit(w4, scale[i], chunks);
#pragma unroll
      for (int w = 0; w < 4; ++w) store_chunk(Layout::address(tile_base, thread, i, w), chunks[w]);
    }
  }
};

// K-major B (the forward GEMMs): codes [BlockN][32] bytes -> [BlockN][64] BF16, 128-byte
// swizzled; a unit is (row, 32-column half). Units are in order, so a warp reads 512
// contiguous code bytes and a quarter warp's 16-byte stores hit 8 different bank groups.
template <int BlockN, int Threads>
struct KMajorTileDecode : TileDecodeUnits<KMajorTileDecode<BlockN, Threads>, BlockN * kUnitsPerRow,
                                          Threads, kUnitsPerRow> {
  __device__ __forceinline__ static void unit_words(const uint32_t (&in)[4], int, int,
                                                    uint32_t (&out)[4]) {
#pragma unroll
    for (int w = 0; w < 4; ++w) out[w] = in[w];
  }

  // Where word w of unit i of this thread lands in the B tile.
  __device__ __forceinline__ static uint32_t address(uint32_t tile_base, int thread, int i, int w) {
    const int unit = thread + i * Threads;
    const int row = unit / kUnitsPerRow, half = unit % kUnitsPerRow;
    return tile_base + swizzled_chunk_offset(row, 4 * half + w);
  }
};

// MN-major B (the dgrads' view of the weights as stored: K rows, N along the packed
// axis): codes [64][BlockN / 2] bytes (K row, then N) -> BlockN / 64 boxes of [64 K rows]
// [64 N] BF16 side by side, each 128-byte swizzled (the layout TMA writes for a BF16
// MN-major B); a unit is (K row, 32-column N block). Units are in order: a warp reads
// contiguous code bytes, and a unit's four chunks land in one 128-byte row of one box.
template <int BlockN, int Threads>
struct MNMajorTileDecode : TileDecodeUnits<MNMajorTileDecode<BlockN, Threads>, 64 * (BlockN / 32),
                                           Threads, BlockN / 32> {
  static constexpr int kBlockK = 64, kBoxBytes = kBlockK * 128;
  static constexpr int kUnitsPerKRow = BlockN / 32;

  // A quarter warp (8 units of one K row) stores to up to 4 boxes 8 KB apart, i.e. the
  // same banks: each unit starts at chunk `rotation` of its four so the 8 stores of a
  // round hit 8 different 16-byte bank groups. Rotating the 4 input words (selects, no
  // dynamically indexed registers) puts chunk (w + rotation) % 4 in slot w.
  __device__ __forceinline__ static int rotation(int thread, int i) {
    const int n_block = (thread + i * Threads) % kUnitsPerKRow;
    return (n_block / 2) % 4;
  }
  __device__ __forceinline__ static void unit_words(const uint32_t (&in)[4], int thread, int i,
                                                    uint32_t (&w4)[4]) {
    const int r = rotation(thread, i);
#pragma unroll
    for (int w = 0; w < 4; ++w) w4[w] = in[w];
    if (r & 1) {
      const uint32_t first = w4[0];
      w4[0] = w4[1], w4[1] = w4[2], w4[2] = w4[3], w4[3] = first;
    }
    if (r & 2) {
      uint32_t t = w4[0];
      w4[0] = w4[2], w4[2] = t;
      t = w4[1], w4[1] = w4[3], w4[3] = t;
    }
  }
  // Where slot w of unit i of this thread lands: chunk (w + rotation) % 4 of its four.
  __device__ __forceinline__ static uint32_t address(uint32_t tile_base, int thread, int i, int w) {
    const int unit = thread + i * Threads;
    const int k_row = unit / kUnitsPerKRow, n_block = unit % kUnitsPerKRow;
    const uint32_t box = tile_base + (n_block / 2) * kBoxBytes;
    return box + swizzled_chunk_offset(k_row, 4 * (n_block % 2) + (w + rotation(thread, i)) % 4);
  }
};

}  // namespace megamoe::kernels::mxfp4
