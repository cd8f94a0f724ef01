// The nanobind module megamoe._C: torch-free (DLPack tensors, streams as integers),
// so one build serves every torch version of an integration pin.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "cuda_check.h"
#include "engine_launch.h"
#include "mxfp4_decode.h"
#include "pool_ops.h"
#include "route_plan.h"
#include "variant_table.h"
#include "weight_stream_launch.h"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "megamoe device kernels for sm_90a (host launchers; tensors via DLPack)";

  m.def("variant_names", [] {
    std::vector<std::string> names;
    for (const char* name : megamoe::variants::kVariantNames) names.emplace_back(name);
    return names;
  });
  m.def("block_m_choices", [] {
    std::vector<int> choices;
    for (int choice : megamoe::variants::kBlockMChoices) choices.push_back(choice);
    return choices;
  });
  m.def(
      "cuda_runtime_version",
      [] {
        int version = 0;
        megamoe::cuda_check(cudaRuntimeGetVersion(&version), "cudaRuntimeGetVersion");
        return version;
      },
      "Version of the CUDA runtime linked into the module (e.g. 13000).");
  m.def(
      "device_sm_count",
      [](int device) {
        int count = 0;
        megamoe::cuda_check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
                            "cudaDeviceGetAttribute(MultiProcessorCount)");
        return count;
      },
      nb::arg("device"));
  m.def(
      "device_compute_capability",
      [](int device) {
        int major = 0, minor = 0;
        megamoe::cuda_check(
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
            "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
        megamoe::cuda_check(
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
            "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
        return major * 10 + minor;
      },
      nb::arg("device"));

  m.def("route_plan_num_tiles", &megamoe::route_plan_num_tiles, nb::arg("num_routes"));
  m.def("route_plan", &megamoe::route_plan, nb::arg("topk_ids"), nb::arg("expert_begin"),
        nb::arg("num_local_experts"), nb::arg("block_m"), nb::arg("tile_expert_counts"),
        nb::arg("expert_counts"), nb::arg("expert_pool_offsets"), nb::arg("route_to_pool_row"),
        nb::arg("pool_row_to_route"), nb::arg("tile_id_extremes").none(),
        nb::arg("id_extremes_host"), nb::arg("stream"),
        "Stable counting sort of routes by local expert (three launches on `stream`), and "
        "optionally the ids' [min, max] into pinned host memory.");

  megamoe::register_pool_ops(m);
  megamoe::register_engine(m);
  megamoe::register_mxfp4_decode(m);
  megamoe::register_weight_stream(m);
}
