// Tile constants shared by the GEMM kernels' device code and their host launchers.
#pragma once

namespace megamoe {

// K of one pipeline stage: one 128-byte swizzle row of BF16, the TMA box width.
constexpr int kGemmBlockK = 64;

}  // namespace megamoe
