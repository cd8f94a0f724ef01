// Just enough of CUDA's device built-ins to run a kernel's C++ on the host, one warp at
// a time with 32 std::threads (tests/cpu: the kernel's own source against the CPU
// reference). Warp collectives meet at a barrier of the warp's 32 threads (a warp one
// of whose lanes skips one hangs: the tests run the driver under a timeout); nothing
// else is shared between threads, as in the kernels this runs. Warps run one after
// another, so races between warps do not show here. `__ldg` counts the bytes it reads
// inside a watched range (host_shim::watch), for tests of what a kernel reads.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

struct HostDim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace host_shim {
inline thread_local HostDim3 thread_idx, block_idx;
inline HostDim3 block_dim, grid_dim;
// The running warp's ballot: each lane's vote, then the barrier, then the result.
inline std::barrier<>* warp_barrier = nullptr;
inline uint32_t votes[32];

// Bytes read through __ldg inside [watch_begin, watch_end).
inline const char* watch_begin = nullptr;
inline const char* watch_end = nullptr;
inline std::atomic<uint64_t> watched_bytes{0};
inline void watch(const void* begin, size_t bytes) {
  watch_begin = static_cast<const char*>(begin);
  watch_end = watch_begin + bytes;
  watched_bytes = 0;
}

inline uint32_t ballot(bool predicate) {
  const unsigned lane = thread_idx.x % 32;
  warp_barrier->arrive_and_wait();  // every lane is done reading the previous ballot
  votes[lane] = predicate ? 1u : 0u;
  warp_barrier->arrive_and_wait();
  uint32_t mask = 0;
  for (int i = 0; i < 32; ++i) mask |= votes[i] << i;
  return mask;
}

// Runs kernel(params) over grid x block (block a multiple of 32), one warp at a time.
template <class Kernel, class Params>
void launch(Kernel kernel, const Params& params, unsigned blocks, unsigned threads) {
  grid_dim = {blocks, 1, 1};
  block_dim = {threads, 1, 1};
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned w = 0; w < threads / 32; ++w) {
      std::barrier<> barrier(32);
      warp_barrier = &barrier;
      std::vector<std::thread> lanes;
      for (unsigned lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
          block_idx = {b, 0, 0};
          thread_idx = {w * 32 + lane, 0, 0};
          kernel(params);
        });
      for (auto& t : lanes) t.join();
    }
  }
}
}  // namespace host_shim

#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __restrict__
#define threadIdx (host_shim::thread_idx)
#define blockIdx (host_shim::block_idx)
#define blockDim (host_shim::block_dim)
#define gridDim (host_shim::grid_dim)
template <class T>
T __ldg(const T* p) {
  const char* at = reinterpret_cast<const char*>(p);
  if (at >= host_shim::watch_begin && at < host_shim::watch_end)
    host_shim::watched_bytes += sizeof(T);
  return *p;
}
// Full-warp ballots only (what the kernels use).
inline uint32_t __ballot_sync(uint32_t mask, bool predicate) {
  if (mask != 0xFFFFFFFFu) std::abort();
  return host_shim::ballot(predicate);
}
inline int __ffs(int v) { return __builtin_ffs(v); }
using std::max;
using std::min;
