// B-operand policies: what the producer loads into a stage's B tile for a K step, how
// the consumers turn it into the BF16 tile wgmma reads (the MXFP4 decode), and the
// major of each segment's tile (which wgmma descriptor reads it).
//
// Stage layout of the B part: the BF16 tile [BLOCK_N x 64] (K-major rows, or MN-major
// boxes of [64 K][64 N]). An MXFP4 step's codes land in their own area after it, so
// each decoding thread reads its codes and writes its chunks with no barrier among the
// decoding threads (the 64-row MXFP4 stage still fits four times). The decoding threads
// read the scales from global memory in the layout the caller holds them in
// (`scale_offset` once per tile, plus `scale_step` per step): one byte per 32 values, a
// step ahead of their use, so no per-call transposed copy of the scales exists.
//
// Side and extra segments are BF16 in every format and are read in the layout the caller
// holds them in (the adapter factors as given, no transposed copy), which is the other
// major from the base's in GEMM1, GEMM2 and dgrad2: each policy names the major of each
// segment and the consumers pick the wgmma flavour per segment (engine_kernel.cuh).
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "engine_params.h"
#include "mxfp4_tile_decode.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "wgmma.cuh"

namespace megamoe::kernels::engine {

template <int BlockN, BFormat kFormat>
struct OperandBLayout {
  static constexpr bool kMxfp4 = kFormat == BFormat::MXFP4;
  static constexpr int kTileBytes = BlockN * kRowBytes;
  // Codes of one K step: 32 bytes per row (K-major) = 32 K rows x 128 bytes (MN-major).
  static constexpr int kCodeBytes = BlockN * mxfp4::kCodeBytesPerRow;
  static constexpr int kCodeOffset = kTileBytes;
  static constexpr int kBytes = kTileBytes + (kMxfp4 ? kCodeBytes : 0);
  // What TMA delivers for one K step's B: codes if the step decodes, else a BF16 tile.
  __device__ __forceinline__ static constexpr int step_bytes(bool decodes) {
    return decodes ? kCodeBytes : kTileBytes;
  }
  // A unit's scale byte in the caller's tensor (`scale_offset` at the first base step,
  // plus `scale_step` per base step), or 127 (2^0) for a row or column block past the
  // weight's end (-1), whose codes TMA zero-filled (any scale decodes them to zeros).
  __device__ __forceinline__ static uint32_t scale_at(const uint8_t* scales, int32_t offset,
                                                      int32_t shift) {
    return offset >= 0 ? static_cast<uint32_t>(__ldg(scales + offset + shift)) : 127u;
  }
  // `boxes` [64 K rows][64 N] boxes of a 3-D map [E][K][N], side by side along N from
  // box `first` of the tile (the MN-major tile layout).
  __device__ __forceinline__ static void load_mn_boxes(const CUtensorMap* map, uint64_t* bar,
                                                       uint8_t* dst, int first, int boxes, int n0,
                                                       int k0, int expert) {
    for (int box = 0; box < boxes; ++box)
      cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint, dst + (first + box) * kBoxBytes,
                                   n0 + 64 * box, k0, expert);
  }
};

// GEMM1's w13 [E, 2I, H] as given: a tile's BLOCK_N rows are BLOCK_N / 2 gate rows
// (i0 ..) then the matching up rows (I + i0 ..), two boxes of one 4-D map
// [E][gate|up][I][H] (rows past I zero-fill). Side steps, MN-major: the gate half reads
// b1 [E][r][I] as given at K = k', the up half b3 at K = k' - r, both through TMA's zero
// fill outside [0, r): the [q1 | q3] side columns meet [b1 | 0] and [0 | b3].
template <int BlockN, BFormat kFormat>
struct GatedOperandB : OperandBLayout<BlockN, kFormat> {
  using L = OperandBLayout<BlockN, kFormat>;
  static constexpr bool kMNMajor = false;
  static constexpr bool kSideMNMajor = true;
  static constexpr bool kExtraMNMajor = false;  // no extra segment
  static constexpr int kHalf = BlockN / 2;

  __device__ __forceinline__ static bool decodes(const TileInfo& tile, int step) {
    return L::kMxfp4 && step >= tile.side_steps;
  }

  // Tile row `row`'s 32-column half `half`: its scale's offset at the first base step in
  // w13's scales [E][2I][K / 32] (gate rows, then up rows), -1 past I; 2 bytes per step.
  __device__ __forceinline__ static int32_t scale_offset(const OperandParams& p,
                                                         const TileInfo& tile, int row, int half) {
    const int i = tile.n_block * kHalf + row % kHalf;
    const int stored_row = (tile.expert * 2 + row / kHalf) * p.n_base + i;
    return i < p.n_base ? stored_row * (p.k_base / 32) + half : -1;
  }
  __device__ __forceinline__ static int32_t scale_step(const OperandParams&) { return 2; }

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
    const int i0 = tile.n_block * kHalf;
    if (step < tile.side_steps) {
      const int k = step * kBlockK;
      L::load_mn_boxes(&p.side_gate, bar, dst, 0, kHalf / 64, i0, k, tile.expert);
      L::load_mn_boxes(&p.side_up, bar, dst, kHalf / 64, kHalf / 64, i0, k - p.side_rank,
                       tile.expert);
      return;
    }
    const int k0 = (step - tile.side_steps) * kBlockK;
    if constexpr (L::kMxfp4) {
      uint8_t* codes = dst + L::kCodeOffset;
#pragma unroll
      for (int half = 0; half < 2; ++half)
        cute::SM90_TMA_LOAD_4D::copy(&p.codes, bar, kCacheHint,
                                     codes + half * kHalf * mxfp4::kCodeBytesPerRow, k0 / 2, i0,
                                     half, tile.expert);
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        cute::SM90_TMA_LOAD_4D::copy(&p.b, bar, kCacheHint, dst + half * kHalf * kRowBytes, k0, i0,
                                     half, tile.expert);
    }
  }
};

// GEMM2's w2 [E, H, I] (nn.Linear, K-major): one [BLOCK_N rows][64] box of a 3-D map
// [E][N][K]. N extra tiles, MN-major: the extra segment as given (a2 [E][I][r] = [E][K]
// [N_x]) in [64 K][64 N] boxes.
template <int BlockN, BFormat kFormat>
struct KMajorOperandB : OperandBLayout<BlockN, kFormat> {
  using L = OperandBLayout<BlockN, kFormat>;
  static constexpr bool kMNMajor = false;
  static constexpr bool kSideMNMajor = false;  // no side segment
  static constexpr bool kExtraMNMajor = true;

  __device__ __forceinline__ static bool decodes(const TileInfo& tile, int) {
    return L::kMxfp4 && !tile.extra;
  }

  // Tile row `row`'s 32-column half `half`: its scale's offset at K step 0 in [E][N][K /
  // 32], -1 past N; 2 bytes per step.
  __device__ __forceinline__ static int32_t scale_offset(const OperandParams& p,
                                                         const TileInfo& tile, int row, int half) {
    const int n = tile.n_block * BlockN + row;
    return n < p.n_base ? (tile.expert * p.n_base + n) * (p.k_base / 32) + half : -1;
  }
  __device__ __forceinline__ static int32_t scale_step(const OperandParams&) { return 2; }

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
    const int k0 = step * kBlockK;
    if (tile.extra) {
      L::load_mn_boxes(&p.extra, bar, dst, 0, BlockN / 64, tile.n_local * BlockN, k0, tile.expert);
      return;
    }
    const int n0 = tile.n_block * BlockN;
    if constexpr (L::kMxfp4) {
      cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, dst + L::kCodeOffset, k0 / 2, n0,
                                   tile.expert);
    } else {
      cute::SM90_TMA_LOAD_3D::copy(&p.b, bar, kCacheHint, dst, k0, n0, tile.expert);
    }
  }
};

// The weights as stored, read MN-major (the dgrads: dgrad1's w13 [E, 2I, H], dgrad2's w2
// [E, H, I]): BLOCK_N / 64 boxes of [64 K rows][64 N] from a 3-D map [E][K][N] (K rows
// past an expert's end zero-fill). N extra tiles, K-major: dgrad1's b1/b3 shrinks as
// given, the blocks of [[b1_e^T, 0], [0, b3_e^T]], one [BLOCK_N rows][64] box per step
// from the block its K rows fall in; the block's map zero-fills the tile rows outside
// it (rows past N_lo of `extra`, negative rows of `extra_hi`), so the zero blocks are
// never stored. Side steps, K-major: dgrad2's a2 as given ([E][I][r] = [E][N][K]) in one
// [BLOCK_N rows][64] box.
template <int BlockN, BFormat kFormat>
struct MNMajorOperandB : OperandBLayout<BlockN, kFormat> {
  using L = OperandBLayout<BlockN, kFormat>;
  static constexpr bool kMNMajor = true;
  static constexpr bool kSideMNMajor = false;
  static constexpr bool kExtraMNMajor = false;
  static constexpr int kBoxes = BlockN / 64;

  __device__ __forceinline__ static bool decodes(const TileInfo& tile, int step) {
    return L::kMxfp4 && !tile.extra && step >= tile.side_steps;
  }

  // K row `k_row`, N block `n_block` (of 32) of the tile: its scale's offset at the first
  // base step in [E][K][N / 32], -1 past N; a step is 64 K rows.
  __device__ __forceinline__ static int32_t scale_offset(const OperandParams& p,
                                                         const TileInfo& tile, int k_row,
                                                         int n_block) {
    const int block = tile.n_block * (BlockN / 32) + n_block, blocks = p.n_base / 32;
    return block < blocks ? (tile.expert * p.k_base + k_row) * blocks + block : -1;
  }
  __device__ __forceinline__ static int32_t scale_step(const OperandParams& p) {
    return kBlockK * (p.n_base / 32);
  }

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
    if (step < tile.side_steps) {
      cute::SM90_TMA_LOAD_3D::copy(&p.side_gate, bar, kCacheHint, dst, step * kBlockK,
                                   tile.n_block * BlockN, tile.expert);
      return;
    }
    const int k0 = (step - tile.side_steps) * kBlockK;
    if (tile.extra) {
      const int n0 = tile.n_local * BlockN;
      if (k0 < p.extra_k_lo)
        cute::SM90_TMA_LOAD_3D::copy(&p.extra, bar, kCacheHint, dst, k0, n0, tile.expert);
      else
        cute::SM90_TMA_LOAD_3D::copy(&p.extra_hi, bar, kCacheHint, dst, k0 - p.extra_k_lo,
                                     n0 - p.extra_n_lo, tile.expert);
      return;
    }
    const int n0 = tile.n_block * BlockN;
    if constexpr (L::kMxfp4) {
      // Codes [E * K, N / 2]: this expert's 64 K rows (K is a multiple of 64).
      cute::SM90_TMA_LOAD_2D::copy(&p.codes, bar, kCacheHint, dst + L::kCodeOffset, n0 / 2,
                                   tile.expert * p.k_base + k0);
    } else {
      L::load_mn_boxes(&p.b, bar, dst, 0, kBoxes, n0, k0, tile.expert);
    }
  }
};

// The K-grouped weight gradient's B: 64 pool rows of BLOCK_N columns per K step,
// BLOCK_N / 64 boxes of [64 rows][64 columns], read MN-major.
template <int BlockN>
struct RowsOperandB : OperandBLayout<BlockN, BFormat::BF16> {
  using L = OperandBLayout<BlockN, BFormat::BF16>;
  static constexpr bool kMNMajor = true;
  static constexpr bool kSideMNMajor = true;  // no side or extra segment
  static constexpr bool kExtraMNMajor = true;
  static constexpr int kBoxes = BlockN / 64;

  __device__ __forceinline__ static bool decodes(const TileInfo&, int) { return false; }

  __device__ __forceinline__ static void load(const OperandParams& p, const TileInfo& tile,
                                              int step, uint8_t* dst, uint64_t* bar) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box)
      cute::SM90_TMA_LOAD_2D::copy(&p.b, bar, kCacheHint, dst + box * kBoxBytes,
                                   tile.n_block * BlockN + 64 * box, tile.row0 + step * kBlockK);
  }
};

}  // namespace megamoe::kernels::engine
