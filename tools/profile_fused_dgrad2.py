"""Profile the engine's dgrad2 kernels under Nsight Compute: the plain MN-major Store
GEMM and the fused dgrad2 + activation-backward epilogue (with the a2 side K segment,
a2 as given, read K-major), on the same pool.

    ncu --target-processes all -k regex:engine_kernel --launch-skip 2 \\
        --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python tools/profile_fused_dgrad2.py [--mxfp4]

16,384 tokens, top-6 over 16 experts (balanced), H=4096, I=2048, r=128: a quarter of
the ep4rank pool, large enough for every SM to walk many tiles. Two rounds of two
engine launches: the first warms up, ncu profiles the second (``--launch-skip 2``).
``--mxfp4``: w2 as MXFP4 codes and scales, decoded inside both GEMMs' pipelines.
``--block-m 64``: a pool padded to 64 rows. GPU only.
"""

from __future__ import annotations

import argparse

import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
from megamoe.wrappers.grouped_gemm import grouped_gemm

TOKENS, EXPERTS, TOP_K, HIDDEN, INTER, RANK = 16384, 16, 6, 4096, 2048, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mxfp4", action="store_true", help="w2 as MXFP4 codes + scales")
    parser.add_argument("--block-m", type=int, default=128, choices=[64, 128])
    args = parser.parse_args()
    ids, weights = make_routing(TOKENS, EXPERTS, TOP_K, kind="balanced", seed=0)
    plan = mm.plan_routes(ids.cuda(), EXPERTS, args.block_m)
    rows = plan.pool_capacity
    gen = torch.Generator(device="cuda").manual_seed(0)
    preact = (torch.randn(rows, 2 * INTER, device="cuda", generator=gen) * 2).bfloat16()
    dout_pool = torch.randn(rows, HIDDEN + RANK, device="cuda", generator=gen).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / 64).bfloat16()
    # a2 as given [E, I, r]
    side_a2 = (torch.randn(EXPERTS, INTER, RANK, device="cuda", generator=gen) / 16).bfloat16()
    w2_scales = None
    if args.mxfp4:
        w2, w2_scales = mm.quantize_mxfp4(w2, axis=-1)  # codes [E, H, I/2], scales [E, H, I/32]
    weights = weights.cuda()
    for _ in range(2):
        # z alone (the pool's columns past H are ignored), then z consumed by the epilogue.
        grouped_gemm(dout_pool, w2, plan, b_major="mn", b_scales=w2_scales)
        fused_dgrad2_activation_backward(
            dout_pool, w2, preact, weights, plan, side_a2=side_a2, w2_scales=w2_scales
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
