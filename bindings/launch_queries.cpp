#include "launch_queries.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "cuda_check.h"

namespace megamoe {

namespace {

// Launchers run on any Python thread (the autograd engine's worker among them).
std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

void ensure_dynamic_smem(const void* kernel, int device, int smem_bytes) {
  static std::map<std::pair<const void*, int>, int> limit_set;
  std::lock_guard<std::mutex> lock(cache_mutex());
  int& limit = limit_set[{kernel, device}];
  if (limit >= smem_bytes) return;
  // Not a stream operation: allowed during CUDA-graph capture.
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  limit = smem_bytes;
}

int64_t resident_blocks(const void* kernel, int device, int threads) {
  static std::map<std::tuple<const void*, int, int>, int64_t> resident;
  std::lock_guard<std::mutex> lock(cache_mutex());
  const auto key = std::make_tuple(kernel, device, threads);
  if (const auto found = resident.find(key); found != resident.end()) return found->second;
  int sm_count = 0, blocks_per_sm = 0;
  cuda_check(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(MultiProcessorCount)");
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int64_t blocks = int64_t{sm_count} * std::max(blocks_per_sm, 1);
  resident.emplace(key, blocks);
  return blocks;
}

}  // namespace megamoe
