// The activation backward of one BF16 pair (two adjacent columns of a pool row), shared
// by the engine's dgrad2 epilogue (epilogue_activation_backward.cuh) and the streaming
// dgrad2 (weight_stream_kernel.cuh), so that the two give the same bits. With g, u the
// forward's BF16 pre-activations, gc, uc their clamped values and w the route's weight:
//   h = bf16(act(gc) uc)                    (the forward's h, bit for bit)
//   dg = w z uc act'(gc), du = w z act(gc)   (0 where the clamp cut; boundaries pass)
//   w h; and the row's router dot, advanced by z h over the pair's two columns in column
//   order (router_dot_add: both epilogues sum a row's dot in the same order).
#pragma once

#include <cstdint>

#include "activation_math.cuh"
#include "staging_tile.cuh"

namespace megamoe::kernels::engine {

struct ActivationBackwardPair {
  uint32_t dg, du, weighted_h, h;  // BF16 pairs
};

template <bool kGeGLU, bool kClamp>
__device__ __forceinline__ ActivationBackwardPair
activation_backward_pair(uint32_t z_pair, uint32_t g_pair, uint32_t u_pair, float w, float clamp) {
  float dg2[2], du2[2], prod2[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float z = bf16_bits_to_float(z_pair, c);
    const float g = bf16_bits_to_float(g_pair, c);
    const float u = bf16_bits_to_float(u_pair, c);
    const float gc = kClamp ? fminf(g, clamp) : g;
    const float uc = kClamp ? fminf(fmaxf(u, -clamp), clamp) : u;
    float act, derivative;
    activation_and_derivative<kGeGLU>(gc, act, derivative);
    const float dh = w * z;
    // Boundary values pass the gradient, like torch.clamp's.
    dg2[c] = !kClamp || g <= clamp ? dh * uc * derivative : 0.0f;
    du2[c] = !kClamp || (u >= -clamp && u <= clamp) ? dh * act : 0.0f;
    prod2[c] = act * uc;
  }
  // h = bf16(act(gc) uc), the forward's h bit for bit; both of the pair at once.
  const uint32_t h_pair = pack_bf16(prod2[0], prod2[1]);
  const float h0 = bf16_bits_to_float(h_pair, 0), h1 = bf16_bits_to_float(h_pair, 1);
  return {pack_bf16(dg2[0], dg2[1]), pack_bf16(du2[0], du2[1]), pack_bf16(w * h0, w * h1), h_pair};
}

// dot += z_0 h_0, then += z_1 h_1 (two FMAs, in this order).
__device__ __forceinline__ void router_dot_add(float& dot, uint32_t z_pair, uint32_t h_pair) {
  dot += bf16_bits_to_float(z_pair, 0) * bf16_bits_to_float(h_pair, 0);
  dot += bf16_bits_to_float(z_pair, 1) * bf16_bits_to_float(h_pair, 1);
}

}  // namespace megamoe::kernels::engine
