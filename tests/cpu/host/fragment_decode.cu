// Host driver for tests/cpu/test_fragment_decode.py: runs the weight-streaming GEMM's
// placement of MXFP4 code pairs into BF16 pairs (kernels/engine/fragment_decode.cuh) on
// the CPU.
//
// Writes, to the file named by argv[1]: the factor bits pair_factor(scale) for scales
// 0..128, then for each byte position c = 0..3 and every word of the word list the
// placed pair pair_bits_times_2_pow_minus_126(word, fragment_selector(c)). The word list:
// mxfp4_test_words.h.
#include <cstdio>
#include <vector>

#include "engine/fragment_decode.cuh"
#include "mxfp4_test_words.h"

namespace {
constexpr int kRandomWords = 1024;  // MXFP4_RANDOM_WORDS in tests/cpu/conftest.py
}

int main(int argc, char** argv) {
  namespace mx = megamoe::kernels::mxfp4;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  const std::vector<uint32_t> words = mxfp4_test_words(kRandomWords);
  FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 1;
  for (uint32_t scale = 0; scale <= 128; ++scale) {
    const uint32_t factor = mx::pair_factor(scale);
    std::fwrite(&factor, sizeof(factor), 1, out);
  }
  for (uint32_t c = 0; c < 4; ++c) {
    const uint32_t selector = mx::fragment_selector(c);
    for (const uint32_t word : words) {
      const uint32_t bits = mx::pair_bits_times_2_pow_minus_126(word, selector);
      std::fwrite(&bits, sizeof(bits), 1, out);
    }
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
