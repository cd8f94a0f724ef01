"""Host time of one small-token layer call, per function (needs a CUDA GPU).

Every function of the loaded ``megamoe`` modules (the DLPack export and the stream
query among them), the native launchers and a few torch calls (``empty``, ``cat``,
``mm``, ``aminmax``, ``@``) are wrapped in ``perf_counter`` timers; the table gives each
one's inclusive host time per layer call (nested entries overlap), for a side-LoRA
forward and a forward + backward at ep4rank dims. A small-token call is bound by this time, not by
its kernels (``docs/PERFORMANCE.md``, eighth session).

    python tools/host_time_per_call.py --tokens 512 --format bf16 [--op-route] [--plain]

``--op-route`` sends ``mm.moe`` through the registered custom ops instead of its eager
route, for an A/B in one process. ``--without-checks`` replaces the primitive argument
checks (``check_tensor``, ``check_int``, ``check_choice``, ``check_finite_float``) in every
megamoe module with no-ops: an upper bound of what the checks cost (a measurement only;
the layer then accepts anything). ``--plain`` times without the wrappers instead: the
medians over ``--calls`` calls of the host time to return from one call that starts on
an idle GPU and of that call's wall time until its kernels are done, and the mean host
time per call of ``--calls`` calls enqueued back to back. ``--ab-backward-checks`` times
the eager F+B with the backward's input check as the eager route runs it (``dout``
only) and as the backward op runs it (everything again), in alternating rounds of one
process: the host's speed differs more between processes than the check costs.
``--stack L`` times an eager F+B of ``L`` layers chained by residual adds (one shared base,
an adapter each, one ``torch.autograd.grad`` per step, as a model's step runs), per
layer, against one layer alone and against the stack replayed from a CUDA graph: a
single layer's F+B also pays the autograd engine's fixed cost per backward call, which a
model pays once per step.
``--ab-unchecked`` times the eager F+B with the fused pipelines calling their unchecked
entries (``*_unchecked``: pool ops, GEMM wrappers, dgrad2's) as they do, and with each
replaced by its checked twin, in alternating rounds of one process.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
import types

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--format", choices=("bf16", "mxfp4"), default="bf16")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per pass")
    parser.add_argument("--op-route", action="store_true", help="force the custom ops")
    parser.add_argument("--plain", action="store_true", help="no per-function timers")
    parser.add_argument(
        "--without-checks", action="store_true", help="the primitive argument checks as no-ops"
    )
    parser.add_argument(
        "--ab-backward-checks",
        action="store_true",
        help="the eager backward checking dout only against checking everything, alternated",
    )
    parser.add_argument(
        "--ab-unchecked",
        action="store_true",
        help="the pipelines' unchecked entries against their checked twins, alternated",
    )
    parser.add_argument(
        "--stack",
        type=int,
        default=0,
        metavar="L",
        help="per-layer host, wall and replayed times of an L-layer eager stack",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_time_per_call: needs a CUDA GPU", file=sys.stderr)
        return 2

    import megamoe as mm
    from megamoe import ops
    from megamoe.bench.shapes import SHAPES
    from megamoe.wrappers import _native

    if args.op_route:
        ops.takes_eager_route = lambda tensors: False
    shape = SHAPES["ep4rank"].with_tokens(args.tokens)
    layer = shape.make_layer(ordinary=False, device="cuda", requires_grad=True, format=args.format)
    dout = torch.randn_like(layer.x)
    leaves = list(layer.grad_leaves().values())

    # mm.moe is looked up at each call, so the timers patched in below see these too.
    def forward():
        return layer.call(mm.moe)

    def forward_backward():
        torch.autograd.grad(layer.call(mm.moe), leaves, dout)

    passes = (("forward", forward), ("fwd+bwd", forward_backward))
    if args.without_checks:
        forward_backward()  # every module of a pass loaded, then its checks disabled
        _disable_checks()
    if args.ab_backward_checks:
        return backward_checks_ab(forward_backward, args)
    if args.ab_unchecked:
        return unchecked_entries_ab(forward_backward, args)
    if args.plain:
        return plain_times(passes, args)
    if args.stack:
        return stack_times(layer, args)

    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    timing = [False]

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if not timing[0]:
                return fn(*a, **k)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                entry = totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return wrapper

    wrapped: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("megamoe") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, types.FunctionType) and obj.__module__.startswith("megamoe"):
                key = f"{obj.__module__.removeprefix('megamoe.')}.{obj.__qualname__}"
                wrapped.setdefault(id(obj), timed(key, obj))
                setattr(module, attr, wrapped[id(obj)])
    compiled = _native.native()

    class Launchers:
        def __getattr__(self, name):
            return timed(f"native.{name}", getattr(compiled, name))

    launchers = Launchers()
    _native.native = lambda: launchers
    for name in ("empty", "cat", "mm", "aminmax"):
        setattr(torch, name, timed(f"torch.{name}", getattr(torch, name)))
    torch.Tensor.__matmul__ = timed("Tensor.__matmul__", torch.Tensor.__matmul__)

    route = "op" if args.op_route else "eager"
    for label, fn in passes:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        totals.clear()
        timing[0] = True
        host = 0.0
        for _ in range(args.calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            host += time.perf_counter() - start
        timing[0] = False
        torch.cuda.synchronize()
        print(
            f"\n{route} route, T={args.tokens} {args.format} {label}: "
            f"{host / args.calls * 1e3:.3f} ms of host time per call (instrumented)"
        )
        print(f"{'us/call':>9} {'calls':>6} {'us each':>8}  function")
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:50]
        for name, (count, seconds) in ranked:
            print(
                f"{seconds / args.calls * 1e6:9.1f} {count / args.calls:6.1f} "
                f"{seconds / count * 1e6:8.1f}  {name}"
            )
    return 0


def host_and_wall_ms(fn, calls: int, warmup: int) -> tuple[float, float]:
    """Medians over ``calls`` calls of ``fn`` that each start on an idle GPU: the host
    time to return, and the wall time until its kernels are done (ms)."""
    for _ in range(warmup):
        fn()
    host, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(wall) * 1e3


def plain_times(passes, args) -> int:
    """Uninstrumented host and wall times per call of each ``(label, call)`` of
    ``passes`` (see the module docstring)."""
    route = "op" if args.op_route else "eager"
    print(f"{route} route, T={args.tokens} {args.format}, medians of {args.calls} calls (ms)")
    print(f"{'pass':8} {'host, idle GPU':>15} {'synced wall':>12} {'host, back to back':>19}")
    for label, fn in passes:
        host, wall = host_and_wall_ms(fn, args.calls, warmup=10)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        queued = (time.perf_counter() - start) / args.calls
        torch.cuda.synchronize()
        print(f"{label:8} {host:15.3f} {wall:12.3f} {queued * 1e3:19.3f}")
    return 0


def stack_times(layer, args) -> int:
    """Host and synced wall time per layer of an eager F+B through ``args.stack`` layers
    (and through one), and the GPU time per layer of the stack replayed from a CUDA graph
    (see the module docstring)."""
    import megamoe as mm

    if args.stack < 1:
        print("host_time_per_call: --stack needs at least one layer", file=sys.stderr)
        return 2
    sides = [
        mm.SideLoRA(
            *(t.detach().clone().requires_grad_() for t in layer.side.tensors()),
            scale=layer.side.scale,
        )
        for _ in range(args.stack)
    ]
    x0 = layer.x.detach().clone().requires_grad_()

    def step(depth: int) -> None:
        x = x0
        for side in sides[:depth]:
            x = x + mm.moe(x, layer.topk_ids, layer.topk_weights, layer.base, side)
        leaves = [x0, *(t for side in sides[:depth] for t in side.tensors())]
        torch.autograd.grad(x.float().sum(), leaves)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    probe = torch.randn(8, device="cuda", requires_grad=True)
    engine, _ = host_and_wall_ms(
        lambda: torch.autograd.grad(Identity.apply(probe).sum(), [probe]),
        10 * args.calls,
        warmup=20,
    )
    print(
        "a trivial autograd.Function's F+B on CUDA (the fixed cost of one grad call): "
        f"{engine:.3f} ms of host time"
    )
    print(f"eager F+B stacks, T={args.tokens} {args.format}, medians of {args.calls} steps (ms)")
    print(f"{'layers':>6} {'host/layer':>11} {'wall/layer':>11}")
    for depth in sorted({1, args.stack}):
        host, wall = host_and_wall_ms(lambda depth=depth: step(depth), args.calls, warmup=5)
        print(f"{depth:6d} {host / depth:11.3f} {wall / depth:11.3f}")
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for _ in range(3):
            step(args.stack)  # warm-up off the capture stream, as capture needs
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(args.stack)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replayed = []
    for _ in range(3 + args.calls):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        replayed.append(start.elapsed_time(end))
    per_layer = statistics.median(replayed[3:]) / args.stack
    print(f"{args.stack:6d} replayed: {per_layer:.3f} ms of GPU time per layer")
    return 0


def backward_checks_ab(forward_backward, args) -> int:
    """Host time of an eager F+B whose backward checks ``dout`` only (the eager route's
    ``_eager_backward``) and one that first runs the backward op's whole input check
    (``_backward_inputs``), in alternating rounds."""
    from megamoe.custom_ops import layer as layer_ops
    from megamoe.custom_ops.inputs import SAVED_INPUTS, SIDE_NAMES

    dout_only = layer_ops._eager_backward
    weights = SAVED_INPUTS[: SAVED_INPUTS.index(SIDE_NAMES[0])]  # x .. w2_scales

    def checks_all(dout, inputs, options, state, **which):
        layer_ops._backward_inputs(
            dout, *(inputs[name] for name in weights), tuple(inputs[name] for name in SIDE_NAMES),
            options["scale"], options["activation"], options["activation_clamp"],
            *state.values(),
        )  # fmt: skip
        return dout_only(dout, inputs, options, state, **which)

    def use(backward):
        return lambda: setattr(layer_ops, "_eager_backward", backward)

    cases = {"dout only": use(dout_only), "everything": use(checks_all)}
    return alternating_rounds(forward_backward, cases, "backward checks", args)


def unchecked_entries_ab(forward_backward, args) -> int:
    """Host time of an eager F+B with the fused pipelines' ``*_unchecked`` entries as
    they are and with each replaced by its checked twin (the same name without the
    suffix, in the module that defines it), in alternating rounds."""
    import importlib

    swaps = []  # (namespace, name, unchecked entry, checked twin)
    for module_name in ("megamoe.pipeline.fused_forward", "megamoe.pipeline.fused_backward"):
        module = importlib.import_module(module_name)
        for name, entry in vars(module).items():
            if name.endswith("_unchecked") and callable(entry):
                home = sys.modules[entry.__module__]
                swaps.append((module, name, entry, getattr(home, name.removesuffix("_unchecked"))))
    from megamoe.wrappers import pool

    for name, entry in vars(pool).items():  # the pipelines call these as pool.<name>
        if name.endswith("_unchecked") and callable(entry):
            swaps.append((pool, name, entry, getattr(pool, name.removesuffix("_unchecked"))))
    print("swapped: " + ", ".join(sorted({name for _, name, _, _ in swaps})))

    def use(checked: bool):
        def apply():
            for namespace, name, unchecked, twin in swaps:
                setattr(namespace, name, twin if checked else unchecked)

        return apply

    cases = {"unchecked": use(False), "checked": use(True)}
    return alternating_rounds(forward_backward, cases, "pipeline entries", args)


def alternating_rounds(forward_backward, cases, what: str, args, rounds: int = 10) -> int:
    """Host time of an eager F+B under each of two ``cases`` (name -> a function that
    puts it in place; the first is restored at the end), in ``rounds`` alternating rounds
    of ``--calls`` calls each; prints the medians and the second's extra time."""
    names = list(cases)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(10):
        forward_backward()
    try:
        for round_ in range(rounds):
            for name in names[round_ % 2 :] + names[: round_ % 2]:
                cases[name]()
                host = []
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    forward_backward()
                    host.append(time.perf_counter() - start)
                medians[name].append(statistics.median(host) * 1e3)
    finally:
        cases[names[0]]()
    torch.cuda.synchronize()
    saved = [second - first for first, second in zip(medians[names[0]], medians[names[1]])]
    print(
        f"eager F+B, T={args.tokens} {args.format}: host ms, medians of {args.calls} calls "
        f"per round, {rounds} alternating rounds"
    )
    for name, values in medians.items():
        print(f"  {what} {name:10}: median {statistics.median(values):.3f} "
              f"(rounds {min(values):.3f}-{max(values):.3f})")  # fmt: skip
    print(
        f"  saved per F+B by {names[0]}: median {statistics.median(saved):.3f} ms over the "
        f"rounds (range {min(saved):.3f} to {max(saved):.3f})"
    )
    return 0


def _disable_checks() -> None:
    """The primitive argument checks as no-ops in every loaded megamoe module (each module
    binds them by name at import)."""
    no_ops = {
        "check_tensor": lambda name, value, **kwargs: value,
        "check_int": lambda name, value, **kwargs: value,
        "check_choice": lambda name, value, choices: None,
        "check_finite_float": lambda name, value: float(value),
    }
    for name, module in list(sys.modules.items()):
        if name.startswith("megamoe") and module is not None:
            for attr, no_op in no_ops.items():
                if hasattr(module, attr):
                    setattr(module, attr, no_op)


if __name__ == "__main__":
    raise SystemExit(main())
