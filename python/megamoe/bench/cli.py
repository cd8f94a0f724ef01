"""``python -m megamoe.bench``: time the MoE layer per backend, in one run.

Backends: ``fused`` (our kernels; needs a Hopper GPU, else its rows read "skipped:
needs a Hopper GPU"), ``baseline`` (the unfused torch._grouped_mm layer a trainer
would write, megamoe.testing.baseline) and ``reference`` (the oracle: float64 on CPU,
float32 with BF16 rounding points on GPU). Passes: the training forward (autograd on,
activations saved) and forward+backward timed together. Medians of CUDA-event samples
after warm-up; TFLOP/s from the useful FLOPs of megamoe.bench.flops; peak memory of
one timed run (the counter is reset before each; the row's is its last run's); for the
fused backend on a GPU the kernel launches (and memcpy/memset
copies) of one pass, counted by torch.profiler in one extra untimed call. Without a
GPU it runs the ``small`` shape on the CPU, so the command always works; a shape too
large for the host stops with a memory estimate.

Runs:
  one shape        every --mode x --dtype x backend x pass at --shape (the default);
  token sweep      --tokens 128,512,...: the same at the shape's dims for each token
                   count, with the weight-read floor (the routed experts' w13 + w2
                   bytes over the device copy bandwidth, measured in the same run)
                   and each time's ratio to it; --plot draws time against tokens
                   with the floors of every expert;
  expert parallel  --ep P: megamoe.bench.ep on P local GPUs under torchrun.

Routing: balanced by default (expert loads even); --routing skewed draws Zipf-like expert
popularity (--skew), and the table gives each token count's busiest expert's routes
over the mean ("max load").

Examples:
  python -m megamoe.bench                                   # ep4rank on a GPU
  python -m megamoe.bench --mode side-lora,ordinary --dtype bf16,mxfp4 --json t.json --plot t.png
  python -m megamoe.bench --tokens 128,512,2048,8192,65536 --dtype bf16,mxfp4 --plot sweep.png
  python -m megamoe.bench --tokens 512,4096 --routing skewed --skew 0.5 --cuda-graph
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import megamoe
from megamoe.testing.inputs import DEFAULT_SKEW

from .flops import backward_flops, forward_flops
from .shapes import SHAPES, Shape, estimate_peak_bytes, host_memory_available
from .timing import (
    Progress,
    capture_graph,
    copy_bandwidth,
    floor_ms,
    profile_device_work,
    sample_count,
    seed_value,
    time_back_to_back,
    time_fn,
    warmup_count,
)

BACKENDS = ("fused", "baseline", "reference")
PASSES = ("forward", "fwd+bwd")
MODES = ("side-lora", "ordinary")
DTYPES = ("bf16", "mxfp4")
ROUTINGS = ("balanced", "skewed")
GIB = 2**30
#: Bytes of the copy that measures the device bandwidth: far beyond the H200's 50 MB
#: L2 (GPU); smaller on a CPU, where the figure only serves the CPU's own sweep.
COPY_BYTES = {"cuda": 2 * GIB, "cpu": 256 * 2**20}


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused backend cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "needs a Hopper GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"needs a Hopper GPU (this one is sm_{major}{minor})"
    try:
        from megamoe import _C  # noqa: F401
    except ImportError as error:
        return f"needs the compiled module megamoe._C ({error})"
    return None


def build_commit() -> tuple[str | None, str]:
    """``(commit, source)`` of the code that runs.

    An installed wheel carries the commit it was built from (``megamoe._build_info``,
    written by CMake at build time); a source checkout asks git. ``source`` is
    ``"build"``, ``"git"`` or ``"unknown"``.
    """
    try:
        # Generated into the wheel by CMakeLists.txt. import_module (not `from megamoe
        # import`) so that sys.modules decides, which is what the tests replace.
        _build_info = importlib.import_module("megamoe._build_info")
    except ImportError:
        _build_info = None
    if _build_info is not None and _build_info.COMMIT:
        return _build_info.COMMIT + ("-dirty" if _build_info.DIRTY else ""), "build"

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    out = git("rev-parse", "HEAD")
    commit = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    if not commit:
        return None, "unknown"
    # As CMakeLists.txt marks a wheel: tracked files changed against HEAD. An answer
    # other than "clean" (exit 0), a failed or timed-out git included, says dirty here:
    # a stamp that may be wrong should not claim the commit.
    diff = git("diff", "--quiet", "HEAD", "--")
    dirty = diff is None or diff.returncode != 0
    return commit + ("-dirty" if dirty else ""), "git"


def compute_dtype(backend: str, device: torch.device) -> torch.dtype:
    """The element type a backend runs in on ``device`` (the bench's choice)."""
    if backend == "fused":
        return torch.bfloat16
    if backend == "baseline":
        # BF16 is the trainer's dtype on the GPU; CPUs run BF16 matmuls very slowly.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if backend == "reference":
        return torch.float32 if device.type == "cuda" else torch.float64
    raise ValueError(f"backend: {backend!r} has no implementation")


def _backend_fn(backend: str, device: torch.device):
    dtype = compute_dtype(backend, device)
    if backend == "baseline":
        from megamoe.testing import baseline

        return baseline.moe, dtype, {}
    if backend == "reference":
        extra = {"compute_dtype": dtype}
        if device.type == "cuda":
            extra["round_bf16"] = True
        return megamoe.reference.moe, dtype, extra
    return megamoe.moe, dtype, {}


def _row(shape: Shape, mode: str, dtype: str, backend: str, pass_name: str, **fields) -> dict:
    return {
        "mode": mode,
        "dtype": dtype,
        "tokens": shape.num_tokens,
        "backend": backend,
        "pass": pass_name,
        **fields,
    }


def run_backend(
    backend: str,
    shape: Shape,
    mode: str,
    dtype: str,
    args: argparse.Namespace,
    device: torch.device,
    progress: Progress,
) -> list[dict]:
    """Time one backend at one (shape, mode, dtype); one result row per pass."""
    why = fused_unavailable(device) if backend == "fused" else None
    if why is not None:
        return [_row(shape, mode, dtype, backend, p, status=f"skipped: {why}") for p in args.passes]
    rows = _measure(backend, shape, mode, dtype, args, device, progress)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the last layer is gone: free it before the next
    return rows


def _measure(
    backend: str,
    shape: Shape,
    mode: str,
    dtype: str,
    args: argparse.Namespace,
    device: torch.device,
    progress: Progress,
) -> list[dict]:
    fn, compute, extra = _backend_fn(backend, device)
    if backend == "fused" and args.activation_checkpoint:
        extra = {**extra, "activation_checkpoint": True}
    ordinary = mode == "ordinary"
    progress.update(f"{backend}: building inputs for {shape.name} T={shape.num_tokens}")
    layer = shape.make_layer(
        ordinary=ordinary,
        seed=args.seed,
        device=device,
        dtype=compute,
        format=dtype,
        requires_grad=True,
        trainable_base=ordinary,
        routing=args.routing,
        **({"skew": args.skew} if args.routing == "skewed" else {}),
    )
    load = max_expert_load(layer.topk_ids, shape.num_local_experts)
    routed = experts_routed(layer.topk_ids, shape.num_local_experts)
    leaves = list(layer.grad_leaves().values())
    # Hold only the weights this backend reads, as a trainer would: the BF16 baseline
    # takes the nn.Linear-layout pair; the fused layer and the MXFP4 baseline read the
    # prepared base (the baseline dequantizes it every call, as a trainer would), so for
    # a frozen base the original w13/w2 go (in ordinary mode they are the trainable
    # masters, kept).
    use_pair = backend == "baseline" and dtype == "bf16"
    if use_pair:
        layer.base = None
    elif not ordinary:
        layer.w13 = layer.w2 = None
    dout = torch.randn(
        shape.num_tokens,
        shape.hidden,
        device=device,
        generator=torch.Generator(device).manual_seed(args.seed + 1),
    ).to(compute)
    routes = int((layer.topk_ids >= 0).sum())
    rank = 0 if ordinary else shape.side_rank
    flops = {
        "forward": forward_flops(shape.num_tokens, routes, shape.hidden, shape.intermediate, rank),
    }
    flops["fwd+bwd"] = flops["forward"] + backward_flops(
        shape.num_tokens, routes, shape.hidden, shape.intermediate, rank, base_grads=ordinary
    )

    def setup() -> None:
        for leaf in leaves:
            leaf.grad = None
        if ordinary and not use_pair:
            layer.reprepare_base()  # the prepared base is part of the last step's graph
        if device.type == "cuda":
            # The peak of a timed run from its start (held memory included), not of the
            # untimed setup (a re-quantized MXFP4 master's temporaries are several times
            # the weights): the row's peak is the last run's.
            torch.cuda.reset_peak_memory_stats(device)

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
        timing = time_fn(
            body,
            device=device,
            warmup=args.warmup,
            iters=args.iters,
            setup=setup,
            label=f"{backend} {mode} {dtype} T={shape.num_tokens} {pass_name}",
            progress=progress,
        )
        row = _row(
            shape,
            mode,
            dtype,
            backend,
            pass_name,
            status="ok",
            median_ms=timing.median_ms,
            min_ms=timing.min_ms,
            samples_ms=list(timing.samples_ms),
            flops=flops[pass_name],
            tflops=flops[pass_name] / (timing.median_ms * 1e-3) / 1e12,
            routing=args.routing,
            max_load=load,
            experts_routed=routed,
            num_experts=shape.num_local_experts,
        )
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            if backend == "fused":  # the launches per pass, in one extra untimed call
                work = profile_device_work(body, setup=setup)
                row["launches"], row["copies"] = work.kernels, work.copies
                if args.cuda_graph and not ordinary:
                    one, burst = _graph_replay_ms(
                        call, leaves, dout if pass_name == "fwd+bwd" else None, args, device
                    )
                    row["graph_ms"] = one
                    if burst is not None:
                        row["graph_b2b_ms"] = burst
        rows.append(row)
    setup()
    return rows


def experts_routed(topk_ids: torch.Tensor, num_experts: int) -> int:
    """Experts with at least one route: only their weights are read (an expert without
    rows has no tile), so they set the weight-read floor of a few-token step."""
    ids = topk_ids.reshape(-1)
    return int((torch.bincount(ids[ids >= 0].long().cpu(), minlength=num_experts) > 0).sum())


def max_expert_load(topk_ids: torch.Tensor, num_experts: int) -> float:
    """The busiest expert's routes over the mean routes per expert (1.0: even loads).

    Args:
        topk_ids: ``[T, K]`` integer expert ids in ``0 .. num_experts - 1``, ``-1`` masked.
        num_experts: ``E``, the experts the mean is taken over.
    """
    ids = topk_ids.reshape(-1)
    loads = torch.bincount(ids[ids >= 0].long().cpu(), minlength=num_experts)
    mean = float(loads.sum()) / num_experts
    return float(loads.max()) / mean if mean > 0 else 1.0


# Replays per sample of the back-to-back graph timing: enough that the first replay's
# launch latency is a small share of the burst. Timed only for passes whose one replay is
# under GRAPH_BACK_TO_BACK_MAX_MS: a graph launch's latency (tens of microseconds) is
# under 1% of a longer pass, and the bursts would lengthen a sweep's large-T rows.
GRAPH_REPLAYS_BACK_TO_BACK = 10
GRAPH_BACK_TO_BACK_MAX_MS = 5.0


def _graph_replay_ms(
    call: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    dout: torch.Tensor | None,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[float, float | None]:
    """Median ms of one pass captured in a CUDA graph and replayed: the forward
    (``dout`` None) or the forward and ``torch.autograd.grad`` of ``leaves``; the GPU's
    time without the host's per-launch work (the fused layer has no host sync). Two
    figures: one replay between events on an idle GPU (the graph launch's latency
    included), and the per-replay time of ``GRAPH_REPLAYS_BACK_TO_BACK`` back to back
    (each launched while the one before runs, as in a step's stream; None where one
    replay takes ``GRAPH_BACK_TO_BACK_MAX_MS`` or more)."""

    def body() -> None:
        out = call()
        if dout is not None:
            torch.autograd.grad(out, leaves, dout)

    graph = capture_graph(body, device)
    one = time_fn(graph.replay, device=device, warmup=args.warmup, iters=args.iters)
    burst = None
    if one.median_ms < GRAPH_BACK_TO_BACK_MAX_MS:  # the graph is warm from the line above
        burst = time_back_to_back(
            graph.replay,
            device=device,
            warmup=0,
            iters=args.iters,
            calls=GRAPH_REPLAYS_BACK_TO_BACK,
        ).median_ms
    del graph
    return one.median_ms, burst


def add_floor_ratios(rows: list[dict], floors: dict[str, float]) -> None:
    """Set ``floor_ms`` and ``x_floor`` (time / floor) on every measured row: each pass
    against its base format's forward weight-read floor (``floors``: every expert's
    weights), scaled to the experts the row's routing reaches (``experts_routed`` of
    ``num_experts``, where the row has them: a few tokens reach only some experts)."""
    for row in rows:
        share = row.get("experts_routed", 1) / row.get("num_experts", 1)
        if row["status"] == "ok" and row["dtype"] in floors and share > 0:
            floor = floors[row["dtype"]] * share  # (no route at all: no weight to read)
            row["floor_ms"] = floor
            row["x_floor"] = row["median_ms"] / floor
            if "graph_ms" in row:
                row["graph_x_floor"] = row["graph_ms"] / floor
            if "graph_b2b_ms" in row:
                row["graph_b2b_x_floor"] = row["graph_b2b_ms"] / floor


def format_table(rows: list[dict]) -> str:
    """The results as a text table: one line per row; ``launches`` the kernels one pass
    launched (fused rows on a GPU); ``vs baseline`` is the baseline's time over this
    row's at the same mode, format, tokens and pass; ``x floor`` (token sweeps) the time
    over the weight-read floor; ``graph ms`` (``--cuda-graph``) the pass replayed from a
    CUDA graph, one replay on an idle GPU; ``b2b ms`` a replay's share of replays back to
    back (no launch latency between them); ``max load`` (rows with other than balanced
    routing) the busiest expert's routes over the mean."""
    baseline = {
        _key(row): row["median_ms"]
        for row in rows
        if row["status"] == "ok" and row["backend"] == "baseline"
    }
    floors = any("x_floor" in row for row in rows)
    graphs = any("graph_ms" in row for row in rows)
    bursts = any("graph_b2b_ms" in row for row in rows)
    loads = any(row.get("routing", "balanced") != "balanced" for row in rows)
    header = (
        f"{'mode':<9} {'dtype':<5} {'tokens':>6} {'backend':<9} {'pass':<7} {'median ms':>10} "
        f"{'TFLOP/s':>8} {'peak GiB':>9} {'launches':>8} {'vs baseline':>11}"
    )
    header += f" {'x floor':>8}" if floors else ""
    header += f" {'graph ms':>9}" if graphs else ""
    header += f" {'x floor':>8}" if graphs and floors else ""
    header += f" {'b2b ms':>8}" if bursts else ""
    header += f" {'x floor':>8}" if bursts and floors else ""
    header += f" {'max load':>8}" if loads else ""
    lines = [header]
    for row in rows:
        lead = (
            f"{row['mode']:<9} {row['dtype']:<5} {row['tokens']:>6} {row['backend']:<9} "
            f"{row['pass']:<7}"
        )
        if row["status"] != "ok":
            lines.append(f"{lead} {row['status']}")
            continue
        base = baseline.get(_key(row))
        speedup = f"{base / row['median_ms']:.2f}x" if base else "-"
        peak = f"{row['peak_gib']:.1f}" if "peak_gib" in row else "-"
        launches = str(row.get("launches", "-"))
        line = (
            f"{lead} {row['median_ms']:>10.3f} {row['tflops']:>8.3g} {peak:>9} {launches:>8} "
            f"{speedup:>11}"
        )
        if floors:
            line += f" {row['x_floor']:>7.2f}x" if "x_floor" in row else f" {'-':>8}"
        if graphs:
            line += f" {row['graph_ms']:>9.3f}" if "graph_ms" in row else f" {'-':>9}"
            if floors:
                graph_floor = row.get("graph_x_floor")
                line += f" {graph_floor:>7.2f}x" if graph_floor else f" {'-':>8}"
        if bursts:
            line += f" {row['graph_b2b_ms']:>8.3f}" if "graph_b2b_ms" in row else f" {'-':>8}"
            if floors:
                burst_floor = row.get("graph_b2b_x_floor")
                line += f" {burst_floor:>7.2f}x" if burst_floor else f" {'-':>8}"
        if loads:
            line += f" {row['max_load']:>7.2f}x" if "max_load" in row else f" {'-':>8}"
        lines.append(line)
    return "\n".join(lines)


def _key(row: dict) -> tuple:
    return row["mode"], row["dtype"], row["tokens"], row["pass"]


def plot(report: dict, path: Path) -> None:
    """Write a PNG of ``report``'s results (needs matplotlib).

    A token sweep: median time against tokens per row kind (log-log), with each base
    format's weight-read floor as a dotted line; rows timed replayed from a CUDA graph
    (``--cuda-graph``) are drawn by their replayed time (the GPU's, which the floors
    bound), with the eager time beside each in a faint line of the same colour. One
    shape: grouped bars of the median time per (mode, format, pass), one bar per backend.
    """
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot: needs matplotlib (python -m pip install matplotlib, or megamoe[plot])"
        ) from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    title = f"{report['shape']['name']} dims on {report['device']}"
    if report.get("sweep"):
        series: dict[tuple, list[tuple[int, float, float | None]]] = {}
        for r in rows:
            series.setdefault((r["backend"], r["mode"], r["dtype"], r["pass"]), []).append(
                (r["tokens"], r["median_ms"], r.get("graph_ms"))
            )
        for (backend, mode, dtype, pass_name), points in sorted(series.items()):
            points.sort()
            style = "-" if pass_name == "forward" else "--"
            label = f"{backend} {mode} {dtype} {pass_name}"
            replayed = [(t, graph) for t, _, graph in points if graph is not None]
            if replayed:
                (line,) = ax.plot(
                    [t for t, _ in replayed],
                    [ms for _, ms in replayed],
                    style,
                    marker="o",
                    label=f"{label}, replayed",
                )
                ax.plot(
                    [t for t, _, _ in points],
                    [ms for _, ms, _ in points],
                    style,
                    marker=".",
                    alpha=0.35,
                    color=line.get_color(),
                    label=f"{label}, eager",
                )
            else:
                ax.plot(
                    [t for t, _, _ in points],
                    [ms for _, ms, _ in points],
                    style,
                    marker="o",
                    label=label,
                )
        for dtype, value in sorted(report["sweep"]["floors_ms"].items()):
            ax.axhline(value, linestyle=":", color="gray")
            ax.annotate(
                f"{dtype} weight-read floor {value:.3g} ms",
                (0.01, value),
                xycoords=("axes fraction", "data"),
                va="bottom",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("median time (ms)")
        title += f", copy bandwidth {report['sweep']['copy_bandwidth_gbs']:.0f} GB/s"
    else:
        groups = sorted({(r["mode"], r["dtype"], r["pass"]) for r in rows})
        backends = sorted({r["backend"] for r in rows}, key=BACKENDS.index)
        width = 0.8 / max(len(backends), 1)
        times = {(r["mode"], r["dtype"], r["pass"], r["backend"]): r["median_ms"] for r in rows}
        for b, backend in enumerate(backends):
            xs = [g + b * width for g in range(len(groups))]
            ax.bar(xs, [times.get((*grp, backend), 0.0) for grp in groups], width, label=backend)
        ax.set_xticks([g + width * (len(backends) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels(["\n".join(g) for g in groups], fontsize=8)
        ax.set_ylabel("median time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _comma_list(
    parser: argparse.ArgumentParser, option: str, text: str, choices: tuple
) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        parser.error(f"{option}: expected a comma-separated subset of {','.join(choices)}")
    for item in items:
        if item not in choices:
            parser.error(f"{option}: expected a subset of {','.join(choices)}, got {item!r}")
    return list(dict.fromkeys(items))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every option's help states its meaning and default."""
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--shape",
        choices=sorted(SHAPES),
        help="layer dims per rank: "
        + "; ".join(
            f"{name}: T={s.num_tokens} H={s.hidden} I={s.intermediate} E_l={s.num_local_experts} "
            f"K={s.top_k} r={s.side_rank}"
            for name, s in sorted(SHAPES.items())
        )
        + " (default: ep4rank with a CUDA GPU, small without)",
    )
    add(
        "--mode",
        default="side-lora",
        help="comma-separated subset of side-lora (frozen base, trainable adapters) and "
        "ordinary (trainable base, no adapters) (default: side-lora)",
    )
    add(
        "--dtype",
        default=None,
        help="base weight formats, comma-separated subset of bf16,mxfp4 (default: bf16; "
        "bf16,mxfp4 with --tokens)",
    )
    add(
        "--backend",
        help=f"comma-separated subset of {','.join(BACKENDS)} (default: fused,baseline with "
        "a CUDA GPU, fused,baseline,reference without: the fused rows then read 'skipped'; "
        "with --tokens: fused with a GPU, fused,baseline without)",
    )
    add(
        "--pass",
        dest="passes",
        default=",".join(PASSES),
        help="comma-separated subset of forward (the training forward) and fwd+bwd "
        f"(default: {','.join(PASSES)})",
    )
    add(
        "--tokens",
        help="token sweep: comma-separated token counts per rank at the shape's dims, e.g. "
        "128,512,2048,8192,65536; adds the weight-read floor and each time's ratio to it "
        "(default: off, the shape's own T)",
    )
    add(
        "--routing",
        choices=ROUTINGS,
        default="balanced",
        help="router output: balanced (expert loads as even as possible) or skewed "
        "(Zipf-like expert popularity p ~ 1/rank**skew, K distinct experts per token) "
        "(default: balanced)",
    )
    add(
        "--skew",
        type=float,
        help=f"Zipf exponent of --routing skewed, >= 0 (0: uniform draws) (default: "
        f"{DEFAULT_SKEW})",
    )
    add("--warmup", type=warmup_count, default=3, help="untimed runs before sampling (default: 3)")
    add(
        "--iters",
        type=sample_count,
        default=10,
        help="timed samples; the median is reported (default: 10)",
    )
    add("--seed", type=seed_value, default=0, help="seed of the inputs and routing (default: 0)")
    add("--device", help="torch device to run on (default: cuda with a CUDA GPU, cpu without)")
    add("--json", type=Path, help="write the report (rows, commit, device) here (default: none)")
    add(
        "--plot",
        type=Path,
        help="write a PNG here: time against tokens with the floors for a token sweep, "
        "bars per mode/format/pass otherwise; needs matplotlib (default: none)",
    )
    add("--quiet", action="store_true", help="no progress line on stderr (default: off)")
    add(
        "--cuda-graph",
        action="store_true",
        help="fused side-LoRA rows on a GPU: also time each pass captured in one CUDA graph "
        "and replayed (graph ms: the GPU's time without the host's per-kernel launch work; "
        "one graph launch's latency stays in; b2b ms, for passes under 5 ms: a replay's "
        "share of 10 back to back, a tenth of that latency) "
        "(default: off)",
    )
    add(
        "--activation-checkpoint",
        action="store_true",
        help="fused backend: recompute GEMM1's pre-activations in the backward instead of "
        "saving them (default: off)",
    )
    add(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree: > 1 runs megamoe.bench.ep on that many local GPUs "
        "under torchrun (65,536 tokens per rank, 256 experts; one --mode and --dtype, "
        "--warmup, --iters and --json pass on; other options are refused) (default: 1)",
    )
    return parser


def _check_ep_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--ep P`` runs ``megamoe.bench.ep``, which takes ``--mode``, ``--dtype``,
    ``--warmup``, ``--iters`` and ``--json``: refuse the options it would not see."""
    given = [
        flag
        for flag, value in (
            ("--shape", args.shape),
            ("--backend", args.backend),
            ("--device", args.device),
            ("--plot", args.plot),
        )
        if value is not None
    ]
    given += [
        flag
        for flag, on in (
            ("--cuda-graph", args.cuda_graph),
            ("--activation-checkpoint", args.activation_checkpoint),
            ("--pass", args.passes != ",".join(PASSES)),
            ("--seed", args.seed != 0),
        )
        if on
    ]
    if given:
        parser.error(
            "--ep: runs megamoe.bench.ep, which takes --mode, --dtype, --warmup, --iters "
            f"and --json only; got {', '.join(given)}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ep > 1:
        _check_ep_options(parser, args)
    args.shape = args.shape or ("ep4rank" if gpu else "small")
    args.device = args.device or ("cuda" if gpu else "cpu")
    args.modes = _comma_list(parser, "--mode", args.mode, MODES)
    dtypes = args.dtype or ("bf16,mxfp4" if args.tokens else "bf16")
    args.dtypes = _comma_list(parser, "--dtype", dtypes, DTYPES)
    if args.backend:
        backends = args.backend
    elif args.tokens:  # the sweep is about the fused layer against its floor
        backends = "fused" if gpu else "fused,baseline"
    else:
        backends = "fused,baseline" if gpu else "fused,baseline,reference"
    args.backends = _comma_list(parser, "--backend", backends, BACKENDS)
    args.passes = _comma_list(parser, "--pass", args.passes, PASSES)
    args.token_counts = None
    if args.tokens:
        try:
            args.token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
        if not args.token_counts or min(args.token_counts) < 1:
            parser.error(f"--tokens: expected token counts >= 1, got {args.tokens!r}")
        # Once each, as the other lists: a repeated count ran twice, and the table's
        # "vs baseline" column paired rows by count (a review).
        args.token_counts = list(dict.fromkeys(args.token_counts))
    if args.skew is not None and args.routing != "skewed":
        parser.error("--skew: applies to --routing skewed only")
    if args.skew is None:
        args.skew = DEFAULT_SKEW
    if not (math.isfinite(args.skew) and args.skew >= 0):
        parser.error(f"--skew: expected a finite Zipf exponent >= 0, got {args.skew}")
    if args.ep < 1:
        parser.error("--ep must be >= 1")
    if args.ep > 1 and (len(args.modes) > 1 or len(args.dtypes) > 1 or args.tokens):
        parser.error("--ep: takes one --mode and one --dtype, and no --tokens")
    if args.ep > 1 and args.routing != "balanced":
        parser.error("--ep: routes each rank's tokens itself (--routing balanced only)")
    if args.device.startswith("cuda") and not gpu:
        parser.error("--device cuda: no CUDA GPU is available")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: expected a torch device such as cuda or cpu, got {args.device!r}")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device: the bench runs on cuda or cpu, got {args.device!r}")
    return args


def memory_refusal(args: argparse.Namespace, device: torch.device) -> str | None:
    """On a CPU: why the requested runs would not fit in host memory (None: they fit or
    cannot be judged). The estimate is :func:`~megamoe.bench.shapes.estimate_peak_bytes`
    for the largest runnable backend, mode, format and token count."""
    if device.type != "cpu":
        return None
    available = host_memory_available()
    if available is None:
        return None
    shape = SHAPES[args.shape]
    tokens = args.token_counts or [shape.num_tokens]
    need: dict[str, tuple[str, int]] = {}
    for backend in args.backends:
        if backend == "fused" and fused_unavailable(device):
            continue
        compute = {torch.bfloat16: "bf16", torch.float32: "float32", torch.float64: "float64"}[
            compute_dtype(backend, device)
        ]
        peak = max(
            estimate_peak_bytes(shape.with_tokens(t), compute=compute, mode=m, format=f)
            for t in tokens
            for m in args.modes
            for f in args.dtypes
        )
        need[backend] = (compute, peak)
    if not need or max(peak for _, peak in need.values()) <= 0.8 * available:
        return None
    estimates = " and ".join(
        f"the {backend} ({compute}) about {peak / GIB:.0f} GiB"
        for backend, (compute, peak) in need.items()
    )
    return (
        f"--shape {args.shape} on the CPU: needs {estimates} of host memory (an upper "
        "estimate), "
        f"and this machine has {available / GIB:.1f} GiB available. Run it on a Hopper GPU "
        "(the fused backend needs one), or use --shape small here."
    )


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
        args.modes[0],
        "--dtype",
        args.dtypes[0],
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
    ]
    if args.json:
        command += ["--json", str(args.json)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    return subprocess.run(command, env=env, check=False).returncode


def select_device(name: str) -> torch.device:
    """``torch.device(name)``, made the current CUDA device where it names an index (the
    events, the copy and the graph capture use the current device's stream). A bare
    ``"cuda"`` is the current device already (``set_device`` refuses a device without an
    index)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ep > 1:
        return _run_ep(args)
    device = select_device(args.device)
    refusal = memory_refusal(args, device)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (fail before hours of timing, not after)
        except ImportError:
            print("--plot: needs matplotlib (python -m pip install matplotlib)", file=sys.stderr)
            return 2
    shape = SHAPES[args.shape]
    progress = Progress(enabled=not args.quiet)
    sweep = None
    if args.token_counts:
        progress.update("measuring the device copy bandwidth")
        bandwidth = copy_bandwidth(device, COPY_BYTES[device.type])
        floors = {f: floor_ms(shape.weight_bytes(f), bandwidth) for f in args.dtypes}
        sweep = {
            "tokens": args.token_counts,
            "copy_bytes": COPY_BYTES[device.type],
            "copy_bandwidth_gbs": bandwidth / 1e9,
            "weight_bytes": {f: shape.weight_bytes(f) for f in args.dtypes},
            "floors_ms": floors,
        }
    commit, commit_source = build_commit()
    rows: list[dict] = []

    def make_report(complete: bool) -> dict:
        return {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "megamoe": megamoe.__version__,
            "commit": commit,
            "commit_source": commit_source,
            "command": " ".join(
                ["python -m megamoe.bench", *(argv if argv is not None else sys.argv[1:])]
            ),
            # A token sweep runs the shape's dims at each of sweep["tokens"]: its own T
            # was not measured.
            "shape": vars(shape)
            | {"num_routes": shape.num_routes}
            | ({"num_tokens": None, "num_routes": None} if sweep else {}),
            "modes": args.modes,
            "dtypes": args.dtypes,
            "routing": {"kind": args.routing}
            | ({"skew": args.skew} if args.routing == "skewed" else {}),
            "warmup": args.warmup,
            "iters": args.iters,
            "sweep": sweep,
            "complete": complete,
            "results": rows,
        }

    def write_json(complete: bool) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(make_report(complete), indent=1))

    for tokens in args.token_counts or [shape.num_tokens]:
        point = shape.with_tokens(tokens)
        for mode in args.modes:
            for dtype in args.dtypes:
                for backend in args.backends:
                    rows.extend(run_backend(backend, point, mode, dtype, args, device, progress))
                    if sweep:
                        add_floor_ratios(rows, sweep["floors_ms"])
                    # After every configuration, so a run cut short keeps what it measured.
                    write_json(complete=False)
    progress.done()
    report = make_report(complete=True)
    write_json(complete=True)
    if args.plot:
        plot(report, args.plot)
    tokens = ",".join(map(str, args.token_counts)) if args.token_counts else shape.num_tokens
    print(
        f"{shape.name}: T={tokens} H={shape.hidden} I={shape.intermediate} "
        f"E_l={shape.num_local_experts} K={shape.top_k} r={shape.side_rank} "
        f"routing={args.routing}{f' (skew {args.skew:g})' if args.routing == 'skewed' else ''} "
        f"device={report['device']} commit={commit or 'unknown'}"
    )
    if sweep:
        floors_text = ", ".join(
            f"{f} {sweep['weight_bytes'][f] / 1e6:.1f} MB -> {ms:.3f} ms"
            for f, ms in sweep["floors_ms"].items()
        )
        print(
            f"weight-read floor (w13 + w2 once at the measured copy bandwidth "
            f"{sweep['copy_bandwidth_gbs']:.0f} GB/s): {floors_text}"
        )
    print(format_table(rows))
    return 0
