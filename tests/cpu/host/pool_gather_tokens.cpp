// Host driver for tests/cpu/test_pool_gather_tokens.py: runs the pool gather kernels'
// source (kernels/pool_gather_tokens.cuh, and the row-major kernels/pool_gather.cuh)
// on the CPU (cuda_host_shim.h).
//
// argv: IN OUT. IN holds int64 T, K, H, C, capacity, rows_used, blocks, slices,
// zero_parts, kernel (0: token-major, 1: row-major with the inverse map); then x [T, H] and side
// [T, C] as uint16 (BF16 bits), route_to_pool_row [T, K] and pool_row_to_route [capacity] as int32,
// and the pool's initial [capacity, H + C] uint16. OUT receives the pool after the kernel; stdout,
// the bytes of x the kernel read.
#include <cstdio>
#include <vector>

// The shim defines the CUDA built-ins the kernel's source uses: it comes first.
// clang-format off
#include "cuda_host_shim.h"
#include "pool_gather.cuh"
// clang-format on

namespace {
template <class T>
bool read(FILE* f, std::vector<T>& v, size_t n) {
  v.resize(n);
  return std::fread(v.data(), sizeof(T), n, f) == n;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr) return 1;
  int64_t head[10];
  if (std::fread(head, sizeof(int64_t), 10, in) != 10) return 1;
  const int64_t T = head[0], K = head[1], H = head[2], C = head[3], capacity = head[4];
  const int32_t rows_used = static_cast<int32_t>(head[5]);
  const unsigned blocks = static_cast<unsigned>(head[6]);
  std::vector<uint16_t> x, side, pool;
  std::vector<int32_t> r2p, p2r;
  if (!read(in, x, T * H) || !read(in, side, T * C) || !read(in, r2p, T * K) ||
      !read(in, p2r, capacity) || !read(in, pool, capacity * (H + C)))
    return 1;
  std::fclose(in);

  megamoe::PoolGatherParams p{};
  p.x = x.data();
  p.side = C > 0 ? side.data() : nullptr;
  p.pool_row_to_route = p2r.data();
  p.route_to_pool_row = r2p.data();
  p.pool_rows_used = &rows_used;
  p.pool_input = pool.data();
  p.num_tokens = T;
  p.pool_capacity = capacity;
  p.top_k = static_cast<int32_t>(K);
  p.hidden = static_cast<int32_t>(H);
  p.side_cols = static_cast<int32_t>(C);
  p.row_slices = static_cast<int32_t>(head[7]);
  p.zero_parts = static_cast<int32_t>(head[8]);
  host_shim::watch(x.data(), x.size() * sizeof(uint16_t));
  const megamoe::PoolGatherKernels kernels = megamoe::kernels::pool_gather_kernels();
  host_shim::launch(head[9] == 0 ? kernels.tokens : kernels.gather, p, blocks,
                    megamoe::kPoolThreadsPerBlock);
  std::printf("%llu\n", static_cast<unsigned long long>(host_shim::watched_bytes.load()));

  FILE* out = std::fopen(argv[2], "wb");
  if (out == nullptr) return 1;
  std::fwrite(pool.data(), sizeof(uint16_t), pool.size(), out);
  return std::fclose(out) == 0 ? 0 : 1;
}
