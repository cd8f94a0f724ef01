// How fast a TMA ring can stream weight-sized bytes from DRAM when nothing but the ring
// runs: per box shape, ring depth, L2 promotion and L2 prefetch distance, beside a plain
// vector-load read of the same buffer and a device-to-device copy, all in one process.
//
// The weight-streaming kernels (kernels/engine/weight_stream_*.cuh) read their codes at
// 41-74% of the copy bandwidth even with the decode and the MMAs taken out
// (docs/PERFORMANCE.md, fifty-eighth session). This probe keeps only the load side of
// such a kernel: one CTA per SM walks tiles of a [rows][row_bytes] byte matrix in the
// engine's order, a producer thread loads one box per stage, and the consumer warps
// release each stage as soon as it lands (optionally after reading it from shared
// memory, as the decode does). What it reaches bounds what the kernels can reach with
// that load shape.
//
// Build (sm_90a; no libcuda at link time, the tensor-map encoder comes from the driver):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -cudart static \
//     -o tma_stream_probe tools/tma_stream_probe.cu
// Run: ./tma_stream_probe [--iters N] [--only SUBSTRING]; `--check-walk` checks every
// configuration's walk on the host (no GPU needed; tests/cpu/test_tma_stream_probe.py).
// Prints one row per configuration: median and sustained (10 launches back to back) read
// bandwidth in GB/s and their ratio to the vector-load read.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "tma_stream_probe: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

// One streamed matrix and how it is walked: tiles of tile_rows x tile_bytes (column tiles
// fastest, as the engine's blocks are), each tile in boxes of box_rows x box_bytes (byte
// columns fastest, as the engine's K steps are), one box per ring stage.
struct StreamShape {
  int64_t rows;
  int64_t row_bytes;
  int tile_rows;
  int tile_bytes;
  int box_rows;
  int box_bytes;
};

struct ProbeParams {
  StreamShape shape;
  int stages;
  int prefetch_steps;   // 0: none; else an L2 prefetch of the box this many steps ahead
  int touch;            // consumers read every byte of a stage from shared memory
  int bulk;             // 1-D bulk copies of contiguous stage-sized pieces instead of boxes
  int pool;             // also a 4 KB pool tile per step from an L2-resident matrix (forward)
  int arrive_all;       // every consumer thread releases a stage (the engine's 256), not a warp
  int consume_cycles;   // consumers hold each stage this long (the decode and MMAs' place)
  const uint8_t* base;  // the bulk mode's source
  unsigned long long* sink;
};

constexpr int kConsumerWarps = 4;
constexpr int kThreads = 32 * (kConsumerWarps + 1);
constexpr int kMaxStages = 32;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_AGAIN:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_AGAIN;\n\t}" ::"r"(bar),
      "r"(phase)
      : "memory");
}

__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void load_box(const CUtensorMap* map, uint32_t dst, uint32_t bar, int x,
                                         int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(map), "r"(bar), "r"(x), "r"(y)
      : "memory");
}

__device__ __forceinline__ void prefetch_box(const CUtensorMap* map, int x, int y) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" ::"l"(map), "r"(x),
               "r"(y)
               : "memory");
}

__device__ __forceinline__ void load_bulk(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// A CTA's walk over its steps (of `ctas` CTAs): the (x in bytes, y in rows) of each box,
// or for the bulk mode the byte offset of each piece (pieces cta, cta + ctas, ...).
// Advanced by counters, with one division per tile: a division per step costs a single
// producer thread hundreds of cycles, enough to bound the ring by the producer's issue.
struct StepWalk {
  int ctas, tile_rows, tile_bytes, box_rows, box_bytes, bulk;
  int col_tiles, steps_x, steps_y, tiles;
  long pieces, piece_bytes;
  int tile, sx = 0, sy = 0, x0 = 0, y0 = 0;
  long piece;
  bool valid;
  __host__ __device__ StepWalk(const ProbeParams& p, int cta, int cta_count)
      : ctas(cta_count),
        tile_rows(p.shape.tile_rows),
        tile_bytes(p.shape.tile_bytes),
        box_rows(p.shape.box_rows),
        box_bytes(p.shape.box_bytes),
        bulk(p.bulk),
        tile(cta),
        piece(cta) {
    col_tiles = static_cast<int>(p.shape.row_bytes / tile_bytes);
    steps_x = tile_bytes / box_bytes;
    steps_y = tile_rows / box_rows;
    tiles = static_cast<int>(p.shape.rows / tile_rows) * col_tiles;
    piece_bytes = static_cast<long>(box_rows) * box_bytes;
    pieces = p.shape.rows * p.shape.row_bytes / piece_bytes;
    valid = bulk ? piece < pieces : tile < tiles;
    if (valid && !bulk) origin();
  }
  __host__ __device__ void origin() {
    x0 = (tile % col_tiles) * tile_bytes;
    y0 = (tile / col_tiles) * tile_rows;
  }
  __host__ __device__ int x() const { return x0 + sx * box_bytes; }
  __host__ __device__ int y() const { return y0 + sy * box_rows; }
  __host__ __device__ long offset() const { return piece * piece_bytes; }
  __host__ __device__ void next() {
    if (bulk) {
      piece += ctas;
      valid = piece < pieces;
      return;
    }
    if (++sx < steps_x) return;
    sx = 0;
    if (++sy < steps_y) return;
    sy = 0;
    tile += ctas;
    valid = tile < tiles;
    if (valid) origin();
  }
};

// The pool matrix of the forward kinds: [64 experts x 32 rows][H = 4096 BF16] (16 MB, L2
// resident), one [32 rows][64 BF16] tile per K step of 64 codes, the expert's rows.
constexpr int kPoolRowBytes = 8192, kPoolRows = 64 * 32, kPoolBoxBytes = 128, kPoolBoxRows = 32;
constexpr int kPoolTileBytes = kPoolBoxBytes * kPoolBoxRows;

__global__ void __launch_bounds__(kThreads, 1)
    stream_kernel(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap pool,
                  const ProbeParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int code_bytes = p.shape.box_rows * p.shape.box_bytes;
  // One pool tile per 64 codes of a row (32 bytes) in a stage.
  const int pool_tiles = p.pool ? p.shape.box_bytes / 32 : 0;
  const int stage_bytes = code_bytes + pool_tiles * kPoolTileBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.stages * stage_bytes);
  const uint32_t full0 = smem_addr(bars), empty0 = smem_addr(bars + kMaxStages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full0 + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty0 + 8 * s),
                   "r"(p.arrive_all ? 32 * kConsumerWarps : kConsumerWarps));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kConsumerWarps) {
    // Producer: one thread waits for a free stage, arms its barrier, issues the load.
    if (lane != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    StepWalk ahead(p, blockIdx.x, gridDim.x);
    for (int n = 0; n < p.prefetch_steps && ahead.valid; ++n) ahead.next();
    for (StepWalk walk(p, blockIdx.x, gridDim.x); walk.valid; walk.next()) {
      if (p.prefetch_steps > 0 && ahead.valid) {
        prefetch_box(&map, ahead.x(), ahead.y());
        ahead.next();
      }
      wait_parity(empty0 + 8 * stage, phase ^ 1u);
      const uint32_t full = full0 + 8 * stage, dst = smem_addr(smem + stage * stage_bytes);
      arrive_expect(full, stage_bytes);
      if (p.bulk) {
        load_bulk(dst, p.base + walk.offset(), stage_bytes, full);
      } else {
        load_box(&map, dst, full, walk.x(), walk.y());
      }
      for (int j = 0; j < pool_tiles; ++j) {
        load_box(&pool, dst + code_bytes + j * kPoolTileBytes, full,
                 (walk.x() * 4 + j * kPoolBoxBytes) % kPoolRowBytes,
                 (walk.y() / 4096) * kPoolBoxRows);
      }
      if (++stage == p.stages) stage = 0, phase ^= 1u;
    }
    return;
  }
  // Consumers: wait for a stage, optionally read it, release it (one arrival per warp).
  uint32_t acc = 0;
  int stage = 0;
  uint32_t phase = 0;
  for (StepWalk walk(p, blockIdx.x, gridDim.x); walk.valid; walk.next()) {
    wait_parity(full0 + 8 * stage, phase);
    if (p.touch) {
      const uint4* words = reinterpret_cast<const uint4*>(smem + stage * stage_bytes);
      for (int i = threadIdx.x; i < stage_bytes / 16; i += 32 * kConsumerWarps) {
        const uint4 w = words[i];
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
    }
    if (p.consume_cycles > 0) {
      const long long until = clock64() + p.consume_cycles;
      while (clock64() < until) {
      }
    }
    __syncwarp();
    if (p.arrive_all || lane == 0) arrive(empty0 + 8 * stage);
    if (++stage == p.stages) stage = 0, phase ^= 1u;
  }
  if (acc == 0x9e3779b9u) atomicAdd(p.sink, 1ull);  // keeps the reads; almost never true
}

__global__ void read_kernel(const uint4* data, long words, unsigned long long* sink) {
  uint32_t acc = 0;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    uint4 w;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                 : "l"(data + i));
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1ull);
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status),
        "cudaGetDriverEntryPointByVersion");
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::fprintf(stderr, "tma_stream_probe: the driver has no cuTensorMapEncodeTiled\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

CUtensorMap byte_map(const uint8_t* base, int64_t rows, int64_t row_bytes, int box_rows,
                     int box_bytes, CUtensorMapL2promotion promotion) {
  CUtensorMap map{};
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "tma_stream_probe: cuTensorMapEncodeTiled failed (%d)\n",
                 static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

struct Config {
  std::string name;
  StreamShape shape;
  int stages;
  CUtensorMapL2promotion promotion;
  int prefetch_steps;
  int touch;
  int bulk;
  int pool = 0;
  int arrive_all = 0;
  int consume_cycles = 0;
};

struct Timing {
  float median_ms, sustained_ms;
};

template <typename Launch>
Timing time_launches(Launch launch, int iters) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(a), "record");
    launch();
    check(cudaEventRecord(b), "record");
    check(cudaEventSynchronize(b), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  check(cudaEventRecord(a), "record");
  for (int i = 0; i < 10; ++i) launch();
  check(cudaEventRecord(b), "record");
  check(cudaEventSynchronize(b), "sync");
  float sustained = 0;
  check(cudaEventElapsedTime(&sustained, a, b), "elapsed");
  check(cudaGetLastError(), "launch");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {ms[ms.size() / 2], sustained / 10};
}

const char* promotion_name(CUtensorMapL2promotion p) {
  switch (p) {
    case CU_TENSOR_MAP_L2_PROMOTION_NONE:
      return "none";
    case CU_TENSOR_MAP_L2_PROMOTION_L2_64B:
      return "64B";
    case CU_TENSOR_MAP_L2_PROMOTION_L2_128B:
      return "128B";
    default:
      return "256B";
  }
}

// ep4rank's w13 codes: 64 experts x 2I = 4096 rows of H / 2 = 2048 bytes (512 MiB);
// w2's: 64 x H = 4096 rows of I / 2 = 1024 bytes.
constexpr int64_t kW13Rows = 64 * 4096, kW13Bytes = 2048;
constexpr int64_t kW2Rows = 64 * 4096, kW2Bytes = 1024;

std::vector<Config> probe_configs() {
  const int64_t w13_rows = kW13Rows, w13_bytes = kW13Bytes, w2_rows = kW2Rows, w2_bytes = kW2Bytes;
  const auto P256 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B, P128 = CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             PNONE = CU_TENSOR_MAP_L2_PROMOTION_NONE;
  // GEMM1's forward walk: 256-row tiles of all of K, a step 32 bytes of each row (64 codes).
  const StreamShape fwd1{w13_rows, w13_bytes, 256, 2048, 256, 32};
  const StreamShape fwd2{w2_rows, w2_bytes, 256, 1024, 256, 32};
  // The same tiles in boxes of other shapes (8 KB each) and in wider steps (K 128-512).
  const StreamShape fwd1_64x128{w13_rows, w13_bytes, 256, 2048, 128, 64};
  const StreamShape fwd1_128x64{w13_rows, w13_bytes, 256, 2048, 64, 128};
  const StreamShape fwd1_k128{w13_rows, w13_bytes, 256, 2048, 256, 64};
  const StreamShape fwd1_k256{w13_rows, w13_bytes, 256, 2048, 256, 128};
  const StreamShape fwd1_128rows{w13_rows, w13_bytes, 128, 2048, 128, 64};
  // dgrad1's transposed walk: a tile is one expert's 4096 K rows of 128 bytes (256 columns).
  const StreamShape dg1{w13_rows, w13_bytes, 4096, 128, 64, 128};
  const StreamShape dg1_128{w13_rows, w13_bytes, 4096, 128, 128, 128};
  std::vector<Config> configs;
  for (int stages : {4, 6, 8, 12, 16})
    configs.push_back({"fwd1 32Bx256 s" + std::to_string(stages), fwd1, stages, P256, 0, 0, 0});
  configs.push_back({"fwd1 32Bx256 s6 promo128", fwd1, 6, P128, 0, 0, 0});
  configs.push_back({"fwd1 32Bx256 s6 promoNone", fwd1, 6, PNONE, 0, 0, 0});
  configs.push_back({"fwd1 32Bx256 s6 touch", fwd1, 6, P256, 0, 1, 0});
  configs.push_back({"fwd1 32Bx256 s6 +pool", fwd1, 6, P256, 0, 0, 0, 1});
  configs.push_back({"fwd1 32Bx256 s6 +pool touch arrive256", fwd1, 6, P256, 0, 1, 0, 1, 1});
  configs.push_back({"fwd1 32Bx256 s6 arrive128", fwd1, 6, P256, 0, 0, 0, 0, 1});
  configs.push_back({"fwd1 64Bx256 (K128) s6 +pool", fwd1_k128, 6, P256, 0, 0, 0, 1});
  // Consumers that hold each stage (cycles): how deep a ring must be to hide the loads
  // behind work of about a streaming step's length.
  for (int cycles : {500, 1000})
    for (int stages : {6, 12})
      configs.push_back(
          {"fwd1 32Bx256 s" + std::to_string(stages) + " +pool hold" + std::to_string(cycles), fwd1,
           stages, P256, 0, 0, 0, 1, 1, cycles});
  configs.push_back(
      {"fwd1 64Bx256 (K128) s6 +pool hold2000", fwd1_k128, 6, P256, 0, 0, 0, 1, 1, 2000});
  // The multi-step stages of the forward's 32-row kinds (docs/ENGINE.md, "Whole code lines
  // per stage"): two steps a stage in four stages, four steps a stage in three, each stage
  // held as long as its steps' work.
  configs.push_back(
      {"fwd1 64Bx256 (K128) s4 +pool hold2000", fwd1_k128, 4, P256, 0, 0, 0, 1, 1, 2000});
  configs.push_back(
      {"fwd1 128Bx256 (K256) s3 +pool hold4000", fwd1_k256, 3, P256, 0, 0, 0, 1, 1, 4000});
  for (int ahead : {8, 16, 32})
    configs.push_back(
        {"fwd1 32Bx256 s6 prefetch" + std::to_string(ahead), fwd1, 6, P256, ahead, 0, 0});
  configs.push_back({"fwd2 32Bx256 s6", fwd2, 6, P256, 0, 0, 0});
  configs.push_back({"fwd2 32Bx256 s10", fwd2, 10, P256, 0, 0, 0});
  configs.push_back({"fwd1 64Bx128 s6", fwd1_64x128, 6, P256, 0, 0, 0});
  configs.push_back({"fwd1 128Bx64 s6", fwd1_128x64, 6, P256, 0, 0, 0});
  configs.push_back({"fwd1 64Bx256 (K128) s3", fwd1_k128, 3, P256, 0, 0, 0});
  configs.push_back({"fwd1 64Bx256 (K128) s6", fwd1_k128, 6, P256, 0, 0, 0});
  configs.push_back({"fwd1 128Bx256 (K256) s3", fwd1_k256, 3, P256, 0, 0, 0});
  configs.push_back({"fwd1 128Bx256 (K256) s5", fwd1_k256, 5, P256, 0, 0, 0});
  configs.push_back({"fwd1 64Bx128 tile128 s6", fwd1_128rows, 6, P256, 0, 0, 0});
  configs.push_back({"dg1 128Bx64 s6", dg1, 6, P256, 0, 0, 0});
  configs.push_back({"dg1 128Bx64 s6 promo128", dg1, 6, P128, 0, 0, 0});
  configs.push_back({"dg1 128Bx64 s12", dg1, 12, P256, 0, 0, 0});
  configs.push_back({"dg1 128Bx128 s6", dg1_128, 6, P256, 0, 0, 0});
  configs.push_back({"bulk 8KB contiguous s6", fwd1, 6, P256, 0, 0, 1});
  configs.push_back({"bulk 8KB contiguous s12", fwd1, 12, P256, 0, 0, 1});
  return configs;
}

// Every configuration's walk, on the host: each CTA's steps stay inside the matrix, and
// over all CTAs every box (or bulk piece) of it is loaded exactly once. A walk that read
// some bytes twice and others never would misstate the bandwidth.
int check_walks() {
  int failures = 0;
  for (const Config& c : probe_configs()) {
    for (int ctas : {132, 114, 78}) {
      const ProbeParams p{c.shape, c.stages, 0, 0, c.bulk, 0, 0, 0, nullptr, nullptr};
      const int64_t boxes_x = c.shape.row_bytes / c.shape.box_bytes;
      const int64_t boxes = boxes_x * (c.shape.rows / c.shape.box_rows);
      std::vector<int> seen(static_cast<size_t>(boxes), 0);
      bool inside = true;
      for (int cta = 0; cta < ctas; ++cta) {
        for (StepWalk walk(p, cta, ctas); walk.valid; walk.next()) {
          int64_t box;
          if (c.bulk) {
            box = walk.offset() / (static_cast<int64_t>(c.shape.box_rows) * c.shape.box_bytes);
          } else {
            const int x = walk.x(), y = walk.y();
            inside = inside && x % c.shape.box_bytes == 0 && y % c.shape.box_rows == 0 &&
                     x + c.shape.box_bytes <= c.shape.row_bytes &&
                     y + c.shape.box_rows <= c.shape.rows;
            box = (static_cast<int64_t>(y) / c.shape.box_rows) * boxes_x + x / c.shape.box_bytes;
          }
          if (box < 0 || box >= boxes) {
            inside = false;
            continue;
          }
          ++seen[static_cast<size_t>(box)];
        }
      }
      const bool once = std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; });
      if (!inside || !once) {
        std::printf("walk FAILED: %s over %d CTAs (inside %d, each box once %d)\n", c.name.c_str(),
                    ctas, inside, once);
        ++failures;
      }
    }
  }
  std::printf("%s: %zu configurations, 3 grid sizes each\n", failures ? "walks failed" : "walks ok",
              probe_configs().size());
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--check-walk")) {
      return check_walks();
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--only SUBSTRING] [--check-walk]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  const size_t buffer = static_cast<size_t>(kW13Rows * kW13Bytes);
  uint8_t *src = nullptr, *dst = nullptr;
  unsigned long long* sink = nullptr;
  check(cudaMalloc(&src, buffer), "malloc");
  check(cudaMalloc(&dst, buffer), "malloc");
  check(cudaMalloc(&sink, sizeof(*sink)), "malloc");
  check(cudaMemset(src, 0x5a, buffer), "memset");

  std::printf("device %s, %d SMs, %.0f MB buffer\n", prop.name, prop.multiProcessorCount,
              buffer / 1e6);
  const Timing copy = time_launches(
      [&] { check(cudaMemcpyAsync(dst, src, buffer, cudaMemcpyDeviceToDevice), "copy"); }, iters);
  const Timing read = time_launches(
      [&] {
        read_kernel<<<prop.multiProcessorCount * 4, 512>>>(reinterpret_cast<const uint4*>(src),
                                                           static_cast<long>(buffer / 16), sink);
      },
      iters);
  const double read_gbs = buffer / (read.median_ms * 1e6);
  std::printf("%-34s %9s %9s %8s\n", "config", "GB/s", "sust.GB/s", "/read");
  std::printf("%-34s %9.0f %9.0f %8s   (read + write counted: %.0f)\n", "device copy (read bytes)",
              buffer / (copy.median_ms * 1e6), buffer / (copy.sustained_ms * 1e6), "-",
              2 * buffer / (copy.median_ms * 1e6));
  std::printf("%-34s %9.0f %9.0f %8.2f\n", "vector-load read", read_gbs,
              buffer / (read.sustained_ms * 1e6), 1.0);

  const std::vector<Config> configs = probe_configs();

  // The pool tiles come from the copy's destination buffer (its first 16 MB).
  const CUtensorMap pool_map = byte_map(dst, kPoolRows, kPoolRowBytes, kPoolBoxRows, kPoolBoxBytes,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  check(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             prop.sharedMemPerBlockOptin),
        "smem attribute");
  for (const Config& c : configs) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    const int stage_bytes = c.shape.box_rows * c.shape.box_bytes +
                            (c.pool ? c.shape.box_bytes / 32 * kPoolTileBytes : 0);
    const size_t smem = static_cast<size_t>(c.stages) * stage_bytes + 2 * kMaxStages * 8;
    if (smem > prop.sharedMemPerBlockOptin || c.stages > kMaxStages) {
      std::printf("%-34s does not fit (%zu bytes)\n", c.name.c_str(), smem);
      continue;
    }
    const CUtensorMap map = byte_map(src, c.shape.rows, c.shape.row_bytes, c.shape.box_rows,
                                     c.shape.box_bytes, c.promotion);
    const ProbeParams p{c.shape, c.stages,     c.prefetch_steps, c.touch, c.bulk,
                        c.pool,  c.arrive_all, c.consume_cycles, src,     sink};
    const Timing t = time_launches(
        [&] { stream_kernel<<<prop.multiProcessorCount, kThreads, smem>>>(map, pool_map, p); },
        iters);
    const double bytes = static_cast<double>(c.shape.rows * c.shape.row_bytes);
    const double gbs = bytes / (t.median_ms * 1e6);
    std::printf("%-34s %9.0f %9.0f %8.2f   (%s promotion, %d KB in flight)\n", c.name.c_str(), gbs,
                bytes / (t.sustained_ms * 1e6), gbs / read_gbs, promotion_name(c.promotion),
                c.stages * stage_bytes / 1024);
  }
  check(cudaDeviceSynchronize(), "synchronize");
  return 0;
}
