// Host driver for tests/cpu/test_fragment_decode.py: runs the dgrads' transposed step of
// the weight-streaming GEMM (decode_column_pairs, kernels/engine/fragment_decode.cuh) on
// the CPU, with the host's exact FP32 product in place of the device multiply; both
// orders of its multiplies, its tile-at-a-time form (decode_column_pair_tile) and the
// one-tile chunks' form (a consumer warpgroup's tile by its selector) must give the same
// registers.
//
// Writes, to the file named by argv[1], a case count and per case (all uint32): the 16
// stored rows' 16 bits (bytes 2q and 2q + 1 of rows 16 k16 + 2c + {0, 1, 8, 9}; the
// decode takes them in pairs, as ldmatrix.trans delivers them),
// the 8 row pairs' scale bytes as loaded (row n's in bits 0-7, row n + 1's in 8-15), the
// 32 fragment registers ([tile][k16][a0..a3]) and StepScales' fast-path flag. The first
// 256 cases run every byte value in both positions of every row (so every code in every
// nibble of both tiles); the scale bytes are the fast path's edges, NaN, then random
// bytes below 128 (fast) and over all 256.
#include <cstdio>
#include <cstring>

#include "engine/fragment_decode.cuh"
#include "mxfp4_test_words.h"

namespace {
constexpr int kCases = 1024;  // TRANSPOSED_CASES in the test

uint32_t case_scale_pair(int i, int pair, uint32_t& state) {
  const uint32_t fixed[] = {0x0000u, 0x7F7Fu, 0x7F01u, 0x8000u, 0x0081u, 0xFFFFu, 0xFE01u, 0x807Fu};
  if (i < 8) return fixed[(i + pair) % 8];
  const uint32_t range = i < kCases / 2 ? 128u : 256u;
  const uint32_t row_n = lcg_next(state) % range;  // two statements: a fixed order
  return row_n | (lcg_next(state) % range) << 8;
}
}  // namespace

int main(int argc, char** argv) {
  namespace mx = megamoe::kernels::mxfp4;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 1;
  const uint32_t cases = kCases;
  std::fwrite(&cases, sizeof(cases), 1, out);
  uint32_t state = 2024u;
  for (int i = 0; i < kCases; ++i) {
    uint32_t rows[16], row_pairs[8], loaded[8], words[8];
    for (int r = 0; r < 16; ++r)
      rows[r] = i < 256 ? static_cast<uint32_t>(i) * 0x0101u : lcg_next(state) & 0xFFFFu;
    for (int pair = 0; pair < 8; ++pair)
      row_pairs[pair] = rows[2 * pair] | rows[2 * pair + 1] << 16;
    for (int pair = 0; pair < 8; ++pair) {
      loaded[pair] = case_scale_pair(i, pair, state);
      words[pair] = mx::scale_word(loaded[pair]);
    }
    const mx::StepScales<8> scales(words);
    mx::StepFragment fragments[2], before_check[2];
    mx::decode_column_pairs<false>(row_pairs, scales, fragments);
    // Both orders of the multiplies and the scale check give the same registers.
    mx::decode_column_pairs<true>(row_pairs, scales, before_check);
    if (std::memcmp(fragments, before_check, sizeof(fragments)) != 0) {
      std::fprintf(stderr, "case %d: the two decode orders differ\n", i);
      return 3;
    }
    // The 128-row chunks' decode, a tile at a time, gives each tile's registers.
    mx::StepFragment by_tile[2];
    mx::decode_column_pair_tile<0>(row_pairs, scales, by_tile[0]);
    mx::decode_column_pair_tile<1>(row_pairs, scales, by_tile[1]);
    if (std::memcmp(fragments, by_tile, sizeof(fragments)) != 0) {
      std::fprintf(stderr, "case %d: the decode a tile at a time differs\n", i);
      return 4;
    }
    // The one-tile chunks' decode: consumer warpgroup t's tile, its selector a value.
    mx::StepFragment by_consumer[2];
    for (uint32_t t = 0; t < 2; ++t)
      mx::decode_column_pair_tile(row_pairs, scales, mx::column_pair_selector(t), by_consumer[t]);
    if (std::memcmp(fragments, by_consumer, sizeof(fragments)) != 0) {
      std::fprintf(stderr, "case %d: the one-tile decode differs\n", i);
      return 5;
    }
    const uint32_t fast = scales.fast ? 1u : 0u;
    std::fwrite(rows, sizeof(rows), 1, out);
    std::fwrite(loaded, sizeof(loaded), 1, out);
    std::fwrite(fragments, sizeof(fragments), 1, out);
    std::fwrite(&fast, sizeof(fast), 1, out);
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
