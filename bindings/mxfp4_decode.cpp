// Host launcher of the MXFP4 decode: argument checks, a persistent grid, one launch on
// the caller's stream.
#include "mxfp4_decode.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_check.h"
#include "launch_queries.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

void mxfp4_decode(const Tensor& packed, const Tensor& scales, const Tensor& out, uintptr_t stream) {
  const int device = packed.device_id();
  check_tensor<uint8_t>("packed", packed, {-1, -1}, device);
  const int64_t rows = packed.shape(0), half = packed.shape(1);
  if (half % (kMxfp4Block / 2) != 0)
    throw nb::value_error(("packed: expected a multiple of 16 bytes per row (32-element "
                           "blocks), got " +
                           str(half))
                              .c_str());
  const int64_t blocks_per_row = half / (kMxfp4Block / 2);
  check_tensor<uint8_t>("scales", scales, {rows, blocks_per_row}, device);
  check_tensor("out", out, bfloat16_dtype(), {rows, 2 * half}, device);
  if (reinterpret_cast<uintptr_t>(packed.data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out.data()) % 16 != 0)
    throw nb::value_error("packed/out: expected 16-byte aligned data pointers");
  int current_device = -1;
  cuda_check(cudaGetDevice(&current_device), "cudaGetDevice");
  if (current_device != device)
    throw nb::value_error(("packed: on cuda:" + str(device) +
                           " but the current device is cuda:" + str(current_device))
                              .c_str());
  Mxfp4DecodeParams params{};
  params.packed = static_cast<const uint8_t*>(packed.data());
  params.scales = static_cast<const uint8_t*>(scales.data());
  params.out = out.data();
  params.num_blocks = rows * blocks_per_row;
  if (params.num_blocks == 0) return;

  const Mxfp4DecodeKernels& kernels = variants::mxfp4_decode;
  // One thread per 8-code word until the device is full; then grid-stride.
  const int64_t words = params.num_blocks * (kMxfp4Block / 8);
  const int64_t needed = (words + kMxfp4DecodeThreads - 1) / kMxfp4DecodeThreads;
  const int64_t resident =
      resident_blocks(reinterpret_cast<const void*>(kernels.kernel), device, kMxfp4DecodeThreads);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, resident))));
  config.blockDim = dim3(kMxfp4DecodeThreads);
  config.stream = reinterpret_cast<cudaStream_t>(stream);
  cuda_check(cudaLaunchKernelEx(&config, kernels.kernel, params), "mxfp4_decode launch");
}

}  // namespace

void register_mxfp4_decode(nb::module_& m) {
  m.def("mxfp4_decode", &mxfp4_decode, nb::arg("packed"), nb::arg("scales"), nb::arg("out"),
        nb::arg("stream"),
        "out [rows, K] bf16 = MXFP4 (packed [rows, K/2] uint8, scales [rows, K/32] uint8).");
}

}  // namespace megamoe
