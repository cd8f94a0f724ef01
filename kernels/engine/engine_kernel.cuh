// The GEMM engine (DESIGN §3): one persistent, warp-specialized TMA + wgmma kernel,
// assembled from a tile scheduler, A and B operand policies and an epilogue functor.
//
// Warp roles (EngineRoles):
//  - producer (warp 0, one thread): streams each tile's K steps of A and B into a ring of
//    shared-memory stages with TMA;
//  - consumers (warpgroups 1..BLOCK_M/64, 64 output rows each): wgmma over the ring, one
//    batch in flight (step k's MMAs are queued before step k-1's are waited for, and
//    k-1's stage is released then), then leave the tile's accumulators in the staging
//    tile (BF16; FP32 for the token sums) and go on to the next tile;
//  - decode warps (MXFP4 B: one more warpgroup): decode each landed stage's codes into
//    its BF16 B tile together with the consumer warpgroup, half the tile each
//    (stage_decoder.cuh; docs/ENGINE.md has what each arrangement measured);
//  - epilogue warps (warps 1-3): finish the staged tile (activation math, TMA stores)
//    while the consumers run the next tile's MMAs.
// Contracts: `full`/`empty` per stage (pipeline.cuh); MXFP4: `decoded` per stage
// completes when every decoding warp (decode and consumer warpgroups) wrote its part of
// the stage's B tile (the consumers wait for it before the stage's MMAs); `staged` completes when
// every consumer thread wrote its part of the staging tile, `drained` when the epilogue warps no
// longer read it (their TMA stores included).
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>

#include "engine_params.h"
#include "epilogue_activation_backward.cuh"
#include "epilogue_gated.cuh"
#include "epilogue_scaled_store.cuh"
#include "epilogue_store.cuh"
#include "operand_a.cuh"
#include "operand_b.cuh"
#include "pipeline.cuh"
#include "role_probe.cuh"
#include "stage_decoder.cuh"
#include "staging_tile.cuh"
#include "tile_scheduler.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

// Which warps do what, per kind and format, in at most three warpgroups (ptxas compiles
// every role within the launch's 65536 / threads registers, and two consumer warpgroups'
// 128 accumulators need 168 of them). Warpgroup 0: the producer warp and three epilogue
// warps; then the consumers; for an MXFP4 B (BLOCK_M 64: one consumer warpgroup) a
// decode warpgroup, and the consumer decodes too.
template <EngineKind kKind, BFormat kFormat, int BlockM>
struct EngineRoles {
  static constexpr int kConsumers = BlockM / 64;
  static constexpr bool kDecodeWarps = kFormat == BFormat::MXFP4;
  static_assert(!kDecodeWarps || kConsumers == 1, "MXFP4 tiles are 64 rows (3 warpgroups)");
  static constexpr int kWarpgroups = 1 + kConsumers + (kDecodeWarps ? 1 : 0);
  static constexpr int kThreads = kWarpgroups * kWarpgroupThreads;
  static constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;
  static constexpr int kDecodeThreads = kWarpgroupThreads;
  // The threads that decode an MXFP4 stage: the decode warpgroup, then the consumer's.
  static constexpr int kDecodingThreads = kDecodeThreads + kConsumerThreads;
  // setmaxnreg moves registers from warpgroup 0 to the two other warpgroups (the 384 x 168
  // the launch grants): two consumers' accumulators, or one consumer's accumulators plus
  // its share of the decode and the decode warpgroup. The activation backward's epilogue
  // keeps four rows' loads in flight and gets more (MXFP4: more still, its other roles
  // need less than two consumers' accumulators).
  static constexpr bool kReallocate = kConsumers == 2 || kDecodeWarps;
  static constexpr bool kHeavyEpilogue = kKind == EngineKind::ActivationBackward;
  static constexpr int kOtherRegisters = kHeavyEpilogue ? (kDecodeWarps ? 152 : 136) : 88;
  static constexpr int kConsumerRegisters = kHeavyEpilogue ? (kDecodeWarps ? 200 : 184) : 208;
  static constexpr int kLaunchRegisters = 3 * 168;
  static constexpr int kDecodeRegisters = kLaunchRegisters - kOtherRegisters - kConsumerRegisters;
  static_assert(!kReallocate || kDecodeWarps ||
                    kOtherRegisters + 2 * kConsumerRegisters == kLaunchRegisters,
                "setmaxnreg must hand out exactly the launch's registers");
  static_assert(kDecodeRegisters % 8 == 0 && kDecodeRegisters >= 128, "decode warpgroup");
};

// The parts of each kind (the registry line of a variant picks one). The pool kinds
// share the pool schedule and A operand.
template <int BlockM, class BOperand, class EpilogueFunctor>
struct PoolParts {
  using Schedule = PoolTiles<BlockM>;
  using A = PoolOperandA<BlockM>;
  using B = BOperand;
  using Epilogue = EpilogueFunctor;
};
template <EngineKind kKind, BFormat kFormat, int BlockM, int BlockN>
struct EngineParts;
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::Gated, kFormat, BlockM, BlockN>
    : PoolParts<BlockM, GatedOperandB<BlockN, kFormat>,
                GatedEpilogue<BlockM, BlockN, kEpilogueWarps>> {};
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::StoreKMajor, kFormat, BlockM, BlockN>
    : PoolParts<BlockM, KMajorOperandB<BlockN, kFormat>,
                StoreEpilogue<BlockM, BlockN, kEpilogueWarps>> {};
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::StoreMNMajor, kFormat, BlockM, BlockN>
    : PoolParts<BlockM, MNMajorOperandB<BlockN, kFormat>,
                StoreEpilogue<BlockM, BlockN, kEpilogueWarps>> {};
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::ActivationBackward, kFormat, BlockM, BlockN>
    : PoolParts<BlockM, MNMajorOperandB<BlockN, kFormat>,
                ActivationBackwardEpilogue<BlockM, BlockN, kEpilogueWarps>> {};
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::KGrouped, kFormat, BlockM, BlockN> {
  static_assert(kFormat == BFormat::BF16, "the weight gradients' operands are activations");
  using Schedule = ExpertRowTiles<BlockM, BlockN>;
  using A = RowsOperandA<BlockM>;
  using B = RowsOperandB<BlockN>;
  using Epilogue = ScaledStoreEpilogue<BlockM, BlockN, kEpilogueWarps>;
};
template <BFormat kFormat, int BlockM, int BlockN>
struct EngineParts<EngineKind::KGroupedFloat, kFormat, BlockM, BlockN>
    : EngineParts<EngineKind::KGrouped, kFormat, BlockM, BlockN> {
  using Epilogue =
      ScaledStoreEpilogue<BlockM, BlockN, kEpilogueWarps, FloatStagingTile<BlockM, BlockN>>;
};

template <EngineKind kKind, BFormat kFormat, int BlockM, int BlockN>
struct EngineConfig : EngineParts<kKind, kFormat, BlockM, BlockN>,
                      EngineRoles<kKind, kFormat, BlockM> {
  using Parts = EngineParts<kKind, kFormat, BlockM, BlockN>;
  using Roles = EngineRoles<kKind, kFormat, BlockM>;
  using Staging = typename Parts::Epilogue::Tile;
  static_assert(BlockM == 64 || BlockM == 128, "64 rows per consumer warpgroup");
  static_assert(BlockN == 128 || BlockN == 256, "wgmma N");
  static constexpr int kBlockM = BlockM, kBlockN = BlockN;
  static constexpr bool kMxfp4 = kFormat == BFormat::MXFP4;
  static constexpr bool kTailMask =
      kKind == EngineKind::KGrouped || kKind == EngineKind::KGroupedFloat;
  // The first extra tile may hold a block's columns in its low half only
  // (OperandParams::extra_low_half): dgrad1's diagonal blocks, GEMM2's a2 at r <= 128.
  static constexpr bool kExtraHalves =
      kKind == EngineKind::StoreMNMajor || kKind == EngineKind::StoreKMajor;
  static_assert(!kExtraHalves || BlockN == 256, "the launcher's extra_low_half is for 256");
  // GEMM1's side steps over q1 columns multiply the tile's gate half only.
  static constexpr bool kSideHalves = kKind == EngineKind::Gated && BlockN == 256;
  static constexpr int kAccumulators = BlockN / 2;
  static constexpr int kABytes = Parts::A::kBytes;
  static constexpr int kStageBytes = (kABytes + Parts::B::kBytes + 1023) / 1024 * 1024;
  // 227 KB per CTA, less the 1024-byte alignment slack and the barriers.
  static constexpr int kSmemLimit = 232448;
  static constexpr int kBarrierBytes = 256;
  static constexpr int kStagesFit =
      (kSmemLimit - 1024 - kBarrierBytes - Staging::kBytes) / kStageBytes;
  static constexpr int kStages = kStagesFit > 8 ? 8 : kStagesFit;
  static_assert(kStages >= 2, "a ring needs two stages");
  static_assert(3 * kStages + 2 <= kBarrierBytes / 8, "barrier area");
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + Staging::kBytes + kBarrierBytes;
};

template <class C>
struct SharedStorage {
  uint8_t* stages;
  uint8_t* staging;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* decoded;
  uint64_t* staged;
  uint64_t* drained;

  __device__ __forceinline__ explicit SharedStorage(uint8_t* raw) {
    // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
    stages =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    staging = stages + C::kStages * C::kStageBytes;
    full = reinterpret_cast<uint64_t*>(staging + C::Staging::kBytes);
    empty = full + C::kStages;
    decoded = empty + C::kStages;
    staged = decoded + C::kStages;
    drained = staged + 1;
  }
  __device__ __forceinline__ uint8_t* a(int s) const { return stages + s * C::kStageBytes; }
  __device__ __forceinline__ uint8_t* b(int s) const { return a(s) + C::kABytes; }
};

// ---- producer: one thread streams every tile's K steps into the ring ----
template <class C>
__device__ __forceinline__ void produce(const EngineParams& p, const SharedStorage<C>& smem) {
  const typename C::Schedule schedule(p.schedule);
  RingState<C::kStages> ring;
  CycleCounter total, wait_empty;
  total.start();
  for (int t = blockIdx.x; t < schedule.num_tiles(); t += gridDim.x) {
    const TileInfo tile = schedule.tile(t);
    for (int step = 0; step < tile.k_steps; ++step) {
      wait_empty.start();
      Barrier::wait(&smem.empty[ring.stage], ring.phase ^ 1u);
      wait_empty.stop();
      uint64_t* bar = &smem.full[ring.stage];
      TransactionBarrier::arrive_and_expect_tx(
          bar, C::kABytes + C::B::step_bytes(C::B::decodes(tile, step)));
      C::A::load(p.operands, tile, step, smem.a(ring.stage), bar);
      C::B::load(p.operands, tile, step, smem.b(ring.stage), bar);
      ring.advance();
    }
  }
  total.stop();
  probe_record(p.probe, kProbeProducerTotal, total);
  probe_record(p.probe, kProbeProducerWaitEmpty, wait_empty);
}

// ---- decode warps (MXFP4): their half of each landed stage's codes into its B tile ----
template <class C>
__device__ __forceinline__ void decode_stages(const EngineParams& p, const SharedStorage<C>& smem,
                                              int thread) {
  const typename C::Schedule schedule(p.schedule);
  StageDecoder<C> decoder(p.operands, thread);
  RingState<C::kStages> ring;
  bool prefetched = false;
  for (int t = blockIdx.x; t < schedule.num_tiles(); t += gridDim.x) {
    const TileInfo tile = schedule.tile(t);
    decoder.begin_tile(tile, prefetched);
    for (int step = 0; step < tile.k_steps; ++step) {
      TransactionBarrier::wait(&smem.full[ring.stage], ring.phase);
      decoder.step(smem.b(ring.stage), schedule, tile, step, t + static_cast<int>(gridDim.x));
      // One arrival per warp (an arrival per thread serializes on the barrier word); the
      // warp's stores are ordered before its lane 0's release by __syncwarp.
      __syncwarp();
      if (thread % 32 == 0) Barrier::arrive(&smem.decoded[ring.stage]);
      ring.advance();
    }
    prefetched = tile.k_steps > 0;
  }
}

// The K-grouped weight gradient's masking of a landed stage's rows past an expert's data
// (all consumer threads, before any wgmma reads the stage).
template <class C>
__device__ __forceinline__ void mask_tail_rows(const SharedStorage<C>& smem, const TileInfo& tile,
                                               int step, int stage, int consumer_thread) {
  const int data_rows = C::Schedule::rows_in_step(tile, step);
  if (data_rows >= kBlockK) return;
  // Rows [data_rows, 64) of every box of A and B: 128 contiguous bytes per row whatever
  // the swizzle (it permutes 16-byte units inside a row), so the byte range is exact.
  constexpr int kBoxes = (C::kABytes + C::B::kTileBytes) / kBoxBytes;
  const int units_per_box = (kBlockK - data_rows) * (kRowBytes / 16);
  uint8_t* stage_base = smem.a(stage);
  for (int unit = consumer_thread; unit < kBoxes * units_per_box; unit += C::kConsumerThreads) {
    const int box = unit / units_per_box, in_box = unit % units_per_box;
    // A's boxes, then B's: the B tile starts right after A (whole boxes).
    uint8_t* at = stage_base + box * kBoxBytes + data_rows * kRowBytes + 16 * in_box;
    *reinterpret_cast<uint4*>(at) = make_uint4(0u, 0u, 0u, 0u);
  }
  fence_generic_to_async();
  named_barrier_sync(kConsumerBarrier, C::kConsumerThreads);
}

// ---- consumers: wgmma over the ring, then the accumulators into the staging tile ----
// A tile's K steps run in segments (side steps, then base steps; an N extra tile's steps
// by diagonal block), each with the wgmma flavour of its B major (operand_b.cuh) and
// width: one loop per segment, so no branch sits between a batch's MMAs.
template <class C>
__device__ __forceinline__ void consume(const EngineParams& p, const SharedStorage<C>& smem,
                                        int consumer) {
  using BaseMma = Wgmma<C::kBlockN, C::A::kMNMajor, C::B::kMNMajor>;
  using SideMma = Wgmma<C::kBlockN, C::A::kMNMajor, C::B::kSideMNMajor>;
  using ExtraMma = Wgmma<C::kBlockN, C::A::kMNMajor, C::B::kExtraMNMajor>;
  // The low half of a tile's columns (B's first BLOCK_N / 2 rows, the first half of the
  // accumulators): the first extra tile's steps of a block whose columns all lie in that
  // half (OperandParams::extra_low_half). No such MMA into the upper half: a half-width
  // wgmma into the upper accumulators makes ptxas serialize the kernel's wgmma.
  using ExtraLowHalfMma = Wgmma<C::kBlockN / 2, C::A::kMNMajor, C::B::kExtraMNMajor>;
  // GEMM1's side steps over q1 meet [b1 | 0]: only the tile's gate half (the low half).
  using SideLowHalfMma = Wgmma<C::kBlockN / 2, C::A::kMNMajor, C::B::kSideMNMajor>;
  // Side steps that hold q1 columns only (GEMM1 with r a multiple of 64; else none).
  const int32_t gate_side_steps =
      p.operands.side_rank % kBlockK == 0 ? p.operands.side_rank / kBlockK : 0;
  const typename C::Schedule schedule(p.schedule);
  const int consumer_thread = threadIdx.x - kWarpgroupThreads;
  const int lane = threadIdx.x % 32;
  float acc[C::kAccumulators];
  // `ring`: the next stage to consume; `release`: the oldest stage still being read.
  RingState<C::kStages> ring, release;
  uint32_t epilogue_phase = 0;
  // MXFP4: the consumer decodes the second part of each stage (decoding threads
  // kDecodeThreads ..), while its previous step's MMAs run.
  using Decoder = std::conditional_t<C::kMxfp4, StageDecoder<C>, NoDecoder>;
  Decoder decoder(p.operands, C::kDecodeThreads + consumer_thread);
  bool prefetched = false;
  // The scheduler's lookup (a binary search over the experts' offsets, then divisions)
  // runs while a tile's last MMAs do, not between tiles where the tensor cores wait.
  const int num_tiles = schedule.num_tiles();
  CycleCounter total, wait_full, wait_drained, staging;
  total.start();
  TileInfo tile{};
  if (static_cast<int>(blockIdx.x) < num_tiles) tile = schedule.tile(blockIdx.x);
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int next_t = t + static_cast<int>(gridDim.x);
    decoder.begin_tile(tile, prefetched);
    prefetched = tile.k_steps > 0;
#pragma unroll
    for (int i = 0; i < C::kAccumulators; ++i) acc[i] = 0.0f;
    fence_accumulators(acc);
    // K steps [first, last) with the MMA flavour `Mma` (a tag object).
    auto run_steps = [&](auto mma, int first, int last) {
      using Mma = decltype(mma);
      for (int step = first; step < last; ++step) {
        if constexpr (C::kMxfp4) {
          TransactionBarrier::wait(&smem.full[ring.stage], ring.phase);
          decoder.step(smem.b(ring.stage), schedule, tile, step, next_t);
          __syncwarp();
          if (lane == 0) Barrier::arrive(&smem.decoded[ring.stage]);
          Barrier::wait(&smem.decoded[ring.stage], ring.phase);
        } else {
          wait_full.start();
          TransactionBarrier::wait(&smem.full[ring.stage], ring.phase);
          wait_full.stop();
          if constexpr (C::kTailMask) mask_tail_rows(smem, tile, step, ring.stage, consumer_thread);
        }
        const uint64_t desc_a = C::A::descriptor(smem.a(ring.stage), consumer);
        const uint64_t desc_b = tile_descriptor<Mma::kReadsBMNMajor>(smem.b(ring.stage));
        cute::warpgroup_arrive();
        Mma::step(desc_a, desc_b, acc);
        cute::warpgroup_commit_batch();
        // Unconditional (a wait in a branch makes ptxas serialize every wgmma): at step 0
        // no older batch exists and it returns at once.
        cute::warpgroup_wait<1>();
        if (step > 0) {  // step - 1's batch retired: its stage goes back to the producer
          if (lane == 0) Barrier::arrive(&smem.empty[release.stage]);
          release.advance();
        }
        ring.advance();
      }
    };
    if (tile.side_steps > 0) {
      int gate_steps = 0;
      if constexpr (C::kSideHalves) {
        gate_steps = min(gate_side_steps, tile.side_steps);
        run_steps(SideLowHalfMma{}, 0, gate_steps);
      }
      run_steps(SideMma{}, gate_steps, tile.side_steps);
      // The side sum is complete: scale it before the base K loop adds on, so the scale
      // multiplies exactly the adapter term (FP32, no extra rounding).
      cute::warpgroup_wait<0>();
      fence_accumulators(acc);
#pragma unroll
      for (int i = 0; i < C::kAccumulators; ++i) acc[i] *= p.operands.side_scale;
      fence_accumulators(acc);
    }
    // The extra segment by block (dgrad1: its two diagonal blocks; GEMM2: one block over
    // all of K), each block's steps half-width where its columns fit the low half.
    auto run_extra = [&] {
      if constexpr (C::kExtraHalves) {
        const int split = min(p.operands.extra_k_lo / kBlockK, tile.k_steps);
        const int low_half = tile.n_local == 0 ? p.operands.extra_low_half : 0;
        if (low_half & 1)
          run_steps(ExtraLowHalfMma{}, 0, split);
        else
          run_steps(ExtraMma{}, 0, split);
        if (low_half & 2)
          run_steps(ExtraLowHalfMma{}, split, tile.k_steps);
        else
          run_steps(ExtraMma{}, split, tile.k_steps);
      } else {
        run_steps(ExtraMma{}, 0, tile.k_steps);
      }
    };
    if (tile.extra)
      run_extra();
    else
      run_steps(BaseMma{}, tile.side_steps, tile.k_steps);
    // The next tile (or this CTA's last one again: no branch), while the batch runs.
    const TileInfo next = schedule.tile(min(next_t, num_tiles - 1));
    cute::warpgroup_wait<0>();  // the last batch, before the accumulators are read
    fence_accumulators(acc);
    if (tile.k_steps > 0) {
      if (lane == 0) Barrier::arrive(&smem.empty[release.stage]);
      release.advance();
    }
    // Hand the tile to the epilogue warps once they drained the previous one.
    wait_drained.start();
    Barrier::wait(smem.drained, epilogue_phase ^ 1u);
    wait_drained.stop();
    staging.start();
    const EpilogueParams& ep = p.epilogue;
    C::Staging::stage(acc, smem.staging, consumer,
                      [&](float v) { return C::Epilogue::transform(v, ep); });
    fence_generic_to_async();  // TMA stores read the staged tile
    Barrier::arrive(smem.staged);
    staging.stop();
    epilogue_phase ^= 1u;
    tile = next;
  }
  total.stop();
  static_assert(kProbeConsumer0 + C::kConsumers * kProbeConsumerSlots <= kProbeEpilogueTotal,
                "the consumers' probe slots");
  if (consumer_thread % kWarpgroupThreads == 0) {
    const int slot = kProbeConsumer0 + consumer * kProbeConsumerSlots;
    probe_record(p.probe, slot, total);
    probe_record(p.probe, slot + 1, wait_full);
    probe_record(p.probe, slot + 2, wait_drained);
    probe_record(p.probe, slot + 3, staging);
  }
}

// ---- epilogue warps: finish each staged tile ----
template <class C>
__device__ __forceinline__ void finish_tiles(const EngineParams& p, const SharedStorage<C>& smem,
                                             int thread) {
  const typename C::Schedule schedule(p.schedule);
  uint32_t phase = 0;
  CycleCounter total, wait_staged, finishing;
  total.start();
  for (int t = blockIdx.x; t < schedule.num_tiles(); t += gridDim.x) {
    const TileInfo tile = schedule.tile(t);
    wait_staged.start();
    Barrier::wait(smem.staged, phase);
    wait_staged.stop();
    finishing.start();
    C::Epilogue::finish(p.epilogue, tile, smem.staging, thread);
    named_barrier_sync(kEpilogueBarrier, C::Epilogue::kThreads);
    finishing.stop();
    if (thread == 0) Barrier::arrive(smem.drained);
    phase ^= 1u;
  }
  if (thread == 0) wait_stores();
  total.stop();
  if (thread == 0) {
    probe_record(p.probe, kProbeEpilogueTotal, total);
    probe_record(p.probe, kProbeEpilogueWaitStaged, wait_staged);
    probe_record(p.probe, kProbeEpilogueFinish, finishing);
  }
}

}  // namespace megamoe::kernels::engine

namespace megamoe::kernels {

template <EngineKind kKind, BFormat kFormat, int BlockM, int BlockN>
__global__ void __launch_bounds__(engine::EngineConfig<kKind, kFormat, BlockM, BlockN>::kThreads, 1)
    engine_kernel(const __grid_constant__ EngineParams p) {
  using namespace engine;
  using C = EngineConfig<kKind, kFormat, BlockM, BlockN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SharedStorage<C> smem(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      TransactionBarrier::init(&smem.full[s], 1);
      Barrier::init(&smem.empty[s], C::kConsumers * 4);  // one arrival per consumer warp
      if constexpr (C::kDecodeWarps) Barrier::init(&smem.decoded[s], C::kDecodingThreads / 32);
    }
    Barrier::init(smem.staged, C::kConsumerThreads);
    Barrier::init(smem.drained, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const bool consumer = warpgroup >= 1 && warpgroup <= C::kConsumers;
  if (warpgroup == 0) {
    if constexpr (C::kReallocate) cutlass::arch::warpgroup_reg_dealloc<C::kOtherRegisters>();
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) produce<C>(p, smem);
    } else {
      finish_tiles<C>(p, smem, threadIdx.x - 32);
    }
    return;
  }
  if constexpr (C::kDecodeWarps) {
    if (!consumer) {
      // setmaxnreg.inc below the launch's count is an illegal instruction: fewer is a dec.
      if constexpr (C::kDecodeRegisters > C::kLaunchRegisters / 3)
        cutlass::arch::warpgroup_reg_alloc<C::kDecodeRegisters>();
      else if constexpr (C::kDecodeRegisters < C::kLaunchRegisters / 3)
        cutlass::arch::warpgroup_reg_dealloc<C::kDecodeRegisters>();
      decode_stages<C>(p, smem, threadIdx.x % kWarpgroupThreads);
      return;
    }
  }
  if constexpr (C::kReallocate) cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegisters>();
  consume<C>(p, smem, warpgroup - 1);
}

template <EngineKind kKind, BFormat kFormat, int BlockM, int BlockN>
EngineKernels engine_kernels() {
  using C = engine::EngineConfig<kKind, kFormat, BlockM, BlockN>;
  return EngineKernels{&engine_kernel<kKind, kFormat, BlockM, BlockN>,
                       kKind,
                       kFormat,
                       BlockM,
                       BlockN,
                       C::kThreads,
                       C::kSmemBytes};
}

}  // namespace megamoe::kernels
