// TMA tensor maps of the GEMM operands and the persistent launch, shared by the grouped
// GEMM launchers (grouped_gemm.cpp, k_grouped_gemm.cpp).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "cuda_check.h"

namespace megamoe {

namespace nb = nanobind;

// A 2-D row-major BF16 view [rows, cols] with `row_stride` elements between rows,
// loaded in [box_rows, 64] boxes with the 128-byte swizzle wgmma reads. Reads past
// `rows`/`cols` are zero-filled by the TMA unit.
CUtensorMap tma_2d(const char* name, const void* base, int64_t rows, int64_t cols,
                   int64_t row_stride, int box_rows);

// A 3-D BF16 view [depth][rows][cols] (row-major, contiguous), loaded in [1, 64, 64]
// boxes with the 128-byte swizzle: an MN-major B, one expert per depth slice, so K rows
// past an expert's k_base are zero-filled rather than read from the next expert.
CUtensorMap tma_3d(const char* name, const void* base, int64_t depth, int64_t rows, int64_t cols);

// A 2-D row-major uint8/uint16 view [rows, cols] loaded unswizzled in [box_rows,
// box_cols] boxes (the MXFP4 codes and scales; the consumers read them, not wgmma).
CUtensorMap tma_2d_plain(const char* name, const void* base, CUtensorMapDataType type,
                         int element_bytes, int64_t rows, int64_t cols, int box_rows, int box_cols);

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
  // Not a stream operation: cheap, and allowed during CUDA-graph capture.
  cuda_check(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(num_sms));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = reinterpret_cast<cudaStream_t>(stream);
  cuda_check(cudaLaunchKernelEx(&config, kernel, params), what);
}

}  // namespace megamoe
