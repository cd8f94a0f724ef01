// Argument checks for DLPack tensors reaching the C++ launchers.
//
// The Python layer validates user input first; these checks guard the C++ entry
// points themselves (they are importable) so that no launch ever sees a buffer of
// the wrong size, type or device. Messages name the argument like the Python ones.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

namespace megamoe {

namespace nb = nanobind;
using Tensor = nb::ndarray<nb::device::cuda>;

inline std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (size_t d = 0; d < t.ndim(); ++d) s += (d ? ", " : "") + std::to_string(t.shape(d));
  return s + "]";
}

inline std::string dtype_name(nb::dlpack::dtype dt) {
  const char* kind = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)      ? "int"
                     : dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)  ? "float"
                     : dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                                       : "other";
  return std::string(kind) + std::to_string(dt.bits);
}

// DLPack's BF16 (torch.bfloat16 arrives with this code).
inline nb::dlpack::dtype bfloat16_dtype() {
  return nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
}

// A dense row-major CUDA tensor of dtype `dtype` and shape `shape` (-1 = any size)
// on `device_id`.
inline void check_tensor(const char* name, const Tensor& t, nb::dlpack::dtype dtype,
                         const std::vector<int64_t>& shape, int device_id) {
  if (t.dtype() != dtype) {
    throw nb::type_error((std::string(name) + ": expected dtype " + dtype_name(dtype) + ", got " +
                          dtype_name(t.dtype()))
                             .c_str());
  }
  bool shape_ok = t.ndim() == shape.size();
  for (size_t d = 0; shape_ok && d < shape.size(); ++d)
    shape_ok = shape[d] < 0 || static_cast<int64_t>(t.shape(d)) == shape[d];
  if (!shape_ok) {
    std::string want = "[";
    for (size_t d = 0; d < shape.size(); ++d)
      want += (d ? ", " : "") + (shape[d] < 0 ? std::string("*") : std::to_string(shape[d]));
    throw nb::value_error(
        (std::string(name) + ": expected shape " + want + "], got " + shape_string(t)).c_str());
  }
  int64_t expected_stride = 1;
  for (size_t d = t.ndim(); d-- > 0;) {
    if (t.shape(d) != 1 && t.stride(d) != expected_stride)
      throw nb::value_error((std::string(name) + ": expected a contiguous tensor").c_str());
    expected_stride *= static_cast<int64_t>(t.shape(d));
  }
  if (t.device_id() != device_id) {
    throw nb::value_error((std::string(name) + ": expected cuda:" + std::to_string(device_id) +
                           ", got cuda:" + std::to_string(t.device_id()))
                              .c_str());
  }
}

template <typename T>
void check_tensor(const char* name, const Tensor& t, const std::vector<int64_t>& shape,
                  int device_id) {
  check_tensor(name, t, nb::dtype<T>(), shape, device_id);
}

}  // namespace megamoe
