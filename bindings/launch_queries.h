// Per-(kernel, device) answers the launchers need before every launch, asked of the
// driver once: the dynamic shared-memory limit a kernel was given, and how many of its
// blocks fit on the device at once. Both are fixed for a kernel on a device, and asking
// again costs a few microseconds of host time per launch (a small-token F+B makes 14
// such launches).
#pragma once

#include <cstdint>

namespace megamoe {

// Raises `kernel`'s dynamic shared-memory limit on `device` (the current device) to at
// least `smem_bytes`; calls the driver only when the limit it set before is lower.
void ensure_dynamic_smem(const void* kernel, int device, int smem_bytes);

// SMs of `device` x blocks of `kernel` (with `threads` threads and no dynamic shared
// memory) resident per SM, at least one per SM.
int64_t resident_blocks(const void* kernel, int device, int threads);

}  // namespace megamoe
