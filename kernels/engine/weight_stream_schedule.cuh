// The weight-streaming GEMMs' tile scheduler (weight_stream_kernel.cuh): which pool
// chunk and column block each persistent CTA runs, in an order every role walks alike,
// and the MMA widths of the wide chunks.
#pragma once

#include <utility>

#include "weight_stream_params.h"

namespace megamoe::kernels::engine {

// ---- schedule: every base tile (TOKENS-row pool chunk, column block; column blocks
// fastest), then the extra tiles (Store: its extra blocks per chunk). The persistent CTAs
// take tiles round-robin, so the extra tiles (segment steps only, no decode, cheaper than
// a base tile) land first on the CTAs with one base tile fewer. ----
struct StreamTile {
  int expert;
  int row0;    // first pool row of the chunk
  int rows;    // the chunk's data rows (0: padding only, written as zeros, nothing loaded)
  int span;    // the chunk's rows in its segment, the rows written (TOKENS but at a wide
               // chunk's segment end; rows past it are the next expert's)
  int n0;      // first output column (an extra tile: the extra columns' first)
  bool extra;  // Store: the tile of the extra columns (segment steps only)
};

template <int Tokens, int Columns>
struct StreamTiles {
  // Wide chunks start at each segment's start: segments are padded to BLOCK_M only.
  static constexpr bool kFromSegmentStarts = stream_chunks_from_segment_starts(Tokens);
  const WeightStreamParams& p;
  int rows_used, chunks;

  __device__ __forceinline__ explicit StreamTiles(const WeightStreamParams& params)
      : p(params),
        rows_used(
            min(max(__ldg(params.expert_pool_offsets + params.num_experts), 0), params.pool_rows)),
        chunks(kFromSegmentStarts ? segment_chunks_in_use() : rows_used / Tokens) {}

  __device__ __forceinline__ int blocks() const { return p.n_base_blocks + p.n_extra_blocks; }
  __device__ __forceinline__ int num_tiles() const { return chunks * blocks(); }

  __device__ __forceinline__ int start(int e) const {
    return min(max(__ldg(p.expert_pool_offsets + e), 0), rows_used);
  }
  __device__ __forceinline__ int end(int e) const { return max(start(e + 1), start(e)); }
  __device__ __forceinline__ int chunks_of(int e) const {
    return e < p.num_experts ? (end(e) - start(e) + Tokens - 1) / Tokens : 0;
  }

  // Wide chunks: the experts' chunk counts summed a warp at a time (32 experts a round).
  // Every lane of the warp calls it and gets the same count.
  __device__ __forceinline__ int segment_chunks_in_use() const {
    const int lane = threadIdx.x % 32;
    int total = 0;
    for (int e0 = 0; e0 < p.num_experts; e0 += 32)
      total += static_cast<int>(__reduce_add_sync(0xffffffffu, chunks_of(e0 + lane)));
    return total;
  }

  // Wide chunks: chunk c's expert (the first whose running chunk count passes c) and first
  // row, from an inclusive scan of 32 experts' counts a round. Warp-uniform.
  __device__ __forceinline__ void locate(int c, int& expert, int& row0) const {
    const int lane = threadIdx.x % 32;
    int before = 0;  // the chunks of the rounds before
    for (int e0 = 0; e0 < p.num_experts; e0 += 32) {
      const int own = chunks_of(e0 + lane);
      int running = own;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, running, d);
        if (lane >= d) running += v;
      }
      const uint32_t past = __ballot_sync(0xffffffffu, before + running > c);
      if (past != 0u) {
        const int l = __ffs(static_cast<int>(past)) - 1;
        expert = e0 + l;
        row0 = start(expert) + (c - before - __shfl_sync(0xffffffffu, running - own, l)) * Tokens;
        return;
      }
      before += __shfl_sync(0xffffffffu, running, 31);
    }
    expert = p.num_experts - 1;  // not reached for c < chunks
    row0 = rows_used;
  }

  __device__ __forceinline__ StreamTile tile(int t) const {
    const int base_tiles = chunks * p.n_base_blocks;
    StreamTile info;
    info.extra = t >= base_tiles;
    int chunk, block;
    if (!info.extra) {
      chunk = t / p.n_base_blocks;
      block = t - chunk * p.n_base_blocks;
    } else if constexpr (kFromSegmentStarts) {
      chunk = (t - base_tiles) / p.n_extra_blocks;
      block = p.n_base_blocks + (t - base_tiles - chunk * p.n_extra_blocks);
    } else {  // one extra block
      chunk = t - base_tiles;
      block = p.n_base_blocks;
    }
    info.n0 = block * Columns;
    if constexpr (kFromSegmentStarts) {
      locate(chunk, info.expert, info.row0);
    } else {
      info.row0 = chunk * Tokens;
      // The expert whose segment holds the chunk: the last e starting at or before it.
      int lo = 0, hi = p.num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start(mid) <= info.row0)
          lo = mid;
        else
          hi = mid - 1;
      }
      info.expert = lo;
    }
    const int first = start(info.expert), end_row = end(info.expert);
    info.span = kFromSegmentStarts ? min(end_row - info.row0, Tokens) : Tokens;
    const int data_end = min(first + max(__ldg(p.expert_counts + info.expert), 0), end_row);
    info.rows = min(max(data_end - info.row0, 0), Tokens);
    return info;
  }
};

// The wide form's MMA widths (StreamConfig::MmaWidths): a 128-row chunk's data rows
// rounded up to 64 or 128; a 192- or 256-row chunk always as wide as the chunk. The
// tile's loop is instantiated per width, and ptxas serialized the wgmma of the 256-row
// kernels with more than one width (also 192 and 256, and 192 as a 128- and a 64-wide
// MMA), and of the 128-row kernels with widths 32 and 96, for registers: a chunk of 192
// rows is its own kernel (docs/ENGINE.md, "192-row chunks").
using StreamWideWidths128 = std::integer_sequence<int, 64, 128>;
using StreamWideWidths192 = std::integer_sequence<int, 192>;
using StreamWideWidths256 = std::integer_sequence<int, 256>;

// The width for `rows` data rows: the first of Widths that holds them, else the last.
template <int... Widths>
__host__ __device__ constexpr int stream_wide_width(int rows,
                                                    std::integer_sequence<int, Widths...>) {
  constexpr int widths[] = {Widths...};
  for (int width : widths)
    if (rows <= width) return width;
  return widths[sizeof...(Widths) - 1];
}
static_assert(stream_wide_width(1, StreamWideWidths128{}) == 64 &&
                  stream_wide_width(65, StreamWideWidths128{}) == 128 &&
                  stream_wide_width(1, StreamWideWidths192{}) == 192 &&
                  stream_wide_width(1, StreamWideWidths256{}) == 256,
              "a chunk's rows round up to the next width");

}  // namespace megamoe::kernels::engine
