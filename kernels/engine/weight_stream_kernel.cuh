// The weight-streaming GEMMs (an MXFP4 base, few pool rows per expert): the swapped
// form of the engine's forward kinds, where the weights are the wgmma's A operand,
// decoded from their codes straight into the A-fragment registers (fragment_decode.cuh),
// and a chunk of an expert's pool rows is its N (TOKENS = 32 or 64; also 128, 192 and 256:
// the wide form, chunks from each segment's start, StreamConfig::kWide; 128-row chunks
// decode and multiply a step's two m64 tiles one at a time, 192- and 256-row chunks hold
// one m64 weight tile per consumer warpgroup). No decoded tile passes through shared
// memory, and every consumer warp decodes: the decode's integer work, which bounds an
// MXFP4 GEMM when each weight meets few rows, spreads over all four schedulers. Four kinds
// (StreamKind):
//  - Gated (GEMM1): a tile is 128 h columns, the gate rows and the up rows of w13 as the
//    two halves of each step's codes; K side steps (b1, then b3, as given) before the
//    base; the gated activation;
//  - Store (GEMM2): a tile is 256 output columns of w2, two 128-row halves; extra tiles
//    over the a2 shrink's columns (a2 as given); a plain store;
//  - StoreMN (dgrad1): the weights as stored, [K][N / 2] codes, read transposed: a tile is
//    256 output columns (128 per consumer, its two m64 tiles on the even and odd bytes:
//    decode_column_pairs; one tile: 128, consumer c's tile on the bytes of parity c), 64
//    stored rows a step; extra tiles over the two K-major blocks (b1's columns over dg,
//    then b3's over du, as given; one tile: an extra tile for each); a plain store;
//  - ActivationBackward (dgrad2): w2 as stored, read transposed as StoreMN does; the a2
//    side's K steps first (a2 as given, its rows boxed in the transposed column order);
//    the activation backward, with the router dot summed in the engine's order (32- to
//    128-row chunks).
//
// Warp roles (384 threads):
//  - producer (warpgroup 0): one thread issues the TMA loads into a ring stage, per base
//    step the step's codes of the tile's two halves ([2][128][32] bytes) and the chunk's
//    [TOKENS][64] pool tile, per segment step (GEMM1's side, GEMM2's extra) one [64][64]
//    BF16 box of the adapter factor per consumer warpgroup and the pool tile; all 128
//    threads write each base step's scale words (the tile's 256 rows' factors) into
//    the stage, from loads issued a few steps ahead;
//  - consumers (warpgroups 1 and 2, 64 rows of each half): per base step, read their
//    rows' codes and scale words, decode both halves' fragments into one of two register
//    buffers while the previous step's MMAs run, then issue the step's MMAs (register A)
//    as one batch (128-row chunks: each tile decoded into its own buffer and its MMAs
//    committed as a batch of their own, while the other tile's run); segment
//    steps are shared-memory wgmma (the factor read MN-major); then the epilogue from
//    registers.
// Contract: `full` completes when the stage's TMA bytes landed and every producer thread
// arrived after writing its words; `empty` when every consumer thread arrived after the
// MMAs that read the stage retired (pipeline.cuh). The producer and the consumers walk
// the same tiles and steps.
//
// The epilogues write from registers every row of every chunk in use, padding rows too,
// as the engine writes its whole tiles: the pool's padding rows are zeros, so theirs are
// exact zeros and the outputs are the engine's bits on every row in use.
//
// Parts (one header each): weight_stream_schedule.cuh (the tiles), weight_stream_config.cuh
// (StreamConfig, the ring's shared memory), weight_stream_producer.cuh (the producer
// warpgroup), weight_stream_operand_a.cuh (the consumers' decode into A fragments),
// weight_stream_mma.cuh (the MMAs and the accumulators' layout), and the epilogues
// weight_stream_epilogue_{gated,store,activation_backward}.cuh; this file holds the
// consumers' main loop and the kernel.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>

#include "weight_stream_config.cuh"
#include "weight_stream_epilogue_activation_backward.cuh"
#include "weight_stream_epilogue_gated.cuh"
#include "weight_stream_epilogue_store.cuh"
#include "weight_stream_mma.cuh"
#include "weight_stream_operand_a.cuh"
#include "weight_stream_producer.cuh"

namespace megamoe::kernels::engine {

// ---- the epilogue of each kind: one functor (weight_stream_epilogue_*.cuh), one line ----
template <StreamKind kKind, class C>
struct StreamEpilogueOf;
template <class C>
struct StreamEpilogueOf<StreamKind::Gated, C> {
  using type = StreamGatedEpilogue<C>;
};
template <class C>
struct StreamEpilogueOf<StreamKind::Store, C> {
  using type = StreamStoreEpilogue<C>;
};
template <class C>
struct StreamEpilogueOf<StreamKind::StoreMN, C> {
  using type = StreamTransposedStoreEpilogue<C>;
};
template <class C>
struct StreamEpilogueOf<StreamKind::ActivationBackward, C> {
  using type = StreamActivationBackwardEpilogue<C>;
};
template <class C>
using StreamEpilogue = typename StreamEpilogueOf<C::kStreamKind, C>::type;

// ---- consumers ----
template <class C>
__device__ __forceinline__ void stream_consume(const WeightStreamParams& p,
                                               const StreamStorage<C>& smem, int consumer) {
  constexpr int kTokens = C::kTokensPerChunk;
  constexpr int kHalves = C::kHalves;
  using Mma = StreamMma<kTokens, !C::kTransposed>;
  const typename C::Schedule schedule(p);
  const int thread = threadIdx.x % kWarpgroupThreads;
  // The tile's halves (Gated: g and u; one tile: g and u in rows r and r + 8).
  float acc[kHalves][kTokens / 2];
  Fragment fragments[2][kHalves];  // [buffer][half]
  StreamRing<C> ring(smem);
  StreamEpilogue<C> epilogue(p, smem);
  auto finish = [&](const StreamTile& tile) { epilogue.finish(p, tile, acc, consumer, thread); };
  auto fence_all_accumulators = [&] {
#pragma unroll
    for (int half = 0; half < kHalves; ++half) fence_accumulators(acc[half]);
  };
  const int num_tiles = schedule.num_tiles();
  int t = blockIdx.x;
  StreamTile tile = t < num_tiles ? schedule.tile(t) : StreamTile{};
  for (; t < num_tiles; t += gridDim.x) {
    // The next tile's lookup (a search over the experts' offsets: dependent loads) runs
    // while this tile's last batch does.
    auto next_tile = [&] {
      return t + static_cast<int>(gridDim.x) < num_tiles ? schedule.tile(t + gridDim.x) : tile;
    };
#pragma unroll
    for (int half = 0; half < kHalves; ++half)
#pragma unroll
      for (int i = 0; i < kTokens / 2; ++i) acc[half][i] = 0.0f;
    fence_all_accumulators();
    if (tile.rows == 0) {  // padding only: its (zero) pool rows give exact zeros
      finish(tile);
      tile = next_tile();
      continue;
    }
    if constexpr (C::kActivation) prefetch_preact_tile<kTokens>(p, tile, consumer, thread);
    const int2 segment = stream_segment_steps<C>(p, tile);
    const int base_steps = C::kSegmentEveryTile || !tile.extra ? p.base_steps : 0;
    // After a step's batch: the previous step's batch retired, its stage (empty barrier
    // `previous`, 0 before the tile's first step) goes back to the producer.
    // Every consumer thread releases the stage itself: the producer rewrites its scale
    // words with plain stores, so each thread's loads must precede that thread's release.
    uint32_t previous = 0;
    auto retire_previous = [&] {
      cute::warpgroup_wait<1>();
      if (previous != 0) arrive_barrier(previous);
      previous = ring.empty();
    };
    // The tile's steps, their MMAs by `ops` (a StreamMma): Tokens wide, or (wide form) as
    // wide as the chunk's data rows rounded up to one of C::MmaWidths, the whole loop
    // instantiated per width (with the width chosen per step, ptxas serialized the wide
    // GEMM1's wgmma for registers).
    auto main_loop = [&](auto ops) {
      auto run_segment = [&](float* sums, int first, int last) {
        for (int step = first; step < last; ++step) {
          wait_barrier(ring.full, ring.phase);
          cute::warpgroup_arrive();
          const uint32_t box = ring.a() + consumer * kBoxBytes;
          const uint64_t desc_a =
              C::kTransposed ? descriptor_k_major(box) : descriptor_mn_major(box);
          const uint64_t desc_b = descriptor_k_major(ring.b());
          ops.side_step(desc_a, desc_b, sums);
          cute::warpgroup_commit_batch();
          retire_previous();
          ring.advance();
        }
      };
      // The one-tile Gated side steps (side_rows_fragment), register MMAs into the m64 tile
      // from one fragment, each retired before the next step: a few steps a tile, and with
      // their batches left in flight ptxas serialized every wgmma of the 256-row kernel for
      // want of registers.
      auto run_side_rows = [&](auto up_rows, int first, int last) {
        const uint32_t lane_offset = stream_column_lane_offset(threadIdx.x);
        Fragment fragment;
        for (int step = first; step < last; ++step) {
          wait_barrier(ring.full, ring.phase);
          side_rows_fragment<decltype(up_rows)::value>(ring.a(), lane_offset, fragment);
          fence_fragment(fragment);
          cute::warpgroup_arrive();
          const uint64_t desc_b = descriptor_k_major(ring.b());
          ops.base_half_step(fragment, desc_b, acc[0]);
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
          retire_previous();
          ring.advance();
        }
      };
      if (segment.y > segment.x) {
        if constexpr (C::kOneTile && C::kGated) {
          run_side_rows(std::false_type{}, 0, p.segment_half);
          run_side_rows(std::true_type{}, p.segment_half, segment.y);
        } else if constexpr (C::kExtraTilePerBlock) {
          run_segment(acc[0], segment.x, segment.y);
        } else {
          run_segment(acc[0], 0, p.segment_half);
          run_segment(acc[kHalves - 1], p.segment_half, segment.y);
        }
        if constexpr (C::kGated) {
          // The side sums are complete: scale them before the base adds on (FP32, exact
          // adapter term as in the engine). The wait also retires the side steps' fragments.
          cute::warpgroup_wait<0>();
          fence_all_accumulators();
#pragma unroll
          for (int half = 0; half < kHalves; ++half)
#pragma unroll
            for (int i = 0; i < kTokens / 2; ++i) acc[half][i] *= p.side_scale;
          fence_all_accumulators();
        }
      }
      const StreamOperandA<C> lines(threadIdx.x);
      // A base step: the halves' fragments decoded, then their MMAs as one batch. The
      // fragments alternate between two buffers (by step parity): a buffer is rewritten
      // only after the batch that read it retired, which the step between guarantees (one
      // batch in flight), so a step's decode overlaps the previous step's MMAs.
      auto base_step = [&](Fragment(&halves)[kHalves]) {
        wait_barrier(ring.full, ring.phase);
        lines.decode(ring.a(), ring.scale_words(), halves);
        // Written out, not as loops over the halves: the loops cost the narrow kernels six
        // uniform moves a step (SASS).
        fence_fragment(halves[0]);
        if constexpr (kHalves == 2) fence_fragment(halves[1]);
        cute::warpgroup_arrive();
        const uint64_t desc_b = descriptor_k_major(ring.b());
        ops.base_half_step(halves[0], desc_b, acc[0]);
        if constexpr (kHalves == 2) ops.base_half_step(halves[1], desc_b, acc[1]);
        cute::warpgroup_commit_batch();
        retire_previous();
        ring.advance();
      };
      // 128-row chunks: a step's two tiles decoded and multiplied one at a time, each
      // tile's batch committed on its own. A tile's decode overlaps the other tile's batch,
      // and one fragment buffer per tile suffices (32 registers beside the 128
      // accumulators; with the narrow form's two step buffers ptxas serialized every
      // wgmma, C7511). After tile 0's batch, the wait retires the previous step's batches
      // (its stage goes back); after tile 1's, tile 0's (its buffer is rewritten next).
      int k_step = 0;
      if constexpr (C::kTilesOneAtATime) {
        auto tile_batch = [&](Fragment& tile_fragment, uint64_t desc_b,
                              float (&sums)[kTokens / 2]) {
          fence_fragment(tile_fragment);
          cute::warpgroup_arrive();
          ops.base_half_step(tile_fragment, desc_b, sums);
          cute::warpgroup_commit_batch();
        };
        auto base_step_by_tiles = [&](Fragment(&tiles)[2]) {
          wait_barrier(ring.full, ring.phase);
          if constexpr (C::kTransposed) {
            uint32_t words[8], row_pairs[8];
            lines.load(ring.a(), ring.scale_words(), words, row_pairs);
            const mxfp4::StepScales<8> scales(words);
            const uint64_t desc_b = descriptor_k_major(ring.b());
            mxfp4::decode_column_pair_tile<0>(row_pairs, scales, tiles[0]);
            tile_batch(tiles[0], desc_b, acc[0]);
            retire_previous();
            mxfp4::decode_column_pair_tile<1>(row_pairs, scales, tiles[1]);
            tile_batch(tiles[1], desc_b, acc[1]);
          } else {  // a half's lines are loaded when it is decoded: fewer registers held
            const uint64_t desc_b = descriptor_k_major(ring.b());
            lines.template decode_half<0>(ring.a(), ring.scale_words(), tiles[0]);
            tile_batch(tiles[0], desc_b, acc[0]);
            retire_previous();
            lines.template decode_half<1>(ring.a(), ring.scale_words(), tiles[1]);
            tile_batch(tiles[1], desc_b, acc[1]);
          }
          cute::warpgroup_wait<1>();
          ring.advance();
        };
        for (; k_step < base_steps; ++k_step) base_step_by_tiles(fragments[0]);
      } else {
        for (; k_step + 1 < base_steps; k_step += 2) {
          base_step(fragments[0]);
          base_step(fragments[1]);
        }
        if (k_step < base_steps) base_step(fragments[0]);
      }
    };
    if constexpr (C::kWide)
      with_mma_width<kTokens>(tile.rows, typename C::MmaWidths{}, [&](auto n) {
        main_loop(StreamMma<decltype(n)::value, !C::kTransposed>{});
      });
    else
      main_loop(Mma{});
    const StreamTile next = next_tile();
    cute::warpgroup_wait<0>();
    fence_all_accumulators();
    arrive_barrier(previous);
    finish(tile);
    tile = next;
  }
}

}  // namespace megamoe::kernels::engine

namespace megamoe::kernels {

template <StreamKind kKind, int Tokens>
__global__ void __launch_bounds__(engine::StreamConfig<kKind, Tokens>::kThreads, 1)
    weight_stream_kernel(const __grid_constant__ WeightStreamParams p) {
  using namespace engine;
  using C = engine::StreamConfig<kKind, Tokens>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const StreamStorage<C> smem(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      // The copies' thread (with the byte count), then every producer thread's words.
      TransactionBarrier::init(&smem.full[s], 1 + kWarpgroupThreads);
      Barrier::init(&smem.empty[s], C::kConsumers * kWarpgroupThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegisters>();
    stream_produce<C>(p, smem, threadIdx.x);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegisters>();
  stream_consume<C>(p, smem, warpgroup - 1);
}

template <StreamKind kKind, int Tokens>
WeightStreamKernels weight_stream_kernels() {
  using C = engine::StreamConfig<kKind, Tokens>;
  return WeightStreamKernels{
      &weight_stream_kernel<kKind, Tokens>, kKind, Tokens, C::kColumns, C::kThreads, C::kSmemBytes};
}

}  // namespace megamoe::kernels
