// Host launcher of the K-grouped weight-gradient GEMM (kernels/k_grouped_gemm.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.k_grouped_gemm`.
void register_k_grouped_gemm(nanobind::module_& m);

}  // namespace megamoe
