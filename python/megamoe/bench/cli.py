"""``python -m megamoe.bench``: time the MoE layer per backend, in one run.

Backends: ``fused`` (our kernels), ``baseline`` (the unfused torch._grouped_mm layer
a trainer would write, megamoe.testing.baseline) and ``reference`` (the oracle:
float64 on CPU, float32 with BF16 rounding points on GPU). Passes: the training
forward (autograd on, activations saved) and forward+backward timed together.
Medians of CUDA-event samples after warm-up; TFLOP/s from the useful FLOPs of
megamoe.bench.flops; peak memory over the F+B runs. Without a GPU it runs the
``small`` shape on the CPU, so the command always works.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import megamoe

from .flops import backward_flops, forward_flops
from .shapes import SHAPES, Shape
from .timing import Progress, time_fn

BACKENDS = ("fused", "baseline", "reference")
PASSES = ("forward", "fwd+bwd")
UNAVAILABLE = {
    ("fused", "cpu"): "needs a Hopper GPU",
}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _backend_fn(backend: str, device: torch.device):
    if backend == "baseline":
        from megamoe.testing import baseline

        # BF16 is the trainer's dtype on the GPU; CPUs run BF16 matmuls very slowly.
        return baseline.moe, torch.bfloat16 if device.type == "cuda" else torch.float32, {}
    if backend == "reference":
        if device.type == "cuda":
            return (
                megamoe.reference.moe,
                torch.float32,
                {"compute_dtype": torch.float32, "round_bf16": True},
            )
        return megamoe.reference.moe, torch.float64, {"compute_dtype": torch.float64}
    if backend == "fused":
        return megamoe.moe, torch.bfloat16, {}
    raise ValueError(f"backend: {backend!r} has no implementation")


def run_backend(
    backend: str, shape: Shape, args, device: torch.device, progress: Progress
) -> list[dict]:
    """Time one backend; one result row per pass."""

    rows = []
    for pass_name in args.passes:
        for key in (pass_name, args.mode, args.dtype, device.type):
            if (backend, key) in UNAVAILABLE:
                rows.append(
                    {"backend": backend, "pass": pass_name, "status": UNAVAILABLE[(backend, key)]}
                )
                break
    if len(rows) == len(args.passes):
        return rows
    runnable = argparse.Namespace(**vars(args))
    runnable.passes = [p for p in args.passes if p not in {r["pass"] for r in rows}]
    rows += _measure(backend, shape, runnable, device, progress)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the last layer is gone: free it before the next
    return rows


def _measure(
    backend: str, shape: Shape, args, device: torch.device, progress: Progress
) -> list[dict]:
    fn, dtype, extra = _backend_fn(backend, device)
    if backend == "fused" and args.activation_checkpoint:
        extra = {**extra, "activation_checkpoint": True}
    ordinary = args.mode == "ordinary"
    progress.update(f"{backend}: building inputs for {shape.name}")
    layer = shape.make_layer(
        ordinary=ordinary,
        seed=args.seed,
        device=device,
        dtype=dtype,
        format=args.dtype,
        requires_grad=True,
        trainable_base=ordinary,
    )
    leaves = list(layer.grad_leaves().values())
    # Hold only the weights this backend reads, as a trainer would: the baseline takes
    # the nn.Linear-layout pair, the fused layer the prepared base (for a frozen base the
    # original w13 can go; in ordinary mode it is the trainable master, kept).
    if backend == "baseline" and args.dtype == "bf16":
        layer.base = None
    elif backend == "fused" and not ordinary:
        layer.w13 = layer.w2 = None
    dout = torch.randn(
        shape.num_tokens,
        shape.hidden,
        device=device,
        generator=torch.Generator(device).manual_seed(args.seed + 1),
    ).to(dtype)
    routes = int((layer.topk_ids >= 0).sum())
    rank = 0 if ordinary else shape.side_rank
    flops = {
        "forward": forward_flops(shape.num_tokens, routes, shape.hidden, shape.intermediate, rank),
    }
    flops["fwd+bwd"] = flops["forward"] + backward_flops(
        shape.num_tokens, routes, shape.hidden, shape.intermediate, rank, base_grads=ordinary
    )

    # The baseline takes nn.Linear-layout BF16 weights as a trainer holds them; an
    # MXFP4 base goes in as BaseWeights (dequantized every call, as a trainer would).
    use_pair = backend == "baseline" and args.dtype == "bf16"

    def setup() -> None:
        for leaf in leaves:
            leaf.grad = None
        if ordinary and not use_pair:
            layer.reprepare_base()  # the prepared base is part of the last step's graph

    def call() -> torch.Tensor:
        base = (layer.w13, layer.w2) if use_pair else layer.base
        return fn(
            layer.x,
            layer.topk_ids,
            layer.topk_weights,
            base,
            layer.side,
            activation=layer.activation,
            activation_clamp=layer.activation_clamp,
            **extra,
        )

    def forward() -> None:
        call()  # autograd on: the training forward, saving what the backward needs

    def forward_backward() -> None:
        call().backward(dout)

    rows = []
    for pass_name in args.passes:
        body = forward if pass_name == "forward" else forward_backward
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        timing = time_fn(
            body,
            device=device,
            warmup=args.warmup,
            iters=args.iters,
            setup=setup,
            label=f"{backend} {pass_name}",
            progress=progress,
        )
        row = {
            "backend": backend,
            "pass": pass_name,
            "status": "ok",
            "median_ms": timing.median_ms,
            "min_ms": timing.min_ms,
            "samples_ms": list(timing.samples_ms),
            "flops": flops[pass_name],
            "tflops": flops[pass_name] / (timing.median_ms * 1e-3) / 1e12,
        }
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rows.append(row)
    setup()
    return rows


def format_table(rows: list[dict]) -> str:
    by_pass = {}
    for row in rows:
        if row["status"] == "ok" and row["backend"] == "baseline":
            by_pass[row["pass"]] = row["median_ms"]
    lines = [
        f"{'backend':<10} {'pass':<8} {'median ms':>10} {'TFLOP/s':>8} {'peak GiB':>9} "
        f"{'vs baseline':>11}"
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['backend']:<10} {row['pass']:<8} {row['status']}")
            continue
        base = by_pass.get(row["pass"])
        speedup = f"{base / row['median_ms']:.2f}x" if base else "-"
        peak = f"{row['peak_gib']:.1f}" if "peak_gib" in row else "-"
        lines.append(
            f"{row['backend']:<10} {row['pass']:<8} {row['median_ms']:>10.2f} "
            f"{row['tflops']:>8.3g} {peak:>9} {speedup:>11}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="ep4rank" if gpu else "small")
    parser.add_argument("--mode", choices=("side-lora", "ordinary"), default="side-lora")
    parser.add_argument(
        "--dtype", choices=("bf16", "mxfp4"), default="bf16", help="base weight format"
    )
    parser.add_argument(
        "--backend",
        default="fused,baseline" if gpu else "baseline,reference",
        help=f"comma-separated subset of {','.join(BACKENDS)}",
    )
    parser.add_argument(
        "--pass",
        dest="passes",
        default=",".join(PASSES),
        help=f"comma-separated subset of {','.join(PASSES)}",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if gpu else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--activation-checkpoint",
        action="store_true",
        help="fused backend: recompute GEMM1's pre-activations in the backward",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree: > 1 runs `megamoe.bench.ep` on that many local GPUs "
        "under torchrun (65,536 tokens per rank, 256 experts; --mode, --dtype and --json "
        "pass on)",
    )
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    for backend in args.backends:
        if backend not in BACKENDS:
            parser.error(f"--backend: expected a subset of {BACKENDS}, got {backend!r}")
    for pass_name in args.passes:
        if pass_name not in PASSES:
            parser.error(f"--pass: expected a subset of {PASSES}, got {pass_name!r}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.ep < 1:
        parser.error("--ep must be >= 1")
    if args.device.startswith("cuda") and not gpu:
        parser.error("--device cuda: no CUDA GPU is available")
    return args


def _run_ep(args: argparse.Namespace) -> int:
    """``--ep P``: the expert-parallel bench on ``P`` local GPUs (a torchrun child)."""
    if torch.cuda.device_count() < args.ep:
        print(
            f"--ep {args.ep}: needs {args.ep} GPUs, {torch.cuda.device_count()} found",
            file=sys.stderr,
        )
        return 2
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ep),
        "-m",
        "megamoe.bench.ep",
        "--mode",
        args.mode,
        "--dtype",
        args.dtype,
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
    ]
    if args.json:
        command += ["--json", str(args.json)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    return subprocess.run(command, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ep > 1:
        return _run_ep(args)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    progress = Progress(enabled=not args.quiet)
    rows = []
    for backend in args.backends:
        rows.extend(run_backend(backend, shape, args, device, progress))
    progress.done()
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "megamoe": megamoe.__version__,
        "commit": _git_commit(),
        "command": " ".join(
            ["python -m megamoe.bench", *(argv if argv is not None else sys.argv[1:])]
        ),
        "shape": vars(shape) | {"num_routes": shape.num_routes},
        "mode": args.mode,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "results": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(
        f"{shape.name}: T={shape.num_tokens} H={shape.hidden} I={shape.intermediate} "
        f"E_l={shape.num_local_experts} K={shape.top_k} r={shape.side_rank} mode={args.mode} "
        f"dtype={args.dtype} device={report['device']}"
    )
    print(format_table(rows))
    return 0
