// Grouped GEMM engine: the parameter block and kernel table shared by device and
// host code. Plain C++ plus the driver's CUtensorMap type (header only, no link).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gemm_tile_constants.h"

namespace megamoe {

// Epilogues are template parameters: they change the register use of the kernel.
//  - Store: BF16 out (N segments);
//  - GatedActivation: GEMM1's act(g) * u (K side segment, optional pre-activations);
//  - ActivationBackward: dgrad2's z = dout_pool w2_e consumed in registers by the
//    activation backward (activation_backward_params.h's math): dg | du, w h and the
//    router dot's per-tile partials are written, z never is (MN-major B only).
enum class Epilogue { Store, GatedActivation, ActivationBackward };

// Layout of the B operand in global memory, a template parameter (it changes the
// TMA boxes and the wgmma descriptor):
//  - K: B_e is [N, K] K-major (nn.Linear layout: GEMM1's w13, GEMM2's w2);
//  - MN: B_e is [K, N] N-major (the same weights read transposed: the dgrads'
//    dx = dg w13_e and z = dout w2_e). Store (optionally with the N extra segment, read
//    MN-major too: dgrad1's b1/b3 shrink columns) or ActivationBackward epilogue.
enum class BMajor { K, MN };

// Storage of the base B operand, a template parameter (it changes the stage layout):
//  - BF16: loaded by TMA straight into the stage's B tile;
//  - MXFP4: E2M1 codes and UE8M0 scales (kernels/mxfp4_tile_decode.cuh) are loaded by
//    TMA into a staging area of the stage, and the consumers decode them to BF16 in the
//    stage's B tile, K-major or MN-major (Store and GatedActivation epilogues; side and
//    extra segments stay BF16).
enum class BFormat { BF16, MXFP4 };

// Activations are runtime parameters (DESIGN §2: keep the variant count small).
enum class Activation : int32_t { SwiGLU = 0, GeGLU = 1 };

// C[m, n] = sum_k A[m, k] * B_e[n, k] over the pool, e = the expert owning row m.
//
// A is the pool (rows sorted by expert, each segment padded to BLOCK_M), so every M
// tile belongs to one expert. B is K-major per expert (nn.Linear layout), flattened to
// [E * rows_per_expert, K] so one 2-D tensor map serves every expert.
//
// Segments (all optional but the base):
//  - K side segment (GatedActivation only): an extra reduction over `side_k` = 2r
//    columns, a_side = the pool's [q1 | q3] columns against b_side = the block-diagonal
//    side weights (gate rows [b1^T | 0], up rows [0 | b3^T], in w13's interleave), so it
//    is a plain full-width K segment; its sum is scaled by `side_scale` before the base
//    K loop adds on.
//  - N extra segment (Store only): `n_extra` more output columns from b_extra.
struct GroupedGemmParams {
  CUtensorMap a;        // [pool rows, k_base] BF16, box [BLOCK_M, 64]
  CUtensorMap b;        // K: [E * n_base, k_base], box [BLOCK_N, 64];
                        // MN: 3-D [E][k_base][n_base], box [1, 64, 64] (BF16)
  CUtensorMap a_side;   // [pool rows, side_k] BF16 ([q1 | q3] columns), box [BLOCK_M, 64]
  CUtensorMap b_side;   // [E * n_base, side_k] BF16 (block-diagonal), box [BLOCK_N, 64]
  CUtensorMap b_extra;  // K: [E * n_extra, k_base] BF16 (a2 transposed), box [BLOCK_N, 64];
                        // MN: 3-D [E][k_base][n_extra], box [1, 64, 64]
  // MXFP4 base B only (b is unused). K-major: the codes [E * n_base, k_base / 2] uint8,
  // box [BLOCK_N, 32] (two codes per byte, even K index in the low nibble), and the
  // scales [E * k_base / 64, n_base] uint16, box [1, BLOCK_N]: for expert e, K block kb
  // and row n, the UE8M0 bytes of K columns 64 kb .. +31 (low byte) and +32 .. +63.
  // MN-major (the weights as stored, read by the dgrads): the codes
  // [E * k_base, n_base / 2] uint8, box [64, BLOCK_N / 2], and the scales
  // [E * n_base / 32, k_base] uint8 (transposed), box [BLOCK_N / 32, 64].
  CUtensorMap b_codes;
  CUtensorMap b_scales;

  const int32_t* expert_pool_offsets;  // [E + 1] segment starts; [E] = pool rows in use
  void* out;                           // BF16 [pool rows, out_stride]
  int64_t out_stride;                  // elements between output rows
  // GatedActivation only, optional (nullptr: not stored): the BF16 pre-activations
  // [pool rows, n_base] (g and u before the clamp, in B's interleaved row order), which
  // the backward's activation derivative needs.
  void* preact_out;
  // ActivationBackward only (n_base = I, the columns of z):
  const void* preact;                // [pool rows, 2I] bf16, from GEMM1
  const float* route_weights;        // [num_routes] float32 (weights of the pool's routes)
  const int32_t* pool_row_to_route;  // [pool rows]
  int64_t num_routes;
  void* dgrad_preact;       // [pool rows, 2I] bf16 out: dg | du, interleaved
  void* weighted_h;         // [pool rows, I] bf16 out: w h, or nullptr
  float* drouter_partials;  // [pool rows, ceil(I / BLOCK_N)] float32 out
  int32_t num_experts;
  int32_t pool_rows;       // rows of A and out: the rows in use are clamped to it
  int32_t k_base;          // reduction length of the base segment
  int32_t n_base;          // output columns of the base segment (B rows per expert)
  int32_t n_extra;         // extra output columns (0: none)
  int32_t side_k;          // K of the side segment, 2r (0: none)
  float side_scale;        // scale of the side segment's sum
  int32_t activation;      // Activation (GatedActivation, ActivationBackward)
  float activation_clamp;  // +inf: no clamp
};

using GroupedGemmKernel = void (*)(GroupedGemmParams);

struct GroupedGemmKernels {
  GroupedGemmKernel kernel;
  int block_m;
  int block_n;
  int num_threads;
  int smem_bytes;
  Epilogue epilogue;
  BMajor b_major;
  BFormat b_format;
};

}  // namespace megamoe
