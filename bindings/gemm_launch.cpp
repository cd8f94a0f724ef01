// TMA tensor maps of the engine's operands (declared in gemm_launch.h).
#include "gemm_launch.h"

#include <cudaTypedefs.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm_tile_constants.h"

namespace megamoe {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    cuda_check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                cudaEnableDefault, &status),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw std::runtime_error("megamoe: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

CUtensorMap tensor_map(const char* name, const void* base, CUtensorMapDataType type,
                       std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides,
                       std::initializer_list<int> box, bool swizzle_128b) {
  return tensor_map(name, base, type, dims, strides, box,
                    swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE);
}

CUtensorMap tensor_map(const char* name, const void* base, CUtensorMapDataType type,
                       std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides,
                       std::initializer_list<int> box, CUtensorMapSwizzle swizzle) {
  const int rank = static_cast<int>(dims.size());
  if (rank < 1 || rank > 5 || static_cast<int>(box.size()) != rank ||
      static_cast<int>(strides.size()) != rank - 1)
    throw std::logic_error(std::string("megamoe: bad tensor map rank for ") + name);
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    throw nb::value_error((std::string(name) + ": TMA needs a 16-byte aligned address").c_str());
  std::vector<cuuint64_t> global_dims, global_strides;
  std::vector<cuuint32_t> box_dims, element_strides(rank, 1);
  for (int64_t d : dims) {
    if (d < 1)
      throw nb::value_error((std::string(name) + ": TMA needs non-empty dimensions").c_str());
    global_dims.push_back(static_cast<cuuint64_t>(d));
  }
  for (int64_t s : strides) {
    if (s % 16 != 0)
      throw nb::value_error(
          (std::string(name) + ": TMA needs strides that are multiples of 16 bytes, got " + str(s))
              .c_str());
    global_strides.push_back(static_cast<cuuint64_t>(s));
  }
  for (int b : box) box_dims.push_back(static_cast<cuuint32_t>(b));
  CUtensorMap map{};
  const CUresult result = encode_tiled()(
      &map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), global_dims.data(),
      global_strides.data(), box_dims.data(), element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error(std::string("megamoe: cuTensorMapEncodeTiled failed for ") + name +
                             " (CUresult " + str(result) + ")");
  return map;
}

CUtensorMap bf16_rows(const char* name, const void* base, int64_t rows, int64_t cols,
                      int64_t row_stride, int box_rows) {
  return tensor_map(name, base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {cols, rows}, {row_stride * 2},
                    {kGemmBlockK, box_rows}, true);
}

CUtensorMap mn_major_map(const char* name, const Tensor& w, int device) {
  check_tensor(name, w, bfloat16_dtype(), {-1, -1, -1}, device);
  const int64_t e = w.shape(0), k = w.shape(1), n = w.shape(2);
  return tensor_map(name, w.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {n, k, e}, {n * 2, k * n * 2},
                    {64, kGemmBlockK, 1}, true);
}

void check_activation(int activation, double clamp) {
  if (activation != 0 && activation != 1)
    throw nb::value_error(
        ("activation: expected 0 (swiglu) or 1 (geglu), got " + str(activation)).c_str());
  if (std::isnan(clamp) || clamp <= 0)
    throw nb::value_error("activation_clamp: expected a positive value (inf = no clamp)");
}

int64_t check_gated_side(const std::optional<Tensor>& side_gate,
                         const std::optional<Tensor>& side_up, double side_scale, int64_t experts,
                         int64_t inter, int64_t k_base, const Tensor& a, int device) {
  if (side_gate.has_value() != side_up.has_value())
    throw nb::value_error("side_gate/side_up: give both or neither");
  int64_t rank = 0;
  if (side_gate) {
    check_tensor("side_gate", *side_gate, bfloat16_dtype(), {experts, -1, inter}, device);
    rank = side_gate->shape(1);
    check_tensor("side_up", *side_up, bfloat16_dtype(), {experts, rank, inter}, device);
    if (rank < 8 || rank % 8 != 0)
      throw nb::value_error(("side_gate: rank must be a multiple of 8, got " + str(rank)).c_str());
    // The kernels take it as float32: finite as a double is not enough (1e39).
    if (!std::isfinite(static_cast<float>(side_scale)))
      throw nb::value_error("side_scale: expected a value finite in float32");
  }
  if (k_base + 2 * rank > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(("a: expected at least k_base + 2r = " + str(k_base + 2 * rank) +
                           " columns, got " + str(a.shape(1)))
                              .c_str());
  return rank;
}

}  // namespace megamoe
