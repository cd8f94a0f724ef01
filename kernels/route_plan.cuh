// Route plan: a stable counting sort of the (token, k) routes by local expert.
//
// The order inside each expert's segment is ascending route index t * K + k, so the
// plan, and everything gathered through it, is identical run after run (no atomics
// decide an order). Three passes on the caller's stream, no host synchronisation:
//   count   - per-tile expert histogram (shared-memory atomics: counts only, no order)
//   offsets - per-expert exclusive scan over tiles, then the padded segment starts
//   scatter - each warp of a tile's block walks its part of the tile in route order and
//             assigns pool rows (its first row per expert: the earlier warps' counts)
#pragma once

#include <climits>
#include <cub/block/block_scan.cuh>

#include "route_plan_params.h"

namespace megamoe::kernels {

template <typename IndexT>
__device__ __forceinline__ int64_t expert_id(const RoutePlanParams& p, int64_t route) {
  return static_cast<int64_t>(static_cast<const IndexT*>(p.topk_ids)[route]);
}

// Local expert of an id, or -1 for a masked (-1) or remote (another rank's) id.
__device__ __forceinline__ int local_expert(const RoutePlanParams& p, int64_t id) {
  const int64_t local = id - p.expert_begin;
  return (id >= 0 && local >= 0 && local < p.num_local_experts) ? static_cast<int>(local) : -1;
}

template <typename IndexT>
__device__ __forceinline__ int local_expert_of(const RoutePlanParams& p, int64_t route) {
  return local_expert(p, expert_id<IndexT>(p, route));
}

template <typename IndexT>
__global__ void __launch_bounds__(256) route_plan_count(RoutePlanParams p) {
  extern __shared__ int tile_histogram[];  // [E_l]
  __shared__ long long tile_extremes[2];   // the tile's smallest and largest id
  for (int e = threadIdx.x; e < p.num_local_experts; e += blockDim.x) tile_histogram[e] = 0;
  if (threadIdx.x == 0) {
    tile_extremes[0] = LLONG_MAX;
    tile_extremes[1] = LLONG_MIN;
  }
  __syncthreads();

  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kRoutePlanRoutesPerTile;
  const int64_t tile_end = min(tile_begin + kRoutePlanRoutesPerTile, p.num_routes);
  long long low = LLONG_MAX, high = LLONG_MIN;
  for (int64_t route = tile_begin + threadIdx.x; route < tile_end; route += blockDim.x) {
    const int64_t id = expert_id<IndexT>(p, route);
    low = min(low, static_cast<long long>(id));
    high = max(high, static_cast<long long>(id));
    const int expert = local_expert(p, id);
    if (expert >= 0) atomicAdd(&tile_histogram[expert], 1);
  }
  // Min and max do not depend on the order the atomics land in.
  if (p.tile_id_extremes != nullptr) {
    atomicMin(&tile_extremes[0], low);
    atomicMax(&tile_extremes[1], high);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_local_experts; e += blockDim.x)
    p.tile_expert_counts[static_cast<int64_t>(blockIdx.x) * p.num_local_experts + e] =
        tile_histogram[e];
  if (p.tile_id_extremes != nullptr && threadIdx.x < 2)
    p.tile_id_extremes[2 * static_cast<int64_t>(blockIdx.x) + threadIdx.x] =
        tile_extremes[threadIdx.x];

  // Padding rows of the pool must read as "no route"; the scatter pass overwrites
  // the rows that hold routes. Grid-stride over the whole pool.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       row < p.pool_capacity; row += stride)
    p.pool_row_to_route[row] = -1;
}

// Templated only so that each variant's translation unit owns its instantiation.
template <typename IndexT>
__global__ void __launch_bounds__(kRoutePlanMaxLocalExperts) route_plan_offsets(RoutePlanParams p) {
  using BlockScan = cub::BlockScan<int, kRoutePlanMaxLocalExperts>;
  __shared__ typename BlockScan::TempStorage scan_storage;

  const int expert = threadIdx.x;
  int expert_total = 0;
  if (expert < p.num_local_experts) {
    // Column walk over tiles (coalesced across experts). Loads are independent, so
    // unrolling keeps several in flight; only the running total is serial.
    int32_t* column = p.tile_expert_counts + expert;
#pragma unroll 8
    for (int tile = 0; tile < p.num_tiles; ++tile) {
      const int count = column[static_cast<int64_t>(tile) * p.num_local_experts];
      column[static_cast<int64_t>(tile) * p.num_local_experts] = expert_total;
      expert_total += count;
    }
  }
  const int padded_rows =
      (expert_total + p.block_m - 1) / p.block_m * p.block_m;  // 0 stays 0: empty experts
  int segment_start = 0;
  int pool_rows_used = 0;
  BlockScan(scan_storage).ExclusiveSum(padded_rows, segment_start, pool_rows_used);
  if (expert < p.num_local_experts) {
    p.expert_counts[expert] = expert_total;
    p.expert_pool_offsets[expert] = segment_start;
  }
  if (expert == 0) p.expert_pool_offsets[p.num_local_experts] = pool_rows_used;

  // All ids' extremes, from the tiles' (the id range check).
  if (p.id_extremes == nullptr) return;
  __shared__ long long extremes[2];
  if (threadIdx.x == 0) {
    extremes[0] = LLONG_MAX;
    extremes[1] = LLONG_MIN;
  }
  __syncthreads();
  long long low = LLONG_MAX, high = LLONG_MIN;
  for (int tile = threadIdx.x; tile < p.num_tiles; tile += blockDim.x) {
    low = min(low, static_cast<long long>(p.tile_id_extremes[2 * static_cast<int64_t>(tile)]));
    high =
        max(high, static_cast<long long>(p.tile_id_extremes[2 * static_cast<int64_t>(tile) + 1]));
  }
  atomicMin(&extremes[0], low);
  atomicMax(&extremes[1], high);
  __syncthreads();
  if (threadIdx.x < 2) p.id_extremes[threadIdx.x] = extremes[threadIdx.x];
}

template <typename IndexT>
__global__ void __launch_bounds__(32 * kRoutePlanScatterWarps)
    route_plan_scatter(RoutePlanParams p) {
  // cursor[w][e]: the pool row the next route of expert e in warp w's part of the tile
  // goes to. Warp w walks routes w * kRoutesPerScatterWarp.. of the tile in route order.
  constexpr int kChunks = kRoutesPerScatterWarp / 32;
  extern __shared__ int cursor[];  // [kRoutePlanScatterWarps][E_l]
  const int num_experts = p.num_local_experts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kRoutePlanScatterWarps * num_experts; i += blockDim.x)
    cursor[i] = 0;
  __syncthreads();

  const int64_t tile = blockIdx.x;
  const int64_t tile_end = min((tile + 1) * kRoutePlanRoutesPerTile, p.num_routes);
  const int64_t warp_begin =
      tile * kRoutePlanRoutesPerTile + static_cast<int64_t>(warp) * kRoutesPerScatterWarp;
  int* own = cursor + warp * num_experts;
  // Every id load of the warp's part first; the lanes routing to the same expert in each
  // 32-route chunk (a lane's rank among them: the peers below it).
  int experts[kChunks];
  unsigned peers[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t route = warp_begin + 32 * c + lane;
    experts[c] = route < tile_end ? local_expert_of<IndexT>(p, route) : -1;
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) peers[c] = __match_any_sync(0xffffffffu, experts[c]);

  // The warp's routes per expert: the highest peer of each chunk adds its group (chunks
  // in turn, one lane per expert: no atomics).
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (experts[c] >= 0 && (peers[c] >> lane) == 1u) own[experts[c]] += __popc(peers[c]);
    __syncwarp();
  }
  __syncthreads();
  // Each warp's first row per expert: the tile's (offsets pass) plus the earlier warps'.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int row = p.expert_pool_offsets[e] + p.tile_expert_counts[tile * num_experts + e];
#pragma unroll
    for (int w = 0; w < kRoutePlanScatterWarps; ++w) {
      const int routes = cursor[w * num_experts + e];
      cursor[w * num_experts + e] = row;
      row += routes;
    }
  }
  __syncthreads();

  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t route = warp_begin + 32 * c + lane;
    const int expert = experts[c];
    if (route < tile_end) {
      if (expert >= 0) {
        const int row = own[expert] + __popc(peers[c] & lanes_below);
        p.route_to_pool_row[route] = row;
        p.pool_row_to_route[row] = static_cast<int32_t>(route);
      } else {
        p.route_to_pool_row[route] = -1;
      }
    }
    __syncwarp();
    // The highest peer advances the expert's cursor past this chunk's routes.
    if (expert >= 0 && (peers[c] >> lane) == 1u) own[expert] += __popc(peers[c]);
    __syncwarp();
  }
}

template <typename IndexT>
RoutePlanKernels route_plan_kernels() {
  return RoutePlanKernels{&route_plan_count<IndexT>, &route_plan_offsets<IndexT>,
                          &route_plan_scatter<IndexT>};
}

}  // namespace megamoe::kernels
