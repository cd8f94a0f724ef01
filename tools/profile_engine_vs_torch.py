"""The engine's plain pool GEMMs beside ``torch._grouped_mm`` on the same products, for
Nsight Compute: how busy each keeps the tensor pipes, and its cycles and bytes.

    ncu -k regex:"engine_kernel|device_kernel" --metrics \\
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,\\
        gpc__cycles_elapsed.max,lts__t_bytes.sum,dram__bytes.sum,\\
        lts__throughput.avg.pct_of_peak_sustained_elapsed \\
        python tools/profile_engine_vs_torch.py

A quarter of the ep4rank pool (16,384 tokens, top-6 over 16 experts, balanced: 6,144
rows per expert, no padding, so torch reads exactly the engine's rows), H = 4096, I =
2048. Two rounds of: dgrad2's product ``[P, H] x [E, H, I]`` (B MN-major) and GEMM1's
product without its epilogue ``[P, H] x [E, 2I, H]^T`` (B K-major), each by the engine
and by torch. ncu runs at its locked base clock, so the cycle counts compare the
kernels without the power cap's clock changes (docs/PERFORMANCE.md, sixteenth
session). GPU only.
"""

from __future__ import annotations

import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.grouped_gemm import grouped_gemm

TOKENS, EXPERTS, TOP_K, HIDDEN, INTER = 16384, 16, 6, 4096, 2048


def main() -> None:
    ids, _ = make_routing(TOKENS, EXPERTS, TOP_K, kind="balanced", seed=0)
    plan = mm.plan_routes(ids.cuda(), EXPERTS, 128)
    rows = int(plan.expert_pool_offsets[-1])
    if rows != TOKENS * TOP_K:
        raise RuntimeError(f"expected an unpadded pool of {TOKENS * TOP_K} rows, got {rows}")
    offs = torch.cumsum(plan.expert_counts.to(torch.int64), 0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dout = torch.randn(plan.pool_capacity, HIDDEN, device="cuda", generator=gen).bfloat16()
    x = torch.randn(plan.pool_capacity, HIDDEN, device="cuda", generator=gen).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / 64).bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / 64).bfloat16()
    dout_rows, x_rows = dout[:rows].contiguous(), x[:rows].contiguous()
    torch.cuda.synchronize()
    for _ in range(2):
        grouped_gemm(dout, w2, plan, b_major="mn")
        torch._grouped_mm(dout_rows, w2, offs=offs)
        grouped_gemm(x, w13, plan)
        torch._grouped_mm(x_rows, w13.transpose(1, 2), offs=offs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
