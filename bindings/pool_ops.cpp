// Host launchers of the pool gather (kernels/pool_gather.cuh) and the pool combine
// (kernels/pool_combine.cuh): argument checks, grid sizing, launches on the caller's
// stream. No host synchronisation: the rows in use are read by the kernels.
#include "pool_ops.h"

#include <cuda_runtime.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "launch_queries.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// 16-byte vector loads and stores: the base address must be 16-byte aligned (row
// strides are, since every row length is a multiple of 8 BF16 elements).
void check_aligned(const char* name, const Tensor& t, uintptr_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(t.data());
  if (t.size() > 0 && address % bytes != 0)
    throw nb::value_error((std::string(name) + ": expected a data pointer aligned to " +
                           str(static_cast<int64_t>(bytes)) + " bytes, got address " +
                           str(static_cast<int64_t>(address)))
                              .c_str());
}

void check_bf16(const char* name, const Tensor& t, const std::vector<int64_t>& shape, int device) {
  check_tensor(name, t, bfloat16_dtype(), shape, device);
  check_aligned(name, t, 16);
}

void check_multiple_of_vector(const char* name, const char* what, int64_t value) {
  if (value % kPoolVectorElems != 0)
    throw nb::value_error((std::string(name) + ": expected " + what + " to be a multiple of " +
                           str(kPoolVectorElems) + " (16-byte vectors), got " + str(value))
                              .c_str());
}

void check_current_device(const char* name, int device) {
  int current_device = -1;
  cuda_check(cudaGetDevice(&current_device), "cudaGetDevice");
  if (current_device != device)
    throw nb::value_error((std::string(name) + ": on cuda:" + str(device) +
                           " but the current device is cuda:" + str(current_device))
                              .c_str());
}

// A persistent grid: as many blocks as fit on the device at once, fewer if the work
// needs fewer. The kernels grid-stride, so any count is correct; more than fit would
// only add scheduling waves. The resident count is asked of the driver once per kernel
// and device (launch_queries.h): no stream work, fine under capture.
unsigned persistent_blocks(const void* kernel, int device, int64_t blocks_needed) {
  const int64_t resident = resident_blocks(kernel, device, kPoolThreadsPerBlock);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks_needed, resident)));
}

// Launches `blocks` blocks (already sized to fit: persistent_blocks).
template <typename Kernel, typename Params>
void launch_blocks(Kernel kernel, const Params& params, unsigned blocks, uintptr_t stream,
                   const char* what) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kPoolThreadsPerBlock);
  config.dynamicSmemBytes = 0;
  config.stream = reinterpret_cast<cudaStream_t>(stream);
  cuda_check(cudaLaunchKernelEx(&config, kernel, params), what);
}

template <typename Kernel, typename Params>
void launch(Kernel kernel, const Params& params, int device, int64_t blocks_needed,
            uintptr_t stream, const char* what) {
  launch_blocks(kernel, params,
                persistent_blocks(reinterpret_cast<const void*>(kernel), device, blocks_needed),
                stream, what);
}

void pool_gather(const Tensor& x, std::optional<Tensor> side, const Tensor& pool_row_to_route,
                 const Tensor& expert_pool_offsets, int top_k, const Tensor& pool_input,
                 uintptr_t stream, std::optional<Tensor> route_to_pool_row) {
  const int device = x.device_id();
  check_bf16("x", x, {-1, -1}, device);
  const int64_t num_tokens = x.shape(0), hidden = x.shape(1);
  if (hidden < kPoolVectorElems)
    throw nb::value_error(
        ("x: expected at least " + str(kPoolVectorElems) + " columns, got " + str(hidden)).c_str());
  check_multiple_of_vector("x", "the hidden size (columns)", hidden);
  int64_t side_cols = 0;
  if (side) {
    check_bf16("side", *side, {num_tokens, -1}, device);
    side_cols = side->shape(1);
    check_multiple_of_vector("side", "its column count", side_cols);
  }
  if (top_k < 1) throw nb::value_error(("top_k: expected >= 1, got " + str(top_k)).c_str());
  // Routes are int32 in the plan.
  if (num_tokens * top_k > INT32_MAX)
    throw nb::value_error(("x: " + str(num_tokens) + " tokens x top_k " + str(top_k) +
                           " routes exceed the int32 route index")
                              .c_str());
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {-1}, device);
  const int64_t pool_capacity = pool_row_to_route.shape(0);
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {-1}, device);
  if (expert_pool_offsets.shape(0) < 2)
    throw nb::value_error(("expert_pool_offsets: expected [E_l + 1] entries with E_l >= 1, got " +
                           shape_string(expert_pool_offsets))
                              .c_str());
  check_bf16("pool_input", pool_input, {pool_capacity, hidden + side_cols}, device);
  if (route_to_pool_row)
    check_tensor<int32_t>("route_to_pool_row", *route_to_pool_row, {num_tokens, top_k}, device);
  check_current_device("x", device);
  if (pool_capacity == 0) return;

  PoolGatherParams params{};
  params.x = x.data();
  params.side = side_cols > 0 ? side->data() : nullptr;
  params.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  params.route_to_pool_row =
      route_to_pool_row ? static_cast<const int32_t*>(route_to_pool_row->data()) : nullptr;
  params.pool_rows_used =
      static_cast<const int32_t*>(expert_pool_offsets.data()) + (expert_pool_offsets.shape(0) - 1);
  params.pool_input = pool_input.data();
  params.num_tokens = num_tokens;
  params.pool_capacity = pool_capacity;
  params.top_k = top_k;
  params.hidden = static_cast<int32_t>(hidden);
  params.side_cols = static_cast<int32_t>(side_cols);

  const PoolGatherKernels& kernels = variants::pool_gather;
  constexpr int64_t kRowsPerBlock = kPoolThreadsPerBlock / 32;  // one warp per row
  launch(kernels.gather, params, device, (pool_capacity + kRowsPerBlock - 1) / kRowsPerBlock,
         stream, "pool_gather launch");
}

// The token-major pool gather (kernels/pool_gather_tokens.cuh). Its grid: a warp per
// (token, row slice), rows split into slices when one warp per token leaves the GPU
// short of resident warps (few tokens), and for the zeroing pass up to 32 warps per
// 32-row group of the pool, as many as fill the GPU (the rows in use are known only on
// the device: sized by the capacity).
void pool_gather_tokens(const Tensor& x, std::optional<Tensor> side,
                        const Tensor& route_to_pool_row, const Tensor& pool_row_to_route,
                        const Tensor& expert_pool_offsets, const Tensor& pool_input,
                        uintptr_t stream) {
  const int device = x.device_id();
  check_bf16("x", x, {-1, -1}, device);
  const int64_t num_tokens = x.shape(0), hidden = x.shape(1);
  if (hidden < kPoolVectorElems)
    throw nb::value_error(
        ("x: expected at least " + str(kPoolVectorElems) + " columns, got " + str(hidden)).c_str());
  check_multiple_of_vector("x", "the hidden size (columns)", hidden);
  int64_t side_cols = 0;
  if (side) {
    check_bf16("side", *side, {num_tokens, -1}, device);
    side_cols = side->shape(1);
    check_multiple_of_vector("side", "its column count", side_cols);
  }
  check_tensor<int32_t>("route_to_pool_row", route_to_pool_row, {num_tokens, -1}, device);
  const int64_t top_k = route_to_pool_row.shape(1);
  if (top_k < 1)
    throw nb::value_error(("route_to_pool_row: expected >= 1 routes per token, got " +
                           shape_string(route_to_pool_row))
                              .c_str());
  // Routes are int32 in the plan.
  if (num_tokens * top_k > INT32_MAX)
    throw nb::value_error(("x: " + str(num_tokens) + " tokens x top_k " + str(top_k) +
                           " routes exceed the int32 route index")
                              .c_str());
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {-1}, device);
  const int64_t pool_capacity = pool_row_to_route.shape(0);
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {-1}, device);
  if (expert_pool_offsets.shape(0) < 2)
    throw nb::value_error(("expert_pool_offsets: expected [E_l + 1] entries with E_l >= 1, got " +
                           shape_string(expert_pool_offsets))
                              .c_str());
  check_bf16("pool_input", pool_input, {pool_capacity, hidden + side_cols}, device);
  check_current_device("x", device);
  if (pool_capacity == 0) return;

  const PoolGatherKernels& kernels = variants::pool_gather;
  const auto* kernel = reinterpret_cast<const void*>(kernels.tokens);
  const int64_t row_vecs = (hidden + side_cols) / kPoolVectorElems;
  const int64_t warps_per_block = kPoolThreadsPerBlock / 32;
  const unsigned resident_blocks = persistent_blocks(kernel, device, INT32_MAX);
  const int64_t resident_warps = int64_t{resident_blocks} * warps_per_block;
  // Slices of whole warp strides; the count is cut to the slices that hold vectors (the
  // kernel derives the same slice length from it).
  const int64_t max_slices = (row_vecs + 31) / 32;
  int64_t slices = std::clamp<int64_t>(
      num_tokens > 0 ? (resident_warps + num_tokens - 1) / num_tokens : 1, 1, max_slices);
  const int64_t slice_vecs = 32 * ((row_vecs + 32 * slices - 1) / (32 * slices));
  slices = (row_vecs + slice_vecs - 1) / slice_vecs;
  const int64_t groups = (pool_capacity + 31) / 32;
  const int64_t zero_parts = std::clamp<int64_t>((resident_warps + groups - 1) / groups, 1, 32);
  const int64_t warps = std::max(num_tokens * slices, groups * zero_parts);

  PoolGatherParams params{};
  params.x = x.data();
  params.side = side_cols > 0 ? side->data() : nullptr;
  params.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  params.route_to_pool_row = static_cast<const int32_t*>(route_to_pool_row.data());
  params.pool_rows_used =
      static_cast<const int32_t*>(expert_pool_offsets.data()) + (expert_pool_offsets.shape(0) - 1);
  params.pool_input = pool_input.data();
  params.num_tokens = num_tokens;
  params.pool_capacity = pool_capacity;
  params.top_k = static_cast<int32_t>(top_k);
  params.hidden = static_cast<int32_t>(hidden);
  params.side_cols = static_cast<int32_t>(side_cols);
  params.row_slices = static_cast<int32_t>(slices);
  params.zero_parts = static_cast<int32_t>(zero_parts);
  const int64_t blocks = (warps + warps_per_block - 1) / warps_per_block;
  launch_blocks(kernels.tokens, params,
                static_cast<unsigned>(std::min<int64_t>(blocks, resident_blocks)), stream,
                "pool_gather_tokens launch");
}

// The combine's grid (mirrors the lane-group choice in pool_combine_tokens): a group of
// `lanes` lanes per token, and the row split into `row_slices` slices when one warp per
// token leaves the GPU short of resident warps (few tokens). The kernel rounds a slice
// up to whole lane-group strides, so the count is then cut to the slices that hold
// vectors (the kernel derives the same slice length from it): no warp is launched idle.
struct CombineGrid {
  int32_t row_slices;
  unsigned blocks;
};

CombineGrid combine_grid(const void* kernel, int device, int64_t num_tokens, int64_t vecs) {
  int64_t lanes = 1;
  while (lanes < vecs && lanes < 32) lanes *= 2;
  const int64_t warps_per_block = kPoolThreadsPerBlock / 32;
  const int64_t token_warps = (num_tokens + 32 / lanes - 1) / (32 / lanes);
  const unsigned resident_blocks = persistent_blocks(kernel, device, INT32_MAX);
  const int64_t resident_warps = int64_t{resident_blocks} * warps_per_block;
  const int64_t max_slices = (vecs + lanes - 1) / lanes;
  int64_t slices =
      std::clamp<int64_t>((resident_warps + token_warps - 1) / token_warps, 1, max_slices);
  const int64_t slice_vecs = lanes * ((vecs + lanes * slices - 1) / (lanes * slices));
  slices = (vecs + slice_vecs - 1) / slice_vecs;
  const int64_t blocks = (token_warps * slices + warps_per_block - 1) / warps_per_block;
  return {static_cast<int32_t>(slices),
          static_cast<unsigned>(std::min<int64_t>(blocks, resident_blocks))};
}

// Checks shared by side_sum and combine; returns (num_tokens, top_k).
std::pair<int64_t, int> check_routes(const Tensor& pool_output, const Tensor& route_to_pool_row,
                                     const Tensor& topk_weights, int device) {
  check_bf16("pool_output", pool_output, {-1, -1}, device);
  check_tensor<int32_t>("route_to_pool_row", route_to_pool_row, {-1, -1}, device);
  const int64_t num_tokens = route_to_pool_row.shape(0), top_k = route_to_pool_row.shape(1);
  if (top_k < 1 || top_k > INT32_MAX)
    throw nb::value_error(("route_to_pool_row: expected 1 to 2^31-1 routes per token, got " +
                           shape_string(route_to_pool_row))
                              .c_str());
  check_tensor<float>("topk_weights", topk_weights, {num_tokens, top_k}, device);
  return {num_tokens, static_cast<int>(top_k)};
}

void pool_side_sum(const Tensor& pool_output, const Tensor& route_to_pool_row,
                   const Tensor& topk_weights, int64_t hidden, const Tensor& p_sum,
                   uintptr_t stream) {
  const int device = pool_output.device_id();
  const auto [num_tokens, top_k] =
      check_routes(pool_output, route_to_pool_row, topk_weights, device);
  const int64_t columns = pool_output.shape(1);
  // hidden = 0 sums whole rows (the backward's b1/b3 shrinks).
  if (hidden < 0 || hidden > columns)
    throw nb::value_error(
        ("hidden: expected 0 to " + str(columns) + " (pool_output's columns), got " + str(hidden))
            .c_str());
  check_multiple_of_vector("hidden", "the hidden size", hidden);
  const int64_t side_rank = columns - hidden;
  check_multiple_of_vector("pool_output", "its side columns (columns - hidden)", side_rank);
  check_bf16("p_sum", p_sum, {num_tokens, side_rank}, device);
  check_current_device("pool_output", device);
  if (num_tokens == 0 || side_rank == 0) return;

  PoolCombineParams params{};
  params.pool_output = pool_output.data();
  params.route_to_pool_row = static_cast<const int32_t*>(route_to_pool_row.data());
  params.topk_weights = static_cast<const float*>(topk_weights.data());
  params.side_expand = nullptr;
  params.out = nullptr;
  params.p_sum = p_sum.data();
  params.num_tokens = num_tokens;
  params.pool_capacity = pool_output.shape(0);
  params.top_k = top_k;
  params.hidden = static_cast<int32_t>(hidden);
  params.side_rank = static_cast<int32_t>(side_rank);
  params.scale = 0.0f;

  const PoolCombineKernels& kernels = variants::pool_combine;
  const CombineGrid grid = combine_grid(reinterpret_cast<const void*>(kernels.side_sum), device,
                                        num_tokens, side_rank / kPoolVectorElems);
  params.row_slices = grid.row_slices;
  launch_blocks(kernels.side_sum, params, grid.blocks, stream, "pool_side_sum launch");
}

void pool_combine(const Tensor& pool_output, const Tensor& route_to_pool_row,
                  const Tensor& topk_weights, std::optional<Tensor> side_expand, double scale,
                  const Tensor& out, uintptr_t stream) {
  const int device = pool_output.device_id();
  const auto [num_tokens, top_k] =
      check_routes(pool_output, route_to_pool_row, topk_weights, device);
  check_bf16("out", out, {num_tokens, -1}, device);
  const int64_t hidden = out.shape(1), columns = pool_output.shape(1);
  if (hidden < kPoolVectorElems || hidden > columns)
    throw nb::value_error(("out: expected " + str(kPoolVectorElems) + " to " + str(columns) +
                           " (pool_output's columns) columns, got " + str(hidden))
                              .c_str());
  check_multiple_of_vector("out", "the hidden size (columns)", hidden);
  check_multiple_of_vector("pool_output", "its side columns (columns - hidden)", columns - hidden);
  if (side_expand) check_bf16("side_expand", *side_expand, {num_tokens, hidden}, device);
  check_current_device("pool_output", device);
  if (num_tokens == 0) return;

  PoolCombineParams params{};
  params.pool_output = pool_output.data();
  params.route_to_pool_row = static_cast<const int32_t*>(route_to_pool_row.data());
  params.topk_weights = static_cast<const float*>(topk_weights.data());
  // scale == 0 drops the side term entirely: the output is then bitwise the no-side one.
  params.side_expand = side_expand && scale != 0.0 ? side_expand->data() : nullptr;
  params.out = out.data();
  params.p_sum = nullptr;
  params.num_tokens = num_tokens;
  params.pool_capacity = pool_output.shape(0);
  params.top_k = top_k;
  params.hidden = static_cast<int32_t>(hidden);
  params.side_rank = static_cast<int32_t>(columns - hidden);
  params.scale = static_cast<float>(scale);

  const PoolCombineKernels& kernels = variants::pool_combine;
  const CombineGrid grid = combine_grid(reinterpret_cast<const void*>(kernels.combine), device,
                                        num_tokens, hidden / kPoolVectorElems);
  params.row_slices = grid.row_slices;
  launch_blocks(kernels.combine, params, grid.blocks, stream, "pool_combine launch");
}

}  // namespace

void register_pool_ops(nb::module_& m) {
  m.def("pool_gather", &pool_gather, nb::arg("x"), nb::arg("side").none(),
        nb::arg("pool_row_to_route"), nb::arg("expert_pool_offsets"), nb::arg("top_k"),
        nb::arg("pool_input"), nb::arg("stream"), nb::arg("route_to_pool_row").none() = nb::none(),
        "pool_input[row] = [x[t] | side[t]] for each routed pool row (t = route / top_k), "
        "zeros for padding rows below expert_pool_offsets[-1]; later rows untouched. With "
        "route_to_pool_row, a row is routed only where that map names it back.");
  m.def("pool_gather_tokens", &pool_gather_tokens, nb::arg("x"), nb::arg("side").none(),
        nb::arg("route_to_pool_row"), nb::arg("pool_row_to_route"), nb::arg("expert_pool_offsets"),
        nb::arg("pool_input"), nb::arg("stream"),
        "pool_gather's result token-major: each token's [x | side] row read once and written to "
        "its routes' pool rows (both index maps must name the pair), zeros for the other rows "
        "below expert_pool_offsets[-1]; later rows untouched.");
  m.def("pool_side_sum", &pool_side_sum, nb::arg("pool_output"), nb::arg("route_to_pool_row"),
        nb::arg("topk_weights"), nb::arg("hidden"), nb::arg("p_sum"), nb::arg("stream"),
        "p_sum[t] = bf16(sum_k w[t,k] * pool_output[row, hidden:]) in FP32, k in order.");
  m.def("pool_combine", &pool_combine, nb::arg("pool_output"), nb::arg("route_to_pool_row"),
        nb::arg("topk_weights"), nb::arg("side_expand").none(), nb::arg("scale"), nb::arg("out"),
        nb::arg("stream"),
        "out[t] = bf16(sum_k w[t,k] * pool_output[row, :H] + scale * side_expand[t]) in FP32, "
        "k in order; scale 0 or side_expand None: no side term.");
}

}  // namespace megamoe
