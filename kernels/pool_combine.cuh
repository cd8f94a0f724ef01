// Pool combine: per-token weighted sums over k of the pool output rows.
//
//   side_sum: p_sum[t, j] = bf16( sum_k w[t,k] * pool_output[row_tk, H + j] )   j < r
//   combine:  out[t, j]   = bf16( sum_k w[t,k] * pool_output[row_tk, j]
//                                 + scale * side_expand[t, j] )                  j < H
//
// over the routes k = 0..K-1 of token t with row_tk = route_to_pool_row[t, k] >= 0.
// The sums are FP32 in that fixed order, each product and each sum rounded separately
// (__fmul_rn / __fadd_rn: no FMA contraction), so the result is bitwise reproducible
// and equal to the torch reference (megamoe.wrappers.pool), which does the same elementwise
// float32 operations. No atomics: one thread owns each output vector.
//
// Memory-bound: a group of lanes (a power of two up to a warp) serves one token and
// strides its row in 16-byte vectors. For each vector the K route indices are loaded
// together, then the K pool-row loads are issued together (in batches of
// kPoolCombineBatch) before any is accumulated: one L1 and one HBM round trip. With
// few tokens the host splits each row into `row_slices` slices, one lane group each, so
// that the grid still fills the GPU (at 128 tokens one warp per token is 128 warps,
// each paying 16 round trips one after another).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "pool_combine_params.h"

namespace megamoe::kernels {

// Routes whose loads are in flight together: covers top-k up to 8 in one round trip
// (production K = 6); larger K takes ceil(K / 8) round trips per vector.
constexpr int kPoolCombineBatch = 8;

// acc[j] += w * value[j] for the 8 BF16 values of a 16-byte vector, in FP32, with
// separately rounded product and sum (the reference does two torch ops).
__device__ __forceinline__ void accumulate_weighted(float (&acc)[kPoolVectorElems], float w,
                                                    const uint4& value) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&value);
#pragma unroll
  for (int i = 0; i < kPoolVectorElems / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, f.x));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, f.y));
  }
}

// Round to nearest even, 8 FP32 -> one 16-byte BF16 vector.
__device__ __forceinline__ uint4 pack_bf16(const float (&acc)[kPoolVectorElems]) {
  uint4 packed;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < kPoolVectorElems / 2; ++i)
    pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return packed;
}

// Up to kPoolCombineBatch routes of one token: their pool rows (-1 = skip) and weights.
struct RouteBatch {
  int32_t row[kPoolCombineBatch];
  float weight[kPoolCombineBatch];
};

// Routes k0 .. k0 + kPoolCombineBatch - 1 of a token. Every index load is issued
// before any is used, so their latencies overlap instead of adding up.
__device__ __forceinline__ RouteBatch load_routes(const int32_t* __restrict__ rows,
                                                  const float* __restrict__ weights, int k0,
                                                  int top_k, int64_t pool_capacity) {
  RouteBatch batch;
#pragma unroll
  for (int i = 0; i < kPoolCombineBatch; ++i)
    batch.row[i] = k0 + i < top_k ? __ldg(rows + k0 + i) : -1;
#pragma unroll
  for (int i = 0; i < kPoolCombineBatch; ++i) {
    // Rows outside the pool (only a corrupt plan has them) count as masked rather
    // than being read out of bounds; the reference does the same.
    if (batch.row[i] >= pool_capacity) batch.row[i] = -1;
    batch.weight[i] = batch.row[i] >= 0 ? __ldg(weights + k0 + i) : 0.0f;
  }
  return batch;
}

// acc += the batch's weighted vectors at vector `v` of the rows (pool_row_vecs
// vectors per row). All loads are issued before the first accumulation; the
// accumulation then runs in k order.
__device__ __forceinline__ void accumulate_batch(float (&acc)[kPoolVectorElems],
                                                 const RouteBatch& batch,
                                                 const uint4* __restrict__ pool, int pool_row_vecs,
                                                 int v) {
  uint4 values[kPoolCombineBatch];
#pragma unroll
  for (int i = 0; i < kPoolCombineBatch; ++i) {
    values[i] = make_uint4(0u, 0u, 0u, 0u);
    if (batch.row[i] >= 0)
      values[i] = __ldg(pool + (static_cast<int64_t>(batch.row[i]) * pool_row_vecs + v));
  }
#pragma unroll
  for (int i = 0; i < kPoolCombineBatch; ++i)
    if (batch.row[i] >= 0) accumulate_weighted(acc, batch.weight[i], values[i]);
}

// kSideSum: the side_sum kernel (columns [H, H + r) into p_sum); otherwise combine
// (columns [0, H) into out, plus the side term). One template so both share the loop.
template <bool kSideSum>
__global__ void __launch_bounds__(kPoolThreadsPerBlock) pool_combine_tokens(PoolCombineParams p) {
  const int pool_row_vecs = (p.hidden + p.side_rank) / kPoolVectorElems;
  const int vecs = (kSideSum ? p.side_rank : p.hidden) / kPoolVectorElems;  // >= 1 (host)
  // Lanes per token: the power of two >= vecs, at most a warp, so short rows (r = 128
  // is 16 vectors) share a warp between tokens instead of idling half of it.
  const int lanes = vecs >= 32 ? 32 : 1 << (32 - __clz(vecs - 1));
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int group_lane = lane & (lanes - 1);
  const int tokens_per_warp = 32 / lanes;
  // One persistent wave (the host caps the grid): warp indices fit 32 bits.
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  const int num_warps = static_cast<int>(gridDim.x * blockDim.x / 32);
  const int top_k = p.top_k;
  // Slice s of a row: vectors [s * slice_vecs, (s + 1) * slice_vecs), a multiple of the
  // group's lanes; a slice past the row's end is empty.
  const int slices = p.row_slices;
  const int slice_vecs = lanes * ((vecs + lanes * slices - 1) / (lanes * slices));
  const int64_t token_warps = (p.num_tokens + tokens_per_warp - 1) / tokens_per_warp;

  // side_sum reads the pool's side columns: start its row pointers past the H columns.
  const uint4* __restrict__ pool =
      static_cast<const uint4*>(p.pool_output) + (kSideSum ? p.hidden / kPoolVectorElems : 0);
  const uint4* __restrict__ side = static_cast<const uint4*>(p.side_expand);
  uint4* __restrict__ out = static_cast<uint4*>(kSideSum ? p.p_sum : p.out);

  // Work items (token warp, slice), slices fastest, grid-strided; the stride is split
  // once into whole token warps and a slice remainder (no 64-bit division in the loop).
  const int stride_tokens = num_warps / slices, stride_slices = num_warps % slices;
  int slice = warp % slices;
  for (int64_t token_warp = warp / slices; token_warp < token_warps;
       token_warp += stride_tokens, slice += stride_slices) {
    if (slice >= slices) slice -= slices, ++token_warp;
    if (token_warp >= token_warps) break;
    const int64_t token = token_warp * tokens_per_warp + lane / lanes;
    if (token >= p.num_tokens) continue;
    const int v_begin = slice * slice_vecs;
    const int v_end = min(vecs, v_begin + slice_vecs);
    const int32_t* rows = p.route_to_pool_row + token * top_k;
    const float* weights = p.topk_weights + token * top_k;
    for (int v = v_begin + group_lane; v < v_end; v += lanes) {
      // The host passes side_expand = nullptr when scale == 0, so a zero adapter scale
      // is the no-side path bit for bit (a non-finite side value cannot leak in as
      // 0 * inf = NaN) and costs no side reads. Loaded first: it depends on nothing,
      // so it flies with the pool loads instead of after them.
      const bool has_side = !kSideSum && side != nullptr;
      uint4 side_value = make_uint4(0u, 0u, 0u, 0u);
      if (has_side) side_value = __ldg(side + (token * vecs + v));
      float acc[kPoolVectorElems];
#pragma unroll
      for (int i = 0; i < kPoolVectorElems; ++i) acc[i] = 0.0f;
      // Rows and weights are reloaded per vector (same address across the group: L1
      // hits). Keeping them in registers for the whole token costs ~50 registers
      // (hoisted 64-bit row addresses), i.e. a third of the resident warps.
      for (int k0 = 0; k0 < top_k; k0 += kPoolCombineBatch)
        accumulate_batch(acc, load_routes(rows, weights, k0, top_k, p.pool_capacity), pool,
                         pool_row_vecs, v);
      if (has_side) accumulate_weighted(acc, p.scale, side_value);
      out[token * vecs + v] = pack_bf16(acc);
    }
  }
}

inline PoolCombineKernels pool_combine_kernels() {
  return PoolCombineKernels{&pool_combine_tokens<true>, &pool_combine_tokens<false>};
}

}  // namespace megamoe::kernels
