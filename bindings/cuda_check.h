// CUDA runtime errors become Python RuntimeErrors that say which call failed.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace megamoe {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("megamoe: ") + what + " failed: " +
                             cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

}  // namespace megamoe
