// Pool gather: the parameter block and kernel table shared by device and host code.
// Plain C++ (no device code) so the host launcher can include it.
#pragma once

#include <cstdint>

namespace megamoe {

// Threads per block of the pool kernels: 8 warps, one pool row (gather) or one group
// of tokens (combine) per warp at a time.
constexpr int kPoolThreadsPerBlock = 256;
// BF16 elements per 16-byte vector: every row length must be a multiple of this.
constexpr int kPoolVectorElems = 8;

struct PoolGatherParams {
  const void* x;                     // [num_tokens, hidden] bf16 row-major
  const void* side;                  // [num_tokens, side_cols] bf16, nullptr if side_cols == 0
  const int32_t* pool_row_to_route;  // [pool_capacity] flat route t*K+k, -1 for padding
  const int32_t*
      route_to_pool_row;          // [num_tokens * K] pool row per route, -1: none (rows: or null)
  const int32_t* pool_rows_used;  // &expert_pool_offsets[E_l]: read on the device (no sync)
  void* pool_input;               // [pool_capacity, hidden + side_cols] bf16 row-major
  int64_t num_tokens;             // T (rows of x and side)
  int64_t pool_capacity;          // rows of pool_input and pool_row_to_route
  int32_t top_k;                  // K: token of route r is r / K
  int32_t hidden;                 // H, a multiple of kPoolVectorElems
  int32_t side_cols;              // C, a multiple of kPoolVectorElems (0: no side tensor)
  int32_t row_slices;             // slices per token row (tokens: >= 1)
  int32_t zero_parts;             // warps per 32-row group zeroing unclaimed rows (1..32)
};

using PoolGatherKernel = void (*)(PoolGatherParams);

struct PoolGatherKernels {
  PoolGatherKernel gather;  // pool rows in use <- [x | side] of their token, padding <- 0
  PoolGatherKernel tokens;  // the same, token-major (pool_gather_tokens.cuh): each x row read once
};

}  // namespace megamoe
