// Host launchers of the weight-streaming GEMMs (kernels/engine/weight_stream_kernel.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.weight_stream_gated`, `_C.weight_stream_store`,
// `_C.weight_stream_store_mn` and `_C.weight_stream_activation_backward`.
void register_weight_stream(nanobind::module_& m);

}  // namespace megamoe
