// The weight-streaming GEMM1's epilogue from registers: g | u rounded to BF16, then the
// gated activation (activation_math.cuh), as the engine's gated epilogue.
#pragma once

#include <cuda_bf16.h>

#include "activation_math.cuh"
#include "weight_stream_config.cuh"
#include "weight_stream_mma.cuh"

namespace megamoe::kernels::engine {

// Gated: g and u rounded to BF16 (stored as g | u when asked), then h = act(min(g, c)) *
// clamp(u, -c, c) in FP32, rounded once, as the engine's gated epilogue. The outputs'
// places are read once per tile (read per element, they cost the 64-row kernel a spill).
template <bool kGeGLU, bool kClamp>
struct GatedOutputs {
  __nv_bfloat16* h;
  __nv_bfloat16* preact;
  int64_t inter;
  float clamp;
  __device__ __forceinline__ explicit GatedOutputs(const WeightStreamParams& p)
      : h(static_cast<__nv_bfloat16*>(p.out)),
        preact(static_cast<__nv_bfloat16*>(p.preact)),
        inter(p.out_columns),
        clamp(p.activation_clamp) {}
  __device__ __forceinline__ void element(int64_t pool_row, int64_t column, float gate,
                                          float up) const {
    const __nv_bfloat16 g = __float2bfloat16_rn(gate);
    const __nv_bfloat16 u = __float2bfloat16_rn(up);
    if (preact != nullptr) {
      preact[pool_row * 2 * inter + column] = g;
      preact[pool_row * 2 * inter + inter + column] = u;
    }
    const float gf = __bfloat162float(g), uf = __bfloat162float(u);
    const float gc = kClamp ? fminf(gf, clamp) : gf;
    const float uc = kClamp ? fminf(fmaxf(uf, -clamp), clamp) : uf;
    h[pool_row * inter + column] = __float2bfloat16_rn(activation<kGeGLU>(gc) * uc);
  }
};

// Two tiles: accumulator i of half 0 is g, of half 1 u, at h column n0 + 64 consumer +
// row_of(i). One tile: accumulator i is g (i % 4 < 2) or u (i + 2) of h column n0 + 32
// consumer + 8 warp + lane / 4. A wide chunk's rows past its span are not written.
template <int Halves, int Tokens, bool kGeGLU, bool kClamp>
__device__ __forceinline__ void gated_epilogue(const WeightStreamParams& p, const StreamTile& tile,
                                               const float (&acc)[Halves][Tokens / 2], int consumer,
                                               int thread) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const StreamFragmentRows<Tokens> at(thread);
  const GatedOutputs<kGeGLU, kClamp> outputs(p);
  if constexpr (Halves == 2) {
#pragma unroll
    for (int i = 0; i < Tokens / 2; ++i)
      if (!kSpan || at.token(i) < tile.span)
        outputs.element(tile.row0 + at.token(i), tile.n0 + 64 * consumer + at.row_of(i), acc[0][i],
                        acc[1][i]);
  } else {
    const int64_t column = tile.n0 + 32 * consumer + 8 * (thread / 32) + at.lane / 4;
#pragma unroll
    for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (at.token(i + e) < tile.span)
          outputs.element(tile.row0 + at.token(i + e), column, acc[0][i + e], acc[0][i + e + 2]);
  }
}

// GEMM1's epilogue (StreamEpilogue): the activation's kind and clamp read once per kernel.
template <class C>
struct StreamGatedEpilogue {
  bool clamped, geglu;
  __device__ __forceinline__ StreamGatedEpilogue(const WeightStreamParams& p,
                                                 const StreamStorage<C>&)
      : clamped(is_clamped(p.activation_clamp)),
        geglu(p.activation == static_cast<int>(Activation::GeGLU)) {}
  __device__ __forceinline__ void finish(const WeightStreamParams& p, const StreamTile& tile,
                                         const float (&acc)[C::kHalves][C::kTokensPerChunk / 2],
                                         int consumer, int thread) const {
    with_activation(geglu, clamped, [&](auto kGeGLU, auto kClamp) {
      gated_epilogue<C::kHalves, C::kTokensPerChunk, decltype(kGeGLU)::value,
                     decltype(kClamp)::value>(p, tile, acc, consumer, thread);
    });
  }
};

}  // namespace megamoe::kernels::engine
