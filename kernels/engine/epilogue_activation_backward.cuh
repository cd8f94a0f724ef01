// Activation-backward epilogue of dgrad2: the staged tile is z (columns i0 .. of I, the
// unweighted dL/dh of each route, rounded once to BF16). Per pool row (one route,
// weight w) and column i, with g, u the forward's BF16 pre-activations and gc, uc their
// clamped values:
//   h = bf16(act(gc) uc)                    (the forward's h, bit for bit)
//   dg = w z uc act'(gc), du = w z act(gc)   (0 where the clamp cut; boundaries pass)
//   w h (optional), and the router dot sum_i z_i h_i over the tile's columns (FP32,
//   fixed order), which the host sums over the column blocks in order.
// Padding rows (route -1) give zeros whatever their inputs hold. One warp walks a row:
// its lanes take consecutive 8-column vectors, so g, u loads and dg, du, w h stores are
// 512-byte coalesced, and the row's dot is a fixed butterfly over the warp.
#pragma once

#include <cuda_bf16.h>

#include "activation_backward_math.cuh"
#include "activation_math.cuh"
#include "engine_params.h"
#include "pipeline.cuh"
#include "staging_tile.cuh"
#include "tile_scheduler.cuh"

namespace megamoe::kernels::engine {

template <int BlockM, int BlockN, int EpilogueWarps>
struct ActivationBackwardEpilogue {
  static constexpr int kThreads = EpilogueWarps * 32;
  using Tile = StagingTile<BlockM, BlockN>;
  static constexpr int kVectors = BlockN / 8;  // 8-column vectors per row of the tile
  static_assert(kVectors == 32 || kVectors == 16, "a warp covers whole rows");
  static constexpr int kRowsPerPass = 32 / kVectors;
  static constexpr int kPasses = BlockM / kRowsPerPass;
  // Rows in flight per warp: their route, weight, g and u loads are all issued before
  // any of their math (the epilogue is latency-bound otherwise).
  static constexpr int kUnroll = 4;
  static_assert(kUnroll == 4, "sum_row_dots sums four rows");

  __device__ __forceinline__ static float transform(float v, const EpilogueParams&) { return v; }

  // L2-cached, not the read-only path: dg | du may be written over preact in place (each
  // 16 bytes are read, then written, by the same thread; nothing reads them again).
  __device__ __forceinline__ static uint4 load_global_16(const void* at) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(at));
    return v;
  }
  // A row's route and weight: coherent loads (.cg) like g and u. ptxas re-issues a .nc
  // load at its first use to save registers, and the row's math then waits a full load.
  __device__ __forceinline__ static uint32_t load_global_4(const void* at) {
    uint32_t v;
    asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(at));
    return v;
  }
  __device__ __forceinline__ static void store_global_16(void* at, const uint4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  }

  // Element (row, col) of a row-major matrix `width` columns wide: one 32 x 32 -> 64-bit
  // multiply-add (rows, columns and widths are below 2^31).
  __device__ __forceinline__ static uint64_t element(int row, int width, int col) {
    return static_cast<uint64_t>(static_cast<uint32_t>(row)) * static_cast<uint32_t>(width) +
           static_cast<uint32_t>(col);
  }

  // The four rows' dots (dot[k]: this lane's part of row k's) summed over each row's
  // kVectors lanes, all at once: the first butterfly step trades two partials per lane
  // (a lane keeps the two rows its top vector bit picks), the second one, the rest the
  // one left. The same additions as a butterfly per row, so the same bits, in 6 shuffles
  // (5 for 16-lane rows) instead of 4 log2(kVectors). Returns row `kept`'s sum (kept = 0..3).
  __device__ __forceinline__ static float sum_row_dots(const float (&dot)[4], int vector,
                                                       int& kept) {
    constexpr int kTop = kVectors / 2;
    const bool high = (vector & kTop) != 0, odd = (vector & (kTop / 2)) != 0;
    const float give0 = high ? dot[0] : dot[2], give1 = high ? dot[1] : dot[3];
    float keep0 = high ? dot[2] : dot[0], keep1 = high ? dot[3] : dot[1];
    keep0 += __shfl_xor_sync(0xffffffffu, give0, kTop);
    keep1 += __shfl_xor_sync(0xffffffffu, give1, kTop);
    float sum = odd ? keep1 : keep0;
    sum += __shfl_xor_sync(0xffffffffu, odd ? keep0 : keep1, kTop / 2);
#pragma unroll
    for (int offset = kTop / 4; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    kept = (high ? 2 : 0) + (odd ? 1 : 0);
    return sum;
  }

  __device__ __forceinline__ static void finish(const EpilogueParams& p, const TileInfo& tile,
                                                uint8_t* staging, int thread) {
    // One branch per tile: the per-element math below has none.
    const bool clamped = is_clamped(p.activation_clamp);
    with_activation(p.activation == static_cast<int>(Activation::GeGLU), clamped,
                    [&](auto kGeGLU, auto kClamp) {
                      finish_rows<decltype(kGeGLU)::value, decltype(kClamp)::value>(
                          p, tile, staging, thread);
                    });
  }

  template <bool kGeGLU, bool kClamp>
  __device__ __forceinline__ static void finish_rows(const EpilogueParams& p, const TileInfo& tile,
                                                     uint8_t* staging, int thread) {
    const int warp = thread / 32, lane = thread % 32;
    const int inter = p.intermediate, two_i = 2 * p.intermediate;
    const int vector = lane % kVectors;
    const int col = tile.n_block * BlockN + 8 * vector;
    const bool in_n = col < inter;  // N tail (I is a multiple of 64)
    const int n_blocks = (p.intermediate + BlockN - 1) / BlockN;
    const float clamp = p.activation_clamp;
    const uint32_t base = shared_address(staging);
    const __nv_bfloat16* preact = static_cast<const __nv_bfloat16*>(p.preact);
    __nv_bfloat16* dgrad = static_cast<__nv_bfloat16*>(p.dgrad_preact);
    __nv_bfloat16* weighted = static_cast<__nv_bfloat16*>(p.weighted_h);

    for (int pass0 = warp; pass0 < kPasses; pass0 += EpilogueWarps * kUnroll) {
      int row[kUnroll], route[kUnroll];
      bool live[kUnroll];
      float weight[kUnroll];
      uint4 g8[kUnroll], u8[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int pass = pass0 + k * EpilogueWarps;
        live[k] = pass < kPasses;  // uniform over the warp
        const int r = (live[k] ? pass : 0) * kRowsPerPass + lane / kVectors;
        row[k] = tile.row0 + r;
        route[k] = static_cast<int>(load_global_4(p.pool_row_to_route + row[k]));
        weight[k] = __uint_as_float(load_global_4(p.row_weights + row[k]));
        const __nv_bfloat16* at = preact + element(row[k], two_i, col);
        g8[k] = live[k] && in_n ? load_global_16(at) : make_uint4(0, 0, 0, 0);
        u8[k] = live[k] && in_n ? load_global_16(at + inter) : make_uint4(0, 0, 0, 0);
      }
      float dot[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        dot[k] = 0.0f;
        if (!live[k]) continue;
        __nv_bfloat16* dgrad_row = dgrad + element(row[k], two_i, col);
        // As an integer: `weighted` is null when w h is not wanted (nothing is stored then).
        const uintptr_t weighted_row = reinterpret_cast<uintptr_t>(weighted) +
                                       sizeof(__nv_bfloat16) * element(row[k], inter, col);
        // Padding rows (route -1) give zeros whatever their inputs hold. One unsigned
        // compare: -1 wraps past every route (num_routes < 2^31, int32 ids).
        if (static_cast<uint32_t>(route[k]) >= static_cast<uint32_t>(p.num_routes)) {
          if (in_n) {
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            store_global_16(dgrad_row, zero);
            store_global_16(dgrad_row + inter, zero);
            if (weighted != nullptr) store_global_16(reinterpret_cast<void*>(weighted_row), zero);
          }
          continue;
        }
        const float w = weight[k];
        uint32_t dg[4], du[4], wh[4];
        const uint4 z8 = load_shared_16(base + Tile::offset(row[k] - tile.row0, 8 * vector));
        const uint32_t zw[4] = {z8.x, z8.y, z8.z, z8.w};
        const uint32_t gw[4] = {g8[k].x, g8[k].y, g8[k].z, g8[k].w};
        const uint32_t uw[4] = {u8[k].x, u8[k].y, u8[k].z, u8[k].w};
        // Two columns (one BF16 pair) at a time, packed as they come.
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
          const ActivationBackwardPair out =
              activation_backward_pair<kGeGLU, kClamp>(zw[pair], gw[pair], uw[pair], w, clamp);
          router_dot_add(dot[k], zw[pair], out.h);
          dg[pair] = out.dg;
          du[pair] = out.du;
          wh[pair] = out.weighted_h;
        }
        if (in_n) {
          store_global_16(dgrad_row, make_uint4(dg[0], dg[1], dg[2], dg[3]));
          store_global_16(dgrad_row + inter, make_uint4(du[0], du[1], du[2], du[3]));
          if (weighted != nullptr)
            store_global_16(reinterpret_cast<void*>(weighted_row),
                            make_uint4(wh[0], wh[1], wh[2], wh[3]));
        }
      }
      // Each row's dot over its kVectors lanes, in a fixed order.
      int kept;
      const float sum = sum_row_dots(dot, vector, kept);
      const int kept_pass = pass0 + kept * EpilogueWarps;  // no dynamic index into row[]
      if (vector % (kVectors / 4) == 0 && kept_pass < kPasses) {
        const int kept_row = tile.row0 + kept_pass * kRowsPerPass + lane / kVectors;
        p.drouter_partials[static_cast<int64_t>(kept_row) * n_blocks + tile.n_block] = sum;
      }
    }
  }
};

}  // namespace megamoe::kernels::engine
