// The weight-streaming GEMM1's parameter block and kernel table (weight_stream_kernel.cuh),
// shared by device and host code. Plain C++ plus the driver's CUtensorMap type.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace megamoe {

// GEMM1 with an MXFP4 w13 for pools with few rows per expert, in the swapped form: the
// weights are the wgmma's A (decoded into registers), a chunk of an expert's pool rows
// its N. h = act(g) * u with g | u = [x | q1 | q3] . [w13_e ; side] as EngineKind::Gated.
struct WeightStreamParams {
  // Schedule: the pool in chunks of TOKENS rows (segments are padded to a multiple of
  // it), each chunk against every block of 128 h columns.
  const int32_t* expert_pool_offsets;  // [E + 1] segment starts; [E] = pool rows in use
  const int32_t* expert_counts;        // [E] data rows per segment
  int32_t num_experts;
  int32_t pool_rows;   // rows of the pool: a corrupt plan is clamped to them
  int32_t n_blocks;    // I / 128
  int32_t side_steps;  // gate steps then up steps, ceil(r / 64) each; 0: no side segment
  int32_t base_steps;  // H / 64
  // Operands. `pool` [P, H + 2r] BF16 K-major, box [64, TOKENS]; `codes` w13's codes 4-D
  // [E][2][I][H / 2] bytes, box [32, 128, 2, 1]; `side_gate` / `side_up` b1 and b3 as
  // given, 3-D [E][r][I], box [64 I, 64 r, 1] (the A of the side steps, MN-major).
  CUtensorMap pool;
  CUtensorMap codes;
  CUtensorMap side_gate;
  CUtensorMap side_up;
  const uint8_t* scales;  // [E][2I][H / 32] UE8M0 as stored
  int32_t k_base;         // H
  int32_t side_rank;      // r (0: no side segment)
  int32_t intermediate;   // I
  float side_scale;       // the side sum is scaled by this before the base adds on
  // Epilogue: h [P, I] BF16 and, optionally, preact [P, 2I] BF16 (g | u).
  void* h;
  void* preact;
  int32_t activation;      // Activation (engine_params.h)
  float activation_clamp;  // +inf: no clamp
};

using WeightStreamKernel = void (*)(WeightStreamParams);

struct WeightStreamKernels {
  WeightStreamKernel kernel;
  int tokens;  // pool rows per chunk (the wgmma N)
  int num_threads;
  int smem_bytes;
};

}  // namespace megamoe
