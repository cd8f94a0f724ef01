// Host launcher of the weight-streaming GEMM1 (kernels/engine/weight_stream_kernel.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.weight_stream_gated`.
void register_weight_stream(nanobind::module_& m);

}  // namespace megamoe
