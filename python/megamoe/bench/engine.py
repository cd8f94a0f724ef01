"""``python -m megamoe.bench.engine``: the engine as a plain grouped GEMM vs
``torch._grouped_mm`` at the ep4rank GEMM1 and GEMM2 shapes and the backward's
dgrad1/dgrad2 shapes (MN-major B), in one run; and the K-grouped weight gradients
(``wgrad13`` = dw13 ``[2I, H]``, ``wgrad2`` = dw2 ``[H, I]``, ``db13`` ``[2r, 2I]``,
``da2`` ``[I, r]`` per expert) vs ``torch._grouped_mm`` on the transposed pool. For
GEMM1/GEMM2 also an MXFP4 B: the engine's in-kernel decode ("mxfp4 ...") and the
transient path ("decode+engine ...": the BF16 decode of the whole weight, then the BF16
engine).

Both compute the same products over the same routed rows (balanced routing: the
pool has no padding at BLOCK_M 128, so FLOPs are equal). CUDA-event medians.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import megamoe as mm
from megamoe.grouped_gemm import gated_grouped_gemm, grouped_gemm
from megamoe.k_grouped_gemm import k_grouped_gemm
from megamoe.mxfp4_decode import decode_mxfp4_bf16
from megamoe.testing.inputs import make_routing

from .timing import time_fn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument(
        "--gemms",
        default="gemm1,gemm2,dgrad1,dgrad2,wgrad13,wgrad2,db13,da2",
        help="comma-separated subset of the GEMMs to time",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    ids, _ = make_routing(args.tokens, args.experts, args.top_k, kind="balanced", seed=0)
    block_m = mm.get_block_m(args.tokens, args.top_k, args.experts)
    plan = mm.plan_routes(ids.to(device), args.experts, block_m)
    rows = int(plan.expert_pool_offsets[-1])
    routes = args.tokens * args.top_k
    counts = plan.expert_counts.to(torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, e = args.hidden, args.intermediate, args.experts

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).bfloat16()

    results = []

    def time_cases(name: str, cases: dict, flops: float) -> None:
        """Time each case of one GEMM and append its row to ``results``."""
        for case, fn in cases.items():
            timing = time_fn(fn, device=device, warmup=args.warmup, iters=args.iters)
            results.append(
                {
                    "gemm": name,
                    "case": case,
                    "median_ms": timing.median_ms,
                    "tflops": flops / timing.median_ms / 1e9,
                }
            )

    # gemm1/gemm2: the forward (B K-major, [E, N, K]). dgrad1/dgrad2: the backward's
    # data grads, which read the same weights transposed (B MN-major, [E, K, N]).
    shapes = {
        "gemm1": (h, 2 * i, "k"),
        "gemm2": (i, h, "k"),
        "dgrad1": (2 * i, h, "mn"),
        "dgrad2": (h, i, "mn"),
    }
    selected = set(args.gemms.split(","))
    unknown = selected - set(shapes) - {"wgrad13", "wgrad2", "db13", "da2"}
    if unknown:
        parser.error(f"--gemms: unknown {sorted(unknown)}")
    for name, (k, n, b_major) in shapes.items():
        if name not in selected:
            continue
        a = randn(plan.pool_capacity, k)
        b = randn(e, n, k, scale=k**-0.5) if b_major == "k" else randn(e, k, n, scale=k**-0.5)
        a_dense = a[:routes] if rows == routes else None
        flops = 2.0 * routes * k * n
        cases = {"engine": lambda a=a, b=b, m=b_major: grouped_gemm(a, b, plan, b_major=m)}
        if block_m == 128:
            cases["engine n256"] = lambda a=a, b=b, m=b_major: grouped_gemm(
                a, b, plan, block_n=256, b_major=m
            )
        if name == "gemm1":
            cases["engine+act"] = lambda a=a, b=b, k=k: gated_grouped_gemm(a, b, plan, k=k)
            if block_m == 128:
                cases["engine+act n256"] = lambda a=a, b=b, k=k: gated_grouped_gemm(
                    a, b, plan, k=k, block_n=256
                )
        if b_major == "mn" and block_m == 128:
            # The dgrads on MXFP4 weights as stored ([E, K, N/2], quantized along N).
            codes, scales = mm.quantize_mxfp4(b, axis=-1)
            cases["mxfp4 n256"] = lambda a=a, c=codes, s=scales: grouped_gemm(
                a, c, plan, block_n=256, b_major="mn", b_scales=s
            )
            cases["decode+engine n256"] = lambda a=a, c=codes, s=scales: grouped_gemm(
                a, decode_mxfp4_bf16(c, s), plan, block_n=256, b_major="mn"
            )
        if b_major == "k":
            codes, scales = mm.quantize_mxfp4(b, axis=-1)
            block_n = 256 if block_m == 128 else 128
            if name == "gemm1":
                cases[f"mxfp4+act n{block_n}"] = lambda a=a, c=codes, s=scales, k=k, bn=block_n: (
                    gated_grouped_gemm(a, c, plan, k=k, block_n=bn, w13_scales=s)
                )
                cases[f"decode+engine+act n{block_n}"] = (
                    lambda a=a, c=codes, s=scales, k=k, bn=block_n: gated_grouped_gemm(
                        a, decode_mxfp4_bf16(c, s), plan, k=k, block_n=bn
                    )
                )
            cases[f"mxfp4 n{block_n}"] = lambda a=a, c=codes, s=scales, bn=block_n: grouped_gemm(
                a, c, plan, block_n=bn, b_scales=s
            )
            cases[f"decode+engine n{block_n}"] = lambda a=a, c=codes, s=scales, bn=block_n: (
                grouped_gemm(a, decode_mxfp4_bf16(c, s), plan, block_n=bn)
            )
        if a_dense is not None:
            b_kn = b.transpose(1, 2) if b_major == "k" else b
            cases["torch._grouped_mm"] = lambda a=a_dense, b=b_kn: torch._grouped_mm(
                a, b, offs=offs
            )
        time_cases(name, cases, flops)
        del a, b
    # K-grouped weight gradients: out[e] = a_e^T b_e over each expert's rows.
    wgrads = {
        "wgrad13": (2 * i, h),
        "wgrad2": (h, i),
        "db13": (2 * args.rank, 2 * i),
        "da2": (i, args.rank),
    }
    for name, (m, n) in wgrads.items():
        if name not in selected:
            continue
        a = randn(plan.pool_capacity, m)
        b = randn(plan.pool_capacity, n)
        cases = {"k-grouped": lambda a=a, b=b: k_grouped_gemm(a, b, plan)}
        if rows == routes:
            cases["torch._grouped_mm"] = lambda a=a[:routes], b=b[:routes]: torch._grouped_mm(
                a.T, b, offs=offs
            )
        flops = 2.0 * routes * m * n
        time_cases(name, cases, flops)
        del a, b
    base = {r["gemm"]: r["median_ms"] for r in results if r["case"] == "torch._grouped_mm"}
    print(f"T={args.tokens} E={e} K={args.top_k} H={h} I={i} BLOCK_M={block_m} rows={rows}")
    print(f"{'gemm':<7} {'case':<26} {'median ms':>10} {'TFLOP/s':>8} {'vs torch':>9}")
    for r in results:
        ratio = f"{base[r['gemm']] / r['median_ms']:.2f}x" if r["gemm"] in base else "-"
        print(
            f"{r['gemm']:<7} {r['case']:<26} {r['median_ms']:>10.3f} {r['tflops']:>8.1f} {ratio:>9}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": None}, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
