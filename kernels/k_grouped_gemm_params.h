// K-grouped weight-gradient GEMM: the parameter block and kernel table shared by device
// and host code (kernels/k_grouped_gemm.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gemm_tile_constants.h"

namespace megamoe {

// out[e] = scale * A_e^T B_e for every expert e, where A_e and B_e are the expert's data
// rows of two pool-shaped operands: rows offsets[e] .. offsets[e] + counts[e] - 1 of
// A [pool rows, M] and B [pool rows, N] (row-major BF16). The reduction runs over those
// rows only: the rest of the expert's segment (padding) and the rows of other experts
// are zeroed in shared memory before any MMA reads them, so whatever they hold never
// reaches the sum. An expert with no rows gets exact zeros. FP32 accumulation, one
// rounding to BF16 after the scale.
//
// Both operands are read MN-major (the pool rows are the reduction): TMA boxes of 64 rows
// x 64 columns, 128-byte swizzled, placed side by side along M (A) or N (B).
struct KGroupedGemmParams {
  CUtensorMap a;  // [pool rows, M] BF16 (any row stride), box [64 rows, 64 columns]
  CUtensorMap b;  // [pool rows, N] BF16, box [64 rows, 64 columns]
  const int32_t* expert_pool_offsets;  // [E + 1] segment starts
  const int32_t* expert_counts;        // [E] data rows at the start of each segment
  void* out;                           // BF16 [E, M, N], rows of out_stride elements
  int64_t out_stride;                  // elements between output rows (>= N)
  int64_t out_expert_stride;           // elements between experts' outputs (>= M * out_stride)
  int32_t num_experts;
  int32_t pool_rows;  // rows of A and B: a corrupt plan is clamped to them
  int32_t m;          // output rows per expert (A's columns)
  int32_t n;          // output columns per expert (B's columns)
  float scale;        // applied to the FP32 sum before the one rounding
};

using KGroupedGemmKernel = void (*)(KGroupedGemmParams);

struct KGroupedGemmKernels {
  KGroupedGemmKernel kernel;
  int block_m;
  int block_n;
  int num_threads;
  int smem_bytes;
};

}  // namespace megamoe
