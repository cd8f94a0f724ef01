// Host launcher of the route plan: the stable counting sort of routes by local expert.
#pragma once

#include <cstdint>
#include <optional>

#include "tensor_checks.h"

namespace megamoe {

// Tiles of the route-plan kernels for `num_routes` routes (rows of tile_expert_counts).
int64_t route_plan_num_tiles(int64_t num_routes);

// Plans `topk_ids` [T, K] (int32/int64 global ids, -1 masked) for local experts
// [expert_begin, expert_begin + num_local_experts). Writes every output on `stream`;
// `pool_row_to_route` must hold at least T*K + E_l*(block_m - 1) rows. With
// `tile_expert_counts`' int64 twin `tile_id_extremes` [tiles, 2] and the address of two
// int64 of pinned host memory, also writes all ids' [min, max] there (0: no id check).
void route_plan(const Tensor& topk_ids, int64_t expert_begin, int num_local_experts, int block_m,
                const Tensor& tile_expert_counts, const Tensor& expert_counts,
                const Tensor& expert_pool_offsets, const Tensor& route_to_pool_row,
                const Tensor& pool_row_to_route, std::optional<Tensor> tile_id_extremes,
                uintptr_t id_extremes_host, uintptr_t stream);

}  // namespace megamoe
