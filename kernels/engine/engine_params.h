// The GEMM engine's parameter blocks and kernel table, shared by device and host code.
// Plain C++ plus the driver's CUtensorMap type (header only, no link).
//
// One kernel template serves every GEMM of the layer; a variant fixes its kind (the
// tile scheduler, the operand majors and the epilogue functor), the B storage format and
// the tile shape. Each part reads only its own parameter block.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gemm_tile_constants.h"

namespace megamoe {

// The GEMMs of the layer (DESIGN §3). `pool` is the routed rows sorted by local expert,
// each expert's segment padded to BLOCK_M; A is always a pool-shaped BF16 operand.
enum class EngineKind : int32_t {
  // GEMM1: h = act([x | q1 | q3] . [w13_e ; side]) over the pool. B = w13 [E, 2I, H] as
  // given (gate rows 0..I-1, up rows I..2I-1): a tile's gate and up rows are two TMA
  // boxes. Side K segment: q1 against b1_e (as given, MN-major) for the gate half, q3
  // against b3_e for the up half. Epilogue: the pre-activations g | u and h.
  Gated,
  // out = pool . w_e^T (B K-major, nn.Linear [E, N, K]: GEMM2's w2) + an N extra segment
  // (GEMM2's a2 shrink, a2 as given, MN-major). Epilogue: store.
  StoreKMajor,
  // out = pool . w_e (B MN-major, the weights as stored [E, K, N]: dgrad1's w13) + an N
  // extra segment (dgrad1's b1/b3 shrink). Epilogue: store.
  StoreMNMajor,
  // z = [dout | s dout b2^T]_pool . [w2_e ; a2_e^T] (MN-major; the adapter term as a K
  // side segment, a2 as given, K-major), consumed by the activation backward epilogue:
  // dg | du, w h and the router-dot partials (dgrad2; z never reaches memory).
  ActivationBackward,
  // out[e] = s A_e^T B_e over each expert's data rows of two pool-shaped operands (both
  // read MN-major; the weight gradients). Epilogue: scaled store.
  KGrouped,
  // KGrouped with the sums left in FP32, out [E][M][N] float: the token sums (the shared
  // adapter factors' gradients, sums over every token), each "expert" a chunk of the
  // tokens whose FP32 partials are added outside the kernel in a fixed order.
  KGroupedFloat,
};

// Storage of the base B operand: BF16 loaded by TMA, or MXFP4 (E2M1 codes + UE8M0
// scales, kernels/mxfp4_tile_decode.cuh) decoded to BF16 in shared memory inside the
// pipeline. Side and extra segments are always BF16.
enum class BFormat : int32_t { BF16, MXFP4 };

// Runtime parameters (DESIGN §2: keep the variant count small).
enum class Activation : int32_t { SwiGLU = 0, GeGLU = 1 };

// Tile schedulers (kernels/engine/tile_scheduler.cuh).
struct ScheduleParams {
  const int32_t* expert_pool_offsets;  // [E + 1] segment starts; [E] = pool rows in use
  const int32_t* expert_counts;        // [E] data rows per segment (KGrouped only)
  int32_t num_experts;
  int32_t pool_rows;       // rows of the pool operands: a corrupt plan is clamped to them
  int32_t n_base_blocks;   // pool schedule: BLOCK_N column blocks of the base segment
  int32_t n_extra_blocks;  // pool schedule: ... of the N extra segment (0: none)
  int32_t m_blocks;        // KGrouped(Float): BLOCK_M output row blocks per expert
  int32_t group_m;         // pool schedule: M blocks of one expert walked per N sweep
  int32_t side_steps;      // pool schedule: K steps of the side segment (0: none)
  int32_t base_steps;      // pool schedule: K steps of the base segment
};

// Operand loads (kernels/engine/operand_a.cuh, operand_b.cuh). Box shapes per kind are
// in the launcher (bindings/engine_launch.cpp).
struct OperandParams {
  // Pool kinds: [P, k_base + side_k] K-major, box [64 K, BLOCK_M rows]; the side segment
  // is columns k_base.. of the same map. KGrouped: [P, M] read MN-major, box [64, 64].
  CUtensorMap a;
  // BF16 base B. Gated: 4-D [E][2][I][H], box [64, BLOCK_N / 2, 1, 1]; StoreKMajor: 3-D
  // [E][N][K], box [64, BLOCK_N, 1]; StoreMNMajor / ActivationBackward: 3-D [E][K][N],
  // box [64 N, 64 K, 1]; KGrouped: B [P, N], box [64, 64].
  CUtensorMap b;
  // K side segment, the adapter factors as given. Gated: b1 and b3, 3-D [E][r][I] read
  // MN-major, box [64 N, 64 K, 1]; ActivationBackward: a2 3-D [E][I][r] read K-major, box
  // [64 K, BLOCK_N, 1] (side_up unused).
  CUtensorMap side_gate;
  CUtensorMap side_up;
  // N extra segment. StoreKMajor: GEMM2's a2 as given, 3-D [E][K][N_x] read MN-major, box
  // [64 N, 64 K, 1]. StoreMNMajor: two K-major blocks on the diagonal (dgrad1's b1 and b3
  // shrinks as given): `extra` [E][N_lo][K_lo] over K rows 0.. K_lo and extra columns
  // 0.. N_lo, `extra_hi` [E][N_hi][K - K_lo] over the rest; box [64 K, BLOCK_N rows, 1].
  CUtensorMap extra;
  CUtensorMap extra_hi;
  int32_t extra_k_lo;  // StoreMNMajor: K_lo (a multiple of 64: a K step is in one block);
                       // StoreKMajor: K (the extra segment is one block)
  int32_t extra_n_lo;  // StoreMNMajor: N_lo
  // Bit 0 (1) when the lo block's columns lie in the first extra tile's low half (N_lo <=
  // BLOCK_N / 2; StoreKMajor: N_x <= BLOCK_N / 2), bit 1 (2) when the hi block's do too
  // (N_lo + N_hi <= BLOCK_N / 2): those steps multiply only the low half (the rest of B
  // is zero there).
  int32_t extra_low_half;
  // MXFP4 base (b unused). Codes by TMA: K-major (Gated, StoreKMajor) 4-D [E][2][I][K / 2]
  // (Gated) or 3-D [E][N][K / 2] uint8; MN-major [E * K, N / 2] uint8, box [64, BLOCK_N /
  // 2]. Scales as stored (UE8M0 bytes, read by the decoding warps from global memory):
  // K-major [E][N][K / 32] (Gated: N = 2I, gate rows then up rows), MN-major
  // [E][K][N / 32].
  CUtensorMap codes;
  const uint8_t* scales;
  int32_t k_base;     // base reduction length (a multiple of 64 for MXFP4)
  int32_t side_rank;  // Gated: r (q1 | q3 boundary of the side columns); else 0
  int32_t n_base;     // output columns of the base segment (Gated: I)
  float side_scale;   // the side segment's sum is scaled by this before the base adds on
};

// Epilogue functors (kernels/engine/epilogue_*.cuh).
struct EpilogueParams {
  // Store: out [P, n_base] (row stride out_stride), box [64, BLOCK_M]; out_extra its
  // columns n_base.. (N extra). Gated: out = h [P, I]. KGrouped: out 3-D [E][M][N],
  // box [64, BLOCK_M, 1].
  CUtensorMap out;
  CUtensorMap out_extra;
  // Gated, optional (store_preact): g and u [P, I] views of preact [P, 2I].
  CUtensorMap preact_gate;
  CUtensorMap preact_up;
  int32_t store_preact;
  // ActivationBackward (columns i < I = intermediate of z):
  const void* preact;                // [P, 2I] bf16 g | u from GEMM1
  const float* row_weights;          // [P] float32: each pool row's route weight (padding: unused)
  const int32_t* pool_row_to_route;  // [P]: the row's route, or -1 (padding)
  int64_t num_routes;
  void* dgrad_preact;       // [P, 2I] bf16 out: dg | du
  void* weighted_h;         // [P, I] bf16 out: w h, or nullptr
  float* drouter_partials;  // [P, ceil(I / BLOCK_N)] float32 out
  int32_t intermediate;
  int32_t activation;      // Activation (Gated, ActivationBackward)
  float activation_clamp;  // +inf: no clamp
  float scale;             // KGrouped: applied to the FP32 sum before the one rounding
};

// Diagnostic builds (MEGAMOE_ENGINE_PROBE): the role cycle counters of one CTA
// (kernels/engine/role_probe.cuh); the producer, consumer warpgroup c at kProbeConsumer0 +
// c * kProbeConsumerSlots, the epilogue warps.
enum ProbeSlot : int {
  kProbeProducerTotal = 0,
  kProbeProducerWaitEmpty = 1,
  kProbeConsumer0 = 2,  // + 0 total, + 1 waiting on `full`, + 2 on `drained`, + 3 staging
  kProbeConsumerSlots = 4,
  kProbeEpilogueTotal = 10,
  kProbeEpilogueWaitStaged = 11,
  kProbeEpilogueFinish = 12,
  kProbeSlots = 16,  // per CTA (tools/engine_role_probe.py reads this layout)
};

struct EngineParams {
  ScheduleParams schedule;
  OperandParams operands;
  EpilogueParams epilogue;
  // Diagnostic builds (MEGAMOE_ENGINE_PROBE): [grid][kProbeSlots] role cycle counters;
  // nullptr otherwise.
  uint64_t* probe;
};

using EngineKernel = void (*)(EngineParams);

struct EngineKernels {
  EngineKernel kernel;
  EngineKind kind;
  BFormat b_format;
  int block_m;
  int block_n;
  int num_threads;
  int smem_bytes;
};

}  // namespace megamoe
