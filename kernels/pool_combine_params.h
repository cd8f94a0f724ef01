// Pool combine: the parameter block and kernel table shared by device and host code.
// Plain C++ (no device code) so the host launcher can include it.
#pragma once

#include <cstdint>

#include "pool_gather_params.h"  // kPoolThreadsPerBlock, kPoolVectorElems

namespace megamoe {

// One block serves both kernels: side_sum reads the side columns [hidden, hidden +
// side_rank) of the pool output into p_sum; combine reads the columns [0, hidden)
// into out (plus the optional scaled side expansion).
struct PoolCombineParams {
  const void* pool_output;           // [pool_capacity, hidden + side_rank] bf16 row-major
  const int32_t* route_to_pool_row;  // [num_tokens, top_k] pool row of each route, -1 if none
  const float* topk_weights;         // [num_tokens, top_k] fp32
  const void* side_expand;           // [num_tokens, hidden] bf16; nullptr: no side term
  void* out;                         // [num_tokens, hidden] bf16 (combine)
  void* p_sum;                       // [num_tokens, side_rank] bf16 (side_sum)
  int64_t num_tokens;                // T
  int64_t pool_capacity;             // rows of pool_output; rows outside it count as masked
  int32_t top_k;                     // K
  int32_t hidden;                    // H, a multiple of kPoolVectorElems
  int32_t side_rank;                 // r, a multiple of kPoolVectorElems (may be 0)
  int32_t row_slices;                // >= 1: lane groups per token row (few tokens: the
                                     // row's vectors spread over more warps)
  float scale;                       // side-term scale (the host passes side_expand=nullptr
                                     // when it is 0, so scale 0 is the no-side path exactly)
};

using PoolCombineKernel = void (*)(PoolCombineParams);

struct PoolCombineKernels {
  PoolCombineKernel side_sum;  // p_sum[t] = bf16(sum_k w[t,k] * pool_output[row, H:H+r])
  PoolCombineKernel combine;   // out[t] = bf16(sum_k w[t,k] * pool_output[row, 0:H] + s*side)
};

}  // namespace megamoe
