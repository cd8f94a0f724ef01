// Host launcher of the grouped GEMM engine (kernels/grouped_gemm.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.grouped_gemm` and `_C.grouped_gemm_variants`.
void register_grouped_gemm(nanobind::module_& m);

}  // namespace megamoe
