"""``python -m megamoe.bench.breakdown``: per-kernel GPU time of one fused call.

Runs the fused forward (``--pass forward``, inference) or forward + backward
(``--pass fwd+bwd``, side-LoRA or ``--mode ordinary``) at a bench shape under
torch.profiler (after warm-up) and prints each kernel's total CUDA time over
``--iters`` calls, divided by ``--iters``, and the launches per call. ``--tokens N``
runs the shape's dims with N tokens (the weight-bound regime). ``--cuda-graph`` profiles
the pass captured in a CUDA graph and replayed, as ``python -m megamoe.bench
--cuda-graph`` times it: the GPU's idle time is then what lies between the graph's
kernels (and between back-to-back replays), without the host's per-launch work.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe as mm

from .shapes import SHAPES, add_shape_and_mode
from .timing import (
    capture_graph,
    count_device_work,
    device_event_kind,
    device_idle,
    kernel_times_by_name,
    sample_count,
    time_fn,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench.breakdown",
        description=__doc__,
    )
    add_shape_and_mode(parser, mode_help="fwd+bwd: frozen base + adapters, or a trainable base")
    parser.add_argument(
        "--iters",
        type=sample_count,
        default=5,
        help="profiled calls; times are per call (default: 5)",
    )
    parser.add_argument(
        "--pass", dest="pass_name", choices=("forward", "fwd+bwd"), default="forward",
        help="the inference forward, or a training forward + backward (default: forward)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("bf16", "mxfp4"), default="bf16", help="base format (default: bf16)"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per rank (default: the shape's)"
    )
    parser.add_argument(
        "--full-names", action="store_true", help="print whole kernel names (default: 90 chars)"
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="profile replays of the pass captured in a CUDA graph (not with a trainable "
        "base: it is prepared again before each call)",
    )
    args = parser.parse_args(argv)
    ordinary = args.mode == "ordinary"
    training = args.pass_name == "fwd+bwd"
    # A trainable base is prepared again before each step (MXFP4: quantized), outside
    # the profiled calls, as python -m megamoe.bench leaves it out of its times: the calls
    # are then profiled one by one, the base prepared between them.
    prepares = training and ordinary
    if args.cuda_graph and prepares:
        parser.error(
            "--cuda-graph: a trainable base (--mode ordinary --pass fwd+bwd) is prepared "
            "again before each call, outside the pass a graph would capture"
        )
    if not torch.cuda.is_available():
        print("megamoe.bench.breakdown: needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    s = SHAPES[args.shape]
    if args.tokens is not None:
        if args.tokens < 1:
            parser.error(f"--tokens must be >= 1, got {args.tokens}")
        s = s.with_tokens(args.tokens)
    layer = s.make_layer(
        ordinary=ordinary,
        device="cuda",
        requires_grad=training,
        trainable_base=training and ordinary,
        format=args.dtype,
    )
    dout = torch.randn_like(layer.x)

    def step() -> None:
        if not training:
            with torch.no_grad():
                layer.call(mm.moe)
            return
        leaves = list(layer.grad_leaves().values())
        torch.autograd.grad(layer.call(mm.moe), leaves, dout)

    for _ in range(3):
        if prepares:
            layer.reprepare_base()
        step()
    call = step
    if args.cuda_graph:
        graph = capture_graph(step, layer.x.device)
        graph.replay()
        call = graph.replay

    def profiled(calls: int) -> list:
        """The profiler's events of ``calls`` back-to-back calls."""
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        return list(prof.events())

    if prepares:
        runs = []
        for _ in range(args.iters):
            layer.reprepare_base()
            runs.append(profiled(1))
    else:
        runs = [profiled(args.iters)]
    per_name = kernel_times_by_name(event for events in runs for event in events)
    run_intervals = [
        [
            (event.time_range.start, event.time_range.end, event.name)
            for event in events
            if device_event_kind(event) is not None
        ]
        for events in runs
    ]
    rows = [
        (sum(times) / args.iters / 1e3, len(times) // args.iters, name)
        for name, times in per_name.items()
    ]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    what = f"{args.pass_name} {args.mode if training else ''} {args.dtype}"
    if args.cuda_graph:
        what += " replayed"
    what = " ".join(what.split())
    work = count_device_work([event for events in runs for event in events])
    if work.kernels == 0:  # (a profiler that does not see a graph's kernels, say)
        print("megamoe.bench.breakdown: the profiler recorded no kernel", file=sys.stderr)
        return 1
    launches = work.kernels // args.iters
    print(
        f"{args.shape} T={s.num_tokens}: per {what} call, {total:.3f} ms of kernel time"
        f" in {launches} launches"
    )
    print(f"{'ms':>8} {'share':>6} {'calls':>5}  kernel")
    for ms, calls, name in rows:
        print(f"{ms:8.3f} {ms / total:6.1%} {calls:5d}  {name if args.full_names else name[:90]}")
    # Back-to-back calls, no host sync between them: idle time inside the window is time
    # the GPU waited for the host (launch overhead, a host sync, CPU-side work).
    idles = [device_idle(intervals) for intervals in run_intervals]
    span_us = sum(idle.span_us for idle in idles)
    busy_us = sum(idle.busy_us for idle in idles)
    if prepares:
        # A window of one call holds the profiler's own start-up on the host (its
        # activity buffers, about 2 ms), which the GPU would wait out as if it were the
        # call's: time the calls with CUDA events instead, each after its prepare and a
        # sync, as python -m megamoe.bench does; the gaps are not listed.
        timing = time_fn(
            step, device=layer.x.device, warmup=0, iters=args.iters, setup=layer.reprepare_base
        )
        wall_ms, busy_ms = timing.median_ms, busy_us / args.iters / 1e3
        print(
            f"GPU idle: {wall_ms - busy_ms:.3f} ms per call (CUDA-event median {wall_ms:.3f}"
            f" ms over {args.iters} calls, {busy_ms:.3f} ms busy)"
        )
        return 0
    gaps = sorted((gap for idle in idles for gap in idle.gaps), key=lambda gap: -gap[0])[:5]
    per_call = (span_us - busy_us) / args.iters / 1e3
    print(
        f"GPU idle: {per_call:.3f} ms per call ({span_us / args.iters / 1e3:.3f} ms span, "
        f"{busy_us / args.iters / 1e3:.3f} ms busy); largest gaps over the {args.iters} calls:"
    )
    for gap_us, before, after in gaps:
        width = None if args.full_names else 50
        print(f"{gap_us / 1e3:8.3f} ms  after {before[:width]}  before {after[:width]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
