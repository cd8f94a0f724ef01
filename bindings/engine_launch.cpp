// Host launchers of the GEMM engine (kernels/engine/): one per GEMM kind of the layer.
// Each checks its operands once, builds the tensor maps and parameter blocks
// (kernels/engine/engine_params.h), selects the registry variant and launches
// persistently on the caller's stream.
#include "engine_launch.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "gemm_launch.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

constexpr int kBlockN = 256;  // every pool kind's tile width
constexpr int kBlockK = kGemmBlockK;

std::string str(int64_t v) { return std::to_string(v); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The variant for a pool padded to `block_m` rows. An MXFP4 B runs 64-row tiles (a
// warpgroup decodes it: kernels/engine/engine_kernel.cuh), which tile any pool.
const EngineKernels& select_variant(EngineKind kind, BFormat format, int block_m, int block_n) {
  if (format == BFormat::MXFP4 && block_m % 64 == 0) block_m = 64;
  for (const auto& variant : variants::kEngineVariants) {
    const EngineKernels& k = *variant.kernels;
    if (k.kind == kind && k.b_format == format && k.block_m == block_m && k.block_n == block_n)
      return k;
  }
  throw nb::value_error(("block_m: no engine variant for BLOCK_M " + str(block_m) + ", BLOCK_N " +
                         str(block_n) + (format == BFormat::MXFP4 ? " with an MXFP4 B" : ""))
                            .c_str());
}

// A BF16 [rows, cols] operand whose rows may be spaced wider than its columns.
void check_rows(const char* name, const Tensor& t, int64_t rows, int device) {
  if (t.dtype() != bfloat16_dtype())
    throw nb::type_error(
        (std::string(name) + ": expected dtype bfloat16, got " + dtype_name(t.dtype())).c_str());
  if (t.ndim() != 2 || (rows >= 0 && static_cast<int64_t>(t.shape(0)) != rows))
    throw nb::value_error((std::string(name) + ": expected shape [" +
                           (rows >= 0 ? str(rows) : std::string("*")) + ", *], got " +
                           shape_string(t))
                              .c_str());
  if (t.stride(1) != 1 || t.stride(0) < static_cast<int64_t>(t.shape(1)))
    throw nb::value_error(
        (std::string(name) + ": expected unit column stride and a row stride >= the columns")
            .c_str());
  if (t.device_id() != device)
    throw nb::value_error((std::string(name) + ": expected cuda:" + std::to_string(device) +
                           ", got cuda:" + std::to_string(t.device_id()))
                              .c_str());
}

// The pool schedule shared by the pool kinds: the plan's offsets, the rows in use
// clamped to the pool on the device.
ScheduleParams pool_schedule(const Tensor& offsets, int64_t experts, int64_t pool_rows, int block_m,
                             int group_m, int64_t n_base, int64_t n_extra, int64_t side_k,
                             int64_t k_base, int device) {
  check_tensor<int32_t>("expert_pool_offsets", offsets, {experts + 1}, device);
  if (pool_rows % block_m != 0)
    throw nb::value_error(
        ("a: pool rows " + str(pool_rows) + " are not a multiple of BLOCK_M " + str(block_m))
            .c_str());
  if (pool_rows >= (int64_t{1} << 31)) throw nb::value_error("a: more than 2^31 - 1 pool rows");
  if (group_m < 1) throw nb::value_error("group_m: expected >= 1");
  ScheduleParams s{};
  s.expert_pool_offsets = static_cast<const int32_t*>(offsets.data());
  s.num_experts = static_cast<int32_t>(experts);
  s.pool_rows = static_cast<int32_t>(pool_rows);
  s.n_base_blocks = static_cast<int32_t>(ceil_div(n_base, kBlockN));
  s.n_extra_blocks = static_cast<int32_t>(ceil_div(n_extra, kBlockN));
  s.group_m = group_m;
  s.side_steps = static_cast<int32_t>(ceil_div(side_k, kBlockK));
  s.base_steps = static_cast<int32_t>(ceil_div(k_base, kBlockK));
  return s;
}

// The output [P, n_base (+ n_extra)]: its base columns and its extra columns as two maps.
void set_store_outputs(EpilogueParams& e, const Tensor& out, int64_t rows, int64_t n_base,
                       int64_t n_extra, int block_m, int device) {
  check_tensor("out", out, bfloat16_dtype(), {rows, n_base + n_extra}, device);
  const int64_t stride = n_base + n_extra;
  e.out = bf16_rows("out", out.data(), rows, n_base, stride, block_m);
  if (n_extra > 0) {
    if (n_base % 8 != 0)
      throw nb::value_error(
          ("b: N extra columns need N a multiple of 8 (16-byte aligned), got " + str(n_base))
              .c_str());
    e.out_extra =
        bf16_rows("out (extra columns)", static_cast<const uint16_t*>(out.data()) + n_base, rows,
                  n_extra, stride, block_m);
  }
}

// A BF16 [E, N, K] operand as stored (nn.Linear-like), read K-major in [64 K, BLOCK_N
// rows] boxes.
CUtensorMap k_major_map(const char* name, const Tensor& w, int device) {
  check_tensor(name, w, bfloat16_dtype(), {-1, -1, -1}, device);
  const int64_t e = w.shape(0), n = w.shape(1), k = w.shape(2);
  return tensor_map(name, w.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {k, n, e}, {k * 2, n * k * 2},
                    {kBlockK, kBlockN, 1}, true);
}

// The decoding warps address the scales with 32-bit offsets.
void check_scale_bytes(const char* name, const Tensor& scales) {
  if (scales.nbytes() >= (size_t{1} << 31))
    throw nb::value_error((std::string(name) + ": more than 2^31 - 1 bytes").c_str());
}

// MXFP4 weights as stored (codes [E, K, N/2], scales [E, K, N/32]), read MN-major: per K
// step the codes box [64 K rows, BLOCK_N / 2 bytes]; the decoding warps read the scales
// from global memory.
void set_mn_major_mxfp4(OperandParams& o, const Tensor& codes, const Tensor& scales,
                        int64_t experts, int64_t k, int64_t n, int device) {
  check_tensor<uint8_t>("b", codes, {experts, k, n / 2}, device);
  check_tensor<uint8_t>("b_scales", scales, {experts, k, n / 32}, device);
  check_scale_bytes("b_scales", scales);
  if (k % kBlockK != 0 || n % 32 != 0)
    throw nb::value_error(("b: an MN-major MXFP4 B needs K a multiple of 64 and N of 32, got K=" +
                           str(k) + ", N=" + str(n))
                              .c_str());
  o.codes = tensor_map("b", codes.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {n / 2, experts * k},
                       {n / 2}, {kBlockN / 2, kBlockK}, false);
  o.scales = static_cast<const uint8_t*>(scales.data());
}

#ifdef MEGAMOE_ENGINE_PROBE
// Diagnostic builds: every engine launch writes its role cycle counters
// (kernels/engine/role_probe.cuh) into one buffer, cleared before the launch. The buffer
// is allocated on the device current at the first launch and not during CUDA-graph
// capture (cudaMalloc is not capturable): a probe build is for eager, one-GPU runs.
constexpr int kProbeCtas = 1024;
uint64_t* probe_buffer() {
  static uint64_t* buffer = nullptr;
  if (buffer == nullptr)
    cuda_check(cudaMalloc(&buffer, kProbeCtas * kProbeSlots * sizeof(uint64_t)), "probe buffer");
  return buffer;
}

// The last launch's counters, [num_sms][16] (waits for the device).
std::vector<uint64_t> engine_probe_read(int num_sms) {
  if (num_sms < 1 || num_sms > kProbeCtas) throw nb::value_error("num_sms: expected 1..1024");
  std::vector<uint64_t> out(static_cast<size_t>(num_sms) * kProbeSlots);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cuda_check(
      cudaMemcpy(out.data(), probe_buffer(), out.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost),
      "cudaMemcpy(probe)");
  return out;
}
#endif

void launch(const EngineKernels& k, EngineParams params, int device, int num_sms, uintptr_t stream,
            const char* what) {
#ifdef MEGAMOE_ENGINE_PROBE
  if (num_sms > kProbeCtas) throw nb::value_error("num_sms: a probe build takes at most 1024");
  params.probe = probe_buffer();
  cuda_check(cudaMemsetAsync(params.probe, 0, kProbeCtas * kProbeSlots * sizeof(uint64_t),
                             reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemsetAsync(probe)");
#endif
  launch_persistent(k.kernel, params, k.num_threads, k.smem_bytes, device, num_sms, stream, what);
}

// GEMM1: h = act(g) * u, g | u = [x | q1 | q3] . [w13_e ; side] (EngineKind::Gated).
void engine_gated(const Tensor& a, int64_t k_base, const Tensor& w13,
                  std::optional<Tensor> w13_scales, const Tensor& offsets, const Tensor& h,
                  std::optional<Tensor> preact, std::optional<Tensor> side_gate,
                  std::optional<Tensor> side_up, double side_scale, int activation,
                  double activation_clamp, int block_m, int group_m, int num_sms,
                  uintptr_t stream) {
  const int device = a.device_id();
  check_rows("a", a, -1, device);
  const int64_t rows = a.shape(0);
  const bool mxfp4 = w13_scales.has_value();
  if (mxfp4)
    check_tensor<uint8_t>("w13", w13, {-1, -1, k_base / 2}, device);
  else
    check_tensor("w13", w13, bfloat16_dtype(), {-1, -1, k_base}, device);
  const int64_t experts = w13.shape(0), two_i = w13.shape(1), inter = two_i / 2;
  if (k_base < kBlockK || k_base % kBlockK != 0)
    throw nb::value_error(("k_base: expected a multiple of 64, got " + str(k_base)).c_str());
  if (two_i % 2 != 0 || inter % 64 != 0)
    throw nb::value_error(
        ("w13: expected 2I rows with I a multiple of 64, got " + str(two_i)).c_str());
  check_activation(activation, activation_clamp);
  const int64_t rank =
      check_gated_side(side_gate, side_up, side_scale, experts, inter, k_base, a, device);
  const int64_t side_k = 2 * rank;
  check_tensor("h", h, bfloat16_dtype(), {rows, inter}, device);
  const EngineKernels& kernels =
      select_variant(EngineKind::Gated, mxfp4 ? BFormat::MXFP4 : BFormat::BF16, block_m, kBlockN);

  EngineParams p{};
  // A gated tile is BLOCK_N / 2 gate and as many up rows of w13: 2I / BLOCK_N tiles.
  p.schedule = pool_schedule(offsets, experts, rows, kernels.block_m, group_m, 2 * inter, 0, side_k,
                             k_base, device);
  OperandParams& o = p.operands;
  o.a = bf16_rows("a", a.data(), rows, k_base + side_k, a.stride(0), kernels.block_m);
  if (mxfp4) {
    check_tensor<uint8_t>("w13_scales", *w13_scales, {experts, two_i, k_base / 32}, device);
    check_scale_bytes("w13_scales", *w13_scales);
    o.codes = tensor_map("w13", w13.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8,
                         {k_base / 2, inter, 2, experts},
                         {k_base / 2, inter * k_base / 2, two_i * k_base / 2},
                         {kBlockK / 2, kBlockN / 2, 1, 1}, false);
    o.scales = static_cast<const uint8_t*>(w13_scales->data());
  } else {
    o.b = tensor_map(
        "w13", w13.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {k_base, inter, 2, experts},
        {k_base * 2, inter * k_base * 2, two_i * k_base * 2}, {kBlockK, kBlockN / 2, 1, 1}, true);
  }
  if (side_gate) {
    o.side_gate = mn_major_map("side_gate", *side_gate, device);
    o.side_up = mn_major_map("side_up", *side_up, device);
  }
  o.k_base = static_cast<int32_t>(k_base);
  o.side_rank = static_cast<int32_t>(rank);
  o.n_base = static_cast<int32_t>(inter);
  o.side_scale = static_cast<float>(side_scale);

  EpilogueParams& e = p.epilogue;
  const int tile_m = kernels.block_m;
  e.out = bf16_rows("h", h.data(), rows, inter, inter, tile_m);
  if (preact) {
    check_tensor("preact_out", *preact, bfloat16_dtype(), {rows, two_i}, device);
    e.preact_gate = bf16_rows("preact_out", preact->data(), rows, inter, two_i, tile_m);
    e.preact_up = bf16_rows("preact_out", static_cast<const uint16_t*>(preact->data()) + inter,
                            rows, inter, two_i, tile_m);
    e.store_preact = 1;
  }
  e.activation = activation;
  e.activation_clamp = static_cast<float>(activation_clamp);
  launch(kernels, p, device, num_sms, stream, "engine_gated launch");
}

// out = a . b_e^T (K-major b [E, N, K]) or a . b_e (MN-major b [E, K, N]), Store epilogue
// (EngineKind::StoreKMajor/MNMajor), plus N extra columns: K-major b, a . b_extra_e
// (b_extra [E, K, N_x]); MN-major b, the two K-major blocks on the diagonal
// (a[:, :K_lo] . b_extra_e^T | a[:, K_lo:] . b_extra_hi_e^T), b_extra [E, N_lo, K_lo] and
// b_extra_hi [E, N_hi, K - K_lo].
void engine_store(const Tensor& a, int64_t k_base, const Tensor& b, std::optional<Tensor> b_scales,
                  bool b_major_mn, std::optional<Tensor> b_extra, std::optional<Tensor> b_extra_hi,
                  const Tensor& offsets, const Tensor& out, int block_m, int group_m, int num_sms,
                  uintptr_t stream) {
  const int device = a.device_id();
  check_rows("a", a, -1, device);
  const int64_t rows = a.shape(0);
  const bool mxfp4 = b_scales.has_value();
  if (k_base < 8 || k_base % 8 != 0 || k_base > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(("k_base: expected a multiple of 8 in [8, " + str(a.shape(1)) +
                           "] (a's columns), got " + str(k_base))
                              .c_str());
  if (mxfp4 && k_base % kBlockK != 0)
    throw nb::value_error(
        ("k_base: an MXFP4 B needs K a multiple of 64, got " + str(k_base)).c_str());
  // nanobind's shape(i) is unchecked: the rank first, before any dimension is read.
  if (b.ndim() != 3) throw nb::value_error("b: expected 3 dimensions [E, N, K] or [E, K, N]");
  const int64_t experts = b.shape(0);
  int64_t n_base = 0;
  if (b_major_mn)
    n_base = b.shape(2) * (mxfp4 ? 2 : 1);
  else
    n_base = b.shape(1);
  int64_t n_extra = 0, extra_k_lo = 0, extra_n_lo = 0;
  if (b_extra_hi.has_value() && !(b_major_mn && b_extra.has_value()))
    throw nb::value_error("b_extra_hi: only with an MN-major b and b_extra (the diagonal blocks)");
  if (b_extra && b_major_mn) {
    if (!b_extra_hi) throw nb::value_error("b_extra_hi: an MN-major b's extra needs both blocks");
    check_tensor("b_extra", *b_extra, bfloat16_dtype(), {experts, -1, -1}, device);
    extra_n_lo = b_extra->shape(1);
    extra_k_lo = b_extra->shape(2);
    if (extra_k_lo < kBlockK || extra_k_lo % kBlockK != 0 || extra_k_lo >= k_base)
      throw nb::value_error(("b_extra: expected K_lo a multiple of 64 below K=" + str(k_base) +
                             ", got " + str(extra_k_lo))
                                .c_str());
    check_tensor("b_extra_hi", *b_extra_hi, bfloat16_dtype(), {experts, -1, k_base - extra_k_lo},
                 device);
    n_extra = extra_n_lo + b_extra_hi->shape(1);
  } else if (b_extra) {
    // [E, K, N_x], read MN-major.
    check_tensor("b_extra", *b_extra, bfloat16_dtype(), {experts, k_base, -1}, device);
    n_extra = b_extra->shape(2);
  }
  if (n_extra % 8 != 0)
    throw nb::value_error(
        ("b_extra: expected N_x a multiple of 8 (16-byte rows), got " + str(n_extra)).c_str());
  if (n_base % 8 != 0)
    throw nb::value_error(("b: expected N a multiple of 8, got " + str(n_base)).c_str());
  const EngineKind kind = b_major_mn ? EngineKind::StoreMNMajor : EngineKind::StoreKMajor;
  const EngineKernels& kernels =
      select_variant(kind, mxfp4 ? BFormat::MXFP4 : BFormat::BF16, block_m, kBlockN);

  EngineParams p{};
  p.schedule = pool_schedule(offsets, experts, rows, kernels.block_m, group_m, n_base, n_extra, 0,
                             k_base, device);
  OperandParams& o = p.operands;
  o.a = bf16_rows("a", a.data(), rows, k_base, a.stride(0), kernels.block_m);
  o.k_base = static_cast<int32_t>(k_base);
  o.n_base = static_cast<int32_t>(n_base);
  o.side_scale = 1.0f;
  if (b_major_mn) {
    if (mxfp4)
      set_mn_major_mxfp4(o, b, *b_scales, experts, k_base, n_base, device);
    else {
      check_tensor("b", b, bfloat16_dtype(), {experts, k_base, n_base}, device);
      o.b = mn_major_map("b", b, device);
    }
  } else {
    if (mxfp4) {
      check_tensor<uint8_t>("b", b, {experts, n_base, k_base / 2}, device);
      check_tensor<uint8_t>("b_scales", *b_scales, {experts, n_base, k_base / 32}, device);
      check_scale_bytes("b_scales", *b_scales);
      o.codes =
          tensor_map("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_UINT8, {k_base / 2, n_base, experts},
                     {k_base / 2, n_base * k_base / 2}, {kBlockK / 2, kBlockN, 1}, false);
      o.scales = static_cast<const uint8_t*>(b_scales->data());
    } else {
      check_tensor("b", b, bfloat16_dtype(), {experts, n_base, k_base}, device);
      o.b = tensor_map("b", b.data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {k_base, n_base, experts},
                       {k_base * 2, n_base * k_base * 2}, {kBlockK, kBlockN, 1}, true);
    }
  }
  if (b_extra && b_major_mn) {
    o.extra = k_major_map("b_extra", *b_extra, device);
    o.extra_hi = k_major_map("b_extra_hi", *b_extra_hi, device);
    o.extra_k_lo = static_cast<int32_t>(extra_k_lo);
    o.extra_n_lo = static_cast<int32_t>(extra_n_lo);
    o.extra_low_half =
        (2 * extra_n_lo <= kernels.block_n ? 1 : 0) | (2 * n_extra <= kernels.block_n ? 2 : 0);
  } else if (b_extra) {
    o.extra = mn_major_map("b_extra", *b_extra, device);
    o.extra_k_lo = static_cast<int32_t>(k_base);  // one block over all of K
    o.extra_low_half = 2 * n_extra <= kernels.block_n ? 1 : 0;
  }
  set_store_outputs(p.epilogue, out, rows, n_base, n_extra, kernels.block_m, device);
  launch(kernels, p, device, num_sms, stream, "engine_store launch");
}

// dgrad2 + activation backward (EngineKind::ActivationBackward): z = a . [b_e ; side_e^T]
// with b the weights as stored [E, K, I] (BF16 or MXFP4 codes [E, K, I/2]) and side a2
// as given [E, I, r] over a's columns K.. K + r; consumed by the epilogue.
void engine_activation_backward(const Tensor& a, int64_t k_base, const Tensor& b,
                                std::optional<Tensor> b_scales, std::optional<Tensor> side,
                                const Tensor& offsets, const Tensor& preact,
                                const Tensor& row_weights, int64_t num_routes,
                                const Tensor& pool_row_to_route, const Tensor& dgrad_preact,
                                std::optional<Tensor> weighted_h, const Tensor& drouter_partials,
                                int activation, double activation_clamp, int block_m, int group_m,
                                int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  check_rows("a", a, -1, device);
  const int64_t rows = a.shape(0);
  const bool mxfp4 = b_scales.has_value();
  if (b.ndim() != 3) throw nb::value_error("b: expected 3 dimensions [E, K, I]");
  const int64_t experts = b.shape(0);
  const int64_t inter = mxfp4 ? b.shape(2) * 2 : b.shape(2);
  if (k_base < kBlockK || k_base % kBlockK != 0)
    throw nb::value_error(("k_base: expected a multiple of 64, got " + str(k_base)).c_str());
  // The epilogue's row offsets take 2I as a 32-bit int.
  if (inter % 64 != 0 || inter >= (int64_t{1} << 30))
    throw nb::value_error(("b: expected I a multiple of 64 below 2^30, got " + str(inter)).c_str());
  int64_t rank = 0;
  if (side) {
    check_tensor("side_a2", *side, bfloat16_dtype(), {experts, inter, -1}, device);
    rank = side->shape(2);
    if (rank < 8 || rank % 8 != 0)
      throw nb::value_error(("side_a2: rank must be a multiple of 8, got " + str(rank)).c_str());
  }
  if (k_base + rank > static_cast<int64_t>(a.shape(1)))
    throw nb::value_error(
        ("a: expected at least K + r = " + str(k_base + rank) + " columns, got " + str(a.shape(1)))
            .c_str());
  check_activation(activation, activation_clamp);
  check_tensor("preact", preact, bfloat16_dtype(), {rows, 2 * inter}, device);
  check_tensor<float>("row_weights", row_weights, {rows}, device);
  check_tensor<int32_t>("pool_row_to_route", pool_row_to_route, {rows}, device);
  // The epilogue compares routes as unsigned 32-bit (the pool maps int32 route ids).
  if (num_routes < 0 || num_routes > INT32_MAX)
    throw nb::value_error("num_routes: expected 0 to 2^31-1");
  check_tensor("dgrad_preact", dgrad_preact, bfloat16_dtype(), {rows, 2 * inter}, device);
  if (weighted_h) check_tensor("weighted_h", *weighted_h, bfloat16_dtype(), {rows, inter}, device);
  // The epilogue moves these in 16-byte vectors (every row a multiple of 8 elements).
  const std::pair<const char*, const Tensor*> vectors[] = {
      {"preact", &preact},
      {"dgrad_preact", &dgrad_preact},
      {"weighted_h", weighted_h ? &*weighted_h : nullptr}};
  for (const auto& [name, t] : vectors)
    if (t != nullptr && t->size() > 0 && reinterpret_cast<uintptr_t>(t->data()) % 16 != 0)
      throw nb::value_error((std::string(name) + ": expected a 16-byte aligned address").c_str());
  check_tensor<float>("drouter_partials", drouter_partials, {rows, ceil_div(inter, kBlockN)},
                      device);
  const EngineKernels& kernels = select_variant(
      EngineKind::ActivationBackward, mxfp4 ? BFormat::MXFP4 : BFormat::BF16, block_m, kBlockN);

  EngineParams p{};
  p.schedule = pool_schedule(offsets, experts, rows, kernels.block_m, group_m, inter, 0, rank,
                             k_base, device);
  OperandParams& o = p.operands;
  o.a = bf16_rows("a", a.data(), rows, k_base + rank, a.stride(0), kernels.block_m);
  if (mxfp4) {
    set_mn_major_mxfp4(o, b, *b_scales, experts, k_base, inter, device);
  } else {
    check_tensor("b", b, bfloat16_dtype(), {experts, k_base, inter}, device);
    o.b = mn_major_map("b", b, device);
  }
  if (side)  // K-major: [BLOCK_N rows of I][64 of r] boxes
    o.side_gate = tensor_map("side_a2", side->data(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                             {rank, inter, experts}, {rank * 2, inter * rank * 2},
                             {kBlockK, kBlockN, 1}, true);
  o.k_base = static_cast<int32_t>(k_base);
  o.n_base = static_cast<int32_t>(inter);
  o.side_scale = 1.0f;  // the side columns of a carry the adapter scale already

  EpilogueParams& e = p.epilogue;
  e.preact = preact.data();
  e.row_weights = static_cast<const float*>(row_weights.data());
  e.pool_row_to_route = static_cast<const int32_t*>(pool_row_to_route.data());
  e.num_routes = num_routes;
  e.dgrad_preact = dgrad_preact.data();
  e.weighted_h = weighted_h ? weighted_h->data() : nullptr;
  e.drouter_partials = static_cast<float*>(drouter_partials.data());
  e.intermediate = static_cast<int32_t>(inter);
  e.activation = activation;
  e.activation_clamp = static_cast<float>(activation_clamp);
  launch(kernels, p, device, num_sms, stream, "engine_activation_backward launch");
}

// out[e] = scale * a_e^T b_e over each expert's data rows: EngineKind::KGrouped for a BF16
// out, KGroupedFloat for an FP32 one (the sums not rounded).
void engine_k_grouped(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& counts,
                      const Tensor& out, int block_n, double scale, int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  check_rows("a", a, -1, device);
  const int64_t rows = a.shape(0);
  check_rows("b", b, rows, device);
  const int64_t m = a.shape(1), n = b.shape(1);
  if (m % 8 != 0 || n % 8 != 0)
    throw nb::value_error(
        ("a, b: expected columns that are multiples of 8, got " + str(m) + " and " + str(n))
            .c_str());
  check_tensor<int32_t>("expert_pool_offsets", offsets, {-1}, device);
  const int64_t experts = static_cast<int64_t>(offsets.shape(0)) - 1;
  if (experts < 1) throw nb::value_error("expert_pool_offsets: expected E + 1 >= 2 entries");
  check_tensor<int32_t>("expert_counts", counts, {experts}, device);
  const bool float_out = out.dtype() == nb::dtype<float>();
  check_tensor("out", out, float_out ? nb::dtype<float>() : bfloat16_dtype(), {experts, m, n},
               device);
  if (rows >= (int64_t{1} << 31)) throw nb::value_error("a: more than 2^31 - 1 pool rows");
  if (!std::isfinite(static_cast<float>(scale)))
    throw nb::value_error("scale: expected a value finite in float32");
  constexpr int kBlockM = 128;
  const EngineKernels& kernels =
      select_variant(float_out ? EngineKind::KGroupedFloat : EngineKind::KGrouped, BFormat::BF16,
                     kBlockM, block_n);
  const int64_t out_bytes = float_out ? 4 : 2;
  if (rows == 0) {  // no rows, no data: exact zeros (TMA cannot map an empty tensor)
    cuda_check(cudaMemsetAsync(out.data(), 0, static_cast<size_t>(experts * m * n * out_bytes),
                               reinterpret_cast<cudaStream_t>(stream)),
               "cudaMemsetAsync(out)");
    return;
  }
  EngineParams p{};
  ScheduleParams& s = p.schedule;
  s.expert_pool_offsets = static_cast<const int32_t*>(offsets.data());
  s.expert_counts = static_cast<const int32_t*>(counts.data());
  s.num_experts = static_cast<int32_t>(experts);
  s.pool_rows = static_cast<int32_t>(rows);
  s.m_blocks = static_cast<int32_t>(ceil_div(m, kBlockM));
  s.n_base_blocks = static_cast<int32_t>(ceil_div(n, block_n));
  p.operands.a = bf16_rows("a", a.data(), rows, m, a.stride(0), kBlockK);
  p.operands.b = bf16_rows("b", b.data(), rows, n, b.stride(0), kBlockK);
  // Boxes of 128-byte rows (the staging tile's swizzle span): 64 BF16 or 32 FP32 columns.
  p.epilogue.out =
      tensor_map("out", out.data(),
                 float_out ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 {n, m, experts}, {n * out_bytes, m * n * out_bytes},
                 {static_cast<int>(128 / out_bytes), kBlockM, 1}, true);
  p.epilogue.scale = static_cast<float>(scale);
  launch(kernels, p, device, num_sms, stream, "engine_k_grouped launch");
}

}  // namespace

void register_engine(nb::module_& m) {
#ifdef MEGAMOE_ENGINE_PROBE
  m.def("engine_probe_read", &engine_probe_read, nb::arg("num_sms"),
        "The last engine launch's role cycle counters, [num_sms * 16] (a probe build).");
#endif
  m.def("engine_gated", &engine_gated, nb::arg("a"), nb::arg("k_base"), nb::arg("w13"),
        nb::arg("w13_scales").none(), nb::arg("expert_pool_offsets"), nb::arg("h"),
        nb::arg("preact_out").none(), nb::arg("side_gate").none(), nb::arg("side_up").none(),
        nb::arg("side_scale"), nb::arg("activation"), nb::arg("activation_clamp"),
        nb::arg("block_m"), nb::arg("group_m"), nb::arg("num_sms"), nb::arg("stream"),
        "GEMM1 + side K segment + gated activation over the pool (kernels/engine).");
  m.def("engine_store", &engine_store, nb::arg("a"), nb::arg("k_base"), nb::arg("b"),
        nb::arg("b_scales").none(), nb::arg("b_major_mn"), nb::arg("b_extra").none(),
        nb::arg("b_extra_hi").none(), nb::arg("expert_pool_offsets"), nb::arg("out"),
        nb::arg("block_m"), nb::arg("group_m"), nb::arg("num_sms"), nb::arg("stream"),
        "Pool GEMM with the store epilogue (+ N extra columns).");
  m.def("engine_activation_backward", &engine_activation_backward, nb::arg("a"), nb::arg("k_base"),
        nb::arg("b"), nb::arg("b_scales").none(), nb::arg("side_b").none(),
        nb::arg("expert_pool_offsets"), nb::arg("preact"), nb::arg("row_weights"),
        nb::arg("num_routes"), nb::arg("pool_row_to_route"), nb::arg("dgrad_preact"),
        nb::arg("weighted_h").none(), nb::arg("drouter_partials"), nb::arg("activation"),
        nb::arg("activation_clamp"), nb::arg("block_m"), nb::arg("group_m"), nb::arg("num_sms"),
        nb::arg("stream"), "dgrad2 with the activation backward as its epilogue.");
  m.def("engine_k_grouped", &engine_k_grouped, nb::arg("a"), nb::arg("b"),
        nb::arg("expert_pool_offsets"), nb::arg("expert_counts"), nb::arg("out"),
        nb::arg("block_n"), nb::arg("scale"), nb::arg("num_sms"), nb::arg("stream"),
        "K-grouped sums out[e] = scale * a_e^T b_e over each expert's data rows (BF16 or FP32 "
        "out).");
}

}  // namespace megamoe
