// Host driver for tests/cpu/test_mxfp4_scale_tables.py: runs the in-pipeline MXFP4
// decode's table path (kernels/mxfp4_tile_decode.cuh, ScaleTables) on the CPU.
//
// Writes, to the file named by argv[1]: the 256 ScaleTables::fast flags (one byte per
// scale byte), then for every fast scale byte and every word of the word list the four
// decoded 32-bit words (eight BF16, code 0 first). The word list: mxfp4_test_words.h.
#include <cstdio>
#include <vector>

#include "mxfp4_test_words.h"
#include "mxfp4_tile_decode.cuh"

namespace {
constexpr int kRandomWords = 1024;  // MXFP4_RANDOM_WORDS in tests/cpu/conftest.py
}

int main(int argc, char** argv) {
  using megamoe::kernels::mxfp4::ScaleTables;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  const std::vector<uint32_t> words = mxfp4_test_words(kRandomWords);
  FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 1;
  for (uint32_t scale = 0; scale < 256; ++scale) {
    const unsigned char flag = ScaleTables::fast(scale) ? 1 : 0;
    std::fwrite(&flag, 1, 1, out);
  }
  for (uint32_t scale = 0; scale < 256; ++scale) {
    if (!ScaleTables::fast(scale)) continue;
    const ScaleTables tables(scale);
    for (const uint32_t word : words) {
      const uint4 chunk = tables.decode(word);
      const uint32_t values[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
      std::fwrite(values, sizeof(uint32_t), 4, out);
    }
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
