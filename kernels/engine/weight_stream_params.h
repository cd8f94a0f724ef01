// The weight-streaming GEMMs' parameter block and kernel table (weight_stream_kernel.cuh),
// shared by device and host code. Plain C++ plus the driver's CUtensorMap type.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace megamoe {

// The GEMMs with an MXFP4 base for pools with few rows per expert, in the swapped form:
// the weights are the wgmma's A (decoded into registers), a chunk of an expert's pool
// rows its N.
enum class StreamKind : int32_t {
  // GEMM1: h = act(g) * u, g | u = [x | q1 | q3] . [w13_e ; side] (EngineKind::Gated).
  Gated,
  // GEMM2: out = h . [w2_e^T | a2_e] (EngineKind::StoreKMajor with its N extra segment).
  Store,
  // dgrad1: out = a . [b_e | blockdiag(lo_e^T, hi_e^T)], b as stored [K][N] (quantized
  // along N), the extra blocks K-major as given (EngineKind::StoreMNMajor with its extra
  // blocks): (dg | du) . [w13_e | (b1_e^T, b3_e^T)].
  StoreMN,
  // dgrad2: z = [dout | s dout b2^T] . [w2_e ; a2_e^T], w2 as stored [H][I / 2] (quantized
  // along I), a2 as given [E, I, r], with the activation backward as the epilogue
  // (EngineKind::ActivationBackward with its side segment).
  ActivationBackward,
};

// Chunks of more than 64 rows (the wide form) start at each expert's segment start, so
// the pool's segments need not be padded to them; chunks of 32 and 64 rows tile the pool
// from row 0 (segments padded to a multiple).
constexpr bool stream_chunks_from_segment_starts(int tokens) { return tokens > 64; }
// Pool rows per TMA box: a wide chunk loads only the rows its MMAs read (its data rows
// rounded up to its MMA width, StreamConfig::MmaWidths), in boxes of 64.
constexpr int kStreamWideRowsPerBox = 64;
constexpr int stream_pool_box_rows(int tokens) {
  return stream_chunks_from_segment_starts(tokens) ? kStreamWideRowsPerBox : tokens;
}
// Chunks of 192 and 256 rows hold one m64 weight tile per consumer warpgroup (their N / 2
// accumulators leave no room for a second); narrower chunks hold two.
constexpr bool stream_one_tile(int tokens) { return tokens >= 192; }

struct WeightStreamParams {
  // Schedule: the pool in chunks of TOKENS rows, each chunk against every column block
  // (Gated: 128 h columns, 64 in 192- and 256-row chunks; Store: 256 output columns, 128
  // in 192- and 256-row chunks, then the extra columns' blocks).
  const int32_t* expert_pool_offsets;  // [E + 1] segment starts; [E] = pool rows in use
  const int32_t* expert_counts;        // [E] data rows per segment
  int32_t num_experts;
  int32_t pool_rows;       // rows of the pool: a corrupt plan is clamped to them
  int32_t n_base_blocks;   // Gated: I / columns; Store: N / columns (WeightStreamKernels)
  int32_t n_extra_blocks;  // Store: extra columns' blocks (1 in the narrow form); StoreMN:
                           // 1 with the shrinks; else 0
  int32_t segment_steps;   // Gated: side steps; Store: an extra tile's steps (0: none)
  int32_t segment_half;    // segment steps into the first accumulator half
  int32_t base_steps;      // K / 64
  // Operands. `pool` [P, cols] BF16 K-major, box [64, stream_pool_box_rows]. `codes`:
  // Gated w13's 4-D [E][2][I][K / 2], box [32, columns, 2, 1]; Store w2's 3-D [E][N][K /
  // 2], box [32, columns, 1]; StoreMN b's 3-D [E][K][N / 2], box [128, 64, 1], swizzled.
  // Segment factors as given, box [64, 64, 1], the A of the segment steps: MN-major for
  // Gated b1 (`segment_lo`) and b3 (`segment_hi`) 3-D [E][r][I] and Store a2
  // (`segment_lo`) 3-D [E][K][N_x]; K-major for StoreMN lo [E][N_lo][K_lo] and hi
  // [E][N_hi][K - K_lo], and for ActivationBackward a2 [E][I][r] as 5-D views whose box
  // rows follow the transposed column order (`segment_lo` tile 0's columns, `segment_hi`
  // tile 1's).
  CUtensorMap pool;
  CUtensorMap codes;
  CUtensorMap segment_lo;
  CUtensorMap segment_hi;
  const uint8_t* scales;     // [E][weight_rows][K / 32] UE8M0 as stored (StoreMN: [E][K][N / 32])
  int32_t k_base;            // K
  int32_t side_rank;         // Gated: r (the q1 | q3 boundary of the pool's side columns)
  int32_t weight_rows;       // rows of one expert's weight: Gated 2I, Store N, StoreMN K
  int32_t half_rows;         // row offset of a tile's second half (Gated: of the up rows):
                             // Gated I, Store 128 (narrow form)
  float side_scale;          // Gated: the side sum is scaled by this before the base adds on
  int32_t segment_k_hi;      // StoreMN: K_lo, the pool column of hi's first step
  int32_t extra_lo_columns;  // StoreMN: N_lo (hi's columns follow them)
  // Epilogue: Gated: h [P, I] and, optionally, preact [P, 2I] (g | u), BF16; Store and
  // StoreMN: out [P, N + N_x] BF16; ActivationBackward: preact g | u in, out dg | du [P,
  // 2I] (may be preact: each element is read, then written, by one thread).
  void* out;
  void* preact;
  int32_t out_columns;     // columns (and row stride) of `out`; ActivationBackward: I
  int32_t activation;      // Activation (engine_params.h)
  float activation_clamp;  // +inf: no clamp
  // ActivationBackward: each pool row's route (-1: padding) and weight, w h [P, I] BF16
  // (null: not wanted) and the router dot's partials [P, I / 256] FP32.
  const int32_t* pool_row_to_route;
  const float* row_weights;
  int32_t num_routes;
  void* weighted_h;
  float* drouter_partials;
};

using WeightStreamKernel = void (*)(WeightStreamParams);

struct WeightStreamKernels {
  WeightStreamKernel kernel;
  StreamKind kind;
  int tokens;   // pool rows per chunk (the wgmma N)
  int columns;  // output columns of a base tile (Gated: h columns)
  int num_threads;
  int smem_bytes;
};

}  // namespace megamoe
