// The weight-streaming GEMMs' store epilogues from registers: GEMM2's (Store) and
// dgrad1's (StoreMN, the transposed map, with the b1/b3 shrink's extra tiles).
#pragma once

#include <cuda_bf16.h>

#include "global_access.cuh"
#include "staging_tile.cuh"
#include "weight_stream_config.cuh"
#include "weight_stream_mma.cuh"

namespace megamoe::kernels::engine {

// Store: the sums rounded to BF16, columns past the output's (an extra tile's block past
// N_x) not stored. Two tiles: half 1's columns are 128 on. A wide chunk's rows past its
// span are not written.
template <int Halves, int Tokens>
__device__ __forceinline__ void store_epilogue(const WeightStreamParams& p, const StreamTile& tile,
                                               const float (&acc)[Halves][Tokens / 2], int consumer,
                                               int thread) {
  const StreamFragmentRows<Tokens> at(thread);
  const int64_t columns = p.out_columns;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
  for (int i = 0; i < Tokens / 2; ++i) {
    const int64_t column = tile.n0 + 64 * consumer + at.row_of(i);
    const int64_t pool_row = tile.row0 + at.token(i);
    if (stream_chunks_from_segment_starts(Tokens) && at.token(i) >= tile.span) continue;
#pragma unroll
    for (int half = 0; half < Halves; ++half)
      if (column + 128 * half < columns)
        out[pool_row * columns + column + 128 * half] = __float2bfloat16_rn(acc[half][i]);
  }
}

// StoreMN: a base tile's accumulator i of tile T (acc_lo: T = 0) is fragment row g (i %
// 4 < 2) or g + 8 of the thread's warp, i.e. column 4q + 2T + (i % 4) / 2 of its
// consumer's 128 (q = 8 warp + g, decode_column_pairs): a thread's four columns of a
// chunk row are adjacent, and go out as one 8-byte store (a warp then writes whole
// sectors; one 2-byte store per column wrote each sector in four partial pieces). An
// extra tile's accumulator is A row r = 64 consumer + 16 warp + g (+ 8) of lo (T = 0:
// columns from N on, below N_lo) or of hi (from N + N_lo on, below N_hi), stored per
// column.
template <int Tokens>
__device__ __forceinline__ void transposed_store_epilogue(const WeightStreamParams& p,
                                                          const StreamTile& tile,
                                                          const float (&acc_lo)[Tokens / 2],
                                                          const float (&acc_hi)[Tokens / 2],
                                                          int consumer, int thread) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const StreamFragmentRows<Tokens> at(thread);
  const bool extra = tile.extra;
  const int64_t columns = p.out_columns;
  const int lo_columns = p.extra_lo_columns;
  const int hi_columns = static_cast<int>(columns) - tile.n0 - lo_columns;
  const int row = 64 * consumer + at.row;  // an extra tile's A row of fragment row g
  // A base tile's first column, or an extra tile's column of fragment row g.
  const int first =
      extra ? tile.n0 + row : tile.n0 + 128 * consumer + 32 * (thread / 32) + 4 * (at.lane / 4);
  bool lo_in[2], hi_in[2];
#pragma unroll
  for (int high = 0; high < 2; ++high) {
    lo_in[high] = extra && row + 8 * high < lo_columns;
    hi_in[high] = extra && row + 8 * high < hi_columns;
  }
  __nv_bfloat16* out =
      static_cast<__nv_bfloat16*>(p.out) + (tile.row0 + 2 * (at.lane % 4)) * columns + first;
#pragma unroll
  for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int low = i + odd;  // fragment row g; low + 2: row g + 8
      // A wide chunk writes its segment's rows only (past its span: the next expert's).
      const bool in = !kSpan || at.token(low) < tile.span;
      __nv_bfloat16* at_row = out + (8 * (i / 4) + odd) * columns;
      const uint2 v = make_uint2(pack_bf16(acc_lo[low], acc_lo[low + 2]),
                                 pack_bf16(acc_hi[low], acc_hi[low + 2]));
      store_global_8_if(in && !extra, at_row, v);
      store_global_2_if(in && lo_in[0], at_row, static_cast<uint16_t>(v.x));
      store_global_2_if(in && lo_in[1], at_row + 8, static_cast<uint16_t>(v.x >> 16));
      store_global_2_if(in && hi_in[0], at_row + lo_columns, static_cast<uint16_t>(v.y));
      store_global_2_if(in && hi_in[1], at_row + lo_columns + 8, static_cast<uint16_t>(v.y >> 16));
    }
}

// One-tile StoreMN (192- and 256-row chunks): a base tile's accumulator i is fragment row
// g (i % 4 < 2) or g + 8 of consumer c's tile, the low or high code of byte 2q + c (q = 8
// warp + g), i.e. column 4q + 2c + (i % 4) / 2 of the tile's 128: a thread's two columns
// of a chunk row are adjacent, one 4-byte store (a warp's stores of a row cover half of
// each 32-byte sector, the other consumer's warp the rest). An extra tile is lo's (block
// 0: columns from N on, below N_lo) or hi's (block 1: from N + N_lo on, below N_hi), its
// accumulator A row r = 64 c + 16 warp + g (+ 8), stored per column.
template <int Tokens, int Columns>
__device__ __forceinline__ void transposed_store_epilogue_one_tile(const WeightStreamParams& p,
                                                                   const StreamTile& tile,
                                                                   const float (&acc)[Tokens / 2],
                                                                   int consumer, int thread) {
  const StreamFragmentRows<Tokens> at(thread);
  const bool extra = tile.extra;
  const int64_t columns = p.out_columns;
  const int n_base = p.n_base_blocks * Columns;
  const bool hi = stream_extra_tile_is_hi<Columns>(p, tile);
  const int block_columns =
      hi ? static_cast<int>(columns) - n_base - p.extra_lo_columns : p.extra_lo_columns;
  const int row = 64 * consumer + at.row;  // an extra tile's A row of fragment row g
  // A base tile's first column, or an extra tile's column of fragment row g.
  const int first = extra ? n_base + (hi ? p.extra_lo_columns : 0) + row
                          : tile.n0 + 32 * (thread / 32) + 4 * (at.lane / 4) + 2 * consumer;
  bool extra_in[2];
#pragma unroll
  for (int high = 0; high < 2; ++high) extra_in[high] = extra && row + 8 * high < block_columns;
  __nv_bfloat16* out =
      static_cast<__nv_bfloat16*>(p.out) + (tile.row0 + 2 * (at.lane % 4)) * columns + first;
#pragma unroll
  for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      const int low = i + odd;  // fragment row g; low + 2: row g + 8
      // A wide chunk writes its segment's rows only (past its span: the next expert's).
      const bool in = at.token(low) < tile.span;
      __nv_bfloat16* at_row = out + (8 * (i / 4) + odd) * columns;
      const uint32_t v = pack_bf16(acc[low], acc[low + 2]);
      store_global_4_if(in && !extra, at_row, v);
      store_global_2_if(in && extra_in[0], at_row, static_cast<uint16_t>(v));
      store_global_2_if(in && extra_in[1], at_row + 8, static_cast<uint16_t>(v >> 16));
    }
}

// GEMM2's epilogue (StreamEpilogue).
template <class C>
struct StreamStoreEpilogue {
  __device__ __forceinline__ StreamStoreEpilogue(const WeightStreamParams&,
                                                 const StreamStorage<C>&) {}
  __device__ __forceinline__ void finish(const WeightStreamParams& p, const StreamTile& tile,
                                         const float (&acc)[C::kHalves][C::kTokensPerChunk / 2],
                                         int consumer, int thread) const {
    store_epilogue<C::kHalves, C::kTokensPerChunk>(p, tile, acc, consumer, thread);
  }
};

// dgrad1's epilogue (StreamEpilogue): two tiles or one.
template <class C>
struct StreamTransposedStoreEpilogue {
  __device__ __forceinline__ StreamTransposedStoreEpilogue(const WeightStreamParams&,
                                                           const StreamStorage<C>&) {}
  __device__ __forceinline__ void finish(const WeightStreamParams& p, const StreamTile& tile,
                                         const float (&acc)[C::kHalves][C::kTokensPerChunk / 2],
                                         int consumer, int thread) const {
    if constexpr (C::kOneTile)
      transposed_store_epilogue_one_tile<C::kTokensPerChunk, C::kColumns>(p, tile, acc[0], consumer,
                                                                          thread);
    else
      transposed_store_epilogue<C::kTokensPerChunk>(p, tile, acc[0], acc[1], consumer, thread);
  }
};

}  // namespace megamoe::kernels::engine
