// The grouped GEMM engine (DESIGN §3): persistent, warp-specialized, TMA + wgmma.
//
// One CTA per SM walks output tiles (m_block, n_block) in a static round-robin.
// Warpgroup 0 is the producer: one thread issues TMA loads of A and B K-blocks into a
// ring of shared-memory stages. Warpgroups 1..BLOCK_M/64 are consumers: each owns
// 64 rows of the tile and issues wgmma on the stages, then runs the epilogue from
// registers. Pipeline contract per stage: `full` completes when the TMA bytes land
// (producer arms it with the byte count); `empty` completes when every consumer warp
// has finished the wgmma that read the stage. Both roles walk the same tile and
// K-step sequence, so stage index and phase stay in lock step without messages.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "gated_activation_math.cuh"
#include "grouped_gemm_params.h"
#include "mxfp4_tile_decode.cuh"
#include "wgmma_smem.cuh"

namespace megamoe::kernels {

namespace gemm {

// One pipeline stage: the A tile, the BF16 B tile and, for an MXFP4 B, the staging
// area its codes and scales land in (decoded into the B tile by the consumers).
template <int BlockM, int BlockN, BFormat kBFormat = BFormat::BF16>
struct Tile {
  static constexpr int kConsumers = BlockM / 64;  // wgmma M is 64 per warpgroup
  static constexpr int kThreads = (kConsumers + 1) * kWarpgroupThreads;
  static constexpr bool kMxfp4 = kBFormat == BFormat::MXFP4;
  static constexpr int kABytes = BlockM * kRowBytes;
  static constexpr int kBBytes = BlockN * kRowBytes;
  static constexpr int kCodeBytes = kMxfp4 ? BlockN * mxfp4::kCodeBytesPerRow : 0;
  static constexpr int kScaleBytes = kMxfp4 ? BlockN * 2 : 0;
  // Whole 1024-byte units: every stage's A and B tiles start on a swizzle-atom boundary.
  static constexpr int kStageBytes =
      (kABytes + kBBytes + kCodeBytes + kScaleBytes + 1023) / 1024 * 1024;
  // As many stages as fit next to the barriers (227 KB of shared memory per CTA).
  static constexpr int kStages = (220 * 1024) / kStageBytes > 8 ? 8 : (220 * 1024) / kStageBytes;
  static_assert(kStages >= 2, "the MXFP4 decode runs one stage ahead of the wgmma");
  // full + empty mbarriers per stage, and for MXFP4 a `decoded` one.
  static constexpr int kBarriers = kMxfp4 ? 3 : 2;
  static constexpr int kSmemBytes = kStages * kStageBytes + kBarriers * kStages * 8 + 1024;
};

// The expert owning pool row `row`: the last e with offsets[e] <= row (binary search;
// empty experts have zero-length segments and are skipped by the `<=`).
__device__ __forceinline__ int expert_of_row(const int32_t* offsets, int num_experts, int row) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The K-steps of one tile: side steps, then base steps.
struct TileSchedule {
  int side_steps;  // ceil(side_k / 64) (0: no side segment)
  int base_steps;  // ceil(k_base / 64)
  __device__ __forceinline__ int total() const { return side_steps + base_steps; }
};

__device__ __forceinline__ float activate(float gate, int activation) {
  if (activation == static_cast<int>(Activation::GeGLU)) {
    const float inner = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    return 0.5f * gate * (1.0f + tanhf(inner));
  }
  return gate / (1.0f + expf(-gate));
}

}  // namespace gemm

template <int BlockM, int BlockN, Epilogue kEpilogue, BMajor kBMajor, BFormat kBFormat>
__global__ void __launch_bounds__(gemm::Tile<BlockM, BlockN, kBFormat>::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p) {
  using namespace gemm;
  using T = Tile<BlockM, BlockN, kBFormat>;
  constexpr bool kMxfp4 = T::kMxfp4;
  static_assert(BlockN == 128 || BlockN == 256, "tiles hold whole 64-column gate/up pairs");
  constexpr bool kBMajorMN = kBMajor == BMajor::MN;
  constexpr bool kActBackward = kEpilogue == Epilogue::ActivationBackward;
  static_assert(!kBMajorMN || kEpilogue != Epilogue::GatedActivation,
                "an MN-major B (the dgrads) has the Store or ActivationBackward epilogue");
  static_assert(!kActBackward || kBMajorMN, "the activation backward is dgrad2's (MN-major B)");
  // Accumulator registers per consumer thread (m64 x BlockN FP32 over 128 threads), and
  // the 64-column gate/up interleave blocks one tile spans.
  constexpr int kAccRegs = BlockN / 2;
  constexpr int kGatePairs = BlockN / 128;
  constexpr bool kGated = kEpilogue == Epilogue::GatedActivation;

  extern __shared__ __align__(1024) uint8_t smem[];
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
  uint8_t* stages =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + T::kStages * T::kStageBytes);
  uint64_t* empty = full + T::kStages;
  // MXFP4: completes when every consumer thread has decoded its share of the stage's B
  // tile (or, for a BF16 step, passed it), so both warpgroups' wgmma may read it.
  uint64_t* decoded = empty + T::kStages;
  auto stage_a = [&](int s) { return stages + s * T::kStageBytes; };
  auto stage_b = [&](int s) { return stages + s * T::kStageBytes + T::kABytes; };
  auto stage_codes = [&](int s) { return stage_b(s) + T::kBBytes; };
  auto stage_scales = [&](int s) { return stage_codes(s) + T::kCodeBytes; };

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  // 256-column tiles need 128 accumulator registers per consumer thread: move registers
  // from the producer (one issuing thread) to the consumers, as Hopper allows per
  // warpgroup. 40 + 2 x 232 registers x 128 threads fit the 64K register file.
  constexpr bool kReallocate = BlockN == 256 && T::kConsumers == 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      FullBarrier::init(&full[s], 1);
      EmptyBarrier::init(&empty[s], T::kConsumers * 4);  // one arrival per consumer warp
      if constexpr (kMxfp4) EmptyBarrier::init(&decoded[s], T::kConsumers * kWarpgroupThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // A corrupt plan must not make the kernel read or write past the pool.
  const int rows_used = min(__ldg(p.expert_pool_offsets + p.num_experts), p.pool_rows);
  const int m_blocks = rows_used / BlockM;
  const int n_base_blocks = (p.n_base + BlockN - 1) / BlockN;
  const int n_blocks = n_base_blocks + (p.n_extra + BlockN - 1) / BlockN;
  const int num_tiles = m_blocks * n_blocks;
  TileSchedule schedule{kGated ? (p.side_k + kGemmBlockK - 1) / kGemmBlockK : 0,
                        (p.k_base + kGemmBlockK - 1) / kGemmBlockK};

  if (warpgroup == 0) {
    // ---- producer: one thread streams K-blocks of every tile into the ring ----
    if constexpr (kReallocate) cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    RingState ring;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int m_block = tile / n_blocks;
      const int n_block = tile % n_blocks;
      const int row0 = m_block * BlockM;
      const int expert = expert_of_row(p.expert_pool_offsets, p.num_experts, row0);
      const bool extra = n_block >= n_base_blocks;
      for (int step = 0; step < schedule.total(); ++step) {
        EmptyBarrier::wait(&empty[ring.stage], ring.phase ^ 1u);
        uint64_t* bar = &full[ring.stage];
        const int side_steps = schedule.side_steps;
        if (step < side_steps) {
          // Side segment: [q1 | q3] columns against the block-diagonal side weights, a
          // full-width BF16 B tile like the base's.
          const int k0 = step * kGemmBlockK;
          const int b_row = expert * p.n_base + n_block * BlockN;
          FullBarrier::arrive_and_expect_tx(bar, T::kABytes + T::kBBytes);
          cute::SM90_TMA_LOAD_2D::copy(&p.a_side, bar, kCacheHint, stage_a(ring.stage), k0, row0);
          cute::SM90_TMA_LOAD_2D::copy(&p.b_side, bar, kCacheHint, stage_b(ring.stage), k0, b_row);
        } else {
          const int k0 = (step - side_steps) * kGemmBlockK;
          const int b_row = extra ? expert * p.n_extra + (n_block - n_base_blocks) * BlockN
                                  : expert * p.n_base + n_block * BlockN;
          if (kMxfp4 && !extra) {
            // Codes and scales of the K block into the staging area (the consumers
            // decode them); rows and columns past the tensors are zero-filled, which
            // decodes to exact zeros.
            FullBarrier::arrive_and_expect_tx(bar, T::kABytes + T::kCodeBytes + T::kScaleBytes);
            cute::SM90_TMA_LOAD_2D::copy(&p.a, bar, kCacheHint, stage_a(ring.stage), k0, row0);
            if constexpr (kBMajorMN) {
              // Codes [E * K, N / 2]: 64 K rows of this expert (K is a multiple of 64);
              // scales [E * N / 32, K]: this tile's N blocks of 32, 64 K columns.
              cute::SM90_TMA_LOAD_2D::copy(&p.b_codes, bar, kCacheHint, stage_codes(ring.stage),
                                           n_block * (BlockN / 2), expert * p.k_base + k0);
              cute::SM90_TMA_LOAD_2D::copy(&p.b_scales, bar, kCacheHint, stage_scales(ring.stage),
                                           k0, expert * (p.n_base / 32) + n_block * (BlockN / 32));
            } else {
              cute::SM90_TMA_LOAD_2D::copy(&p.b_codes, bar, kCacheHint, stage_codes(ring.stage),
                                           k0 / 2, b_row);
              cute::SM90_TMA_LOAD_2D::copy(&p.b_scales, bar, kCacheHint, stage_scales(ring.stage),
                                           n_block * BlockN,
                                           expert * schedule.base_steps + k0 / kGemmBlockK);
            }
            ring.template advance<T::kStages>();
            continue;
          }
          FullBarrier::arrive_and_expect_tx(bar, T::kABytes + T::kBBytes);
          cute::SM90_TMA_LOAD_2D::copy(&p.a, bar, kCacheHint, stage_a(ring.stage), k0, row0);
          if constexpr (kBMajorMN) {
            // BLOCK_N / 64 boxes of 64 K rows x 64 N columns, side by side along N; the
            // 3-D map zero-fills K rows past this expert's k_base and columns past the
            // segment's N.
            const CUtensorMap* map = extra ? &p.b_extra : &p.b;
            const int n0 = (extra ? n_block - n_base_blocks : n_block) * BlockN;
#pragma unroll
            for (int chunk = 0; chunk < BlockN / 64; ++chunk)
              cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint,
                                           stage_b(ring.stage) + chunk * kGemmBlockK * kRowBytes,
                                           n0 + 64 * chunk, k0, expert);
          } else {
            cute::SM90_TMA_LOAD_2D::copy(extra ? &p.b_extra : &p.b, bar, kCacheHint,
                                         stage_b(ring.stage), k0, b_row);
          }
        }
        ring.template advance<T::kStages>();
      }
    }
    return;
  }

  // ---- consumers: wgmma over the ring, then the epilogue from registers ----
  if constexpr (kReallocate) cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  float acc[kAccRegs];
  RingState ring;
  // MXFP4 B: every consumer thread decodes its share of a stage's B tile, then arrives
  // on the stage's `decoded` barrier, which both warpgroups wait on before their wgmma.
  // Every step of an MXFP4 kernel passes through it (BF16 steps decode nothing), so its
  // phase follows the ring's like `full`'s.
  const int decode_thread = threadIdx.x - kWarpgroupThreads;
  auto prepare_stage = [&](const RingState& at, bool decodes) {
    FullBarrier::wait(&full[at.stage], at.phase);
    if (decodes) {
      if constexpr (kBMajorMN)
        mxfp4::decode_b_block_mn<BlockN, T::kConsumers * kWarpgroupThreads>(
            stage_codes(at.stage), stage_scales(at.stage), stage_b(at.stage), decode_thread);
      else
        mxfp4::decode_b_block<BlockN, T::kConsumers * kWarpgroupThreads>(
            stage_codes(at.stage), reinterpret_cast<const uint16_t*>(stage_scales(at.stage)),
            stage_b(at.stage), decode_thread);
      // The generic-proxy stores must be visible to wgmma, which reads through the
      // async proxy; the barrier's release/acquire then orders them for the readers.
      cutlass::arch::fence_view_async_shared();
    }
    EmptyBarrier::arrive(&decoded[at.stage]);
  };
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int m_block = tile / n_blocks;
    const int n_block = tile % n_blocks;
    // Which K steps read an MXFP4 B (the base steps of a base-column tile).
    const bool decodes_tile = kMxfp4 && n_block < n_base_blocks;
    const int first_base_step = schedule.side_steps;
    auto step_decodes = [&](int step) { return decodes_tile && step >= first_base_step; };
    // Pipeline contract of an MXFP4 kernel: step k + 1's stage is prepared (waited for
    // and, if MXFP4, decoded) while step k's wgmma run, so a step only waits for its
    // `decoded` barrier; the tile's first step is prepared here.
    if constexpr (kMxfp4) prepare_stage(ring, step_decodes(0));
    for (int step = 0; step < schedule.total(); ++step) {
      if constexpr (kMxfp4)
        EmptyBarrier::wait(&decoded[ring.stage], ring.phase);
      else
        FullBarrier::wait(&full[ring.stage], ring.phase);
      const uint64_t desc_a = smem_descriptor(stage_a(ring.stage) + consumer * 64 * kRowBytes);
      const uint64_t desc_b = smem_descriptor(stage_b(ring.stage));
      const int side_steps = schedule.side_steps;
      cute::warpgroup_arrive();
      {
        // Side and base steps are the same full-width MMA (one code path: a branch
        // around wgmma makes ptxas serialize them); the first step starts the sum.
        const bool first = step == 0;
        if constexpr (kBMajorMN) {
          const uint64_t desc_b_mn = smem_descriptor_mn(stage_b(ring.stage));
#pragma unroll
          for (int k16 = 0; k16 < kGemmBlockK / 16; ++k16)
            Wgmma<BlockN, true>::mma(advance_k16(desc_a, k16), advance_k16_mn(desc_b_mn, k16), acc,
                                     !(first && k16 == 0));
        } else {
#pragma unroll
          for (int k16 = 0; k16 < kGemmBlockK / 16; ++k16)
            Wgmma<BlockN>::mma(advance_k16(desc_a, k16), advance_k16(desc_b, k16), acc,
                               !(first && k16 == 0));
        }
      }
      cute::warpgroup_commit_batch();
      if constexpr (kMxfp4) {
        if (step + 1 < schedule.total()) {
          RingState next = ring;
          next.template advance<T::kStages>();
          prepare_stage(next, step_decodes(step + 1));
        }
      }
      cute::warpgroup_wait<0>();
      if (lane == 0) EmptyBarrier::arrive(&empty[ring.stage]);
      ring.template advance<T::kStages>();
      if (step + 1 == side_steps) {
        // The side sum is complete: scale it before the base K loop accumulates on top,
        // so s multiplies exactly the adapter term (FP32, no extra rounding).
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) acc[i] *= p.side_scale;
      }
    }

    // Accumulator layout of m64nNk16 (per warpgroup): register 4*j + {0,1} holds row
    // warp*16 + lane/4, columns 8*j + 2*(lane%4) + {0,1}; 4*j + {2,3} the row 8 below.
    const int row_in_tile = consumer * 64 + warp * 16 + lane / 4;
    const int64_t row0 = static_cast<int64_t>(m_block) * BlockM + row_in_tile;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
    if constexpr (kGated) {
      // Each 128 columns of the tile are 64 gate then the matching 64 up columns
      // (prepare_base_weights' interleave): register groups 16*pair + j and 16*pair + j + 8
      // pair up in the same thread.
#pragma unroll
      for (int pair = 0; pair < kGatePairs; ++pair) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float h[2], gate[2], up[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              gate[c] = gemm::round_bf16(acc[64 * pair + 4 * j + 2 * half + c]);
              up[c] = gemm::round_bf16(acc[64 * pair + 4 * (j + 8) + 2 * half + c]);
              const float gate_clamped = fminf(gate[c], p.activation_clamp);
              const float up_clamped = fminf(fmaxf(up[c], -p.activation_clamp), p.activation_clamp);
              h[c] = gemm::activate(gate_clamped, p.activation) * up_clamped;
            }
            const int64_t col =
                static_cast<int64_t>(n_block) * (BlockN / 2) + 64 * pair + 8 * j + 2 * (lane % 4);
            const int64_t row = row0 + 8 * half;
            *reinterpret_cast<__nv_bfloat162*>(out + row * p.out_stride + col) =
                __floats2bfloat162_rn(h[0], h[1]);
            if (p.preact_out != nullptr) {
              // Same interleave as B's rows: gate at tile column 128*pair + c, up at +64.
              __nv_bfloat16* preact = static_cast<__nv_bfloat16*>(p.preact_out) + row * p.n_base +
                                      static_cast<int64_t>(n_block) * BlockN + 128 * pair + 8 * j +
                                      2 * (lane % 4);
              *reinterpret_cast<__nv_bfloat162*>(preact) = __floats2bfloat162_rn(gate[0], gate[1]);
              *reinterpret_cast<__nv_bfloat162*>(preact + 64) = __floats2bfloat162_rn(up[0], up[1]);
            }
          }
        }
      }
    } else if constexpr (kActBackward) {
      // dgrad2 + activation backward: the accumulators are z for columns
      // i = n_block * BlockN + 8j + 2(lane % 4) + {0,1} of rows row0 and row0 + 8. Each
      // thread reads g, u of those columns (w13's interleave: i's gate column is
      // 128 (i / 64) + i % 64, its up column 64 further) and writes dg | du there.
      const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
      __nv_bfloat16* dgrad = static_cast<__nv_bfloat16*>(p.dgrad_preact);
      __nv_bfloat16* weighted = static_cast<__nv_bfloat16*>(p.weighted_h);
      const int64_t preact_stride = 2 * static_cast<int64_t>(p.n_base);
      const float clamp = p.activation_clamp;
      float weight[2], dot[2] = {0.0f, 0.0f};
      bool routed[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int32_t route = __ldg(p.pool_row_to_route + row0 + 8 * half);
        // Padding rows (route -1) get weight 0 and a zero router dot, as in the
        // activation-backward kernel.
        routed[half] = route >= 0 && route < p.num_routes;
        weight[half] = routed[half] ? __ldg(p.route_weights + route) : 0.0f;
      }
      // The g, u loads of a chunk of column groups are issued together before any math:
      // one memory latency per chunk instead of one per column group (the loads would
      // otherwise sit behind each group's activation math; the tensor cores idle
      // through this epilogue, so its latency is the kernel's).
      constexpr int kGroups = BlockN / 8;
      // 16 registers of g, u in flight per thread: 8 spill under the 168-register cap
      // (ptxas interleaves the chunks' math), 4 fit beside the accumulators.
      constexpr int kChunk = 4;
      static_assert(kGroups % kChunk == 0, "whole chunks of column groups");
#pragma unroll
      for (int j0 = 0; j0 < kGroups; j0 += kChunk) {
        __nv_bfloat162 gate2[kChunk][2], up2[kChunk][2];
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          const int col = n_block * BlockN + 8 * (j0 + jj) + 2 * (lane % 4);
          const int64_t gate_col = static_cast<int64_t>(col / 64) * 128 + col % 64;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const __nv_bfloat16* at = preact + (row0 + 8 * half) * preact_stride + gate_col;
            const bool in_n = col < p.n_base;  // N tail (columns come in pairs)
            gate2[jj][half] = in_n ? *reinterpret_cast<const __nv_bfloat162*>(at)
                                   : __floats2bfloat162_rn(0.0f, 0.0f);
            up2[jj][half] = in_n ? *reinterpret_cast<const __nv_bfloat162*>(at + 64)
                                 : __floats2bfloat162_rn(0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          const int j = j0 + jj;
          const int col = n_block * BlockN + 8 * j + 2 * (lane % 4);
          if (col >= p.n_base) continue;
          const int64_t gate_col = static_cast<int64_t>(col / 64) * 128 + col % 64;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int64_t row = row0 + 8 * half;
            const float gate[2] = {__low2float(gate2[jj][half]), __high2float(gate2[jj][half])};
            const float up[2] = {__low2float(up2[jj][half]), __high2float(up2[jj][half])};
            float dg[2], du[2], wh[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float z = gemm::round_bf16(acc[4 * j + 2 * half + c]);  // a GEMM output
              const float gc = fminf(gate[c], clamp);
              const float uc = fminf(fmaxf(up[c], -clamp), clamp);
              float act, derivative;
              act_math::activation_and_derivative(gc, p.activation, act, derivative);
              const float h = gemm::round_bf16(act * uc);
              dot[half] += z * h;
              const float dh = weight[half] * z;
              // Boundary values pass the gradient, like torch.clamp's. Padding rows get
              // explicit zeros whatever their inputs hold.
              dg[c] = routed[half] && gate[c] <= clamp ? dh * uc * derivative : 0.0f;
              du[c] = routed[half] && up[c] >= -clamp && up[c] <= clamp ? dh * act : 0.0f;
              wh[c] = routed[half] ? weight[half] * h : 0.0f;
            }
            *reinterpret_cast<__nv_bfloat162*>(dgrad + row * preact_stride + gate_col) =
                __floats2bfloat162_rn(dg[0], dg[1]);
            *reinterpret_cast<__nv_bfloat162*>(dgrad + row * preact_stride + gate_col + 64) =
                __floats2bfloat162_rn(du[0], du[1]);
            if (weighted != nullptr)
              *reinterpret_cast<__nv_bfloat162*>(weighted + row * p.n_base + col) =
                  __floats2bfloat162_rn(wh[0], wh[1]);
          }
        }
      }
      // The router dot <z, h>: a row's columns of this tile sit in the 4 lanes of a quad.
      // Sum them in a fixed butterfly; the caller sums the tiles' partials in order.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        dot[half] += __shfl_xor_sync(0xffffffffu, dot[half], 1);
        dot[half] += __shfl_xor_sync(0xffffffffu, dot[half], 2);
        if (lane % 4 == 0)
          p.drouter_partials[(row0 + 8 * half) * n_base_blocks + n_block] =
              routed[half] ? dot[half] : 0.0f;
      }
    } else {
      const bool extra = n_block >= n_base_blocks;
      const int seg_cols = extra ? p.n_extra : p.n_base;
      const int seg_col0 = (extra ? n_block - n_base_blocks : n_block) * BlockN;
      const int64_t out_col0 = (extra ? p.n_base : 0) + seg_col0;
#pragma unroll
      for (int j = 0; j < BlockN / 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        if (seg_col0 + col >= seg_cols) continue;  // segment N tail (columns come in pairs)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t row = row0 + 8 * half;
          *reinterpret_cast<__nv_bfloat162*>(out + row * p.out_stride + out_col0 + col) =
              __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
      }
    }
  }
}

template <int BlockM, int BlockN, Epilogue kEpilogue, BMajor kBMajor = BMajor::K,
          BFormat kBFormat = BFormat::BF16>
GroupedGemmKernels grouped_gemm_kernels() {
  using T = gemm::Tile<BlockM, BlockN, kBFormat>;
  return GroupedGemmKernels{&grouped_gemm_kernel<BlockM, BlockN, kEpilogue, kBMajor, kBFormat>,
                            BlockM,
                            BlockN,
                            T::kThreads,
                            T::kSmemBytes,
                            kEpilogue,
                            kBMajor,
                            kBFormat};
}

}  // namespace megamoe::kernels
