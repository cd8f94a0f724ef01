// Host launcher of the grouped GEMM engine: checks every operand, builds the TMA
// descriptors, selects the registry variant and launches persistently on the
// caller's stream.
#include "grouped_gemm.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <optional>
#include <string>

#include "cuda_check.h"
#include "gemm_launch.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

// The gated epilogues index w13's gate/up interleave as 64-column blocks.
static_assert(variants::kGateUpInterleave == 64, "the GEMM epilogues hard-code the interleave");

std::string str(int64_t v) { return std::to_string(v); }

const GroupedGemmKernels& select_variant(int block_m, int block_n, Epilogue epilogue,
                                         BMajor b_major, BFormat b_format = BFormat::BF16) {
  for (const auto& variant : variants::kGroupedGemmVariants) {
    const GroupedGemmKernels& k = *variant.kernels;
    if (k.block_m == block_m && k.block_n == block_n && k.epilogue == epilogue &&
        k.b_major == b_major && k.b_format == b_format)
      return k;
  }
  throw nb::value_error(("block_m/block_n: no grouped GEMM variant for BLOCK_M " + str(block_m) +
                         ", BLOCK_N " + str(block_n) +
                         (b_major == BMajor::MN ? " with an MN-major B" : "") +
                         (b_format == BFormat::MXFP4 ? " with an MXFP4 B" : ""))
                            .c_str());
}

// The base B operand's tensor maps (kernels/grouped_gemm_params.h), for each storage
// and major: BF16 K-major [E * N, K] in [BLOCK_N, 64] boxes, BF16 MN-major [E][K][N] in
// [1, 64, 64] boxes; MXFP4 codes and scales in the boxes one K step loads (shapes
// checked by the caller).
void set_b_operand(GroupedGemmParams& params, const Tensor& b,
                   const std::optional<Tensor>& b_scales, int64_t experts, int64_t k_base,
                   int64_t n_base, int block_n, bool b_major_mn) {
  if (!b_scales) {
    params.b = b_major_mn ? tma_3d("b", b.data(), experts, k_base, n_base)
                          : tma_2d("b", b.data(), experts * n_base, k_base, k_base, block_n);
  } else if (b_major_mn) {
    params.b_codes = tma_2d_plain("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, experts * k_base,
                                  n_base / 2, kGemmBlockK, block_n / 2);
    params.b_scales = tma_2d_plain("b_scales", b_scales->data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1,
                                   experts * (n_base / 32), k_base, block_n / 32, kGemmBlockK);
  } else {
    params.b_codes = tma_2d_plain("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, experts * n_base,
                                  k_base / 2, block_n, kGemmBlockK / 2);
    params.b_scales = tma_2d_plain("b_scales", b_scales->data(), CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
                                   experts * (k_base / kGemmBlockK), n_base, 1, block_n);
  }
}

void grouped_gemm(const Tensor& a, int64_t k_base, const Tensor& b,
                  const Tensor& expert_pool_offsets, const Tensor& out, int block_m, int block_n,
                  bool gated, int activation, double activation_clamp,
                  std::optional<Tensor> b_extra, std::optional<Tensor> side_b, double side_scale,
                  std::optional<Tensor> preact_out, bool b_major_mn, std::optional<Tensor> b_scales,
                  int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  check_tensor("a", a, bfloat16_dtype(), {-1, -1}, device);
  const int64_t rows = a.shape(0), lda = a.shape(1);
  const bool mxfp4 = b_scales.has_value();
  // K-major B: [E, N, K] (nn.Linear); MN-major B: [E, K, N] (the same weights, read
  // transposed by the dgrads); MXFP4 B: the codes [E, N, K/2] (K-major) or [E, K, N/2]
  // (MN-major).
  if (mxfp4 && k_base % kGemmBlockK != 0)
    throw nb::value_error(
        ("k_base: an MXFP4 B needs K a multiple of 64, got " + str(k_base)).c_str());
  if (mxfp4 && b_major_mn)
    check_tensor<uint8_t>("b", b, {-1, k_base, -1}, device);
  else if (mxfp4)
    check_tensor<uint8_t>("b", b, {-1, -1, k_base / 2}, device);
  else if (b_major_mn)
    check_tensor("b", b, bfloat16_dtype(), {-1, k_base, -1}, device);
  else
    check_tensor("b", b, bfloat16_dtype(), {-1, -1, k_base}, device);
  const int64_t experts = b.shape(0);
  const int64_t n_base = b_major_mn ? b.shape(2) * (mxfp4 ? 2 : 1) : b.shape(1);
  if (mxfp4 && b_major_mn) {
    if (n_base % 32 != 0)
      throw nb::value_error(
          ("b: an MN-major MXFP4 B needs N a multiple of 32, got " + str(n_base)).c_str());
    check_tensor<uint8_t>("b_scales", *b_scales, {experts, n_base / 32, k_base}, device);
  } else if (mxfp4) {
    check_tensor<int16_t>("b_scales", *b_scales, {experts, k_base / kGemmBlockK, n_base}, device);
    if (n_base % 8 != 0)
      throw nb::value_error(
          ("b: an MXFP4 B needs N a multiple of 8 (16-byte scale rows), got " + str(n_base))
              .c_str());
  }
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {experts + 1}, device);
  if (k_base < 8 || k_base % 8 != 0 || k_base > lda)
    throw nb::value_error(("k_base: expected a multiple of 8 in [8, " + str(lda) +
                           "] (a's columns), got " + str(k_base))
                              .c_str());
  if (rows % block_m != 0)
    throw nb::value_error(
        ("a: pool rows " + str(rows) + " are not a multiple of BLOCK_M " + str(block_m)).c_str());
  if (b_major_mn && (gated || side_b || preact_out))
    throw nb::value_error("b: an MN-major B takes the Store epilogue (N extra segment allowed)");
  if (b_major_mn && n_base % 8 != 0)
    throw nb::value_error(
        ("b: an MN-major B needs N a multiple of 8 (16-byte rows), got " + str(n_base)).c_str());
  const GroupedGemmKernels& kernels =
      select_variant(block_m, block_n, gated ? Epilogue::GatedActivation : Epilogue::Store,
                     b_major_mn ? BMajor::MN : BMajor::K, mxfp4 ? BFormat::MXFP4 : BFormat::BF16);

  GroupedGemmParams params{};
  int64_t side_k = 0, n_extra = 0;
  if (gated) {
    if (n_base % kernels.block_n != 0)
      throw nb::value_error(
          ("b: gated GEMM needs 2I a multiple of " + str(kernels.block_n) + ", got " + str(n_base))
              .c_str());
    if (b_extra) throw nb::value_error("b_extra: not supported with the gated epilogue");
    if (activation != 0 && activation != 1)
      throw nb::value_error(
          ("activation: expected 0 (swiglu) or 1 (geglu), got " + str(activation)).c_str());
    if (std::isnan(activation_clamp) || activation_clamp <= 0)
      throw nb::value_error("activation_clamp: expected a positive value (inf = no clamp)");
    check_tensor("out", out, bfloat16_dtype(), {rows, -1}, device);
    if (static_cast<int64_t>(out.shape(1)) != n_base / 2)
      throw nb::value_error(
          ("out: expected " + str(n_base / 2) + " columns (I), got " + str(out.shape(1))).c_str());
    if (preact_out) {
      check_tensor("preact_out", *preact_out, bfloat16_dtype(), {rows, n_base}, device);
      params.preact_out = preact_out->data();
    }
    if (side_b) {
      // [E, 2I, 2r]: the block-diagonal side weights in w13's row order.
      check_tensor("side_b", *side_b, bfloat16_dtype(), {experts, n_base, -1}, device);
      side_k = side_b->shape(2);
      if (side_k % 16 != 0 || k_base + side_k > lda)
        throw nb::value_error(("side_b: K " + str(side_k) +
                               " (2 x rank) must be a multiple of 16 with k_base + K <= a's "
                               "columns " +
                               str(lda))
                                  .c_str());
      if (!std::isfinite(side_scale)) throw nb::value_error("side_scale: expected a finite value");
      params.a_side =
          tma_2d("a ([q1 | q3] columns)", static_cast<const uint16_t*>(a.data()) + k_base, rows,
                 side_k, lda, block_m);
      params.b_side =
          tma_2d("side_b", side_b->data(), experts * n_base, side_k, side_k, kernels.block_n);
    }
  } else {
    if (preact_out) throw nb::value_error("preact_out: only the gated epilogue stores it");
    if (side_b) throw nb::value_error("side_b: the K side segment needs the gated epilogue");
    if (b_extra && b_major_mn) {
      // [E, K, N_x], read as stored like b.
      check_tensor("b_extra", *b_extra, bfloat16_dtype(), {experts, k_base, -1}, device);
      n_extra = b_extra->shape(2);
      if (n_extra % 8 != 0)
        throw nb::value_error(
            ("b_extra: an MN-major extra segment needs N a multiple of 8 (16-byte rows), got " +
             str(n_extra))
                .c_str());
      params.b_extra = tma_3d("b_extra", b_extra->data(), experts, k_base, n_extra);
    } else if (b_extra) {
      check_tensor("b_extra", *b_extra, bfloat16_dtype(), {experts, -1, k_base}, device);
      n_extra = b_extra->shape(1);
      params.b_extra =
          tma_2d("b_extra", b_extra->data(), experts * n_extra, k_base, k_base, kernels.block_n);
    }
    if ((n_base + n_extra) % 2 != 0 || n_base % 2 != 0)
      throw nb::value_error("b: output columns must be even (BF16 pairs are stored together)");
    check_tensor("out", out, bfloat16_dtype(), {rows, n_base + n_extra}, device);
  }

  params.a = tma_2d("a", a.data(), rows, k_base, lda, block_m);
  set_b_operand(params, b, b_scales, experts, k_base, n_base, kernels.block_n, b_major_mn);
  params.expert_pool_offsets = static_cast<const int32_t*>(expert_pool_offsets.data());
  params.out = out.data();
  params.out_stride = out.shape(1);
  params.num_experts = static_cast<int32_t>(experts);
  params.pool_rows = static_cast<int32_t>(rows);
  params.k_base = static_cast<int32_t>(k_base);
  params.n_base = static_cast<int32_t>(n_base);
  params.n_extra = static_cast<int32_t>(n_extra);
  params.side_k = static_cast<int32_t>(side_k);
  params.side_scale = static_cast<float>(side_scale);
  params.activation = activation;
  params.activation_clamp = static_cast<float>(activation_clamp);

  launch_persistent(kernels.kernel, params, kernels.num_threads, kernels.smem_bytes, device,
                    num_sms, stream, "grouped_gemm launch");
}

// dgrad2 with the activation backward as its epilogue (Epilogue::ActivationBackward):
// z = a @ b_e with b [E, K, I] MN-major (w2 as stored, or [w2 ; a2^T]), consumed in
// registers; writes dg | du, w h (optional) and the router dot's per-tile partials.
void grouped_gemm_activation_backward(const Tensor& a, const Tensor& b,
                                      const Tensor& expert_pool_offsets, const Tensor& preact,
                                      const Tensor& route_weights, const Tensor& pool_row_to_route,
                                      const Tensor& dgrad_preact, std::optional<Tensor> weighted_h,
                                      const Tensor& drouter_partials, int block_m, int block_n,
                                      int activation, double activation_clamp,
                                      std::optional<Tensor> b_scales, int num_sms,
                                      uintptr_t stream) {
  const int device = a.device_id();
  check_tensor("a", a, bfloat16_dtype(), {-1, -1}, device);
  const int64_t rows = a.shape(0), lda = a.shape(1);
  // BF16 b [E, K, I], or MXFP4 codes [E, K, I/2] with scales [E, I/32, K] (transposed).
  const bool mxfp4 = b_scales.has_value();
  if (mxfp4)
    check_tensor<uint8_t>("b", b, {-1, -1, -1}, device);
  else
    check_tensor("b", b, bfloat16_dtype(), {-1, -1, -1}, device);
  const int64_t experts = b.shape(0), k_base = b.shape(1),
                intermediate = b.shape(2) * (mxfp4 ? 2 : 1);
  if (mxfp4) {
    if (k_base % kGemmBlockK != 0)
      throw nb::value_error(("b: an MXFP4 B needs K a multiple of 64, got " + str(k_base)).c_str());
    check_tensor<uint8_t>("b_scales", *b_scales, {experts, intermediate / 32, k_base}, device);
  }
  if (k_base < 8 || k_base % 8 != 0 || k_base > lda)
    throw nb::value_error(
        ("b: expected K a multiple of 8 in [8, " + str(lda) + "] (a's columns), got " + str(k_base))
            .c_str());
  if (intermediate % 64 != 0)
    throw nb::value_error(
        ("b: expected I a multiple of 64 (the gate/up interleave), got " + str(intermediate))
            .c_str());
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {experts + 1}, device);
  if (rows % block_m != 0)
    throw nb::value_error(
        ("a: pool rows " + str(rows) + " are not a multiple of BLOCK_M " + str(block_m)).c_str());
  check_tensor("preact", preact, bfloat16_dtype(), {rows, 2 * intermediate}, device);
  check_tensor<float>("route_weights", route_weights, {-1}, device);
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {rows}, device);
  check_tensor("dgrad_preact", dgrad_preact, bfloat16_dtype(), {rows, 2 * intermediate}, device);
  if (weighted_h)
    check_tensor("weighted_h", *weighted_h, bfloat16_dtype(), {rows, intermediate}, device);
  if (activation != 0 && activation != 1)
    throw nb::value_error(
        ("activation: expected 0 (swiglu) or 1 (geglu), got " + str(activation)).c_str());
  if (std::isnan(activation_clamp) || activation_clamp <= 0)
    throw nb::value_error("activation_clamp: expected a positive value (inf = no clamp)");
  const GroupedGemmKernels& kernels =
      select_variant(block_m, block_n, Epilogue::ActivationBackward, BMajor::MN,
                     mxfp4 ? BFormat::MXFP4 : BFormat::BF16);
  const int64_t n_blocks = (intermediate + kernels.block_n - 1) / kernels.block_n;
  check_tensor<float>("drouter_partials", drouter_partials, {rows, n_blocks}, device);

  GroupedGemmParams params{};
  params.a = tma_2d("a", a.data(), rows, k_base, lda, block_m);
  set_b_operand(params, b, b_scales, experts, k_base, intermediate, kernels.block_n, true);
  params.expert_pool_offsets = static_cast<const int32_t*>(expert_pool_offsets.data());
  params.out = nullptr;
  params.out_stride = 0;
  params.num_experts = static_cast<int32_t>(experts);
  params.pool_rows = static_cast<int32_t>(rows);
  params.k_base = static_cast<int32_t>(k_base);
  params.n_base = static_cast<int32_t>(intermediate);
  params.activation = activation;
  params.activation_clamp = static_cast<float>(activation_clamp);
  params.preact = preact.data();
  params.route_weights = static_cast<const float*>(route_weights.data());
  params.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  params.num_routes = route_weights.shape(0);
  params.dgrad_preact = dgrad_preact.data();
  params.weighted_h = weighted_h ? weighted_h->data() : nullptr;
  params.drouter_partials = static_cast<float*>(drouter_partials.data());
  launch_persistent(kernels.kernel, params, kernels.num_threads, kernels.smem_bytes, device,
                    num_sms, stream, "grouped_gemm_activation_backward launch");
}

}  // namespace

void register_grouped_gemm(nb::module_& m) {
  m.def("grouped_gemm", &grouped_gemm, nb::arg("a"), nb::arg("k_base"), nb::arg("b"),
        nb::arg("expert_pool_offsets"), nb::arg("out"), nb::arg("block_m"), nb::arg("block_n"),
        nb::arg("gated"), nb::arg("activation"), nb::arg("activation_clamp"),
        nb::arg("b_extra").none(), nb::arg("side_b").none(), nb::arg("side_scale"),
        nb::arg("preact_out").none(), nb::arg("b_major_mn"), nb::arg("b_scales").none(),
        nb::arg("num_sms"), nb::arg("stream"),
        "Grouped GEMM over the expert pool (see kernels/grouped_gemm_params.h).");
  m.def("grouped_gemm_activation_backward", &grouped_gemm_activation_backward, nb::arg("a"),
        nb::arg("b"), nb::arg("expert_pool_offsets"), nb::arg("preact"), nb::arg("route_weights"),
        nb::arg("pool_row_to_route"), nb::arg("dgrad_preact"), nb::arg("weighted_h").none(),
        nb::arg("drouter_partials"), nb::arg("block_m"), nb::arg("block_n"), nb::arg("activation"),
        nb::arg("activation_clamp"), nb::arg("b_scales").none(), nb::arg("num_sms"),
        nb::arg("stream"), "dgrad2 with the activation backward as its epilogue (MN-major B).");
}

}  // namespace megamoe
