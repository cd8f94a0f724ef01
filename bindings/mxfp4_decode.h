// Host launcher of the MXFP4 decode (kernels/mxfp4_decode.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.mxfp4_decode`.
void register_mxfp4_decode(nanobind::module_& m);

}  // namespace megamoe
