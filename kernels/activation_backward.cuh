// Activation backward over the expert pool: act' of the gated activation, the clamp
// mask, the router-gradient dot product and the route weighting, in one pass over a
// pool row (see activation_backward_params.h for the exact math).
//
// Memory-bound (reads 2I + I BF16, writes 2I + I BF16 per row): one warp per pool
// row, lanes stride the row in 8-column (16-byte) vectors. The dot product is summed
// per lane in column order, then by a fixed butterfly: deterministic.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "activation_backward_params.h"
#include "gated_activation_math.cuh"
#include "grouped_gemm_params.h"

namespace megamoe::kernels {

namespace act_bwd {

constexpr int kVectorElems = 8;                             // BF16 per 16-byte vector
constexpr int kInterleave = kActivationBackwardInterleave;  // gate/up interleave of w13
constexpr int kVectorsPerBlock = kInterleave / kVectorElems;

struct Vec8 {
  float v[kVectorElems];
};

__device__ __forceinline__ Vec8 load8(const void* base, int64_t vec) {
  const uint4 raw = __ldg(static_cast<const uint4*>(base) + vec);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  Vec8 out;
#pragma unroll
  for (int i = 0; i < kVectorElems / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out.v[2 * i] = f.x;
    out.v[2 * i + 1] = f.y;
  }
  return out;
}

__device__ __forceinline__ void store8(void* base, int64_t vec, const Vec8& values) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kVectorElems / 2; ++i)
    pairs[i] = __floats2bfloat162_rn(values.v[2 * i], values.v[2 * i + 1]);
  static_cast<uint4*>(base)[vec] = raw;
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

using act_math::activation_and_derivative;

}  // namespace act_bwd

// Templated only so that the translation unit including this header owns the
// instantiation (a plain __global__ in a header would clash between units).
template <int kUnused>
__global__ void __launch_bounds__(kActivationBackwardThreads)
    activation_backward_rows(ActivationBackwardParams p) {
  using namespace act_bwd;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  // Clamped so that a corrupt plan can never make this kernel write past the pool.
  const int64_t rows_used =
      min(max(static_cast<int64_t>(__ldg(p.pool_rows_used)), int64_t{0}), p.pool_capacity);
  const int vecs = p.intermediate / kVectorElems;  // vectors of an I-wide row
  const float clamp = p.activation_clamp;

  for (int64_t row = warp; row < rows_used; row += num_warps) {
    const int32_t route = __ldg(p.pool_row_to_route + row);
    // Out-of-range routes (only a corrupt plan has them) are padding.
    const bool routed = route >= 0 && route < p.num_routes;
    const float weight = routed ? __ldg(p.route_weights + route) : 0.0f;
    float dot = 0.0f;
    for (int v = lane; v < vecs; v += 32) {
      // Vector v covers columns 8v..8v+7 of I: in the interleaved rows its gate vector
      // is (block, v % 8) and its up vector 8 vectors further.
      const int block = v / kVectorsPerBlock;
      const int64_t gate_vec =
          row * (2 * vecs) + block * 2 * kVectorsPerBlock + v % kVectorsPerBlock;
      const int64_t up_vec = gate_vec + kVectorsPerBlock;
      const int64_t i_vec = row * vecs + v;
      Vec8 dgate, dup, weighted;
      if (!routed) {
#pragma unroll
        for (int i = 0; i < kVectorElems; ++i) dgate.v[i] = dup.v[i] = weighted.v[i] = 0.0f;
      } else {
        const Vec8 gate = load8(p.preact, gate_vec);
        const Vec8 up = load8(p.preact, up_vec);
        const Vec8 z = load8(p.z, i_vec);
#pragma unroll
        for (int i = 0; i < kVectorElems; ++i) {
          const float gc = fminf(gate.v[i], clamp);
          const float uc = fminf(fmaxf(up.v[i], -clamp), clamp);
          float act, derivative;
          activation_and_derivative(gc, p.activation, act, derivative);
          const float h = round_bf16(act * uc);
          dot += z.v[i] * h;
          const float dh = weight * z.v[i];
          // Boundary values pass the gradient, like torch.clamp's.
          const bool gate_pass = gate.v[i] <= clamp;
          const bool up_pass = up.v[i] >= -clamp && up.v[i] <= clamp;
          dgate.v[i] = gate_pass ? dh * uc * derivative : 0.0f;
          dup.v[i] = up_pass ? dh * act : 0.0f;
          weighted.v[i] = weight * h;
        }
      }
      store8(p.dgrad_preact, gate_vec, dgate);
      store8(p.dgrad_preact, up_vec, dup);
      if (p.weighted_h != nullptr) store8(p.weighted_h, i_vec, weighted);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) p.drouter[row] = routed ? dot : 0.0f;
  }
}

inline ActivationBackwardKernels activation_backward_kernels() {
  return ActivationBackwardKernels{&activation_backward_rows<0>};
}

}  // namespace megamoe::kernels
