"""Sums over the tokens (``a^T b``, K = T) by cuBLAS and by the engine, against float64
and timed (needs a CUDA GPU).

cuBLAS's ``torch.mm(a.T, b, out_dtype=torch.float32)`` (the side-LoRA backward's path for
the shared factors' gradients until the fifty-fifth session) was measured wrong at some T
(docs/PERFORMANCE.md); :func:`megamoe.wrappers.token_sum.token_sum` replaced it. This
tool sweeps T for a few (M, N), prints each T where either path is off float64 by more
than ``--max-relative``, and times both at the given shapes (CUDA events, medians of
``--repeats`` back-to-back launches). Re-run it when torch or CUDA moves.

    python tools/token_sum_probe.py [--tokens 1:9000] [--time 512,8192,65536]

Exit status 1 if the engine's sum is ever off (cuBLAS's misses are reported, not failed).
"""

from __future__ import annotations

import argparse
import sys

import torch

from megamoe.bench.timing import time_fn
from megamoe.wrappers.token_sum import token_sum

SHAPES = [(512, 32), (16, 512), (4096, 256), (128, 4096)]


def _operands(tokens: int, m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(tokens, m, device="cuda", generator=gen).bfloat16()
    return a, torch.randn(tokens, n, device="cuda", generator=gen).bfloat16()


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def _cublas(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.T, b, out_dtype=torch.float32)


def _median_ms(fn, repeats: int) -> float:
    return time_fn(fn, device=torch.device("cuda"), warmup=3, iters=repeats).median_ms


def sweep(first: int, last: int, stride: int, max_relative: float) -> bool:
    ok = True
    for m, n in SHAPES:
        # The wide shapes cost more per T: every 64th T and its three successors only.
        wide = m * n >= 4096 * 256
        tokens = [t for t in range(first, last + 1, stride) if not wide or t % 64 < 4]
        bad = {"cublas": [], "engine": []}
        worst = {"cublas": 0.0, "engine": 0.0}
        for t in tokens:
            a, b = _operands(t, m, n, seed=t)
            expected = a.double().T @ b.double()
            for name, fn in (("cublas", _cublas), ("engine", token_sum)):
                error = _relative(fn(a, b), expected)
                worst[name] = max(worst[name], error)
                if error > max_relative:
                    bad[name].append((t, f"{error:.1e}"))
        ok = ok and not bad["engine"]
        for name, misses in bad.items():
            shown = ", ".join(f"{t} ({e})" for t, e in misses[:12])
            more = f" and {len(misses) - 12} more" if len(misses) > 12 else ""
            print(
                f"M={m} N={n} {name}: worst {worst[name]:.1e}; {len(misses)} of {len(tokens)}"
                f" T off: {shown}{more}"
            )
    return ok


def time_both(token_counts: list[int], repeats: int) -> None:
    print(f"{'M':>5} {'N':>5} {'T':>7} {'cuBLAS ms':>10} {'engine ms':>10} {'engine/cuBLAS':>14}")
    for m, n in SHAPES[2:]:
        for t in token_counts:
            a, b = _operands(t, m, n, seed=0)
            cublas = _median_ms(lambda a=a, b=b: _cublas(a, b), repeats)
            engine = _median_ms(lambda a=a, b=b: token_sum(a, b), repeats)
            print(f"{m:>5} {n:>5} {t:>7} {cublas:>10.4f} {engine:>10.4f} {engine / cublas:>14.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/token_sum_probe.py", description=__doc__)
    parser.add_argument("--tokens", default="1:9000", help="FIRST:LAST[:STRIDE] to sweep")
    parser.add_argument("--time", default="512,8192,65536", help="T to time ('' for none)")
    parser.add_argument("--repeats", type=int, default=20)
    # The engine's chunks truncate their FP32 sums (~1e-5 at a few thousand rows); a
    # missing token's share is 1/sqrt(T), 1e-2 at T = 10,000.
    parser.add_argument("--max-relative", type=float, default=1e-4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    first, last, *stride = (int(v) for v in args.tokens.split(":"))
    print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())
    ok = sweep(first, last, stride[0] if stride else 1, args.max_relative)
    if args.time:
        time_both([int(t) for t in args.time.split(",")], args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
