// Host launchers of the GEMM engine (kernels/engine/engine_kernel.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.engine_gated`, `_C.engine_store`, `_C.engine_activation_backward` and
// `_C.engine_k_grouped`.
void register_engine(nanobind::module_& m);

}  // namespace megamoe
