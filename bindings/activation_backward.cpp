// Host launcher of the activation backward: argument checks, grid sizing, one launch on
// the caller's stream. No host synchronisation: the rows in use are read by the kernel.
#include "activation_backward.h"

#include <cuda_runtime.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "cuda_check.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

static_assert(kActivationBackwardInterleave == variants::kGateUpInterleave,
              "the kernel indexes w13's gate/up interleave of the registry");

std::string str(int64_t v) { return std::to_string(v); }

void check_bf16_aligned(const char* name, const Tensor& t, const std::vector<int64_t>& shape,
                        int device) {
  check_tensor(name, t, bfloat16_dtype(), shape, device);
  if (t.size() > 0 && reinterpret_cast<uintptr_t>(t.data()) % 16 != 0)
    throw nb::value_error(
        (std::string(name) + ": expected a 16-byte aligned data pointer").c_str());
}

void activation_backward(const Tensor& preact, const Tensor& z, const Tensor& route_weights,
                         const Tensor& pool_row_to_route, const Tensor& expert_pool_offsets,
                         int activation, double activation_clamp, const Tensor& dgrad_preact,
                         std::optional<Tensor> weighted_h, const Tensor& drouter,
                         uintptr_t stream) {
  const int device = preact.device_id();
  check_bf16_aligned("preact", preact, {-1, -1}, device);
  const int64_t pool_capacity = preact.shape(0), two_i = preact.shape(1);
  const int64_t intermediate = two_i / 2;
  if (two_i % (2 * variants::kGateUpInterleave) != 0 || intermediate == 0)
    throw nb::value_error(("preact: expected 2I columns with I a multiple of " +
                           str(variants::kGateUpInterleave) + ", got " + str(two_i))
                              .c_str());
  check_bf16_aligned("z", z, {pool_capacity, intermediate}, device);
  check_tensor<float>("route_weights", route_weights, {-1}, device);
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {pool_capacity}, device);
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {-1}, device);
  if (expert_pool_offsets.shape(0) < 2)
    throw nb::value_error("expert_pool_offsets: expected [E_l + 1] entries with E_l >= 1");
  if (activation != 0 && activation != 1)
    throw nb::value_error(
        ("activation: expected 0 (swiglu) or 1 (geglu), got " + str(activation)).c_str());
  if (std::isnan(activation_clamp) || activation_clamp <= 0)
    throw nb::value_error("activation_clamp: expected a positive value (inf = no clamp)");
  check_bf16_aligned("dgrad_preact", dgrad_preact, {pool_capacity, two_i}, device);
  if (weighted_h)
    check_bf16_aligned("weighted_h", *weighted_h, {pool_capacity, intermediate}, device);
  check_tensor<float>("drouter", drouter, {pool_capacity}, device);
  int current_device = -1;
  cuda_check(cudaGetDevice(&current_device), "cudaGetDevice");
  if (current_device != device)
    throw nb::value_error(("preact: on cuda:" + str(device) +
                           " but the current device is cuda:" + str(current_device))
                              .c_str());
  if (pool_capacity == 0) return;

  ActivationBackwardParams params{};
  params.preact = preact.data();
  params.z = z.data();
  params.route_weights = static_cast<const float*>(route_weights.data());
  params.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  params.pool_rows_used =
      static_cast<const int32_t*>(expert_pool_offsets.data()) + (expert_pool_offsets.shape(0) - 1);
  params.dgrad_preact = dgrad_preact.data();
  params.weighted_h = weighted_h ? weighted_h->data() : nullptr;
  params.drouter = static_cast<float*>(drouter.data());
  params.pool_capacity = pool_capacity;
  params.num_routes = route_weights.shape(0);
  params.intermediate = static_cast<int32_t>(intermediate);
  params.activation = activation;
  params.activation_clamp = static_cast<float>(activation_clamp);

  // A persistent grid (the kernel grid-strides over rows, one warp per row).
  const ActivationBackwardKernels& kernels = variants::activation_backward;
  int sm_count = 0, blocks_per_sm = 0;
  cuda_check(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(MultiProcessorCount)");
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                 &blocks_per_sm, reinterpret_cast<const void*>(kernels.kernel),
                 kActivationBackwardThreads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  constexpr int64_t kRowsPerBlock = kActivationBackwardThreads / 32;
  const int64_t blocks_needed = (pool_capacity + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t resident = int64_t{sm_count} * std::max(blocks_per_sm, 1);
  cudaLaunchConfig_t config{};
  config.gridDim =
      dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks_needed, resident))));
  config.blockDim = dim3(kActivationBackwardThreads);
  config.stream = reinterpret_cast<cudaStream_t>(stream);
  cuda_check(cudaLaunchKernelEx(&config, kernels.kernel, params), "activation_backward launch");
}

}  // namespace

void register_activation_backward(nb::module_& m) {
  m.def("activation_backward", &activation_backward, nb::arg("preact"), nb::arg("z"),
        nb::arg("route_weights"), nb::arg("pool_row_to_route"), nb::arg("expert_pool_offsets"),
        nb::arg("activation"), nb::arg("activation_clamp"), nb::arg("dgrad_preact"),
        nb::arg("weighted_h").none(), nb::arg("drouter"), nb::arg("stream"),
        "Gated-activation backward + router-gradient dot over the pool "
        "(kernels/activation_backward_params.h).");
}

}  // namespace megamoe
