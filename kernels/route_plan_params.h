// Route plan: the parameter block and kernel table shared by device and host code.
// Plain C++ (no device code) so the host launcher can include it.
#pragma once

#include <cstdint>

#include "registry_constants.h"

namespace megamoe {

// Routes handled by one tile of the route-plan kernels (from the registry). Pass 3's
// warps walk a tile's routes in order, which is what makes the sort stable; pass 2's scan
// over the tiles stays under ~200 of them at the production shape (T*K = 393,216 routes).
constexpr int kRoutePlanRoutesPerTile = registry::kRoutePlanRoutesPerTile;
// Pass 3 runs a block of this many warps per tile, each walking a contiguous part of it.
constexpr int kRoutePlanScatterWarps = 8;
constexpr int kRoutesPerScatterWarp = kRoutePlanRoutesPerTile / kRoutePlanScatterWarps;
static_assert(kRoutesPerScatterWarp % 32 == 0, "a scatter warp walks whole 32-route chunks");
// Pass 2 runs in one block with one thread per local expert (from the registry, which
// the Python checks read too).
constexpr int kRoutePlanMaxLocalExperts = registry::kRoutePlanMaxLocalExperts;

struct RoutePlanParams {
  const void* topk_ids;         // [num_routes] routing ids (int32 or int64), (t, k) order
  int64_t num_routes;           // T * K
  int64_t expert_begin;         // global id of local expert 0
  int32_t num_local_experts;    // E_l
  int32_t block_m;              // each expert's pool segment is padded to this
  int32_t num_tiles;            // ceil(num_routes / kRoutePlanRoutesPerTile)
  int64_t pool_capacity;        // rows of the pool (an upper bound known without a sync)
  int32_t* tile_expert_counts;  // [num_tiles, E_l] scratch: counts, then tile offsets
  int32_t* expert_counts;       // [E_l] routes per local expert
  int32_t*
      expert_pool_offsets;     // [E_l + 1] segment starts (multiples of block_m); last = rows used
  int32_t* route_to_pool_row;  // [num_routes] pool row of each route, -1 if masked or remote
  int32_t* pool_row_to_route;  // [pool_capacity] route of each pool row, -1 for padding
  // The expert-id range check, or null: each tile's smallest and largest id, then all
  // ids' [min, max], written into pinned host memory that the host reads once the stream
  // has passed the plan (no reduction or copy launched for it).
  int64_t* tile_id_extremes;  // [num_tiles, 2] scratch
  int64_t* id_extremes;       // [2] device-visible pinned host memory
};

using RoutePlanKernel = void (*)(RoutePlanParams);

// The three passes of one compiled variant (one per routing-id type).
struct RoutePlanKernels {
  RoutePlanKernel count;    // per-tile histogram; resets pool_row_to_route to -1
  RoutePlanKernel offsets;  // per-expert tile offsets, counts, padded segment starts
  RoutePlanKernel scatter;  // stable ranks -> both index maps
};

}  // namespace megamoe
