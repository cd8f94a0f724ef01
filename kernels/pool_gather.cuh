// Pool gather, row-major: copy [x | side] of every routed token into its pool row, one
// destination row at a time. It needs only the row map, so it also serves any row
// gather (mm's gather_rows), and it fills an expert pool of one route per token (the EP
// layer's received rows: one read per row either way, and only the rows in use are
// visited); a pool of K > 1 routes per token is filled token-major
// (pool_gather_tokens.cuh), which reads each token's row once instead of K times.
//
// pool_input[row, 0:H] = x[t], pool_input[row, H:H+C] = side[t] for each pool row whose
// route r = pool_row_to_route[row] is >= 0 (t = r / K). Padding rows below the rows in
// use are zeroed (the grouped GEMM reads whole BLOCK_M tiles, and zero rows keep its
// padding outputs finite and deterministic). Rows at or past the rows in use are not
// touched: the rows in use are read on the device, so no host sync is needed to size
// the launch, and the tail of a worst-case-sized pool costs no bandwidth.
//
// Memory-bound: one warp per pool row (the route index is loaded once per row), lanes
// stride the row in 16-byte vectors, and each lane issues kUnroll loads before its
// stores so that several KiB per warp are in flight.
#pragma once

#include <cstdint>

#include "pool_gather_params.h"
#include "pool_gather_tokens.cuh"

namespace megamoe::kernels {

// 16-byte loads per lane in flight per step: 4 x 32 lanes x 16 B = 2 KiB per warp,
// ~100 KiB per SM at full occupancy, well above the ~40 KiB per SM HBM3e needs.
constexpr int kPoolGatherUnroll = 4;

// Templated only so that the translation unit including this header owns the
// instantiation (a plain __global__ in a header would clash between units).
template <int kUnroll>
__global__ void __launch_bounds__(kPoolThreadsPerBlock) pool_gather_rows(PoolGatherParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;

  // Written by the route plan earlier on this stream. Clamped so that a corrupt plan
  // can never make this kernel write past pool_input.
  const int64_t rows_used =
      min(max(static_cast<int64_t>(__ldg(p.pool_rows_used)), int64_t{0}), p.pool_capacity);
  const int hidden_vecs = p.hidden / kPoolVectorElems;
  const int row_vecs = hidden_vecs + p.side_cols / kPoolVectorElems;
  const int64_t num_routes = p.num_tokens * p.top_k;

  const uint4* __restrict__ x = static_cast<const uint4*>(p.x);
  const uint4* __restrict__ side = static_cast<const uint4*>(p.side);
  uint4* __restrict__ pool = static_cast<uint4*>(p.pool_input);

  for (int64_t row = warp; row < rows_used; row += num_warps) {
    const int32_t route = __ldg(p.pool_row_to_route + row);
    // Out-of-range routes (only a corrupt plan has them) are treated as padding rather
    // than read out of bounds.
    // With the inverse map (the expert pool), a row holds its route's token only where
    // both maps name the pair, as in the token-major kernel.
    const bool routed =
        route >= 0 && route < num_routes &&
        (p.route_to_pool_row == nullptr || __ldg(p.route_to_pool_row + route) == row);
    const int64_t token = routed ? route / p.top_k : 0;
    const int64_t x_base = token * hidden_vecs;
    // Vector v >= hidden_vecs of the pool row is side vector v - hidden_vecs.
    const int64_t side_base = token * (row_vecs - hidden_vecs) - hidden_vecs;
    uint4* pool_row = pool + row * row_vecs;

    // One step at a time: unrolling this loop too only raises register use (fewer
    // resident warps) without adding bytes in flight per SM.
#pragma unroll 1
    for (int first = lane; first < row_vecs; first += 32 * kUnroll) {
      uint4 values[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = first + 32 * u;
        values[u] = make_uint4(0u, 0u, 0u, 0u);
        if (routed && v < row_vecs)
          values[u] = __ldg(v < hidden_vecs ? x + (x_base + v) : side + (side_base + v));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = first + 32 * u;
        if (v < row_vecs) pool_row[v] = values[u];
      }
    }
  }
}

inline PoolGatherKernels pool_gather_kernels() {
  return PoolGatherKernels{&pool_gather_rows<kPoolGatherUnroll>,
                           &pool_gather_tokens<kPoolGatherUnroll>};
}

}  // namespace megamoe::kernels
