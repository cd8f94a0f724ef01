#!/usr/bin/env python3
"""Where an MXFP4 base should be decoded: inside the GEMM pipeline or into a transient
BF16 buffer first (megamoe.heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT, and
MXFP4_STREAM_MAX_ROWS_PER_EXPERT for the GEMMs the weight-streaming kernels take).

Times GEMM1 (gated, no side) and GEMM2 at ep4rank dims for each token count, with the
in-pipeline decode forced on (``pipe``) and off (``trans``), beside the BF16 weights;
CUDA-event medians. First the transient decode on its own: its time per weight and its
bytes moved per second against a device-to-device copy of the BF16 weight. Needs a
Hopper GPU and the built extension:

    python tools/mxfp4_decode_crossover.py [--tokens 128,512,2048,4096,8192,16384,65536]
"""

from __future__ import annotations

import argparse

import torch

import megamoe as mm
import megamoe.heuristics as heuristics
from megamoe.bench.timing import time_fn
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.grouped_gemm import gated_grouped_gemm, grouped_gemm
from megamoe.wrappers.mxfp4_decode import decode_mxfp4_bf16


def time_decode(name: str, weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> str:
    """The transient decode of one weight: its median time and bytes moved per second
    (codes and scales read, BF16 written), beside a copy of the BF16 weight."""
    dev = weight.device
    copy = torch.empty_like(weight)
    copy_ms = time_fn(lambda: copy.copy_(weight), device=dev, warmup=3, iters=20).median_ms
    decode_ms = time_fn(
        lambda: decode_mxfp4_bf16(codes, scales), device=dev, warmup=3, iters=20
    ).median_ms
    moved = codes.numel() + scales.numel() + 2 * weight.numel()
    return (
        f"decode {name}: {decode_ms:.3f} ms, {moved / decode_ms / 1e6:.0f} GB/s "
        f"(BF16 copy {copy_ms:.3f} ms, {4 * weight.numel() / copy_ms / 1e6:.0f} GB/s)"
    )


def set_limits(pipeline: int, stream: int | None = None) -> None:
    """Both in-pipeline limits of :mod:`megamoe.heuristics` (rows per expert): the
    engine's and the streaming kernels' (``stream``: the same as ``pipeline`` if None)."""
    heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT = pipeline
    heuristics.MXFP4_STREAM_MAX_ROWS_PER_EXPERT = pipeline if stream is None else stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="128,512,2048,4096,8192,16384,65536")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    args = parser.parse_args()
    dev = torch.device("cuda")
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    w13 = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev) * i**-0.5).bfloat16()
    c13, s13 = mm.quantize_mxfp4(w13, axis=-1)
    c2, s2 = mm.quantize_mxfp4(w2, axis=-1)
    limits = (
        heuristics.MXFP4_PIPELINE_MAX_ROWS_PER_EXPERT,
        heuristics.MXFP4_STREAM_MAX_ROWS_PER_EXPERT,
    )
    for name, weight, codes, scales in (("w13", w13, c13, s13), ("w2", w2, c2, s2)):
        print(time_decode(name, weight, codes, scales))
    print(f"{'T':>6} {'rows/e':>6} {'gemm':>6} {'bf16 ms':>8} {'pipe ms':>8} {'trans ms':>8}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids, _ = make_routing(tokens, e, k, kind="balanced", seed=0)
        plan = mm.plan_routes(ids.to(dev), e, mm.get_block_m(tokens, k, e))
        x = torch.randn(plan.pool_capacity, h, device=dev).bfloat16()
        hp = torch.randn(plan.pool_capacity, i, device=dev).bfloat16()

        def median(fn) -> float:
            return time_fn(fn, device=dev, warmup=3, iters=10).median_ms

        # Each case runs now, inside this iteration: the loop's values are bound.
        cases = {
            "gemm1": (
                lambda x=x, plan=plan: gated_grouped_gemm(x, w13, plan, k=h),
                lambda x=x, plan=plan: gated_grouped_gemm(x, c13, plan, k=h, w13_scales=s13),
            ),
            "gemm2": (
                lambda hp=hp, plan=plan: grouped_gemm(hp, w2, plan),
                lambda hp=hp, plan=plan: grouped_gemm(hp, c2, plan, b_scales=s2),
            ),
        }
        for name, (bf16, mxfp4) in cases.items():
            # Both limits: the engine's in-pipeline decode and the streaming kernels'.
            set_limits(1 << 30)  # always in the pipeline
            pipe = median(mxfp4)
            set_limits(0)  # always a transient decode
            trans = median(mxfp4)
            set_limits(*limits)
            rows = plan.pool_capacity // e
            print(f"{tokens:>6} {rows:>6} {name:>6} {median(bf16):8.3f} {pipe:8.3f} {trans:8.3f}")


if __name__ == "__main__":
    main()
