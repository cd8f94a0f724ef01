// Host launchers of the weight-streaming GEMMs (kernels/engine/weight_stream_kernel.cuh):
// each checks its operands once, builds the tensor maps and the parameter block, picks
// the variant by kind and chunk size and launches persistently on the caller's stream.
#include "weight_stream_launch.h"

#include <cuda.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "gemm_launch.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

constexpr int kBlockK = 64;
constexpr int kStoreColumns = 256;  // output columns of a tile of two m64 tiles per warpgroup

std::string str(int64_t v) { return std::to_string(v); }

const WeightStreamKernels& select_stream_variant(StreamKind kind, int tokens) {
  for (const auto& variant : variants::kWeightStreamVariants)
    if (variant.kernels->kind == kind && variant.kernels->tokens == tokens) return *variant.kernels;
  throw nb::value_error(("tokens: no weight-stream variant for chunks of " + str(tokens)).c_str());
}

// The pool [P, cols] BF16 with unit column stride, its segments padded to `block_m`
// rows: a chunk of 32 or 64 rows must lie in one expert's segment (wider chunks start at
// each segment's start).
void check_pool(const Tensor& a, int tokens, int block_m) {
  if (a.dtype() != bfloat16_dtype() || a.ndim() != 2 || a.stride(1) != 1 ||
      a.stride(0) < static_cast<int64_t>(a.shape(1)))
    throw nb::value_error("a: expected a BF16 [P, cols] pool with unit column stride");
  if (block_m < 1) throw nb::value_error(("block_m: expected >= 1, got " + str(block_m)).c_str());
  if (!stream_chunks_from_segment_starts(tokens) && (block_m < tokens || block_m % tokens != 0))
    throw nb::value_error(("block_m: the pool's segment padding " + str(block_m) +
                           " is not a multiple of the chunk " + str(tokens))
                              .c_str());
  const int64_t rows = a.shape(0);
  if (rows % block_m != 0)
    throw nb::value_error(
        ("a: pool rows " + str(rows) + " are not a multiple of BLOCK_M " + str(block_m)).c_str());
  if (rows >= (int64_t{1} << 31)) throw nb::value_error("a: more than 2^31 - 1 pool rows");
}

// MXFP4 scales [E, rows, K / 32] as stored, whose size is a multiple of 8 bytes (rows and
// K / 32 are even). The forward kinds' producer loads the aligned 8-byte chunk that holds
// four steps' bytes of a row (`alignment` 8: one rule for every forward launch, though the
// one-tile kinds and K not a multiple of 256 load two bytes a step); the transposed kinds'
// copies the aligned 4-byte word that holds a step's bytes with cp.async (`alignment` 4).
// Either lies inside the scales when they start so aligned. megamoe.wrappers.grouped_gemm
// sends other scales to the engine's in-pipeline decode instead.
void check_scales(const char* name, const Tensor& scales, int64_t experts, int64_t rows, int64_t k,
                  int device, int alignment) {
  check_tensor<uint8_t>(name, scales, {experts, rows, k / 32}, device);
  if (reinterpret_cast<uintptr_t>(scales.data()) % alignment != 0)
    throw nb::value_error(
        (std::string(name) + ": expected a data pointer aligned to " + str(alignment) + " bytes")
            .c_str());
}

void set_schedule(WeightStreamParams& p, const Tensor& offsets, const Tensor& counts,
                  int64_t experts, int64_t rows, int device) {
  check_tensor<int32_t>("expert_pool_offsets", offsets, {experts + 1}, device);
  check_tensor<int32_t>("expert_counts", counts, {experts}, device);
  p.expert_pool_offsets = static_cast<const int32_t*>(offsets.data());
  p.expert_counts = static_cast<const int32_t*>(counts.data());
  p.num_experts = static_cast<int32_t>(experts);
  p.pool_rows = static_cast<int32_t>(rows);
}

// GEMM1 over the pool with an MXFP4 w13 in the swapped form: h = act(g) * u, g | u =
// [x | q1 | q3] . [w13_e ; side], in chunks of `tokens` pool rows (check_pool).
void weight_stream_gated(const Tensor& a, int64_t k_base, const Tensor& w13,
                         const Tensor& w13_scales, const Tensor& offsets, const Tensor& counts,
                         const Tensor& h, std::optional<Tensor> preact,
                         std::optional<Tensor> side_gate, std::optional<Tensor> side_up,
                         double side_scale, int activation, double activation_clamp, int block_m,
                         int tokens, int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  const WeightStreamKernels& kernels = select_stream_variant(StreamKind::Gated, tokens);
  check_pool(a, tokens, block_m);
  const int64_t rows = a.shape(0);
  if (k_base < kBlockK || k_base % kBlockK != 0)
    throw nb::value_error(("k_base: expected a multiple of 64, got " + str(k_base)).c_str());
  check_tensor<uint8_t>("w13", w13, {-1, -1, k_base / 2}, device);
  const int64_t experts = w13.shape(0), two_i = w13.shape(1), inter = two_i / 2;
  if (experts < 1) throw nb::value_error("w13: expected at least one expert");
  const int columns = kernels.columns;  // h columns per tile
  if (two_i % 2 != 0 || inter % columns != 0)
    throw nb::value_error(("w13: expected 2I rows with I a multiple of " + str(columns) +
                           " (chunks of " + str(tokens) + "), got " + str(two_i))
                              .c_str());
  check_scales("w13_scales", w13_scales, experts, two_i, k_base, device, 8);
  check_activation(activation, activation_clamp);
  const int64_t rank =
      check_gated_side(side_gate, side_up, side_scale, experts, inter, k_base, a, device);
  check_tensor("h", h, bfloat16_dtype(), {rows, inter}, device);
  if (preact) check_tensor("preact_out", *preact, bfloat16_dtype(), {rows, two_i}, device);

  WeightStreamParams p{};
  set_schedule(p, offsets, counts, experts, rows, device);
  p.n_base_blocks = static_cast<int32_t>(inter / columns);
  // Side steps: the gate's over q1 (b1 rows), then the up's over q3 (b3 rows).
  p.segment_half = static_cast<int32_t>((rank + kBlockK - 1) / kBlockK);
  p.segment_steps = 2 * p.segment_half;
  p.base_steps = static_cast<int32_t>(k_base / kBlockK);
  p.pool =
      bf16_rows("a", a.data(), rows, k_base + 2 * rank, a.stride(0), stream_pool_box_rows(tokens));
  p.codes = tensor_map(
      "w13", w13.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {k_base / 2, inter, 2, experts},
      {k_base / 2, inter * k_base / 2, two_i * k_base / 2}, {kBlockK / 2, columns, 2, 1}, false);
  if (side_gate) {
    // b1 and b3 as given [E, r, I]: [64 I, 64 r] boxes, the A of the side steps.
    p.segment_lo = mn_major_map("side_gate", *side_gate, device);
    p.segment_hi = mn_major_map("side_up", *side_up, device);
  }
  p.scales = static_cast<const uint8_t*>(w13_scales.data());
  p.k_base = static_cast<int32_t>(k_base);
  p.side_rank = static_cast<int32_t>(rank);
  p.weight_rows = static_cast<int32_t>(two_i);
  p.half_rows = static_cast<int32_t>(inter);
  p.side_scale = static_cast<float>(side_scale);
  p.out = h.data();
  p.out_columns = static_cast<int32_t>(inter);
  p.preact = preact ? preact->data() : nullptr;
  p.activation = activation;
  p.activation_clamp = static_cast<float>(activation_clamp);
  launch_persistent(kernels.kernel, p, kernels.num_threads, kernels.smem_bytes, device, num_sms,
                    stream, "weight_stream_gated launch");
}

// GEMM2 over the pool with an MXFP4 b in the swapped form: out = a . [b_e^T | b_extra_e]
// (b codes [E, N, K/2] K-major, b_extra as given [E, K, N_x]), in chunks of `tokens` pool
// rows (check_pool).
void weight_stream_store(const Tensor& a, int64_t k_base, const Tensor& b, const Tensor& b_scales,
                         std::optional<Tensor> b_extra, const Tensor& offsets, const Tensor& counts,
                         const Tensor& out, int block_m, int tokens, int num_sms,
                         uintptr_t stream) {
  const int device = a.device_id();
  const WeightStreamKernels& kernels = select_stream_variant(StreamKind::Store, tokens);
  check_pool(a, tokens, block_m);
  const int64_t rows = a.shape(0);
  if (k_base < kBlockK || k_base % kBlockK != 0 || k_base > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(("k_base: expected a multiple of 64 in [64, " + str(a.shape(1)) +
                           "] (a's columns), got " + str(k_base))
                              .c_str());
  check_tensor<uint8_t>("b", b, {-1, -1, k_base / 2}, device);
  const int64_t experts = b.shape(0), n = b.shape(1);
  if (experts < 1) throw nb::value_error("b: expected at least one expert");
  const int columns = kernels.columns;  // output columns per tile
  if (n < columns || n % columns != 0)
    throw nb::value_error(("b: expected N a multiple of " + str(columns) + " (chunks of " +
                           str(tokens) + "), got " + str(n))
                              .c_str());
  check_scales("b_scales", b_scales, experts, n, k_base, device, 8);
  int64_t n_extra = 0;
  if (b_extra) {
    check_tensor("b_extra", *b_extra, bfloat16_dtype(), {experts, k_base, -1}, device);
    n_extra = b_extra->shape(2);
    if (n_extra < 8 || n_extra % 8 != 0 || n_extra > kStoreColumns)
      throw nb::value_error(
          ("b_extra: expected N_x a multiple of 8 up to 256, got " + str(n_extra)).c_str());
  }
  check_tensor("out", out, bfloat16_dtype(), {rows, n + n_extra}, device);

  WeightStreamParams p{};
  set_schedule(p, offsets, counts, experts, rows, device);
  p.n_base_blocks = static_cast<int32_t>(n / columns);
  p.base_steps = static_cast<int32_t>(k_base / kBlockK);
  if (b_extra) {
    p.segment_lo = mn_major_map("b_extra", *b_extra, device);
    p.segment_half = p.base_steps;
    if (columns == kStoreColumns) {
      // Two m64 tiles per consumer warpgroup (chunks of up to 128 rows): one extra tile,
      // a2 columns 0..127 into the first half, 128.. into the second, each over all of K.
      p.n_extra_blocks = 1;
      p.segment_steps = (n_extra > kStoreColumns / 2 ? 2 : 1) * p.base_steps;
    } else {
      // One m64 tile (192- and 256-row chunks): an extra tile per `columns` a2 columns, over
      // all of K.
      p.n_extra_blocks = static_cast<int32_t>((n_extra + columns - 1) / columns);
      p.segment_steps = p.base_steps;
    }
  }
  p.pool = bf16_rows("a", a.data(), rows, k_base, a.stride(0), stream_pool_box_rows(tokens));
  p.codes = tensor_map("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {k_base / 2, n, experts},
                       {k_base / 2, n * k_base / 2}, {kBlockK / 2, columns, 1}, false);
  p.scales = static_cast<const uint8_t*>(b_scales.data());
  p.k_base = static_cast<int32_t>(k_base);
  p.weight_rows = static_cast<int32_t>(n);
  p.half_rows = columns / 2;  // the second m64 tile's rows (192- and 256-row chunks have one)
  p.side_scale = 1.0f;
  p.out = out.data();
  p.out_columns = static_cast<int32_t>(n + n_extra);
  launch_persistent(kernels.kernel, p, kernels.num_threads, kernels.smem_bytes, device, num_sms,
                    stream, "weight_stream_store launch");
}

// dgrad1 over the pool with an MXFP4 b read as stored, in the swapped form: out = a .
// [b_e | blockdiag(lo_e^T, hi_e^T)] (b codes [E, K, N/2] quantized along N; lo [E, N_lo,
// K_lo] and hi [E, N_hi, K - K_lo] K-major as given, both or neither), in chunks of
// `tokens` (32, 64, 128, 192 or 256) pool rows (check_pool).
void weight_stream_store_mn(const Tensor& a, const Tensor& b, const Tensor& b_scales,
                            std::optional<Tensor> extra_lo, std::optional<Tensor> extra_hi,
                            const Tensor& offsets, const Tensor& counts, const Tensor& out,
                            int block_m, int tokens, int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  const WeightStreamKernels& kernels = select_stream_variant(StreamKind::StoreMN, tokens);
  check_pool(a, tokens, block_m);
  const int64_t rows = a.shape(0);
  check_tensor<uint8_t>("b", b, {-1, -1, -1}, device);
  const int64_t experts = b.shape(0), k = b.shape(1), n = 2 * b.shape(2);
  if (experts < 1) throw nb::value_error("b: expected at least one expert");
  if (k < kBlockK || k % kBlockK != 0 || k > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(("b: expected K a multiple of 64 in [64, " + str(a.shape(1)) +
                           "] (a's columns), got " + str(k))
                              .c_str());
  // Tiles of 256 columns (two m64 tiles per consumer warpgroup) or 128 (one: 192- and
  // 256-row chunks).
  const int columns = kernels.columns;
  if (n < columns || n % columns != 0)
    throw nb::value_error(("b: expected N a multiple of " + str(columns) + " (chunks of " +
                           str(tokens) + "), got " + str(n))
                              .c_str());
  // Scales [E, K, N / 32]: a producer thread copies the 4-byte word holding two column
  // blocks' bytes (one tile: one block's byte).
  check_scales("b_scales", b_scales, experts, k, n, device, 4);
  if (extra_lo.has_value() != extra_hi.has_value())
    throw nb::value_error("extra_lo/extra_hi: give both or neither");
  int64_t n_lo = 0, n_hi = 0, k_lo = 0;
  if (extra_lo) {
    check_tensor("extra_lo", *extra_lo, bfloat16_dtype(), {experts, -1, -1}, device);
    n_lo = extra_lo->shape(1);
    k_lo = extra_lo->shape(2);
    if (k_lo < kBlockK || k_lo % kBlockK != 0 || k_lo >= k)
      throw nb::value_error(
          ("extra_lo: expected K_lo a multiple of 64 below K = " + str(k) + ", got " + str(k_lo))
              .c_str());
    check_tensor("extra_hi", *extra_hi, bfloat16_dtype(), {experts, -1, k - k_lo}, device);
    n_hi = extra_hi->shape(1);
    // Each block's columns in one half of the extra tile, or (one tile) an extra tile of
    // its own: 64 per consumer warpgroup.
    for (const auto& [name, cols] : {std::pair{"extra_lo", n_lo}, std::pair{"extra_hi", n_hi}})
      if (cols < 8 || cols % 8 != 0 || cols > kStoreColumns / 2)
        throw nb::value_error(
            (std::string(name) + ": expected a multiple of 8 up to 128 rows, got " + str(cols))
                .c_str());
  }
  check_tensor("out", out, bfloat16_dtype(), {rows, n + n_lo + n_hi}, device);
  // A base tile's epilogue writes four columns (8 bytes) at a time (one tile: two).
  if (reinterpret_cast<uintptr_t>(out.data()) % 8 != 0)
    throw nb::value_error("out: expected an 8-byte aligned address");

  WeightStreamParams p{};
  set_schedule(p, offsets, counts, experts, rows, device);
  p.n_base_blocks = static_cast<int32_t>(n / columns);
  p.base_steps = static_cast<int32_t>(k / kBlockK);
  if (extra_lo) {
    // The extra tile: lo over the pool's columns 0..K_lo into the first half, then hi over
    // K_lo..K into the second (one tile: lo's tile, then hi's); [64 K, 64 rows] boxes read
    // K-major.
    p.n_extra_blocks = stream_one_tile(tokens) ? 2 : 1;
    p.segment_half = static_cast<int32_t>(k_lo / kBlockK);
    p.segment_steps = p.base_steps;
    p.segment_k_hi = static_cast<int32_t>(k_lo);
    p.extra_lo_columns = static_cast<int32_t>(n_lo);
    p.segment_lo = mn_major_map("extra_lo", *extra_lo, device);  // 64 x 64 boxes of [E, N_lo, K_lo]
    p.segment_hi = mn_major_map("extra_hi", *extra_hi, device);
  }
  p.pool = bf16_rows("a", a.data(), rows, k, a.stride(0), stream_pool_box_rows(tokens));
  // A step's codes: [64 rows][columns / 2 bytes], swizzled as wide as a row (128 or 64
  // bytes), so that an ldmatrix's eight rows meet eight bank groups.
  p.codes =
      tensor_map("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {n / 2, k, experts},
                 {n / 2, k * n / 2}, {columns / 2, kBlockK, 1},
                 stream_one_tile(tokens) ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B);
  p.scales = static_cast<const uint8_t*>(b_scales.data());
  p.k_base = static_cast<int32_t>(k);
  p.weight_rows = static_cast<int32_t>(k);
  p.side_scale = 1.0f;
  p.out = out.data();
  p.out_columns = static_cast<int32_t>(n + n_lo + n_hi);
  launch_persistent(kernels.kernel, p, kernels.num_threads, kernels.smem_bytes, device, num_sms,
                    stream, "weight_stream_store_mn launch");
}

// dgrad2 + activation backward over the pool with an MXFP4 w2 read as stored, in the
// swapped form: z = a . [w2_e ; a2_e^T] (codes [E, H, I/2] quantized along I; a2 as given
// [E, I, r], or none), then per pool row and column the activation backward into dg | du
// (over `preact` when it is the same buffer), w h and the router dot's partials [P, I /
// 256], in chunks of `tokens` (32, 64 or 128) pool rows (check_pool).
void weight_stream_activation_backward(
    const Tensor& a, const Tensor& b, const Tensor& b_scales, std::optional<Tensor> side_a2,
    const Tensor& offsets, const Tensor& counts, const Tensor& preact, const Tensor& row_weights,
    int64_t num_routes, const Tensor& pool_row_to_route, const Tensor& dgrad_preact,
    std::optional<Tensor> weighted_h, const Tensor& drouter_partials, int activation,
    double activation_clamp, int block_m, int tokens, int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  const WeightStreamKernels& kernels =
      select_stream_variant(StreamKind::ActivationBackward, tokens);
  check_pool(a, tokens, block_m);
  const int64_t rows = a.shape(0);
  check_tensor<uint8_t>("b", b, {-1, -1, -1}, device);
  const int64_t experts = b.shape(0), hidden = b.shape(1), inter = 2 * b.shape(2);
  if (experts < 1) throw nb::value_error("b: expected at least one expert");
  if (hidden < kBlockK || hidden % kBlockK != 0)
    throw nb::value_error(("b: expected H a multiple of 64, got " + str(hidden)).c_str());
  if (inter < kStoreColumns || inter % kStoreColumns != 0 || inter >= (int64_t{1} << 30))
    throw nb::value_error(
        ("b: expected I a multiple of 256 below 2^30, got " + str(inter)).c_str());
  check_scales("b_scales", b_scales, experts, hidden, inter, device, 4);
  int64_t rank = 0;
  if (side_a2) {
    check_tensor("side_a2", *side_a2, bfloat16_dtype(), {experts, inter, -1}, device);
    rank = side_a2->shape(2);
    if (rank < 8 || rank % 8 != 0)
      throw nb::value_error(("side_a2: expected r a multiple of 8, got " + str(rank)).c_str());
  }
  if (hidden + rank > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(
        ("a: expected at least H + r = " + str(hidden + rank) + " columns, got " + str(a.shape(1)))
            .c_str());
  check_activation(activation, activation_clamp);
  check_tensor("preact", preact, bfloat16_dtype(), {rows, 2 * inter}, device);
  check_tensor("dgrad_preact", dgrad_preact, bfloat16_dtype(), {rows, 2 * inter}, device);
  if (weighted_h) check_tensor("weighted_h", *weighted_h, bfloat16_dtype(), {rows, inter}, device);
  // The epilogue reads and writes four columns (8 bytes) at a time.
  for (const auto& [name, t] :
       {std::pair{"preact", &preact}, std::pair{"dgrad_preact", &dgrad_preact}})
    if (reinterpret_cast<uintptr_t>(t->data()) % 8 != 0)
      throw nb::value_error((std::string(name) + ": expected an 8-byte aligned address").c_str());
  if (weighted_h && reinterpret_cast<uintptr_t>(weighted_h->data()) % 8 != 0)
    throw nb::value_error("weighted_h: expected an 8-byte aligned address");
  check_tensor<float>("row_weights", row_weights, {rows}, device);
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {rows}, device);
  if (num_routes < 0 || num_routes > INT32_MAX)
    throw nb::value_error("num_routes: expected 0 to 2^31-1");
  check_tensor<float>("drouter_partials", drouter_partials, {rows, inter / kStoreColumns}, device);

  WeightStreamParams p{};
  set_schedule(p, offsets, counts, experts, rows, device);
  p.n_base_blocks = static_cast<int32_t>(inter / kStoreColumns);
  p.base_steps = static_cast<int32_t>(hidden / kBlockK);
  if (side_a2) {
    // The side's K steps (a2's r columns over the pool's columns H..H + r) into tile 0's
    // accumulators, then tile 1's. Each box row is an I column in the transposed order
    // (consumer c's column 32 w + 4 g + 2 t + h, t the tile, at box row 16 w + 8 h + g):
    // a 5-D view of a2 [E, I, r], dims (r, g, h, w, row pairs), tile 1's two rows on.
    p.segment_half = static_cast<int32_t>((rank + kBlockK - 1) / kBlockK);
    p.segment_steps = 2 * p.segment_half;
    const int64_t row_bytes = rank * 2;
    for (int t = 0; t < 2; ++t) {
      const auto* base = static_cast<const uint8_t*>(side_a2->data()) + 2 * t * row_bytes;
      (t == 0 ? p.segment_lo : p.segment_hi) = tensor_map(
          "side_a2", base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {rank, 8, 2, 4, experts * inter / 2},
          {4 * row_bytes, row_bytes, 32 * row_bytes, 2 * row_bytes}, {kBlockK, 8, 2, 4, 1}, true);
    }
  }
  p.pool = bf16_rows("a", a.data(), rows, hidden + rank, a.stride(0), stream_pool_box_rows(tokens));
  p.codes = tensor_map("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {inter / 2, hidden, experts},
                       {inter / 2, hidden * inter / 2}, {kStoreColumns / 2, kBlockK, 1}, true);
  p.scales = static_cast<const uint8_t*>(b_scales.data());
  p.k_base = static_cast<int32_t>(hidden);
  p.weight_rows = static_cast<int32_t>(hidden);
  p.side_scale = 1.0f;  // the pool's side columns carry the adapter scale already
  p.out = dgrad_preact.data();
  p.preact = preact.data();
  p.out_columns = static_cast<int32_t>(inter);
  p.activation = activation;
  p.activation_clamp = static_cast<float>(activation_clamp);
  p.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  p.row_weights = static_cast<const float*>(row_weights.data());
  p.num_routes = static_cast<int32_t>(num_routes);
  p.weighted_h = weighted_h ? weighted_h->data() : nullptr;
  p.drouter_partials = static_cast<float*>(drouter_partials.data());
  launch_persistent(kernels.kernel, p, kernels.num_threads, kernels.smem_bytes, device, num_sms,
                    stream, "weight_stream_activation_backward launch");
}

}  // namespace

void register_weight_stream(nb::module_& m) {
  m.def("weight_stream_gated", &weight_stream_gated, nb::arg("a"), nb::arg("k_base"),
        nb::arg("w13"), nb::arg("w13_scales"), nb::arg("expert_pool_offsets"),
        nb::arg("expert_counts"), nb::arg("h"), nb::arg("preact_out").none(),
        nb::arg("side_gate").none(), nb::arg("side_up").none(), nb::arg("side_scale"),
        nb::arg("activation"), nb::arg("activation_clamp"), nb::arg("block_m"), nb::arg("tokens"),
        nb::arg("num_sms"), nb::arg("stream"),
        "GEMM1 with an MXFP4 w13 decoded into the wgmma's A registers (few rows per expert).");
  m.def("weight_stream_store", &weight_stream_store, nb::arg("a"), nb::arg("k_base"), nb::arg("b"),
        nb::arg("b_scales"), nb::arg("b_extra").none(), nb::arg("expert_pool_offsets"),
        nb::arg("expert_counts"), nb::arg("out"), nb::arg("block_m"), nb::arg("tokens"),
        nb::arg("num_sms"), nb::arg("stream"),
        "GEMM2 with an MXFP4 b decoded into the wgmma's A registers (few rows per expert).");
  m.def("weight_stream_store_mn", &weight_stream_store_mn, nb::arg("a"), nb::arg("b"),
        nb::arg("b_scales"), nb::arg("extra_lo").none(), nb::arg("extra_hi").none(),
        nb::arg("expert_pool_offsets"), nb::arg("expert_counts"), nb::arg("out"),
        nb::arg("block_m"), nb::arg("tokens"), nb::arg("num_sms"), nb::arg("stream"),
        "dgrad1 with an MXFP4 b read as stored, decoded into the wgmma's A registers (few rows "
        "per expert).");
  m.def("weight_stream_activation_backward", &weight_stream_activation_backward, nb::arg("a"),
        nb::arg("b"), nb::arg("b_scales"), nb::arg("side_a2").none(),
        nb::arg("expert_pool_offsets"), nb::arg("expert_counts"), nb::arg("preact"),
        nb::arg("row_weights"), nb::arg("num_routes"), nb::arg("pool_row_to_route"),
        nb::arg("dgrad_preact"), nb::arg("weighted_h").none(), nb::arg("drouter_partials"),
        nb::arg("activation"), nb::arg("activation_clamp"), nb::arg("block_m"), nb::arg("tokens"),
        nb::arg("num_sms"), nb::arg("stream"),
        "dgrad2 + activation backward with an MXFP4 w2 read as stored, decoded into the wgmma's A "
        "registers (few rows per expert).");
}

}  // namespace megamoe
