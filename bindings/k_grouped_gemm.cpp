// Host launcher of the K-grouped weight-gradient GEMM: checks the operands, builds the
// TMA descriptors of the two pool-shaped operands, selects the registry variant and
// launches persistently on the caller's stream.
#include "k_grouped_gemm.h"

#include <cmath>
#include <string>

#include "gemm_launch.h"
#include "tensor_checks.h"
#include "variant_table.h"

namespace megamoe {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// A [rows, cols] BF16 operand whose rows may be spaced wider than its columns (a column
// slice of a wider pool, like dout's columns of the [dout | s dout b2^T] pool).
void check_row_operand(const char* name, const Tensor& t, int64_t rows, int device) {
  if (t.dtype() != bfloat16_dtype())
    throw nb::type_error(
        (std::string(name) + ": expected dtype bfloat16, got " + dtype_name(t.dtype())).c_str());
  if (t.ndim() != 2 || static_cast<int64_t>(t.shape(0)) != rows)
    throw nb::value_error(
        (std::string(name) + ": expected shape [" + str(rows) + ", *], got " + shape_string(t))
            .c_str());
  if (t.shape(1) < 2 || t.shape(1) % 2 != 0)
    throw nb::value_error(
        (std::string(name) + ": expected an even number of columns >= 2, got " + str(t.shape(1)))
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

const KGroupedGemmKernels& select_variant(int block_m, int block_n) {
  for (const auto& variant : variants::kKGroupedGemmVariants) {
    const KGroupedGemmKernels& k = *variant.kernels;
    if (k.block_m == block_m && k.block_n == block_n) return k;
  }
  throw nb::value_error(("block_m/block_n: no K-grouped GEMM variant for BLOCK_M " + str(block_m) +
                         ", BLOCK_N " + str(block_n))
                            .c_str());
}

// out[e] = scale * a_e^T b_e over expert e's data rows (kernels/k_grouped_gemm_params.h).
void k_grouped_gemm(const Tensor& a, const Tensor& b, const Tensor& expert_pool_offsets,
                    const Tensor& expert_counts, const Tensor& out, int block_m, int block_n,
                    double scale, int num_sms, uintptr_t stream) {
  const int device = a.device_id();
  if (a.ndim() != 2) throw nb::value_error(("a: expected 2 dims, got " + shape_string(a)).c_str());
  const int64_t rows = a.shape(0);
  check_row_operand("a", a, rows, device);
  check_row_operand("b", b, rows, device);
  const int64_t m = a.shape(1), n = b.shape(1);
  check_tensor<int32_t>("expert_pool_offsets", expert_pool_offsets, {-1}, device);
  const int64_t experts = static_cast<int64_t>(expert_pool_offsets.shape(0)) - 1;
  if (experts < 1) throw nb::value_error("expert_pool_offsets: expected E + 1 >= 2 entries");
  check_tensor<int32_t>("expert_counts", expert_counts, {experts}, device);
  check_tensor("out", out, bfloat16_dtype(), {experts, m, n}, device);
  if (rows >= (int64_t{1} << 31)) throw nb::value_error("a: more than 2^31 - 1 pool rows");
  if (!std::isfinite(static_cast<float>(scale)))
    throw nb::value_error("scale: expected a value finite in float32");
  if (reinterpret_cast<uintptr_t>(out.data()) % 4 != 0)
    throw nb::value_error("out: expected a 4-byte aligned address (BF16 pairs are stored)");
  const KGroupedGemmKernels& kernels = select_variant(block_m, block_n);
  if (rows == 0) {  // no rows, no data: exact zeros (TMA cannot map an empty tensor)
    cuda_check(cudaMemsetAsync(out.data(), 0, static_cast<size_t>(experts * m * n) * 2,
                               reinterpret_cast<cudaStream_t>(stream)),
               "cudaMemsetAsync(out)");
    return;
  }

  KGroupedGemmParams params{};
  params.a = tma_2d("a", a.data(), rows, m, a.stride(0), kGemmBlockK);
  params.b = tma_2d("b", b.data(), rows, n, b.stride(0), kGemmBlockK);
  params.expert_pool_offsets = static_cast<const int32_t*>(expert_pool_offsets.data());
  params.expert_counts = static_cast<const int32_t*>(expert_counts.data());
  params.out = out.data();
  params.out_stride = n;
  params.out_expert_stride = m * n;
  params.num_experts = static_cast<int32_t>(experts);
  params.pool_rows = static_cast<int32_t>(rows);
  params.m = static_cast<int32_t>(m);
  params.n = static_cast<int32_t>(n);
  params.scale = static_cast<float>(scale);
  launch_persistent(kernels.kernel, params, kernels.num_threads, kernels.smem_bytes, device,
                    num_sms, stream, "k_grouped_gemm launch");
}

}  // namespace

void register_k_grouped_gemm(nb::module_& m) {
  m.def("k_grouped_gemm", &k_grouped_gemm, nb::arg("a"), nb::arg("b"),
        nb::arg("expert_pool_offsets"), nb::arg("expert_counts"), nb::arg("out"),
        nb::arg("block_m"), nb::arg("block_n"), nb::arg("scale"), nb::arg("num_sms"),
        nb::arg("stream"),
        "K-grouped weight gradients out[e] = scale * a_e^T b_e over each expert's data rows.");
}

}  // namespace megamoe
