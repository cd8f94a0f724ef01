// Activation backward: the parameter block and kernel table shared by device and host
// code. Plain C++ (no device code) so the host launcher can include it.
#pragma once

#include <cstdint>

namespace megamoe {

// Threads per block of the activation backward: 8 warps, one pool row per warp.
constexpr int kActivationBackwardThreads = 256;
// The gate/up interleave of w13's rows the kernel indexes with (the host launcher
// asserts it equals the registry's gate_up_interleave).
constexpr int kActivationBackwardInterleave = 64;

// Per pool row (one route, weight w = route_weights[route]), columns i < I:
//   z   (dgrad2's output, the adapter term included)  unweighted dL/dh (DESIGN §1)
//   g,u = preact gate/up (BF16, before the clamp); gc, uc = clamped
//   h   = bf16(act(gc) * uc)                        exactly the forward's h
//   dg  = bf16(w z uc act'(gc)),  du = bf16(w z act(gc))   (0 where the clamp cut)
//   drouter[row] = sum_i z_i h_i   (FP32, fixed order)      router gradient <z, h>
//   weighted_h   = bf16(w h)       (the wgrads of a2 and w2 contract over it)
// preact and dgrad_preact use w13's interleave: per 64 columns of I, 64 gate columns
// then the matching 64 up columns. Padding rows (route -1) below the rows in use get
// zeros; rows at or past the rows in use are not touched.
struct ActivationBackwardParams {
  const void* preact;  // [pool_capacity, 2I] bf16
  const void* z;       // [pool_capacity, I] bf16: [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T]
  const float* route_weights;        // [num_routes] float32 (topk_weights, flat t*K+k)
  const int32_t* pool_row_to_route;  // [pool_capacity]
  const int32_t* pool_rows_used;     // &expert_pool_offsets[E_l]: read on the device
  void* dgrad_preact;                // [pool_capacity, 2I] bf16 out: dg | du, interleaved
  void* weighted_h;                  // [pool_capacity, I] bf16 out, or nullptr
  float* drouter;                    // [pool_capacity] float32 out
  int64_t pool_capacity;
  int64_t num_routes;
  int32_t intermediate;    // I, a multiple of the 64-column interleave
  int32_t activation;      // Activation (0 SwiGLU, 1 GeGLU)
  float activation_clamp;  // +inf: no clamp
};

using ActivationBackwardKernel = void (*)(ActivationBackwardParams);

struct ActivationBackwardKernels {
  ActivationBackwardKernel kernel;
};

}  // namespace megamoe
