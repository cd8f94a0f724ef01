"""Profile the engine's dgrad2 kernels under Nsight Compute: the plain MN-major Store
GEMM and the fused dgrad2 + activation-backward epilogue, on the same pool.

    ncu --target-processes all -k regex:grouped_gemm_kernel --launch-skip 2 \\
        --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python tools/profile_fused_dgrad2.py

16,384 tokens, top-6 over 16 experts (balanced), H=4096, I=2048: a quarter of the
ep4rank pool, large enough for every SM to walk many tiles. Two rounds: the first
warms up, ncu profiles the second (``--launch-skip 2``). GPU only.
"""

from __future__ import annotations

import torch

import megamoe as mm
from megamoe.activation_backward import fused_dgrad2_activation_backward
from megamoe.grouped_gemm import grouped_gemm
from megamoe.testing.inputs import make_routing

TOKENS, EXPERTS, TOP_K, HIDDEN, INTER = 16384, 16, 6, 4096, 2048


def main() -> None:
    ids, weights = make_routing(TOKENS, EXPERTS, TOP_K, kind="balanced", seed=0)
    plan = mm.plan_routes(ids.cuda(), EXPERTS, 128)
    rows = plan.pool_capacity
    gen = torch.Generator(device="cuda").manual_seed(0)
    preact = (torch.randn(rows, 2 * INTER, device="cuda", generator=gen) * 2).bfloat16()
    dout_pool = torch.randn(rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / 64).bfloat16()
    weights = weights.cuda()
    for _ in range(2):
        grouped_gemm(dout_pool, w2, plan, b_major="mn", block_n=256)
        fused_dgrad2_activation_backward(dout_pool, w2, preact, weights, plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
