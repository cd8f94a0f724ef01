// The gated activation's act(g) and act'(g) in FP32, shared by the activation-backward
// kernel and the grouped GEMM's activation-backward epilogue (same expressions as the
// forward epilogue's act, so a recomputed h is bit-identical to the forward's).
#pragma once

#include "grouped_gemm_params.h"

namespace megamoe::kernels::act_math {

__device__ __forceinline__ void activation_and_derivative(float g, int activation, float& act,
                                                          float& derivative) {
  if (activation == static_cast<int>(Activation::GeGLU)) {
    constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;
    const float t = tanhf(k0 * (g + k1 * g * g * g));
    act = 0.5f * g * (1.0f + t);
    const float sech2 = 1.0f - t * t;
    // Where tanh saturates sech2 is exactly 0 but g^2 may overflow: keep 0, not NaN.
    const float tail = sech2 == 0.0f ? 0.0f : 0.5f * g * sech2 * k0 * (1.0f + 3.0f * k1 * g * g);
    derivative = 0.5f * (1.0f + t) + tail;
  } else {
    act = g / (1.0f + expf(-g));
    const float sig = 1.0f / (1.0f + expf(-g));
    derivative = sig * (1.0f + g * (1.0f - sig));
  }
}

}  // namespace megamoe::kernels::act_math
