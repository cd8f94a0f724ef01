// Host launchers of the pool gather and pool combine kernels
// (kernels/pool_gather.cuh, kernels/pool_combine.cuh).
#pragma once

#include <nanobind/nanobind.h>

namespace megamoe {

// Registers `_C.pool_gather`, `_C.pool_side_sum` and `_C.pool_combine`.
void register_pool_ops(nanobind::module_& m);

}  // namespace megamoe
