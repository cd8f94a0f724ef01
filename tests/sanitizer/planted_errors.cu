// Deliberately broken kernels: they prove that megamoe.testing.sanitizer catches and
// attributes each class of error. test_planted_errors.py compiles this file with nvcc
// into a throwaway executable; it is never part of the wheel.
//
// Usage: planted_errors <mode>, mode one of
//   oob      out-of-bounds global write   (memcheck)
//   race     unsynchronized shared memory (racecheck)
//   uninit   read of never-written memory (initcheck)
//   barrier  __syncthreads() in divergent code (synccheck)
//   clean    a correct kernel: every tool must stay silent
// Exit status 0 when the CUDA calls succeed (a sanitizer reports through its own exit
// code), 1 on a CUDA error, 2 on a bad mode.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {

constexpr int kElements = 256;
constexpr int kThreads = 128;

// memcheck: `<=` lets the thread with i == n write one element past the buffer.
__global__ void planted_out_of_bounds_write(int* data, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i <= n) data[i] = i;
}

// racecheck: each thread reads a slot written by a thread of another warp with no
// __syncthreads() between the write and the read (a read-after-write hazard).
__global__ void planted_shared_race(int* out) {
  __shared__ int slots[kThreads];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x);
  out[threadIdx.x] = slots[(threadIdx.x + kThreads / 2) % kThreads];
}

// initcheck: `in` comes from cudaMalloc and is never written before this read.
__global__ void planted_uninitialized_read(const int* in, int* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i] + 1;
}

// synccheck: only the even lanes reach the barrier. Outside a sanitizer this can hang,
// which is why the test runs it under synccheck only (the tool stops the kernel).
__global__ void planted_divergent_barrier(int* out) {
  if (threadIdx.x % 2 == 0) __syncthreads();
  out[threadIdx.x] = static_cast<int>(threadIdx.x);
}

// The control: same shapes, no bug.
__global__ void planted_clean_copy(const int* in, int* out, int n) {
  __shared__ int slots[kThreads];
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  slots[threadIdx.x] = i < n ? in[i] : 0;
  __syncthreads();
  if (i < n) out[i] = slots[(threadIdx.x + kThreads / 2) % kThreads];
}

bool ok(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  int* a = nullptr;
  int* b = nullptr;
  if (!ok(cudaMalloc(&a, kElements * sizeof(int)), "cudaMalloc") ||
      !ok(cudaMalloc(&b, kElements * sizeof(int)), "cudaMalloc")) {
    return 1;
  }
  const int blocks = kElements / kThreads;
  if (std::strcmp(mode, "oob") == 0) {
    // One extra block so that thread i == kElements exists.
    planted_out_of_bounds_write<<<blocks + 1, kThreads>>>(a, kElements);
  } else if (std::strcmp(mode, "race") == 0) {
    planted_shared_race<<<1, kThreads>>>(a);
  } else if (std::strcmp(mode, "uninit") == 0) {
    planted_uninitialized_read<<<blocks, kThreads>>>(a, b, kElements);
  } else if (std::strcmp(mode, "barrier") == 0) {
    planted_divergent_barrier<<<1, 32>>>(a);
  } else if (std::strcmp(mode, "clean") == 0) {
    if (!ok(cudaMemset(a, 0, kElements * sizeof(int)), "cudaMemset")) return 1;
    planted_clean_copy<<<blocks, kThreads>>>(a, b, kElements);
  } else {
    std::fprintf(stderr, "unknown mode '%s' (oob, race, uninit, barrier, clean)\n", mode);
    return 2;
  }
  const bool launched = ok(cudaGetLastError(), "launch");
  const bool finished = ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cudaFree(a);
  cudaFree(b);
  return launched && finished ? 0 : 1;
}
