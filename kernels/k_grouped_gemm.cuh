// K-grouped weight-gradient GEMM (DESIGN §3, the backward's db1/db3/da2 and dw13/dw2):
// out[e] = scale * A_e^T B_e, reducing over each expert's data rows of the pool.
//
// Persistent and warp-specialized like the grouped GEMM engine: one CTA per SM walks
// output tiles (expert, m_block, n_block) in a static round-robin; warpgroup 0's first
// thread streams 64-row K steps of A and B into a ring of shared-memory stages with TMA;
// consumer warpgroups (64 output rows each) run wgmma with both operands MN-major.
// Pipeline contract per stage, as in grouped_gemm.cuh: `full` completes when the TMA
// bytes land, `empty` when every consumer warp's wgmma on the stage finished. Both roles
// derive the same per-expert step counts from the plan, so they stay in lock step.
//
// Tail masking: an expert's last K step usually covers fewer than 64 data rows; the
// stage still holds 64 rows (its padding rows, or the next expert's data). The consumers
// overwrite the rows past the data with zeros in shared memory before any wgmma reads the
// stage, so no padding row is ever read as data (a NaN there cannot leak in either).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "k_grouped_gemm_params.h"
#include "wgmma_smem.cuh"

namespace megamoe::kernels {

namespace k_grouped {

// One pipeline stage: 64 pool rows of A's BLOCK_M columns, then of B's BLOCK_N columns,
// each as 64-column boxes of 8 KB (64 rows x 128 bytes) side by side.
template <int BlockM, int BlockN>
struct Tile {
  static constexpr int kConsumers = BlockM / 64;  // wgmma M is 64 per warpgroup
  static constexpr int kConsumerThreads = kConsumers * gemm::kWarpgroupThreads;
  static constexpr int kThreads = kConsumerThreads + gemm::kWarpgroupThreads;
  static constexpr int kBoxBytes = kGemmBlockK * gemm::kRowBytes;  // 64 rows x 64 columns
  static constexpr int kABoxes = BlockM / 64;
  static constexpr int kBBoxes = BlockN / 64;
  static constexpr int kABytes = kABoxes * kBoxBytes;
  static constexpr int kBBytes = kBBoxes * kBoxBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;  // whole 1024-byte swizzle atoms
  static constexpr int kStages = (220 * 1024) / kStageBytes > 8 ? 8 : (220 * 1024) / kStageBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(kStages >= 2, "a ring needs two stages");
};

// The data rows of expert e: its segment start and row count, clamped to its segment
// and to the pool, so a corrupt plan (negative or decreasing offsets, counts past the
// segment) can neither read another expert's rows nor walk past the pool.
struct ExpertRows {
  int start;
  int count;
  __device__ __forceinline__ int steps() const { return (count + kGemmBlockK - 1) / kGemmBlockK; }
  // Data rows in K step `step` (64 but in the last step).
  __device__ __forceinline__ int rows_in_step(int step) const {
    return min(kGemmBlockK, count - step * kGemmBlockK);
  }
};

__device__ __forceinline__ ExpertRows expert_rows(const KGroupedGemmParams& p, int expert) {
  const int start = min(max(__ldg(p.expert_pool_offsets + expert), 0), p.pool_rows);
  const int end = min(max(__ldg(p.expert_pool_offsets + expert + 1), start), p.pool_rows);
  const int count = max(0, min(__ldg(p.expert_counts + expert), end - start));
  return ExpertRows{start, count};
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous
// wgmma that own the registers (CUTLASS's warpgroup_fence_operand, per register).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Output tile `tile` in expert-major order: the CTAs working at one time share an
// expert's rows in L2.
struct TileCoord {
  int expert, m_block, n_block;
};

__device__ __forceinline__ TileCoord tile_coord(int tile, int m_blocks, int n_blocks) {
  const int per_expert = m_blocks * n_blocks;
  const int in_expert = tile % per_expert;
  return TileCoord{tile / per_expert, in_expert / n_blocks, in_expert % n_blocks};
}

// Zero rows [data_rows, 64) of every box of a stage (A's and B's), split over the
// consumer threads in 16-byte stores. A row is 128 contiguous bytes whatever the swizzle
// (the swizzle permutes 16-byte units within a row), so the byte range is exact.
template <int Boxes, int Threads>
__device__ __forceinline__ void zero_tail_rows(uint8_t* stage, int data_rows, int thread) {
  const int units_per_box = (kGemmBlockK - data_rows) * (gemm::kRowBytes / 16);
  const int first_byte = data_rows * gemm::kRowBytes;
  for (int unit = thread; unit < Boxes * units_per_box; unit += Threads) {
    const int box = unit / units_per_box;
    const int in_box = unit % units_per_box;
    uint8_t* at = stage + box * (kGemmBlockK * gemm::kRowBytes) + first_byte + 16 * in_box;
    *reinterpret_cast<uint4*>(at) = make_uint4(0u, 0u, 0u, 0u);
  }
}

}  // namespace k_grouped

template <int BlockM, int BlockN>
__global__ void __launch_bounds__(k_grouped::Tile<BlockM, BlockN>::kThreads, 1)
    k_grouped_gemm_kernel(const __grid_constant__ KGroupedGemmParams p) {
  using namespace gemm;
  using T = k_grouped::Tile<BlockM, BlockN>;
  static_assert(BlockM % 64 == 0 && (BlockN == 128 || BlockN == 256), "supported tiles");
  constexpr int kAccRegs = BlockN / 2;

  extern __shared__ __align__(1024) uint8_t smem[];
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
  uint8_t* stages =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + T::kStages * T::kStageBytes);
  uint64_t* empty = full + T::kStages;
  auto stage_a = [&](int s) { return stages + s * T::kStageBytes; };
  auto stage_b = [&](int s) { return stage_a(s) + T::kABytes; };

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  // 256-column tiles hold 128 FP32 accumulators per consumer thread: move registers from
  // the producer warpgroup (one issuing thread) to the consumers.
  constexpr bool kReallocate = BlockN == 256 && T::kConsumers == 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      FullBarrier::init(&full[s], 1);
      EmptyBarrier::init(&empty[s], T::kConsumers * 4);  // one arrival per consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int m_blocks = (p.m + BlockM - 1) / BlockM;
  const int n_blocks = (p.n + BlockN - 1) / BlockN;
  const int num_tiles = p.num_experts * m_blocks * n_blocks;

  if (warpgroup == 0) {
    // ---- producer: one thread streams each tile's 64-row K steps into the ring ----
    if constexpr (kReallocate) cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    RingState ring;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const k_grouped::TileCoord at = k_grouped::tile_coord(tile, m_blocks, n_blocks);
      const k_grouped::ExpertRows rows = k_grouped::expert_rows(p, at.expert);
      for (int step = 0; step < rows.steps(); ++step) {
        EmptyBarrier::wait(&empty[ring.stage], ring.phase ^ 1u);
        uint64_t* bar = &full[ring.stage];
        const int row = rows.start + step * kGemmBlockK;
        // Columns past M or N are zero-filled by TMA (and never stored).
        FullBarrier::arrive_and_expect_tx(bar, T::kStageBytes);
#pragma unroll
        for (int box = 0; box < T::kABoxes; ++box)
          cute::SM90_TMA_LOAD_2D::copy(&p.a, bar, kCacheHint,
                                       stage_a(ring.stage) + box * T::kBoxBytes,
                                       at.m_block * BlockM + 64 * box, row);
#pragma unroll
        for (int box = 0; box < T::kBBoxes; ++box)
          cute::SM90_TMA_LOAD_2D::copy(&p.b, bar, kCacheHint,
                                       stage_b(ring.stage) + box * T::kBoxBytes,
                                       at.n_block * BlockN + 64 * box, row);
        ring.template advance<T::kStages>();
      }
    }
    return;
  }

  // ---- consumers: mask the tail, wgmma over the ring, then store from registers ----
  if constexpr (kReallocate) cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = warpgroup - 1;
  const int consumer_thread = threadIdx.x - kWarpgroupThreads;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  // A named barrier over the consumer threads only (the producer warpgroup has left);
  // CUTLASS offsets user ids past its reserved ones.
  constexpr uint32_t kTailBarrier = 0;
  float acc[kAccRegs];
  // `ring` is the next stage to consume; `release` the oldest stage whose wgmma may still
  // be reading it. One wgmma batch stays in flight: step k's MMAs are queued before the
  // warpgroup waits for step k-1's, so the tensor cores never drain between K steps, and
  // step k-1's stage is released as soon as its batch retires.
  RingState ring, release;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const k_grouped::TileCoord at = k_grouped::tile_coord(tile, m_blocks, n_blocks);
    const k_grouped::ExpertRows rows = k_grouped::expert_rows(p, at.expert);
    const int steps = rows.steps();
    // Zeros for an expert without rows (otherwise the first MMA overwrites them).
    // Unconditional: accumulator writes in a branch make ptxas serialize the wgmma.
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    k_grouped::fence_accumulators(acc);
    for (int step = 0; step < steps; ++step) {
      FullBarrier::wait(&full[ring.stage], ring.phase);
      const int data_rows = rows.rows_in_step(step);
      if (data_rows < kGemmBlockK) {
        // Every consumer thread zeroes its share of the rows past the data; the proxy
        // fence makes the generic stores visible to wgmma (async proxy), the barrier
        // makes both warpgroups' shares visible before either MMA reads the stage.
        k_grouped::zero_tail_rows<T::kABoxes + T::kBBoxes, T::kConsumerThreads>(
            stage_a(ring.stage), data_rows, consumer_thread);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::arrive_and_wait(T::kConsumerThreads, kTailBarrier);
      }
      // This warpgroup's 64 output rows are A's box `consumer`; B spans all boxes.
      const uint64_t desc_a = smem_descriptor_mn(stage_a(ring.stage) + consumer * T::kBoxBytes);
      const uint64_t desc_b = smem_descriptor_mn(stage_b(ring.stage));
      cute::warpgroup_arrive();
#pragma unroll
      for (int k16 = 0; k16 < kGemmBlockK / 16; ++k16)
        Wgmma<BlockN, true, true>::mma(advance_k16_mn(desc_a, k16), advance_k16_mn(desc_b, k16),
                                       acc, !(step == 0 && k16 == 0));
      cute::warpgroup_commit_batch();
      // Unconditional (a wait in a branch makes ptxas serialize every wgmma): at step 0
      // no older batch exists and it returns at once.
      cute::warpgroup_wait<1>();
      if (step > 0) {  // step - 1's batch retired: its stage goes back to the producer
        if (lane == 0) EmptyBarrier::arrive(&empty[release.stage]);
        release.template advance<T::kStages>();
      }
      ring.template advance<T::kStages>();
    }
    cute::warpgroup_wait<0>();  // the last batch, before the epilogue reads acc
    k_grouped::fence_accumulators(acc);
    if (steps > 0) {
      if (lane == 0) EmptyBarrier::arrive(&empty[release.stage]);
      release.template advance<T::kStages>();
    }

    // Accumulator layout of m64nNk16 (per warpgroup): register 4*j + {0,1} holds row
    // warp*16 + lane/4, columns 8*j + 2*(lane%4) + {0,1}; 4*j + {2,3} the row 8 below.
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + at.expert * p.out_expert_stride;
    const int row0 = at.m_block * BlockM + consumer * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < BlockN / 8; ++j) {
      const int col = at.n_block * BlockN + 8 * j + 2 * (lane % 4);
      if (col >= p.n) continue;  // N tail (N is even: columns come in pairs)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + 8 * half;
        if (row >= p.m) continue;  // M tail
        // + 0.0f: a negative scale times an empty sum is -0; the contract says +0.
        *reinterpret_cast<__nv_bfloat162*>(out + static_cast<int64_t>(row) * p.out_stride + col) =
            __floats2bfloat162_rn(p.scale * acc[4 * j + 2 * half] + 0.0f,
                                  p.scale * acc[4 * j + 2 * half + 1] + 0.0f);
      }
    }
  }
}

template <int BlockM, int BlockN>
KGroupedGemmKernels k_grouped_gemm_kernels() {
  using T = k_grouped::Tile<BlockM, BlockN>;
  return KGroupedGemmKernels{&k_grouped_gemm_kernel<BlockM, BlockN>, BlockM, BlockN, T::kThreads,
                             T::kSmemBytes};
}

}  // namespace megamoe::kernels
