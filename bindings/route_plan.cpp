// Host launcher of the route plan (kernels/route_plan.cuh): checks, variant
// selection, three launches on the caller's stream.
#include "route_plan.h"

#include <string>

#include "cuda_check.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

const RoutePlanKernels& select_variant(nb::dlpack::dtype id_dtype) {
  const char* index_type = id_dtype == nb::dtype<int32_t>()   ? "int32_t"
                           : id_dtype == nb::dtype<int64_t>() ? "int64_t"
                                                              : nullptr;
  if (index_type != nullptr) {
    for (const auto& variant : variants::kRoutePlanVariants)
      if (std::string(variant.index_type) == index_type) return *variant.kernels;
  }
  throw nb::type_error(
      ("topk_ids: expected dtype int32 or int64, got " + dtype_name(id_dtype)).c_str());
}

bool is_block_m_choice(int block_m) {
  for (int choice : variants::kBlockMChoices)
    if (choice == block_m) return true;
  return false;
}

}  // namespace

int64_t route_plan_num_tiles(int64_t num_routes) {
  return (num_routes + kRoutePlanRoutesPerTile - 1) / kRoutePlanRoutesPerTile;
}

void route_plan(const Tensor& topk_ids, int64_t expert_begin, int num_local_experts, int block_m,
                const Tensor& tile_expert_counts, const Tensor& expert_counts,
                const Tensor& expert_pool_offsets, const Tensor& route_to_pool_row,
                const Tensor& pool_row_to_route, std::optional<Tensor> tile_id_extremes,
                uintptr_t id_extremes_host, uintptr_t stream) {
  const RoutePlanKernels& kernels = select_variant(topk_ids.dtype());
  if (topk_ids.ndim() != 2)
    throw nb::value_error(
        ("topk_ids: expected 2 dimensions [T, K], got " + shape_string(topk_ids)).c_str());
  const int device = topk_ids.device_id();
  const int64_t num_routes = static_cast<int64_t>(topk_ids.shape(0) * topk_ids.shape(1));
  if (topk_ids.dtype() == nb::dtype<int32_t>())
    check_tensor<int32_t>("topk_ids", topk_ids, {-1, -1}, device);
  else
    check_tensor<int64_t>("topk_ids", topk_ids, {-1, -1}, device);
  if (num_routes < 1 || num_routes > INT32_MAX)
    throw nb::value_error(
        ("topk_ids: expected 1 to 2^31-1 routes, got " + std::to_string(num_routes)).c_str());
  if (num_local_experts < 1 || num_local_experts > kRoutePlanMaxLocalExperts)
    throw nb::value_error(("num_local_experts: expected 1.." +
                           std::to_string(kRoutePlanMaxLocalExperts) + ", got " +
                           std::to_string(num_local_experts))
                              .c_str());
  if (!is_block_m_choice(block_m))
    throw nb::value_error(
        ("block_m: not a registry BLOCK_M choice: " + std::to_string(block_m)).c_str());
  const int64_t num_tiles = route_plan_num_tiles(num_routes);
  check_tensor<int32_t>("tile_expert_counts", tile_expert_counts, {num_tiles, num_local_experts},
                        device);
  check_tensor<int32_t>("expert_counts", expert_counts, {num_local_experts}, device);
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {num_local_experts + 1},
                        device);
  check_tensor<int32_t>("route_to_pool_row", route_to_pool_row, {num_routes}, device);
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {-1}, device);
  const int64_t pool_capacity = static_cast<int64_t>(pool_row_to_route.shape(0));
  const int64_t worst_case_rows = num_routes + int64_t{num_local_experts} * (block_m - 1);
  // The kernels compute pool rows (segment offsets, each route's row) in int32.
  if (worst_case_rows > INT32_MAX)
    throw nb::value_error(("topk_ids: " + std::to_string(num_routes) + " routes over " +
                           std::to_string(num_local_experts) + " experts at BLOCK_M " +
                           std::to_string(block_m) + " need up to " +
                           std::to_string(worst_case_rows) +
                           " pool rows (T*K + E_l*(BLOCK_M-1)); pool rows are int32 indices")
                              .c_str());
  if (pool_capacity < worst_case_rows)
    throw nb::value_error(("pool_row_to_route: pool capacity " + std::to_string(pool_capacity) +
                           " is below the worst case " + std::to_string(worst_case_rows) +
                           " rows (T*K + E_l*(BLOCK_M-1))")
                              .c_str());

  // The id check: both or neither. The host pointer of pinned memory (torch's
  // pin_memory) maps to the device pointer the kernel writes through.
  if (tile_id_extremes.has_value() != (id_extremes_host != 0))
    throw nb::value_error("tile_id_extremes/id_extremes_host: give both or neither");
  int64_t* id_extremes = nullptr;
  if (tile_id_extremes) {
    check_tensor<int64_t>("tile_id_extremes", *tile_id_extremes, {num_tiles, 2}, device);
    void* mapped = nullptr;
    if (cudaHostGetDevicePointer(&mapped, reinterpret_cast<void*>(id_extremes_host), 0) !=
        cudaSuccess) {
      cudaGetLastError();  // not a sticky error: clear it
      throw nb::value_error("id_extremes_host: expected pinned host memory (pin_memory=True)");
    }
    id_extremes = static_cast<int64_t*>(mapped);
  }

  RoutePlanParams params{};
  params.topk_ids = topk_ids.data();
  params.num_routes = num_routes;
  params.expert_begin = expert_begin;
  params.num_local_experts = num_local_experts;
  params.block_m = block_m;
  params.num_tiles = static_cast<int32_t>(num_tiles);
  params.pool_capacity = pool_capacity;
  params.tile_expert_counts = static_cast<int32_t*>(tile_expert_counts.data());
  params.expert_counts = static_cast<int32_t*>(expert_counts.data());
  params.expert_pool_offsets = static_cast<int32_t*>(expert_pool_offsets.data());
  params.route_to_pool_row = static_cast<int32_t*>(route_to_pool_row.data());
  params.pool_row_to_route = static_cast<int32_t*>(pool_row_to_route.data());
  params.tile_id_extremes =
      tile_id_extremes ? static_cast<int64_t*>(tile_id_extremes->data()) : nullptr;
  params.id_extremes = id_extremes;

  int current_device = -1;
  cuda_check(cudaGetDevice(&current_device), "cudaGetDevice");
  if (current_device != device)
    throw nb::value_error(("topk_ids: on cuda:" + std::to_string(device) +
                           " but the current device is cuda:" + std::to_string(current_device))
                              .c_str());

  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  const size_t histogram_bytes = sizeof(int32_t) * num_local_experts;
  cudaLaunchConfig_t config{};
  config.stream = cuda_stream;

  config.gridDim = dim3(static_cast<unsigned>(num_tiles));
  config.blockDim = dim3(256);
  config.dynamicSmemBytes = histogram_bytes;
  cuda_check(cudaLaunchKernelEx(&config, kernels.count, params), "route_plan count launch");

  config.gridDim = dim3(1);
  config.blockDim = dim3(kRoutePlanMaxLocalExperts);
  config.dynamicSmemBytes = 0;
  cuda_check(cudaLaunchKernelEx(&config, kernels.offsets, params), "route_plan offsets launch");

  config.gridDim = dim3(static_cast<unsigned>(num_tiles));
  config.blockDim = dim3(32 * kRoutePlanScatterWarps);
  config.dynamicSmemBytes = histogram_bytes * kRoutePlanScatterWarps;
  cuda_check(cudaLaunchKernelEx(&config, kernels.scatter, params), "route_plan scatter launch");
}

}  // namespace megamoe
