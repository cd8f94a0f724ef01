// The weight-streaming GEMMs' A operand: a consumer thread's view of a stage (its code
// rows or columns and its scale words) and the decode of the MXFP4 codes straight into
// its A-fragment registers (fragment_decode.cuh), one reader per code layout; and the
// one-tile GEMM1's adapter rows as register fragments.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fragment_decode.cuh"
#include "weight_stream_config.cuh"

namespace megamoe::kernels::engine {

using Fragment = mxfp4::StepFragment;  // one weight's A fragment of a base step

// ---- the consumer's view of its rows: codes, scales and the decode ----
// A thread holds A rows r and r + 8 (r = 16 warp + lane / 4) of its warpgroup's 64, in
// each half of the tile (Gated: the gate and the up weight): four weight rows ("lines":
// r, r + 8 of the first half, then of the second). Per base step each line's 32 code
// bytes are eight words; word 2j / 2j + 1 feed k16 step j's a0|a1 / a2|a3, and words
// 0-3 / 4-7 share scale bytes 0 / 1 (one 16-bit pair per line and step).

// A consumer thread's places in a stage from its block thread index (consumer c's
// threads are 128 (c + 1) on): its row r's codes, r = 64 c + 16 warp + lane / 4 of each
// half's 128, and its quad's 16 bytes of scale words (slot (4 c + warp) 8 + lane / 4).
// Written in few instructions, since ptxas recomputes them where registers are short;
// checked against the definitions at compile time.
__host__ __device__ constexpr uint32_t stream_code_offset(uint32_t tid) {
  return 16 * (tid & ~31u) + 8 * (tid & 28u) - 2048u;
}
__host__ __device__ constexpr uint32_t stream_scale_offset(uint32_t tid) {
  return 4 * (tid & ~3u) - 512u;
}
constexpr bool stream_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, quad = tid % 32 / 4;
    const uint32_t row = 64 * consumer + 16 * warp + quad, slot = (4 * consumer + warp) * 8 + quad;
    if (stream_code_offset(tid) != 32 * row || stream_scale_offset(tid) != 16 * slot ||
        stream_scale_slot_row(static_cast<int>(slot)) != static_cast<int>(row))
      return false;
  }
  return true;
}
static_assert(stream_offsets_follow_the_layout(), "a consumer reads its own rows and words");

// A line's 32 code bytes of a step (its eight words) from shared address `at`.
__device__ __forceinline__ void load_line_codes(uint32_t at, uint32_t (&words)[8]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
               : "r"(at));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[4]), "=r"(words[5]), "=r"(words[6]), "=r"(words[7])
               : "r"(at + 16));
}

// Two lines of a step (rows r and r + 8 of one m64 tile: their codes at shared address
// `first` and `apart` bytes on, their two scale words at `scale_words_at`) into the
// tile's fragment, under their own scale check. The loads first.
__device__ __forceinline__ void decode_line_pair(uint32_t first, uint32_t apart,
                                                 uint32_t scale_words_at, uint32_t selector,
                                                 Fragment (&fragment)[1]) {
  uint32_t scale_words[2];
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(scale_words[0]), "=r"(scale_words[1])
               : "r"(scale_words_at));
  uint32_t words[2][8];
#pragma unroll
  for (int line = 0; line < 2; ++line) load_line_codes(first + line * apart, words[line]);
  const mxfp4::StepScales<2> scales(scale_words);
  mxfp4::decode_rows<1>(words, scales, selector, fragment);
}

struct StreamLines {
  // Line l's codes are at code_offset + line_code_offset(l) in a stage's code area.
  __device__ __forceinline__ static constexpr uint32_t line_code_offset(int line) {
    return (line % 2 ? 8 * 32 : 0) + (line / 2 ? 128 * 32 : 0);
  }
  uint32_t code_offset;
  uint32_t scale_offset;  // the quad's 16 bytes in a stage's scale area
  uint32_t selector;

  __device__ __forceinline__ explicit StreamLines(uint32_t tid)
      : code_offset(opaque(stream_code_offset(tid))),
        scale_offset(opaque(stream_scale_offset(tid))),
        selector(opaque(mxfp4::fragment_selector(tid % 4))) {}

  // Decode a landed stage's codes of the four lines into both halves' fragments with
  // their scale words (the code area at shared address `code_area`, the scale words at
  // `scale_area`). Every load first: 32 independent pairs to interleave.
  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[2]) const {
    const uint32_t base = code_area + code_offset;
    uint32_t scale_words[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(scale_words[0]), "=r"(scale_words[1]), "=r"(scale_words[2]),
                   "=r"(scale_words[3])
                 : "r"(scale_area + scale_offset));
    uint32_t words[4][8];
#pragma unroll
    for (int line = 0; line < 4; ++line)
      load_line_codes(base + line_code_offset(line), words[line]);
    const mxfp4::StepScales<4> scales(scale_words);
    mxfp4::decode_rows<2>(words, scales, selector, fragments);
  }

  // 128-row chunks: one half's two lines (2 Half, 2 Half + 1) into its fragment, with
  // their own scale check; the same values as decode's.
  template <int Half>
  __device__ __forceinline__ void decode_half(uint32_t code_area, uint32_t scale_area,
                                              Fragment& fragment) const {
    const uint32_t base = code_area + code_offset + line_code_offset(2 * Half);
    decode_line_pair(base, line_code_offset(1), scale_area + scale_offset + 8 * Half, selector,
                     *reinterpret_cast<Fragment(*)[1]>(&fragment));
  }
};

// One tile (192- and 256-row chunks): a consumer thread's two lines are rows r and r + 8 (r = 16
// warp + lane / 4) of its warpgroup's m64 tile: Gated the gate and the up row of h column
// 32 c + 8 warp + lane / 4 (the code area is the gate rows' [64][32] bytes, then the up
// rows'); Store rows 64 c + r and + 8 of the tile's 128 ([128][32]). Its quad's scale
// words are 8 bytes at slot (4 c + warp) 8 + lane / 4.
template <bool kGated>
__host__ __device__ constexpr uint32_t stream_line_pair_code_offset(uint32_t tid) {
  return kGated ? 8 * (tid & ~3u) - 1024u : stream_code_offset(tid);
}
__host__ __device__ constexpr uint32_t stream_line_pair_scale_offset(uint32_t tid) {
  return 2 * (tid & ~3u) - 256u;
}
template <bool kGated>
constexpr bool stream_line_pair_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, quad = tid % 32 / 4;
    const uint32_t row =
        kGated ? 32 * consumer + 8 * warp + quad : 64 * consumer + 16 * warp + quad;
    const uint32_t slot = (4 * consumer + warp) * 8 + quad;
    if (stream_line_pair_code_offset<kGated>(tid) != 32 * row ||
        stream_line_pair_scale_offset(tid) != 8 * slot)
      return false;
  }
  return true;
}
static_assert(stream_line_pair_offsets_follow_the_layout<true>() &&
                  stream_line_pair_offsets_follow_the_layout<false>(),
              "a one-tile consumer reads its own rows and words");

template <bool kGated>
struct StreamLinePair {
  static constexpr uint32_t kSecondLine = kGated ? 64 * 32 : 8 * 32;  // row r + 8's codes
  uint32_t code_offset;
  uint32_t scale_offset;
  uint32_t selector;

  __device__ __forceinline__ explicit StreamLinePair(uint32_t tid)
      : code_offset(opaque(stream_line_pair_code_offset<kGated>(tid))),
        scale_offset(opaque(stream_line_pair_scale_offset(tid))),
        selector(opaque(mxfp4::fragment_selector(tid % 4))) {}

  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[1]) const {
    const uint32_t base = code_area + code_offset;
    decode_line_pair(base, kSecondLine, scale_area + scale_offset, selector, fragments);
  }
};

// StoreMN: a consumer thread (consumer c, warp w, lane quad t = lane % 4, g = lane / 4)
// decodes the bytes 2q and 2q + 1 (q = 8 w + g) of its consumer's 64 in each of its 16
// stored rows of a step (16 k16 + 2 t + {0, 1, 8, 9}): output columns 4q .. 4q + 3 of the
// consumer's 128 (decode_column_pairs). The code area is [64 rows][128 bytes] under the
// 128-byte swizzle (16-byte unit u of row n at unit u ^ (n % 8)); a warp's bytes are unit
// 4 c + w of every row. Two ldmatrix.x4.trans read them: matrix m of load x is stored
// rows 32 x + 8 m .. + 7 of that unit, lane L gives row L % 8 of matrix L / 8, and thread
// (g, t) receives rows 2t and 2t + 1 at its 16-bit column g, the row pair 4 x + m of
// decode_column_pairs. One shared-memory instruction per 16 rows instead of one per row:
// the loads no longer fill the memory-input queue. A matrix's eight rows lie in eight
// different units, so a load has no bank conflict.
__host__ __device__ constexpr uint32_t stream_column_lane_offset(uint32_t tid) {
  return 128 * (tid % 32) + 16 * (((tid / 32 - 4) ^ tid) & 7);
}
constexpr bool stream_column_lane_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t consumer = tid / 128 - 1, warp = tid % 128 / 32, lane = tid % 32;
    const uint32_t row = 8 * (lane / 8) + lane % 8, byte = 64 * consumer + 16 * warp;
    const uint32_t swizzled = 128 * row + 16 * ((byte / 16) ^ (row % 8));
    if (stream_column_lane_offset(tid) != swizzled) return false;
  }
  return true;
}
static_assert(stream_column_lane_offsets_follow_the_layout(), "a warp reads its own unit");

// A transposed step's reads: the thread's 32 bytes of scale words at `scale_at`, and two
// ldmatrix.x4.trans over the code area's 64 rows of kCodeRowBytes each (this lane's row
// pointer `code_at` in the first 32): matrix m of load x is rows 32 x + 8 m .. + 7.
__device__ __forceinline__ void load_scale_words_32(uint32_t scale_at, uint32_t (&words)[8]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
               : "r"(scale_at));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(words[4]), "=r"(words[5]), "=r"(words[6]), "=r"(words[7])
               : "r"(scale_at + 16));
}
template <int kCodeRowBytes>
__device__ __forceinline__ void load_64_rows_transposed(uint32_t code_at, uint32_t (&r)[8]) {
#pragma unroll
  for (int x = 0; x < 2; ++x)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[4 * x]), "=r"(r[4 * x + 1]), "=r"(r[4 * x + 2]), "=r"(r[4 * x + 3])
                 : "r"(code_at + kCodeRowBytes * 32 * x));
}

template <bool kValuesBeforeCheck>
struct StreamColumnPairs {
  uint32_t lane_offset;   // the row of the code area whose unit this lane points ldmatrix at
  uint32_t scale_offset;  // the thread's 32 bytes of scale words

  __device__ __forceinline__ explicit StreamColumnPairs(uint32_t tid)
      : lane_offset(opaque(stream_column_lane_offset(tid))),
        scale_offset(opaque(32 * ((tid / 32 - 4) * 4 + tid % 4))) {}

  // The thread's scale words and row pairs of a step.
  __device__ __forceinline__ void load(uint32_t code_area, uint32_t scale_area,
                                       uint32_t (&words)[8], uint32_t (&row_pairs)[8]) const {
    load_scale_words_32(scale_area + scale_offset, words);
    load_64_rows_transposed<128>(code_area + lane_offset, row_pairs);
  }

  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[2]) const {
    uint32_t words[8], row_pairs[8];
    load(code_area, scale_area, words, row_pairs);
    const mxfp4::StepScales<8> scales(words);
    mxfp4::decode_column_pairs<kValuesBeforeCheck>(row_pairs, scales, fragments);
  }
};

// One-tile StoreMN (192- and 256-row chunks): the code area is [64 rows][64 bytes] under
// the 64-byte swizzle (16-byte unit u of row n at unit u ^ (n / 2 % 4)); both consumer
// warpgroups read it whole, warp w unit w of every row, and consumer c decodes the bytes
// 2q + c (q = 8 w + g) of the 16-bit columns ldmatrix.trans hands it, as the two-tile
// form's tile c: output columns 4q + 2c and 4q + 2c + 1 of the tile's 128. A matrix's
// eight rows lie in eight different 16-byte bank groups, so a load has no bank conflict.
// Its scale words: 32 bytes at slot 4 w + t (StreamScaleColumns<true, ...>).
__host__ __device__ constexpr uint32_t stream_column_one_tile_lane_offset(uint32_t tid) {
  return 64 * (tid % 32) + 16 * (((tid / 32) ^ (tid / 2)) & 3);
}
constexpr bool stream_column_one_tile_lane_offsets_follow_the_layout() {
  for (uint32_t tid = kWarpgroupThreads; tid < 3 * kWarpgroupThreads; ++tid) {
    const uint32_t warp = tid % 128 / 32, row = tid % 32;
    const uint32_t linear = 64 * row + 16 * warp;
    const uint32_t swizzled = linear ^ (((linear >> 7) & 3u) << 4);  // CU_TENSOR_MAP_SWIZZLE_64B
    if (stream_column_one_tile_lane_offset(tid) != swizzled) return false;
  }
  return true;
}
static_assert(stream_column_one_tile_lane_offsets_follow_the_layout(),
              "a one-tile warp reads its own unit");

struct StreamColumnPairOneTile {
  uint32_t lane_offset;   // the row of the code area whose unit this lane points ldmatrix at
  uint32_t scale_offset;  // the thread's 32 bytes of scale words
  uint32_t selector;      // the consumer's bytes (column_pair_selector)

  __device__ __forceinline__ explicit StreamColumnPairOneTile(uint32_t tid)
      : lane_offset(opaque(stream_column_one_tile_lane_offset(tid))),
        scale_offset(opaque(32 * ((tid / 32 % 4) * 4 + tid % 4))),
        selector(opaque(mxfp4::column_pair_selector(tid / kWarpgroupThreads - 1))) {}

  __device__ __forceinline__ void decode(uint32_t code_area, uint32_t scale_area,
                                         Fragment (&fragments)[1]) const {
    uint32_t words[8], row_pairs[8];
    load_scale_words_32(scale_area + scale_offset, words);
    load_64_rows_transposed<64>(code_area + lane_offset, row_pairs);
    const mxfp4::StepScales<8> scales(words);
    mxfp4::decode_column_pair_tile(row_pairs, scales, selector, fragments[0]);
  }
};

// The consumers' reader of kind C's codes: the forward's rows (two tiles: StreamLines;
// one: StreamLinePair) or the transposed kinds' columns (StreamColumnPairs,
// StreamColumnPairOneTile).
template <class C>
using StreamOperandA =
    std::conditional_t<C::kTransposed,
                       std::conditional_t<C::kOneTile, StreamColumnPairOneTile,
                                          StreamColumnPairs<C::kValuesBeforeCheck>>,
                       std::conditional_t<C::kOneTile, StreamLinePair<C::kGated>, StreamLines>>;

__device__ __forceinline__ void fence_fragment(Fragment& f) {
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(f[k16][i])::"memory");
}

// The one-tile Gated side steps (192- and 256-row chunks): a side step's box is b1's (or b3's)
// [64 K][64 h] (MN-major, 128-byte swizzle), and a thread's A rows r and r + 8 are the
// gate and the up row of one h column, whose side sums run over different pool columns
// (q1, q3). So the side steps are register MMAs over K = 2r: a q1 step's fragment holds
// b1 in the gate rows and zeros in the up rows, a q3 step's the reverse (a zero product
// adds nothing, exactly).
// Two ldmatrix.x4.trans read a warp's 8 h columns (unit 4 c + warp of every K row, the
// StoreMN lane offsets): matrix m of load x is K rows 32 x + 8 m .. + 7, and thread
// (g, t) receives K rows 2t, 2t + 1 (+ 8 m) of its column g: a0 (m even) or a2 of k16
// step 2x + m / 2.
template <bool kUpRows>
__device__ __forceinline__ void side_rows_fragment(uint32_t box, uint32_t lane_offset,
                                                   Fragment& fragment) {
  uint32_t r[8];
  load_64_rows_transposed<128>(box + lane_offset, r);
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) {
    const uint32_t low = r[2 * k16], high = r[2 * k16 + 1];  // K 2t (+1), K 2t + 8 (+9)
    fragment[k16][0] = kUpRows ? 0u : low;
    fragment[k16][1] = kUpRows ? low : 0u;
    fragment[k16][2] = kUpRows ? 0u : high;
    fragment[k16][3] = kUpRows ? high : 0u;
  }
}

}  // namespace megamoe::kernels::engine
