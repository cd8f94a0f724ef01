// MXFP4 decode: the parameter block and kernel table shared by device and host code.
// Plain C++ (no device code) so the host launcher can include it.
#pragma once

#include <cstdint>

namespace megamoe {

// Threads per block of the decode kernel (each decodes 8-code words, grid-stride).
constexpr int kMxfp4DecodeThreads = 256;
// Elements per UE8M0 scale (OCP MX): 16 packed bytes, 64 output bytes.
constexpr int kMxfp4Block = 32;

// out[b * 32 + i] = E2M1(code i of block b) * 2^(scales[b] - 127) as BF16, for every
// block b of a row-major [rows, K] tensor (K a multiple of 32): codes two per byte,
// low nibble first; scale byte 0 is 2^-127, 0xFF is NaN (the whole block). The FP32
// product is exact (codes have at most 2 significant bits) and so is the BF16 result
// (same exponent range; the smallest value 2^-128 is a BF16 subnormal).
struct Mxfp4DecodeParams {
  const uint8_t* packed;  // [num_blocks * 16] bytes
  const uint8_t* scales;  // [num_blocks]
  void* out;              // [num_blocks * 32] bf16
  int64_t num_blocks;
};

using Mxfp4DecodeKernel = void (*)(Mxfp4DecodeParams);

struct Mxfp4DecodeKernels {
  Mxfp4DecodeKernel kernel;
};

}  // namespace megamoe
