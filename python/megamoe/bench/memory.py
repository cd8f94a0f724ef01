"""``python -m megamoe.bench.memory``: where the fused layer's memory goes, stage by stage.

Runs one fused forward + backward at a bench shape and prints, after every pipeline
stage (route plan, gathers, GEMMs, combines), the bytes allocated
and the peak reached during that stage, from torch's caching-allocator counters. The
stages are found by wrapping the pipeline's module-level functions for the duration of
the run, so the layer itself runs unchanged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

import megamoe as mm
from megamoe.pipeline import fused_backward, fused_forward

from .shapes import SHAPES, add_shape_and_mode

GIB = 2**30

# (module, attribute) of every stage to watch: the pipeline's module-level calls, looked
# up at call time (tests/cpu/test_bench.py checks that each still exists).
STAGES = [
    (fused_forward, "plan_routes"),
    (fused_forward.pool, "gather_pool_unchecked"),
    (fused_forward, "gated_grouped_gemm_unchecked"),
    (fused_forward, "grouped_gemm_unchecked"),
    (fused_forward.pool, "side_sum_unchecked"),
    (fused_forward.pool, "combine_unchecked"),
    (fused_backward, "fused_dgrad2_activation_backward_unchecked"),
    (fused_backward, "k_grouped_gemm_unchecked"),
    (fused_backward, "grouped_gemm_unchecked"),  # dgrad1 with the b1/b3 shrink columns
    (fused_backward, "recompute_preact"),
]


def _watch(
    rows: list[tuple[str, float, float]], overall: list[float]
) -> list[tuple[object, str, Callable]]:
    """Wrap every stage: a row per call, and ``overall[0]`` the peak since the first reset,
    the work between stages included (each stage resets the counter: its peak so far is
    folded in first)."""
    originals = []
    for module, name in STAGES:
        original = getattr(module, name)

        def wrapped(*args, __original=original, __name=name, **kwargs):
            overall[0] = max(overall[0], torch.cuda.max_memory_allocated() / GIB)
            torch.cuda.reset_peak_memory_stats()
            result = __original(*args, **kwargs)
            rows.append(
                (
                    __name.removesuffix("_unchecked"),  # the pipelines' entries: same stage
                    torch.cuda.memory_allocated() / GIB,
                    torch.cuda.max_memory_allocated() / GIB,
                )
            )
            return result

        setattr(module, name, wrapped)
        originals.append((module, name, original))
    return originals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench.memory",
        description=__doc__,
    )
    add_shape_and_mode(parser, mode_help="frozen base + adapters, or a trainable base")
    parser.add_argument(
        "--activation-checkpoint", action="store_true",
        help="recompute GEMM1's pre-activations in the backward instead of keeping them",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("megamoe.bench.memory: needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    s = SHAPES[args.shape]
    ordinary = args.mode == "ordinary"
    layer = s.make_layer(
        ordinary=ordinary,
        device="cuda",
        requires_grad=True,
        trainable_base=ordinary,
    )
    dout = torch.randn_like(layer.x)
    leaves = list(layer.grad_leaves().values())
    if not ordinary:
        layer.w13 = layer.w2 = None  # a frozen base is held only as the prepared copy
    torch.autograd.grad(layer.call(mm.moe), leaves, dout)  # warm-up
    torch.cuda.synchronize()
    if ordinary:
        layer.reprepare_base()
    inputs = torch.cuda.memory_allocated() / GIB
    rows: list[tuple[str, float, float]] = []
    overall = [0.0]
    originals = _watch(rows, overall)
    try:
        torch.cuda.reset_peak_memory_stats()
        out = layer.call(mm.moe, activation_checkpoint=args.activation_checkpoint)
        rows.append(("-- forward done (saved state held)", torch.cuda.memory_allocated() / GIB, 0))
        grads = torch.autograd.grad(out, leaves, dout)
        del out
        rows.append(("-- backward done (grads held)", torch.cuda.memory_allocated() / GIB, 0))
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
    overall[0] = max(overall[0], torch.cuda.max_memory_allocated() / GIB)
    del grads
    print(
        f"{args.shape} {args.mode}{' checkpoint' if args.activation_checkpoint else ''}: "
        f"inputs, weights and dout hold {inputs:.2f} GiB"
    )
    print(f"{'stage':40s} {'after GiB':>10s} {'peak GiB':>10s}")
    for name, after, peak in rows:
        print(f"{name:40s} {after:10.2f} {peak:10.2f}")
    print(f"{'overall peak':40s} {'':10s} {overall[0]:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
