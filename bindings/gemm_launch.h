// TMA tensor maps of the engine's operands and the persistent launch (engine_launch.cpp).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "cuda_check.h"
#include "launch_queries.h"
#include "tensor_checks.h"

namespace megamoe {

namespace nb = nanobind;

// A tensor map over `base`: `dims` innermost first (elements), `strides` the byte
// strides of dims 1.. (dim 0 is contiguous), `box` the elements one TMA copy moves per
// dim. BF16 operands wgmma reads use the 128-byte swizzle (their box is 64 elements wide);
// MXFP4 codes and scales are plain bytes. Reads past `dims` are zero-filled and stores
// past them clipped by the TMA unit. Raises ValueError naming `name` on addresses or
// strides TMA cannot take.
CUtensorMap tensor_map(const char* name, const void* base, CUtensorMapDataType type,
                       std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides,
                       std::initializer_list<int> box, bool swizzle_128b);
// The same with any swizzle (the one-tile dgrad1's 64-byte code rows: the 64-byte one).
CUtensorMap tensor_map(const char* name, const void* base, CUtensorMapDataType type,
                       std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides,
                       std::initializer_list<int> box, CUtensorMapSwizzle swizzle);

// BF16 [rows, cols] with `row_stride` elements between rows, box [box_rows, 64], swizzled.
CUtensorMap bf16_rows(const char* name, const void* base, int64_t rows, int64_t cols,
                      int64_t row_stride, int box_rows);

// A BF16 [E, K, N] operand as stored (weights, or adapter factors as given), read
// MN-major in [64 N, 64 K] boxes (checked: a dense 3-D BF16 tensor on `device`).
CUtensorMap mn_major_map(const char* name, const Tensor& w, int device);

// The gated activation's arguments: 0 (SwiGLU) or 1 (GeGLU), and a positive clamp (inf:
// none).
void check_activation(int activation, double clamp);

// The gated GEMMs' side K segment: `side_gate`/`side_up` (b1 and b3 as given, [E, r, I]
// BF16, read MN-major) both or neither, r a multiple of 8, a finite `side_scale`, and the
// pool `a` holding [x | q1 | q3] (at least k_base + 2r columns). Returns r (0: none).
int64_t check_gated_side(const std::optional<Tensor>& side_gate,
                         const std::optional<Tensor>& side_up, double side_scale, int64_t experts,
                         int64_t inter, int64_t k_base, const Tensor& a, int device);

// Launch a persistent kernel taking one parameter block: one CTA per SM (`num_sms`),
// `threads` threads and `smem_bytes` of dynamic shared memory, on `stream`. Checks that
// `device` is the current device (the tensor maps' addresses belong to it).
template <typename Params>
void launch_persistent(void (*kernel)(Params), const Params& params, int threads, int smem_bytes,
                       int device, int num_sms, uintptr_t stream, const char* what) {
  int current_device = -1;
  cuda_check(cudaGetDevice(&current_device), "cudaGetDevice");
  if (current_device != device)
    throw nb::value_error(("a: on cuda:" + std::to_string(device) +
                           " but the current device is cuda:" + std::to_string(current_device))
                              .c_str());
  if (num_sms < 1) throw nb::value_error("num_sms: expected >= 1");
  ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem_bytes);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(num_sms));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = reinterpret_cast<cudaStream_t>(stream);
  cuda_check(cudaLaunchKernelEx(&config, kernel, params), what);
}

}  // namespace megamoe
