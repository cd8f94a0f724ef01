// Pool gather, token-major: [x | side] of every token into the pool rows of its routes.
//
// pool_input[row] = [x[t] | side[t]] for the pool row of each route r of token t, zeros
// for the other rows in use; rows at or past the rows in use are not touched (their
// count is read on the device: no host sync). Each token's row is read once and
// written to its routes' rows (route_to_pool_row), where the row-major gather
// (pool_gather.cuh) reads it once per route: K times x's bytes, 6x at production K,
// and as many bytes again as the pool writes.
//
// Every row in use has exactly one writer, whatever the plan holds, so the result is
// deterministic and in bounds: route r's token writes row j when both index maps name
// the pair (route_to_pool_row[r] == j and pool_row_to_route[j] == r); every other row
// in use (padding between experts' segments, a row a corrupt plan leaves unclaimed) is
// zeroed.
//
// Work, grid-strided over one persistent wave: (token, row slice) items, one warp each,
// lanes striding the slice in 16-byte vectors with kUnroll loads in flight before
// their stores to each route's row (the host splits rows into slices when there are too
// few tokens to fill the GPU). A token none of whose routes claims a row is not read
// (the EP layer's receive buffers are only written up to the rows received). Then the
// pool's rows in use in groups of 32: a ballot finds a group's unclaimed rows, which
// `zero_parts` warps zero together (with few tokens, padding is most of the pool).
#pragma once

#include <cstdint>

#include "pool_gather_params.h"

namespace megamoe::kernels {

// Routes whose pool rows one pass over a slice writes (production K = 6: one pass); a
// larger K reads the slice again per batch.
constexpr int kPoolGatherRouteBatch = 8;

template <int kUnroll>
__global__ void __launch_bounds__(kPoolThreadsPerBlock) pool_gather_tokens(PoolGatherParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // One persistent wave (the host caps the grid): warp indices fit 32 bits.
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int num_warps = static_cast<int>(gridDim.x * blockDim.x / 32);

  // Written by the route plan earlier on this stream; clamped so that a corrupt plan
  // can never make this kernel write past pool_input.
  const int64_t rows_used =
      min(max(static_cast<int64_t>(__ldg(p.pool_rows_used)), int64_t{0}), p.pool_capacity);
  const int hidden_vecs = p.hidden / kPoolVectorElems;
  const int side_vecs = p.side_cols / kPoolVectorElems;
  const int row_vecs = hidden_vecs + side_vecs;
  const int top_k = p.top_k;
  const int64_t num_routes = p.num_tokens * top_k;

  const uint4* __restrict__ x = static_cast<const uint4*>(p.x);
  const uint4* __restrict__ side = static_cast<const uint4*>(p.side);
  uint4* __restrict__ pool = static_cast<uint4*>(p.pool_input);

  // Slice s of a row: vectors [s * slice_vecs, (s + 1) * slice_vecs), whole warp strides.
  const int slices = p.row_slices;
  const int slice_vecs = 32 * ((row_vecs + 32 * slices - 1) / (32 * slices));
  // Items (token, slice), slices fastest; the stride split once into whole tokens and a
  // slice remainder (no 64-bit division in the loop).
  const int stride_tokens = num_warps / slices, stride_slices = num_warps % slices;
  int slice = warp % slices;
  for (int64_t token = warp / slices; token < p.num_tokens;
       token += stride_tokens, slice += stride_slices) {
    if (slice >= slices) slice -= slices, ++token;
    if (token >= p.num_tokens) break;
    const int v_begin = slice * slice_vecs;
    const int v_end = min(row_vecs, v_begin + slice_vecs);
    const int64_t route0 = token * top_k;
    for (int k0 = 0; k0 < top_k; k0 += kPoolGatherRouteBatch) {
      // The batch's claimed rows (as vector offsets into the pool; -1: none). Every
      // index load is issued before any is used.
      int32_t rows[kPoolGatherRouteBatch];
#pragma unroll
      for (int i = 0; i < kPoolGatherRouteBatch; ++i)
        rows[i] = k0 + i < top_k ? __ldg(p.route_to_pool_row + route0 + k0 + i) : -1;
      int64_t out_base[kPoolGatherRouteBatch];
#pragma unroll
      for (int i = 0; i < kPoolGatherRouteBatch; ++i) {
        const bool in_use = rows[i] >= 0 && rows[i] < rows_used;
        const bool claimed = in_use && __ldg(p.pool_row_to_route + rows[i]) == route0 + k0 + i;
        out_base[i] = claimed ? static_cast<int64_t>(rows[i]) * row_vecs : -1;
      }
      bool any_claimed = false;  // the same for every lane: the loads above are
#pragma unroll
      for (int i = 0; i < kPoolGatherRouteBatch; ++i) any_claimed |= out_base[i] >= 0;
      if (!any_claimed) continue;
      // One step at a time: unrolling this loop too only raises register use.
#pragma unroll 1
      for (int first = v_begin + lane; first < v_end; first += 32 * kUnroll) {
        uint4 values[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = first + 32 * u;
          values[u] = make_uint4(0u, 0u, 0u, 0u);
          if (v < v_end)
            values[u] = __ldg(v < hidden_vecs ? x + (token * hidden_vecs + v)
                                              : side + (token * side_vecs + (v - hidden_vecs)));
        }
#pragma unroll
        for (int i = 0; i < kPoolGatherRouteBatch; ++i) {
          if (out_base[i] < 0) continue;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = first + 32 * u;
            if (v < v_end) pool[out_base[i] + v] = values[u];
          }
        }
      }
    }
  }

  // The rows in use that no route claimed <- 0: item (group, part) zeroes the group's
  // unclaimed rows whose index in the group is part modulo zero_parts.
  const int parts = p.zero_parts;
  const int64_t groups = (rows_used + 31) / 32;
  for (int64_t item = warp; item < groups * parts; item += num_warps) {
    const int64_t group = item / parts;
    const int part = static_cast<int>(item % parts);
    const int64_t row = group * 32 + lane;
    bool unclaimed = false;
    if (row < rows_used) {
      const int32_t route = __ldg(p.pool_row_to_route + row);
      unclaimed = route < 0 || route >= num_routes || __ldg(p.route_to_pool_row + route) != row;
    }
    uint32_t mask = __ballot_sync(0xFFFFFFFFu, unclaimed);
    while (mask != 0u) {
      const int bit = __ffs(static_cast<int>(mask)) - 1;
      mask &= mask - 1u;
      if (bit % parts != part) continue;
      uint4* out = pool + (group * 32 + bit) * row_vecs;
      for (int v = lane; v < row_vecs; v += 32) out[v] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

}  // namespace megamoe::kernels
