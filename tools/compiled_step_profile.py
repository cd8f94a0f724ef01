"""Eager against torch.compile'd F+B of ``mm.moe``, and the compiled step's kernels
(needs a CUDA GPU).

At ep4rank dims (side-LoRA, frozen BF16 or MXFP4 base): CUDA-event medians of
``--iters`` F+B steps, eager and compiled, in ``--rounds`` alternating rounds, then
torch.profiler's table of the GPU kernels of one compiled step (self time, calls),
largest first. It shows what compilation adds around megamoe's opaque ops, such as
inductor's copy of the pre-activations the backward writes over
(docs/INTEGRATIONS.md, "torch.compile").

    python tools/compiled_step_profile.py --tokens 65536 --format bf16
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--format", choices=("bf16", "mxfp4"), default="bf16")
    parser.add_argument("--iters", type=int, default=7, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--kernels", type=int, default=25, help="rows of the kernel table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("compiled_step_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    if min(args.tokens, args.iters, args.rounds, args.kernels) < 1:
        print("compiled_step_profile: every count must be at least 1", file=sys.stderr)
        return 2

    import megamoe as mm
    from megamoe.bench.shapes import SHAPES
    from megamoe.bench.timing import kernel_times_by_name, time_fn

    shape = SHAPES["ep4rank"].with_tokens(args.tokens)
    layer = shape.make_layer(ordinary=False, device="cuda", requires_grad=True, format=args.format)
    leaves = list(layer.grad_leaves().values())
    dout = torch.randn_like(layer.x)

    def layer_call(x, weights):
        return mm.moe(x, layer.topk_ids, weights, layer.base, layer.side)

    compiled_call = torch.compile(layer_call)

    def step(call) -> None:
        torch.autograd.grad(call(layer.x, layer.topk_weights), leaves, dout)

    def median_ms(call) -> float:
        device = layer.x.device
        return time_fn(lambda: step(call), device=device, warmup=3, iters=args.iters).median_ms

    print(f"T={args.tokens} {args.format} side-LoRA, F+B medians of {args.iters} steps (ms)")
    for round_ in range(args.rounds):
        order = [("eager", layer_call), ("compiled", compiled_call)]
        if round_ % 2:
            order.reverse()
        times = {name: median_ms(call) for name, call in order}
        print(f"round {round_}: eager {times['eager']:.3f}, compiled {times['compiled']:.3f}")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(compiled_call)
        torch.cuda.synchronize()
    # Kernels and copies only: the GPU spans of profiler ranges (megamoe::<stage>,
    # torch.compile's) would count their kernels' time again.
    per_name = kernel_times_by_name(prof.events())
    rows = sorted(((sum(t), len(t), name) for name, t in per_name.items()), reverse=True)
    print("one compiled step's kernels: ms, calls, name")
    for total_us, calls, name in rows[: args.kernels]:
        print(f"{total_us / 1e3:9.3f} {calls:4d}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
