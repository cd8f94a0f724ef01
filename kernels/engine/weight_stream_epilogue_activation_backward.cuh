// The weight-streaming dgrad2's epilogue from registers: the activation backward
// (activation_backward_math.cuh) into dg | du and w h, and the router dot's partials in
// the engine's summation order.
#pragma once

#include <cuda_bf16.h>

#include "activation_backward_math.cuh"
#include "global_access.cuh"
#include "weight_stream_config.cuh"
#include "weight_stream_mma.cuh"

namespace megamoe::kernels::engine {

// dgrad2 (ActivationBackward): a thread's four accumulators of a chunk row are z at its
// four adjacent columns 4q .. 4q + 3 of its consumer's 128 (StoreMN's map), rounded to
// BF16 once as the engine stages z; then per pair of columns the activation backward
// (activation_backward_math.cuh), read from and written to g | u / dg | du with one 8-byte
// access each. The router dot of a row's 256 columns is summed in the engine's order:
// each 8-column vector sequentially (the even-g lane's four columns, then its odd
// neighbour's, which restarts its chain from the even lane's sum), then the tile's 32
// vector sums as the engine's butterfly (v + v ^ 16, then ^ 8, ...), through shared
// memory `dots` (this tile's buffer), one thread per chunk row, after both consumers
// wrote theirs (named barrier 1).

// dgrad2: the tile's g | u (Tokens rows, 256 columns of each half: eight 128-byte lines a
// row), asked of L2 when its main loop starts, so that the epilogue's loads a main loop
// later meet L2's latency rather than DRAM's (the weights' stream evicts them from L2
// between the forward that wrote them and this GEMM).
template <int Tokens>
__device__ __forceinline__ void prefetch_preact_tile(const WeightStreamParams& p,
                                                     const StreamTile& tile, int consumer,
                                                     int thread) {
  const int64_t inter = p.out_columns;
  const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
  // An opaque copy of the thread: derived from it once, ptxas kept the lines' places
  // through the tile loop and spilled them.
  const int self = static_cast<int>(opaque(static_cast<uint32_t>(thread)));
#pragma unroll
  for (int k = 0; k < Tokens / 32; ++k) {
    const int line = 256 * k + 128 * consumer + self;  // of the tile's 8 x Tokens
    // A wide chunk's rows past its segment are not its own.
    if (stream_chunks_from_segment_starts(Tokens) && line / 8 >= tile.span) break;
    const int64_t row = tile.row0 + line / 8;
    const int64_t column = (line / 4 % 2) * inter + tile.n0 + 64 * (line % 4);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(preact + row * 2 * inter + column));
  }
}

// The router dot's butterfly over a chunk row's N vector sums in shared memory (`at`):
// v + v ^ N / 2, then ^ N / 4, .., ^ 1, the engine's order. Each level's count is a
// constant, so the array stays in registers (a loop over the levels put it in local
// memory).
template <int Half, int N>
__device__ __forceinline__ void butterfly_levels(float (&v)[N]) {
#pragma unroll
  for (int k = 0; k < Half; ++k) v[k] = v[k] + v[k + Half];
  if constexpr (Half > 1) butterfly_levels<Half / 2>(v);
}
template <int N>
__device__ __forceinline__ float butterfly_sum(uint32_t at) {
  float v[N];
#pragma unroll
  for (int k = 0; k < N; k += 4)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[k]), "=f"(v[k + 1]), "=f"(v[k + 2]), "=f"(v[k + 3])
                 : "r"(at + 4 * k));
  butterfly_levels<N / 2>(v);
  return v[0];
}

template <int Tokens, bool kGeGLU, bool kClamp>
__device__ __forceinline__ void activation_backward_epilogue(
    const WeightStreamParams& p, const StreamTile& tile, const float (&acc_lo)[Tokens / 2],
    const float (&acc_hi)[Tokens / 2], int consumer, int thread, uint32_t dots) {
  constexpr bool kSpan = stream_chunks_from_segment_starts(Tokens);
  const int64_t inter = p.out_columns;
  const float clamp = p.activation_clamp;
  const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
  __nv_bfloat16* dgrad = static_cast<__nv_bfloat16*>(p.out);
  __nv_bfloat16* weighted = static_cast<__nv_bfloat16*>(p.weighted_h);
  // A thread's rows are (i, e), i = 0, 4, .. and e = 0, 1 (its accumulators i + e and
  // i + e + 2), taken eight at a time (Tokens 64: two groups, within the registers). A
  // group's loads all come before its stores: the stores are volatile with a memory
  // clobber, so a row's loads issued after the previous row's stores would cost every row
  // two round trips (its route, then g | u where it is live); a group waits for two.
  constexpr int kRows = 8;
  // z of every row first, as BF16 pairs: half the accumulators' registers, which the row
  // groups' loads then have (with the 128-row chunks' 128 accumulators live through the
  // rows, the loads spilled).
  uint32_t staged[Tokens / 4][2];  // [row (i, e): i / 2 + e][tile]
#pragma unroll
  for (int i = 0; i < Tokens / 2; i += 4)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      staged[i / 2 + e][0] = pack_bf16(acc_lo[i + e], acc_lo[i + e + 2]);
      staged[i / 2 + e][1] = pack_bf16(acc_hi[i + e], acc_hi[i + e + 2]);
    }
  // The 128-row chunks run the row groups in a loop, not unrolled: unrolled, the epilogue
  // was 256 KB of code per activation variant (1.1 MB in all), and the kernel stalled on
  // its instruction fetch (docs/ENGINE.md, "The 128-row transposed chunks"). A group takes
  // its rows' z from the staged registers by a compare per group (constant indices).
  constexpr int kGroups = Tokens / 2 / (2 * kRows);
  auto run_group = [&](int group) {
    const int i0 = group * 2 * kRows;
    // The thread's places from its index, derived in the loop (an opaque copy): derived
    // once, ptxas kept them through the main loop and spilled them.
    const int self = static_cast<int>(opaque(static_cast<uint32_t>(thread)));
    const StreamFragmentRows<Tokens> at(self);
    const int g = at.lane / 4, warp = self / 32;
    const int64_t column = tile.n0 + 128 * consumer + 32 * warp + 4 * g;
    const int vector = 16 * consumer + 4 * warp + g / 2;  // of the tile's 32 (8 columns each)
    uint32_t z_rows[kRows][2];
#pragma unroll
    for (int k = 0; k < kGroups; ++k)
      if (k == group)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          z_rows[r][0] = staged[k * kRows + r][0];
          z_rows[r][1] = staged[k * kRows + r][1];
        }
    // A row's token and pool row are recomputed where used (a few instructions), not
    // held: held, they spilled.
    auto token_of = [&](int r) { return at.token(i0 + 4 * (r / 2) + r % 2); };
    auto row_of = [&](int r) { return tile.row0 + static_cast<int64_t>(token_of(r)); };
    bool live[kRows];
    float weight[kRows];
    bool in[kRows];  // a wide chunk's rows of its own segment (all rows of a narrow one)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      in[r] = !kSpan || token_of(r) < tile.span;
      const int route = in[r] ? static_cast<int>(__ldcg(p.pool_row_to_route + row_of(r))) : -1;
      weight[r] = in[r] ? __ldcg(p.row_weights + row_of(r)) : 0.0f;
      // Padding rows (route -1) give zeros whatever their inputs hold (unsigned compare).
      live[r] = static_cast<uint32_t>(route) < static_cast<uint32_t>(p.num_routes);
    }
    uint2 g2[kRows], u2[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      g2[r] = u2[r] = make_uint2(0u, 0u);
      if (live[r]) {
        g2[r] = load_global_8_cg(preact + row_of(r) * 2 * inter + column);
        u2[r] = load_global_8_cg(preact + row_of(r) * 2 * inter + inter + column);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row_of(r);
      const float w = weight[r];
      const uint32_t (&z)[2] = z_rows[r];
      __nv_bfloat16* dgrad_at = dgrad + row * 2 * inter + column;
      uint2 dg = make_uint2(0u, 0u), du = dg, wh = dg, h = dg;
      if (live[r]) {
        const ActivationBackwardPair lo =
            activation_backward_pair<kGeGLU, kClamp>(z[0], g2[r].x, u2[r].x, w, clamp);
        const ActivationBackwardPair hi =
            activation_backward_pair<kGeGLU, kClamp>(z[1], g2[r].y, u2[r].y, w, clamp);
        dg = make_uint2(lo.dg, hi.dg);
        du = make_uint2(lo.du, hi.du);
        wh = make_uint2(lo.weighted_h, hi.weighted_h);
        h = make_uint2(lo.h, hi.h);
      }
      if (in[r]) {
        store_global_8(dgrad_at, dg);
        store_global_8(dgrad_at + inter, du);
        if (weighted != nullptr) store_global_8(weighted + row * inter + column, wh);
      }
      // The vector's chain: the even lane's four columns from 0, the odd lane's from the
      // even lane's sum (padding rows: zeros, as the engine's).
      float sum = 0.0f;
      if (live[r]) {
        router_dot_add(sum, z[0], h.x);
        router_dot_add(sum, z[1], h.y);
      }
      const float even = __shfl_xor_sync(0xffffffffu, sum, 4);
      if (g % 2 == 1) {
        sum = even;
        if (live[r]) {
          router_dot_add(sum, z[0], h.x);
          router_dot_add(sum, z[1], h.y);
        }
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(dots + 4 * (32 * token_of(r) + vector)),
                     "f"(sum)
                     : "memory");
      }
    }
  };
  if constexpr (kSpan) {
#pragma unroll 1
    for (int group = 0; group < kGroups; ++group) run_group(group);
  } else {  // the 64-row kernels' registers are too few for the rolled loop's (it spilled)
#pragma unroll
    for (int group = 0; group < kGroups; ++group) run_group(group);
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers' vector sums are in
  const int own_row = 128 * consumer + thread;
  if (own_row < (kSpan ? tile.span : Tokens)) {
    p.drouter_partials[(tile.row0 + own_row) * static_cast<int64_t>(p.n_base_blocks) +
                       tile.n0 / 256] = butterfly_sum<32>(dots + 4 * 32 * own_row);
  }
}

// dgrad2's epilogue (StreamEpilogue): the activation's kind and clamp read once per
// kernel; the tile's router-dot buffer by tile parity (the barrier of the next tile orders
// this tile's reads before the writes of the one after).
template <class C>
struct StreamActivationBackwardEpilogue {
  static constexpr int kTokens = C::kTokensPerChunk;
  uint8_t* dots;
  bool clamped, geglu;
  int tiles_done = 0;
  __device__ __forceinline__ StreamActivationBackwardEpilogue(const WeightStreamParams& p,
                                                              const StreamStorage<C>& smem)
      : dots(smem.dots),
        clamped(is_clamped(p.activation_clamp)),
        geglu(p.activation == static_cast<int>(Activation::GeGLU)) {}
  __device__ __forceinline__ void finish(const WeightStreamParams& p, const StreamTile& tile,
                                         const float (&acc)[C::kHalves][C::kTokensPerChunk / 2],
                                         int consumer, int thread) {
    const uint32_t dot_area = shared_address(dots) + (tiles_done & 1) * (C::kDotBytes / 2);
    with_activation(geglu, clamped, [&](auto kGeGLU, auto kClamp) {
      activation_backward_epilogue<kTokens, decltype(kGeGLU)::value, decltype(kClamp)::value>(
          p, tile, acc[0], acc[1], consumer, thread, dot_area);
    });
    ++tiles_done;
  }
};

}  // namespace megamoe::kernels::engine
