// The gated activation act(g) and act'(g) in FP32 with the fast exponential and
// reciprocal (MUFU ex2 and rcp: no IEEE division, no slow paths), shared by GEMM1's
// epilogue and dgrad2's activation-backward epilogue so that the backward's recomputed
// h is bit for bit the forward's. docs/ENGINE.md gives the error against the FP32
// formula.
#pragma once

#include <type_traits>

#include "engine_params.h"

namespace megamoe::kernels::engine {

// e^x as ex2.approx.ftz of x log2(e): __expf's product and MUFU op without the rescaling
// that keeps subnormal results (a compare and two multiplies per call). Every caller adds
// 1 to the result, and 1 + a subnormal rounds to 1, so the flush changes no caller's bits.
__device__ __forceinline__ float fast_exp_flushed(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// 1 / (1 + e^-g) with the fast exponential and reciprocal; saturates to exactly 0 and 1.
__device__ __forceinline__ float fast_sigmoid(float g) {
  return __fdividef(1.0f, 1.0f + fast_exp_flushed(-g));
}

// tanh(x) = 1 - 2 / (1 + e^2x): exact limits +-1, absolute error ~1e-7 near 0.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.0f - __fdividef(2.0f, 1.0f + fast_exp_flushed(2.0f * x));
}

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// act(g) of a compile-time kind (the epilogues dispatch once per tile).
template <bool kGeGLU>
__device__ __forceinline__ float activation(float g) {
  if constexpr (kGeGLU) return 0.5f * g * (1.0f + fast_tanh(kGeluK0 * (g + kGeluK1 * g * g * g)));
  return g * fast_sigmoid(g);
}

template <bool kGeGLU>
__device__ __forceinline__ void activation_and_derivative(float g, float& act, float& derivative) {
  if constexpr (kGeGLU) {
    const float t = fast_tanh(kGeluK0 * (g + kGeluK1 * g * g * g));
    act = 0.5f * g * (1.0f + t);
    const float sech2 = 1.0f - t * t;
    // Where tanh saturates sech2 is exactly 0 but g^2 may overflow: keep 0, not NaN.
    const float tail =
        sech2 == 0.0f ? 0.0f : 0.5f * g * sech2 * kGeluK0 * (1.0f + 3.0f * kGeluK1 * g * g);
    derivative = 0.5f * (1.0f + t) + tail;
  } else {
    const float sig = fast_sigmoid(g);
    act = g * sig;                          // the forward's h uses this very product
    derivative = sig + act * (1.0f - sig);  // sig (1 + g (1 - sig))
  }
}

// Whether a clamp is set (+inf: none).
__device__ __forceinline__ bool is_clamped(float clamp) {
  return clamp < __int_as_float(0x7f800000);
}

// `op(kGeGLU, kClamp)` with the activation's kind and clamp as std::bool_constant: the
// epilogues branch once per tile (or kernel) here, so their per-element math has none.
template <class Op>
__device__ __forceinline__ void with_activation(bool geglu, bool clamped, Op&& op) {
  if (geglu) {
    if (clamped)
      op(std::true_type{}, std::true_type{});
    else
      op(std::true_type{}, std::false_type{});
  } else if (clamped) {
    op(std::false_type{}, std::true_type{});
  } else {
    op(std::false_type{}, std::false_type{});
  }
}

}  // namespace megamoe::kernels::engine
