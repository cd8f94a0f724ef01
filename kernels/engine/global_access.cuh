// Global loads and stores in PTX for the weight-streaming epilogues: L2-only (.cg) loads,
// 8-, 4- and 2-byte stores, and stores under a predicate computed from a loaded value.
#pragma once

#include <cstdint>

namespace megamoe::kernels::engine {

__device__ __forceinline__ uint2 load_global_8_cg(const void* at) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(at));
  return v;
}
__device__ __forceinline__ void store_global_8(void* at, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(at), "r"(v.x), "r"(v.y) : "memory");
}

// Predicated stores: the StoreMN epilogue picks between a base tile's and an extra tile's
// stores without a branch on the tile (a loaded value), which would cost the base-step
// loop its uniform registers (about 25 more instructions a step, counted in SASS).
__device__ __forceinline__ void store_global_8_if(bool store, void* at, uint2 v) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.v2.u32 [%1], {%2, %3};\n}" ::"r"(
          static_cast<uint32_t>(store)),
      "l"(at), "r"(v.x), "r"(v.y)
      : "memory");
}
__device__ __forceinline__ void store_global_4_if(bool store, void* at, uint32_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.b32 [%1], %2;\n}" ::"r"(
                   static_cast<uint32_t>(store)),
               "l"(at), "r"(v)
               : "memory");
}
__device__ __forceinline__ void store_global_2_if(bool store, void* at, uint16_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.b16 [%1], %2;\n}" ::"r"(
                   static_cast<uint32_t>(store)),
               "l"(at), "h"(v)
               : "memory");
}

}  // namespace megamoe::kernels::engine
