// Per-role cycle counters of the engine, for diagnostic builds only (CMake option
// MEGAMOE_ENGINE_PROBE). Each role adds up the SM cycles it spends waiting at its
// barriers and finishing tiles, and at its end writes them to EngineParams::probe in
// the ProbeSlot layout (engine_params.h), read back by `megamoe._C.engine_probe_read` and
// summed by tools/engine_role_probe.py. In every other build the counters are locals
// that nothing reads, which the compiler removes.
#pragma once

#include <cstdint>

#include "engine_params.h"

namespace megamoe::kernels::engine {

#ifdef MEGAMOE_ENGINE_PROBE
inline constexpr bool kProbeBuild = true;
#else
inline constexpr bool kProbeBuild = false;
#endif

// Cycles between start() and stop(), summed over every such interval.
struct CycleCounter {
  uint64_t sum = 0, since = 0;
  __device__ __forceinline__ void start() {
    if constexpr (kProbeBuild) since = clock64();
  }
  __device__ __forceinline__ void stop() {
    if constexpr (kProbeBuild) sum += clock64() - since;
  }
};

// The counter into this CTA's `slot` (one thread per role calls it).
__device__ __forceinline__ void probe_record(uint64_t* probe, int slot, const CycleCounter& c) {
  if constexpr (kProbeBuild) probe[blockIdx.x * kProbeSlots + slot] = c.sum;
}

}  // namespace megamoe::kernels::engine
