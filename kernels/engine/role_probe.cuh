// Per-role cycle counters of the engine, for diagnostic builds only (CMake option
// MEGAMOE_ENGINE_PROBE). Each role adds up the SM cycles it spends waiting at its
// barriers and finishing tiles, and at its end writes them to EngineParams::probe:
// kProbeSlots counters per CTA, read back by `megamoe._C.engine_probe_read` and summed
// by tools/engine_role_probe.py. In every other build the counters are empty structs and
// the kernels compile exactly as without them.
#pragma once

#include <cstdint>

namespace megamoe::kernels::engine {

// One CTA's counters: the producer; consumer warpgroup c at kConsumer0 + c *
// kConsumerSlots; the epilogue warps.
enum ProbeSlot : int {
  kProducerTotal = 0,
  kProducerWaitEmpty = 1,
  kConsumer0 = 2,  // + 0 total, + 1 waiting on `full`, + 2 on `drained`, + 3 staging
  kConsumerSlots = 4,
  kEpilogueTotal = 10,
  kEpilogueWaitStaged = 11,
  kEpilogueFinish = 12,
  kProbeSlots = 16,
};

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
