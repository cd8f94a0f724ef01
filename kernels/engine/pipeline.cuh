// The engine's synchronisation pieces: the stage ring's mbarriers and position, named
// barriers, proxy fences and the TMA store group.
//
// Ring contract: `full[s]` completes when the TMA bytes of stage s land (the producer
// arms it with the byte count); `empty[s]` completes when every consumer warp's wgmma
// that read stage s retired. Producer and consumers walk the same tile and K-step
// sequence, so stage index and phase stay in lock step without messages.
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>

#include <cute/arch/copy_sm90_tma.hpp>

namespace megamoe::kernels::engine {

using TransactionBarrier = cutlass::arch::ClusterTransactionBarrier;
using Barrier = cutlass::arch::ClusterBarrier;

// TMA's L2 cache-policy operand must be a valid policy word (0 is not one).
constexpr uint64_t kCacheHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

template <int Stages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Warpgroup 0's warps 1-3 finish the staged tiles (kernels/engine/engine_kernel.cuh).
constexpr int kEpilogueWarps = 3;

// Hardware named barriers (0 is __syncthreads): among the consumer warpgroups (the
// K-grouped tail masking shares a stage), among the epilogue warps (a staged tile is
// read and rewritten in place).
enum NamedBarrierId : int { kConsumerBarrier = 1, kEpilogueBarrier = 2 };

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Generic-proxy shared-memory writes become visible to the async proxy (TMA stores,
// wgmma operand reads) once the writer fences and then synchronises with the reader.
__device__ __forceinline__ void fence_generic_to_async() {
  cutlass::arch::fence_view_async_shared();
}

// TMA stores: issued by one thread, committed as a group; `wait_store_reads` returns
// when the group no longer reads shared memory, `wait_stores` when its writes are done.
__device__ __forceinline__ void commit_stores() { cute::tma_store_arrive(); }
__device__ __forceinline__ void wait_store_reads() { cute::tma_store_wait<0>(); }
__device__ __forceinline__ void wait_stores() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// A ring's wait and arrival on a barrier's shared address: for loops that keep their
// stage addresses in registers, with no generic-to-shared conversion per step.
__device__ __forceinline__ void wait_barrier(uint32_t barrier, uint32_t phase) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_AGAIN:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n\t"
      "@!done bra WAIT_AGAIN;\n\t}"
      :
      : "r"(barrier), "r"(phase), "r"(0x989680u)
      : "memory");
}
__device__ __forceinline__ void arrive_barrier(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" : : "r"(barrier) : "memory");
}

}  // namespace megamoe::kernels::engine
