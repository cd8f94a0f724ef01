// Host driver for tests/cpu/test_fragment_decode.py: runs the weight-streaming GEMM's
// placement of MXFP4 code pairs into BF16 pairs (kernels/engine/fragment_decode.cuh) on
// the CPU.
//
// Writes, to the file named by argv[1]: the factor bits row_factors(b | (127 - b) << 8)
// for bytes b = 0..127, then for each byte position c = 0..3 and every word of the word
// list the placed pair pair_bits_times_2_pow_minus_126(word, fragment_selector(c)). The
// word list: mxfp4_test_words.h. Then the step fragments: a case count, and per case its
// byte position c, scale pairs (row r's in bits 0-15, row r + 8's in 16-31), two rows'
// eight words and decode_rows' 16 fragment registers ([k16][a0..a3]) for them (through
// each row's scale_word, as the kernel's producer writes them), then StepScales' fast-path
// flag for its own two rows, all uint32 (two cases per decode_rows<2> call).
#include <cstdio>
#include <vector>

#include "engine/fragment_decode.cuh"
#include "mxfp4_test_words.h"

namespace {
constexpr int kRandomWords = 1024;   // MXFP4_RANDOM_WORDS in tests/cpu/conftest.py
constexpr int kFragmentCases = 256;  // per byte position: FRAGMENT_CASES in the test

// Scale pairs of the fragment cases: the fast path's edges (127; 128 and 129, the first
// bytes past it), NaN, then random bytes below 128 (fast) and over all 256.
uint32_t case_pairs(int i, uint32_t& state) {
  const uint32_t fixed[] = {0x00000000u, 0x7F7F7F7Fu, 0x7F7F0101u, 0x80000000u,
                            0x00810000u, 0xFFFFFFFFu, 0xFE01FE01u, 0x7F80FF00u};
  if (i < 8) return fixed[i];
  uint32_t pairs = 0;
  for (int b = 0; b < 4; ++b)
    pairs |= (lcg_next(state) % (i < kFragmentCases / 2 ? 128u : 256u)) << (8 * b);
  return pairs;
}
}  // namespace

int main(int argc, char** argv) {
  namespace mx = megamoe::kernels::mxfp4;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  const std::vector<uint32_t> words = mxfp4_test_words(kRandomWords);
  FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 1;
  for (uint32_t scale = 0; scale < 128; ++scale) {
    const uint32_t factors = mx::row_factors(scale | (127u - scale) << 8);
    std::fwrite(&factors, sizeof(factors), 1, out);
  }
  for (uint32_t c = 0; c < 4; ++c) {
    const uint32_t selector = mx::fragment_selector(c);
    for (const uint32_t word : words) {
      const uint32_t bits = mx::pair_bits_times_2_pow_minus_126(word, selector);
      std::fwrite(&bits, sizeof(bits), 1, out);
    }
  }
  const uint32_t cases = 4 * kFragmentCases;
  std::fwrite(&cases, sizeof(cases), 1, out);
  uint32_t state = 777u;
  // The kernel decodes two weights' rows per step (decode_rows<2>, one scale check for
  // both): cases i and i + 1 go through one call, so a fast case beside one past the fast
  // path takes the FP32 path too, and must give the same bits.
  for (uint32_t c = 0; c < 4; ++c)
    for (int i = 0; i < kFragmentCases; i += 2) {
      uint32_t rows[4][8];  // per case: rows r and r + 8, eight words each
      uint32_t pairs[2];
      uint32_t loaded[4];  // each row's pair as the kernel loads it (bits 0-15)
      for (int j = 0; j < 2; ++j) {
        for (int row = 0; row < 2; ++row)
          for (int w = 0; w < 8; ++w)
            rows[2 * j + row][w] = words[(16 * (i + j) + 8 * row + w + 5 * c) % words.size()];
        pairs[j] = case_pairs(i + j, state);
        loaded[2 * j] = pairs[j] & 0xFFFFu;
        loaded[2 * j + 1] = pairs[j] >> 16;
      }
      uint32_t scale_words[4];
      for (int row = 0; row < 4; ++row) scale_words[row] = mx::scale_word(loaded[row]);
      mx::StepFragment fragments[2];
      mx::decode_rows<2>(rows, mx::StepScales<4>(scale_words), mx::fragment_selector(c), fragments);
      for (int j = 0; j < 2; ++j) {
        std::fwrite(&c, sizeof(c), 1, out);
        std::fwrite(&pairs[j], sizeof(pairs[j]), 1, out);
        std::fwrite(rows[2 * j], sizeof(rows[0]), 2, out);
        std::fwrite(fragments[j], sizeof(fragments[j]), 1, out);
        const uint32_t own[2] = {scale_words[2 * j], scale_words[2 * j + 1]};
        const uint32_t fast = mx::StepScales<2>(own).fast ? 1u : 0u;
        std::fwrite(&fast, sizeof(fast), 1, out);
      }
    }
  return std::fclose(out) == 0 ? 0 : 1;
}
