// The 8-code words the host drivers of the MXFP4 decode paths run over
// (tests/cpu/conftest.py builds the same list): the 256 words whose four bytes are equal
// (every code pair in every byte), then `random_words` words of a fixed 32-bit LCG.
#pragma once

#include <cstdint>
#include <vector>

// The drivers' 32-bit LCG: advances `state`, returns its top 24 bits.
inline uint32_t lcg_next(uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return state >> 8;
}

inline std::vector<uint32_t> mxfp4_test_words(int random_words) {
  std::vector<uint32_t> words;
  for (uint32_t byte = 0; byte < 256; ++byte) words.push_back(byte * 0x01010101u);
  uint32_t state = 12345u;
  for (int i = 0; i < random_words; ++i) {
    state = state * 1664525u + 1013904223u;
    words.push_back(state);
  }
  return words;
}
