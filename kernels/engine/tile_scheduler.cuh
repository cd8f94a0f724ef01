// Tile schedulers: which output tile a persistent CTA computes next, and its K steps.
//
// Every role of a CTA (producer, consumers, epilogue warps) walks the same static
// sequence tile = blockIdx.x, blockIdx.x + gridDim.x, ... and asks the scheduler for the
// tile's coordinates, so the roles agree without messages. A corrupt plan (offsets that
// decrease or leave the pool) is clamped: no tile reads or writes past the pool.
#pragma once

#include <cstdint>

#include "engine_params.h"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

struct TileInfo {
  int expert;
  int m_block;     // PoolTiles: pool row block; ExpertRowTiles: output row block of the expert
  int n_block;     // BLOCK_N column block, counted over the base then the extra segment
  bool extra;      // the tile is in the N extra segment
  int n_local;     // its column block inside its segment (base or extra)
  int row0;        // first pool row the tile reads (and, PoolTiles, writes)
  int rows;        // ExpertRowTiles: the expert's data rows (the reduction)
  int k_steps;     // 64-wide K steps
  int side_steps;  // of which the first ones are the K side segment
};

// The pool's tiles, grouped inside one expert for L2: an expert's M blocks are walked in
// groups of `group_m`, and inside a group M runs fastest, so the CTAs of one wave share a
// few of the expert's weight column blocks (B) and a few row blocks (A) instead of one
// A block against every B block.
template <int BlockM>
struct PoolTiles {
  const ScheduleParams& p;
  int rows_used, m_blocks, n_blocks;

  __device__ __forceinline__ explicit PoolTiles(const ScheduleParams& params)
      : p(params),
        rows_used(
            min(max(__ldg(params.expert_pool_offsets + params.num_experts), 0), params.pool_rows)),
        m_blocks(rows_used / BlockM),
        n_blocks(params.n_base_blocks + params.n_extra_blocks) {}

  __device__ __forceinline__ int num_tiles() const { return m_blocks * n_blocks; }

  // First M block of expert e's segment (clamped to the rows in use), e in [0, E].
  __device__ __forceinline__ int first_block(int e) const {
    return min(max(__ldg(p.expert_pool_offsets + e), 0), rows_used) / BlockM;
  }

  __device__ __forceinline__ TileInfo tile(int t) const {
    // The expert owning tile t: the last e whose first tile is <= t (binary search; an
    // empty expert's zero-length range is skipped by the <=).
    int lo = 0, hi = p.num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_block(mid) * n_blocks <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int expert = lo;
    const int first = first_block(expert);
    // offsets has E + 1 entries: first_block(E) is the end of the rows in use.
    const int expert_blocks = max(first_block(expert + 1) - first, 0);
    const int local = max(t - first * n_blocks, 0);
    const int group = local / (p.group_m * n_blocks);
    const int group_blocks = min(max(expert_blocks - group * p.group_m, 1), p.group_m);
    const int in_group = local - group * p.group_m * n_blocks;
    TileInfo info;
    info.expert = expert;
    info.m_block = min(first + group * p.group_m + in_group % group_blocks, m_blocks - 1);
    info.n_block = min(in_group / group_blocks, n_blocks - 1);
    info.extra = info.n_block >= p.n_base_blocks;
    info.n_local = info.extra ? info.n_block - p.n_base_blocks : info.n_block;
    info.row0 = info.m_block * BlockM;
    info.rows = BlockM;
    info.side_steps = info.extra ? 0 : p.side_steps;
    info.k_steps = info.side_steps + p.base_steps;
    return info;
  }
};

// The K-grouped weight gradient's tiles: (expert, M block, N block) of out[e] = A_e^T B_e,
// expert-major with N fastest, each reducing over the expert's data rows in 64-row steps
// (the last step's rows past the data are masked by the consumers).
template <int BlockM, int BlockN>
struct ExpertRowTiles {
  const ScheduleParams& p;

  __device__ __forceinline__ explicit ExpertRowTiles(const ScheduleParams& params) : p(params) {}

  __device__ __forceinline__ int num_tiles() const {
    return p.num_experts * p.m_blocks * p.n_base_blocks;
  }

  __device__ __forceinline__ TileInfo tile(int t) const {
    const int per_expert = p.m_blocks * p.n_base_blocks;
    TileInfo info;
    info.expert = t / per_expert;
    const int in_expert = t % per_expert;
    info.m_block = in_expert / p.n_base_blocks;
    info.n_block = in_expert % p.n_base_blocks;
    info.extra = false;
    info.n_local = info.n_block;
    // The expert's data rows, clamped to its segment and to the pool, so a corrupt plan
    // can neither read another expert's rows nor walk past the pool.
    const int start = min(max(__ldg(p.expert_pool_offsets + info.expert), 0), p.pool_rows);
    const int end = min(max(__ldg(p.expert_pool_offsets + info.expert + 1), start), p.pool_rows);
    info.row0 = start;
    info.rows = max(0, min(__ldg(p.expert_counts + info.expert), end - start));
    info.k_steps = (info.rows + kBlockK - 1) / kBlockK;
    info.side_steps = 0;
    return info;
  }

  // Data rows in K step `step` (64 but in the last one).
  __device__ __forceinline__ static int rows_in_step(const TileInfo& info, int step) {
    return min(kBlockK, info.rows - step * kBlockK);
  }
};

}  // namespace megamoe::kernels::engine
