// Host launcher of the activation backward (kernels/activation_backward.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.activation_backward`.
void register_activation_backward(nanobind::module_& m);

}  // namespace megamoe
