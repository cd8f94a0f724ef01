// TMA tensor maps of the GEMM operands (declared in gemm_launch.h).
#include "gemm_launch.h"

#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

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

CUtensorMap tma_2d(const char* name, const void* base, int64_t rows, int64_t cols,
                   int64_t row_stride, int box_rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    throw nb::value_error((std::string(name) + ": TMA needs a 16-byte aligned address").c_str());
  if ((row_stride * 2) % 16 != 0)
    throw nb::value_error((std::string(name) +
                           ": TMA needs a row stride that is a multiple of 16 bytes, got " +
                           str(row_stride * 2))
                              .c_str());
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride * 2)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kGemmBlockK),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error(std::string("megamoe: cuTensorMapEncodeTiled failed for ") + name +
                             " (CUresult " + str(result) + ")");
  return map;
}

CUtensorMap tma_3d(const char* name, const void* base, int64_t depth, int64_t rows, int64_t cols) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (cols * 2) % 16 != 0)
    throw nb::value_error((std::string(name) +
                           ": TMA needs a 16-byte aligned address and rows of a multiple of "
                           "16 bytes")
                              .c_str());
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(depth)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * 2),
                                 static_cast<cuuint64_t>(rows * cols * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(kGemmBlockK), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error(std::string("megamoe: cuTensorMapEncodeTiled failed for ") + name +
                             " (CUresult " + str(result) + ")");
  return map;
}

CUtensorMap tma_2d_plain(const char* name, const void* base, CUtensorMapDataType type,
                         int element_bytes, int64_t rows, int64_t cols, int box_rows,
                         int box_cols) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (cols * element_bytes) % 16 != 0)
    throw nb::value_error((std::string(name) +
                           ": TMA needs a 16-byte aligned address and rows of a multiple of "
                           "16 bytes, got rows of " +
                           str(cols * element_bytes) + " bytes")
                              .c_str());
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * element_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error(std::string("megamoe: cuTensorMapEncodeTiled failed for ") + name +
                             " (CUresult " + str(result) + ")");
  return map;
}

}  // namespace megamoe
