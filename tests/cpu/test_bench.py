"""The bench CLI on the CPU: its FLOP model, options, fused-backend skip line, memory
refusal, token sweep with the weight-read floor, plots and the commit it reports."""

import argparse
import json
import subprocess
import sys
import time
import types

import pytest
import torch

from megamoe.bench import cli
from megamoe.bench.flops import backward_flops, forward_flops
from megamoe.bench.shapes import SHAPES, estimate_peak_bytes
from megamoe.bench.timing import copy_bandwidth, floor_ms
from megamoe.testing.inputs import make_routing

GIB = 2**30
QUICK = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--quiet"]


def test_flop_model_hand_counts():
    # T=1 token, N=2 routes, H=4, I=2, r=0: GEMM1 2*2*4*4 + GEMM2 2*2*2*4 = 64 + 32.
    assert forward_flops(1, 2, 4, 2, 0) == 96
    # dgrad2 2*N*H*I + dgrad1 2*N*2I*H + the router dots 2*N*I = 32 + 64 + 8; ordinary
    # adds dw2 and dw13, 96 more.
    assert backward_flops(1, 2, 4, 2, 0, base_grads=False) == 104
    assert backward_flops(1, 2, 4, 2, 0, base_grads=True) == 200


@pytest.mark.parametrize("side_rank", [0, 16])
@pytest.mark.parametrize("base_grads", [False, True])
def test_the_bench_counts_what_flop_counter_mode_counts(side_rank, base_grads):
    """The bench's model and the ops' FlopCounterMode formulas count the same backward
    for unmasked routes (the bench left out the router gradient's dots; a review)."""
    from megamoe.custom_ops import flop_formulas

    tokens, top_k, hidden, inter = 6, 3, 64, 128
    bench = backward_flops(tokens, tokens * top_k, hidden, inter, side_rank, base_grads)
    ops = flop_formulas.backward_flops(
        tokens, top_k, hidden, inter, side_rank,
        base_grads=base_grads, side_grads=side_rank > 0, recompute=False,
    )  # fmt: skip
    assert bench == ops


def test_ordinary_ep4rank_matches_the_design_figure():
    # docs/DESIGN.md §7: ordinary F+B at ep4rank, 110.9 ms, is 535 TFLOP/s.
    s = SHAPES["ep4rank"]
    total = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0)
    total += backward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0, True)
    assert total / 0.1109 / 1e12 == pytest.approx(535, abs=1)


def test_side_path_is_a_few_percent_of_the_base():
    s = SHAPES["ep4rank"]
    base = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0)
    side = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, s.side_rank)
    assert 0.03 < side / base - 1 < 0.05  # docs/DESIGN.md §1: ~4% of the base FLOPs


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    assert cli.main([*QUICK, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_cli_runs_small_shape_on_cpu(tmp_path, capsys, mode):
    report = _run(tmp_path, "--shape", "small", "--mode", mode, "--iters", "2", "--warmup", "1")
    rows = {(r["backend"], r["pass"]): r for r in report["results"]}
    for backend in ("baseline", "reference"):
        for pass_name in ("forward", "fwd+bwd"):
            row = rows[(backend, pass_name)]
            assert row["status"] == "ok" and len(row["samples_ms"]) == 2
            assert row["median_ms"] > 0 and row["tflops"] > 0
            assert row["mode"] == mode and row["dtype"] == "bf16" and row["tokens"] == 256
    assert rows[("baseline", "fwd+bwd")]["flops"] > rows[("baseline", "forward")]["flops"]
    assert report["shape"]["name"] == "small" and report["modes"] == [mode]
    table = capsys.readouterr().out
    assert "baseline" in table and "vs baseline" in table


def test_without_a_gpu_the_fused_backend_has_a_skipped_line(tmp_path, capsys):
    """The default backends on a CPU include the fused one, which says why it did not run."""
    args = cli.parse_args(["--device", "cpu"])
    assert args.backends[0] == "fused"
    report = _run(tmp_path, "--shape", "small", "--pass", "forward", "--backend", "fused")
    (row,) = report["results"]
    assert row["status"] == "skipped: needs a Hopper GPU"
    lines = [line for line in capsys.readouterr().out.splitlines() if " fused " in line]
    assert lines and lines[0].endswith("skipped: needs a Hopper GPU")
    assert cli.fused_unavailable(cli.torch.device("cpu")) == "needs a Hopper GPU"


def test_matrix_of_modes_and_formats(tmp_path):
    report = _run(
        tmp_path, "--shape", "small", "--mode", "side-lora,ordinary", "--dtype", "bf16,mxfp4",
        "--backend", "baseline", "--pass", "forward",
    )  # fmt: skip
    kinds = {(r["mode"], r["dtype"]) for r in report["results"] if r["status"] == "ok"}
    assert kinds == {(m, d) for m in ("side-lora", "ordinary") for d in ("bf16", "mxfp4")}
    assert report["dtypes"] == ["bf16", "mxfp4"] and report["sweep"] is None


def test_help_states_every_option_and_its_default(capsys):
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "default" in action.help, action.option_strings
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--shape", "--tokens", "--plot", "--json", "--ep", "weight-read floor"):
        assert option in text


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--backend", "cublas"], "--backend"),
        (["--pass", "backward"], "--pass"),
        (["--dtype", "fp8"], "--dtype"),
        (["--mode", "lora"], "--mode"),
        (["--iters", "0"], "--iters"),
        (["--ep", "0"], "--ep"),
        (["--tokens", "128,many"], "--tokens"),
        (["--tokens", "0,16"], "--tokens"),
        (["--ep", "2", "--dtype", "bf16,mxfp4"], "--ep"),
        (["--routing", "zipf"], "--routing"),
        (["--skew", "0.5"], "--skew"),
        (["--routing", "skewed", "--skew", "-1"], "--skew"),
        (["--routing", "skewed", "--skew", "nan"], "--skew"),
        (["--routing", "skewed", "--skew", "inf"], "--skew"),
        (["--ep", "2", "--routing", "skewed"], "--ep"),
        # A review: these passed the parser and failed later in a traceback.
        (["--seed", "-1"], "--seed: expected a seed in [0, 2^63)"),
        (["--seed", str(2**64 - 1)], "--seed: expected a seed in [0, 2^63)"),
        (["--device", "bogus"], "--device: expected a torch device"),
        (["--device", "meta"], "--device: the bench runs on cuda or cpu"),
    ],
)
def test_cli_rejects_bad_options(argv, match, capsys):
    device = [] if "--ep" in argv else ["--device", "cpu"]  # --ep refuses --device
    with pytest.raises(SystemExit):
        cli.parse_args([*device, *argv])
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ["--shape", "small"],
        ["--backend", "fused"],
        ["--pass", "forward"],
        ["--seed", "5"],
        ["--cuda-graph"],
        ["--activation-checkpoint"],
        ["--plot", "x.png"],
        ["--device", "cpu"],
    ],
)
def test_cli_ep_refuses_the_options_it_would_drop(extra, capsys):
    """``--ep`` runs megamoe.bench.ep, which takes --mode, --dtype, --warmup, --iters and
    --json: any other option would be silently dropped, so it is refused."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--ep", "2", *extra])
    assert "--ep: runs megamoe.bench.ep, which takes --mode" in capsys.readouterr().err


def test_cli_ep_takes_ordinary_mxfp4():
    # The EP op trains an MXFP4 base's masters (it refused this before it took them).
    args = cli.parse_args(["--ep", "2", "--mode", "ordinary", "--dtype", "mxfp4"])
    assert (args.modes, args.dtypes) == (["ordinary"], ["mxfp4"])


@pytest.mark.parametrize(
    "module",
    ["megamoe.bench.breakdown", "megamoe.bench.ep", "megamoe.bench.hf", "megamoe.bench.engine"],
)
def test_the_other_bench_clis_refuse_zero_iterations_before_any_work(module, capsys):
    """(Their work needs a GPU; the refusal comes first, from the argument parser.)"""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--iters", "0"])
    assert "--iters: expected at least 1 timed sample, got 0" in capsys.readouterr().err


def test_breakdown_refuses_a_graph_of_a_trainable_base_before_any_work(capsys):
    """A trainable base is prepared again before each call, outside what a CUDA graph of
    the pass would hold; the refusal comes from the parser, before the GPU check."""
    import megamoe.bench.breakdown as breakdown

    argv = ["--cuda-graph", "--mode", "ordinary", "--pass", "fwd+bwd"]
    with pytest.raises(SystemExit):
        breakdown.main(argv)
    assert "--cuda-graph: a trainable base" in capsys.readouterr().err


def test_repeated_tokens_run_once_and_hf_names_an_unknown_impl(capsys):
    """A repeated ``--tokens`` count ran twice, and the "vs baseline" column paired the
    rows by count (the first baseline row read 0.76x against itself; a review); the
    other lists were already de-duplicated. bench.hf timed its baseline before a bad
    ``--impl`` failed as a KeyError."""
    args = cli.parse_args(["--device", "cpu", "--tokens", "8,16,8"])
    assert args.token_counts == [8, 16]
    import megamoe.bench.hf as hf

    with pytest.raises(SystemExit):
        hf.main(["--impl", "bogus"])
    assert "--impl: invalid choice: 'bogus'" in capsys.readouterr().err


def test_bench_engine_refuses_a_sustained_count_below_one(capsys):
    """``--sustained 0`` timed nothing and divided by zero after building the inputs;
    ``-2`` printed negative times and ratios (a review)."""
    import megamoe.bench.engine as engine

    for value in ("0", "-2"):
        with pytest.raises(SystemExit):
            engine.main(["--sustained", value])
        assert "expected at least 1 launch per sample" in capsys.readouterr().err


def test_cli_ep_needs_the_gpus(capsys):
    # --ep P hands over to torchrun only when P local GPUs exist.
    assert cli.main(["--ep", "2", "--mode", "ordinary", "--iters", "3"]) == 2
    assert "--ep 2: needs 2 GPUs" in capsys.readouterr().err


# ------------------------------------------------------------ memory estimate


def test_memory_estimate_hand_count():
    s = SHAPES["small"]  # T=256 H=256 I=128 E_l=8 K=2 r=16
    weights = 8 * 3 * 256 * 128 * (4 + 2)  # float32 layer + its BF16 prepared base
    adapters = 2 * (3 * 256 * 16 + 3 * 8 * 16 * 128) * 4
    tokens = 4 * 256 * 256 * 4
    routes = 2 * 512 * (2 * 256 + 3 * 128) * 4
    want = weights + adapters + tokens + routes
    assert estimate_peak_bytes(s, compute="float32", mode="side-lora", format="bf16") == want


def test_memory_estimate_bounds_the_measured_ep4rank_peaks():
    # docs/PERFORMANCE.md, H200: fused side-LoRA 14.6 GiB, BF16 baseline 22.5 GiB.
    s = SHAPES["ep4rank"]
    estimate = estimate_peak_bytes(s, compute="bf16", mode="side-lora", format="bf16") / GIB
    assert 22.5 < estimate < 3 * 14.6


def test_ep4rank_on_the_cpu_stops_with_a_memory_estimate(monkeypatch, capsys):
    monkeypatch.setattr(cli, "host_memory_available", lambda: 16 * GIB)
    assert cli.main(["--device", "cpu", "--shape", "ep4rank"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--shape ep4rank on the CPU: needs the baseline (float32) about 55 GiB")
    assert "the reference (float64) about 108 GiB" in err
    assert "16.0 GiB available" in err and "Hopper GPU" in err


def test_a_shape_that_fits_is_not_refused(monkeypatch):
    monkeypatch.setattr(cli, "host_memory_available", lambda: 16 * GIB)
    assert cli.memory_refusal(cli.parse_args(["--device", "cpu"]), cli.torch.device("cpu")) is None


# ----------------------------------------------------------------- token sweep


def test_weight_read_floor_arithmetic():
    s = SHAPES["ep4rank"]
    assert s.weight_bytes("bf16") == 64 * 3 * 4096 * 2048 * 2
    assert s.weight_bytes("mxfp4") / s.weight_bytes("bf16") == pytest.approx(4.25 / 16)
    # issue 17: at 4.2 TB/s the floors are 0.77 ms (BF16) and 0.20 ms (MXFP4).
    assert floor_ms(s.weight_bytes("bf16"), 4.2e12) == pytest.approx(0.767, abs=5e-4)
    assert floor_ms(s.weight_bytes("mxfp4"), 4.2e12) == pytest.approx(0.2037, abs=5e-4)
    with pytest.raises(ValueError, match="bandwidth"):
        floor_ms(1, 0.0)
    rows = [
        {"status": "ok", "dtype": "bf16", "median_ms": 2.0},
        {"status": "ok", "dtype": "mxfp4", "median_ms": 1.0},
        {"status": "skipped: needs a Hopper GPU", "dtype": "bf16"},
    ]
    cli.add_floor_ratios(rows, {"bf16": 0.5, "mxfp4": 0.25})
    assert [r.get("x_floor") for r in rows] == [4.0, 4.0, None]


def test_copy_bandwidth_is_measured_on_the_device():
    bandwidth = copy_bandwidth(cli.torch.device("cpu"), 8 * 2**20, warmup=1, iters=3)
    assert 1e8 < bandwidth < 1e13  # bytes/s: anything a CPU's memory can do


def test_token_sweep_reports_floors_and_ratios(tmp_path, capsys):
    report = _run(
        tmp_path, "--shape", "small", "--tokens", "8,32", "--backend", "fused,baseline",
        "--pass", "forward,fwd+bwd",
    )  # fmt: skip
    sweep = report["sweep"]
    assert sweep["tokens"] == [8, 32] and sweep["copy_bandwidth_gbs"] > 0
    assert set(sweep["floors_ms"]) == {"bf16", "mxfp4"}  # both formats by default
    for dtype, value in sweep["floors_ms"].items():
        assert value == pytest.approx(
            SHAPES["small"].weight_bytes(dtype) / (sweep["copy_bandwidth_gbs"] * 1e9) * 1e3
        )
    measured = [r for r in report["results"] if r["status"] == "ok"]
    assert {(r["tokens"], r["dtype"], r["pass"]) for r in measured} == {
        (t, d, p) for t in (8, 32) for d in ("bf16", "mxfp4") for p in ("forward", "fwd+bwd")
    }
    for row in measured:
        assert row["x_floor"] == pytest.approx(row["median_ms"] / sweep["floors_ms"][row["dtype"]])
    skipped = [r for r in report["results"] if r["backend"] == "fused"]
    assert len(skipped) == 8 and all(r["status"].startswith("skipped") for r in skipped)
    out = capsys.readouterr().out
    assert "weight-read floor" in out and "x floor" in out


# ----------------------------------------------------------------------- plots


def _report(sweep: bool) -> dict:
    rows = []
    for tokens in (128, 512, 2048):
        for dtype in ("bf16", "mxfp4"):
            for backend in ("fused", "baseline"):
                for pass_name in ("forward", "fwd+bwd"):
                    ms = tokens / 100 * (2 if pass_name == "fwd+bwd" else 1)
                    rows.append(
                        {"mode": "side-lora", "dtype": dtype, "tokens": tokens, "backend": backend,
                         "pass": pass_name, "status": "ok", "median_ms": ms}
                    )  # fmt: skip
    if not sweep:
        rows = [r for r in rows if r["tokens"] == 128]
    report = {"shape": {"name": "ep4rank"}, "device": "test", "results": rows, "sweep": None}
    if sweep:
        report["sweep"] = {"floors_ms": {"bf16": 0.77, "mxfp4": 0.2}, "copy_bandwidth_gbs": 4200}
    return report


@pytest.mark.parametrize("sweep", [True, False], ids=["sweep", "one-shape"])
def test_plot_writes_a_png(tmp_path, sweep):
    pytest.importorskip("matplotlib")
    path = tmp_path / "nested" / "plot.png"
    cli.plot(_report(sweep), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_replayed_sweep_is_drawn_by_its_replayed_times(monkeypatch, tmp_path):
    """With --cuda-graph rows the sweep draws each series by its replayed time (what the
    weight-read floors bound) and its eager time as a faint line of the same colour."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    report = _report(True)
    for row in report["results"]:
        if row["backend"] == "fused":
            row["graph_ms"] = row["median_ms"] / 3
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    cli.plot(report, tmp_path / "sweep.png")
    lines = {line.get_label(): line for line in figures[0].axes[0].lines}
    replayed = lines["fused side-lora mxfp4 fwd+bwd, replayed"]
    eager = lines["fused side-lora mxfp4 fwd+bwd, eager"]
    assert list(replayed.get_xdata()) == [128, 512, 2048]
    assert list(replayed.get_ydata()) == pytest.approx([t / 100 * 2 / 3 for t in (128, 512, 2048)])
    assert list(eager.get_ydata()) == pytest.approx([t / 100 * 2 for t in (128, 512, 2048)])
    assert eager.get_color() == replayed.get_color() and eager.get_alpha() < 1
    # Rows without a replayed time (the baseline) keep one line, by their eager time.
    assert list(lines["baseline side-lora bf16 forward"].get_ydata()) == pytest.approx(
        [t / 100 for t in (128, 512, 2048)]
    )
    close(figures[0])


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match="--plot: needs matplotlib"):
        cli.plot(_report(True), tmp_path / "p.png")
    assert cli.main([*QUICK, "--shape", "small", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot: needs matplotlib" in capsys.readouterr().err


def test_cli_mxfp4_base(tmp_path):
    argv = ["--shape", "small", "--backend", "baseline", "--dtype", "mxfp4", "--pass", "forward"]
    assert cli.main([*QUICK, *argv]) == 0


# --------------------------------------------------------------------- commit


def test_the_report_names_the_commit_from_git_in_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "megamoe._build_info", None)  # no wheel metadata
    commit, source = cli.build_commit()
    if source == "git":  # this test runs from a checkout (or an installed wheel)
        head = commit.removesuffix("-dirty")
        assert len(head) == 40 and int(head, 16) >= 0


def test_a_checkout_with_changes_is_named_dirty(tmp_path, monkeypatch):
    """The git fallback named HEAD for a checkout with uncommitted changes (a review):
    a measurement of a modified tree was recorded as the commit's."""
    monkeypatch.setitem(sys.modules, "megamoe._build_info", None)
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv[1])
        code = {"rev-parse": 0, "diff": 1}[argv[1]]
        return subprocess.CompletedProcess(argv, code, stdout="ab" * 20 + "\n", stderr="")

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    assert cli.build_commit() == ("ab" * 20 + "-dirty", "git")
    assert calls == ["rev-parse", "diff"]


def test_the_report_names_the_commit_a_wheel_was_built_from(tmp_path, monkeypatch):
    info = types.ModuleType("megamoe._build_info")
    info.COMMIT, info.DIRTY = "0123456789abcdef0123456789abcdef01234567", False
    monkeypatch.setitem(sys.modules, "megamoe._build_info", info)
    assert cli.build_commit() == (info.COMMIT, "build")
    info.DIRTY = True
    assert cli.build_commit() == (info.COMMIT + "-dirty", "build")
    report = _run(tmp_path, "--shape", "small", "--backend", "fused", "--pass", "forward")
    assert report["commit"] == info.COMMIT + "-dirty" and report["commit_source"] == "build"


def test_memory_bench_watches_stages_that_exist():
    """The memory bench wraps the pipeline's module-level calls by name: a renamed stage
    must fail here, not on the GPU."""
    from megamoe.bench.memory import STAGES

    for module, name in STAGES:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name}"


def test_memory_bench_stages_are_what_the_pipelines_call():
    """Each watched stage is called in the fused pipelines' source (a pipeline that moves
    to another entry, e.g. a checked wrapper's ``*_unchecked`` twin, must fail here and
    not leave that stage silently unwatched; on the CPU the twins call the checked
    wrappers, so running the pipeline could not tell)."""
    import inspect
    import re

    from megamoe.bench.memory import STAGES
    from megamoe.pipeline import fused_backward, fused_forward

    source = inspect.getsource(fused_forward) + inspect.getsource(fused_backward)
    for module, name in STAGES:
        prefix = "pool." if module.__name__.endswith(".pool") else ""
        called = re.search(rf"(?<![\w.]){re.escape(prefix + name)}\(", source)
        assert called, f"{module.__name__}.{name}"


# ------------------------------------------------------------------- launches


def test_device_work_counts_kernels_and_copies_only():
    """Kernels and memcpy/memset by their Kineto activity type; the GPU side of a
    record_function range and the CPU operators are not launches."""
    from types import SimpleNamespace

    from megamoe.bench.timing import DeviceWork, count_device_work

    kinds = ["cpu_op", "kernel", "gpu_user_annotation", "kernel", "gpu_memcpy", "user_annotation"]
    kinds += ["gpu_memset", "cuda_runtime", "kernel"]
    events = [SimpleNamespace(activity_type=kind, name=f"e{i}") for i, kind in enumerate(kinds)]
    assert count_device_work(events) == DeviceWork(kernels=3, copies=2)
    assert count_device_work([]) == DeviceWork(kernels=0, copies=0)


def test_device_work_is_counted_without_activity_types():
    """torch < 2.12 events carry no activity type: GPU events count by name, megamoe's
    profiler ranges and CPU operators do not."""
    from types import SimpleNamespace

    import torch

    from megamoe.bench.timing import DeviceWork, count_device_work

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        SimpleNamespace(device_type=cuda, name="void megamoe::kernels::engine_kernel<0>()"),
        SimpleNamespace(device_type=cuda, name="nvjet_sm90_tst_64x32"),
        SimpleNamespace(device_type=cuda, name="Memcpy DtoH (Device -> Pinned)"),
        SimpleNamespace(device_type=cuda, name="Memset (Device)"),
        SimpleNamespace(device_type=cuda, name="megamoe::gemm1"),
        SimpleNamespace(device_type=cpu, name="aten::mm"),
    ]
    assert count_device_work(events) == DeviceWork(kernels=2, copies=2)


def test_kernel_times_are_summed_by_name_over_kernels_and_copies_only():
    from types import SimpleNamespace

    from megamoe.bench.timing import kernel_times_by_name

    def event(kind, name, us):
        return SimpleNamespace(activity_type=kind, name=name, device_time_total=us)

    events = [
        event("kernel", "gemm", 5.0),
        event("gpu_user_annotation", "megamoe::gemm1", 9.0),  # a range: its kernels count
        event("gpu_memcpy", "Memcpy DtoD", 1.5),
        event("kernel", "gemm", 7.0),
        event("cpu_op", "aten::mm", 3.0),
    ]
    assert kernel_times_by_name(events) == {"gemm": [5.0, 7.0], "Memcpy DtoD": [1.5]}


def test_table_shows_the_launches_of_fused_rows():
    rows = [
        {"mode": "side-lora", "dtype": "bf16", "tokens": 128, "backend": backend,
         "pass": "fwd+bwd", "status": "ok", "median_ms": ms, "tflops": 1.0, **extra}
        for backend, ms, extra in (
            ("fused", 2.0, {"launches": 37, "copies": 1, "peak_gib": 1.0}),
            ("baseline", 4.0, {"peak_gib": 2.0}),
        )
    ]  # fmt: skip
    header, fused, baseline = cli.format_table(rows).splitlines()
    assert header.split()[-3:] == ["launches", "vs", "baseline"]
    assert fused.split()[-2:] == ["37", "2.00x"]
    assert baseline.split()[-2:] == ["-", "1.00x"]


def test_table_shows_graph_replay_times_against_the_floor():
    rows = [
        {"mode": "side-lora", "dtype": "bf16", "tokens": 512, "backend": "fused",
         "pass": "forward", "status": "ok", "median_ms": 1.6, "tflops": 1.0, "launches": 15,
         "peak_gib": 1.0, "graph_ms": 0.9}
    ]  # fmt: skip
    cli.add_floor_ratios(rows, {"bf16": 0.75})
    assert rows[0]["graph_x_floor"] == 0.9 / 0.75
    header, line = cli.format_table(rows).splitlines()
    assert header.endswith("x floor  graph ms  x floor")
    assert line.split()[-3:] == ["2.13x", "0.900", "1.20x"]


def test_table_shows_back_to_back_replays_against_the_floor():
    rows = [
        {"mode": "side-lora", "dtype": "mxfp4", "tokens": 128, "backend": "fused",
         "pass": "forward", "status": "ok", "median_ms": 1.2, "tflops": 1.0, "launches": 12,
         "peak_gib": 1.0, "graph_ms": 0.6, "graph_b2b_ms": 0.55},
        {"mode": "side-lora", "dtype": "mxfp4", "tokens": 128, "backend": "baseline",
         "pass": "forward", "status": "ok", "median_ms": 2.4, "tflops": 0.5},
    ]  # fmt: skip
    cli.add_floor_ratios(rows, {"mxfp4": 0.25})
    assert rows[0]["graph_b2b_x_floor"] == 0.55 / 0.25
    assert "graph_b2b_x_floor" not in rows[1]
    header, fused, baseline = cli.format_table(rows).splitlines()
    assert header.endswith("graph ms  x floor   b2b ms  x floor")
    assert fused.split()[-4:] == ["0.600", "2.40x", "0.550", "2.20x"]
    assert baseline.split()[-4:] == ["-", "-", "-", "-"]


def test_max_expert_load_hand_counts():
    ids = torch.tensor([[0, 1], [0, 2], [0, -1], [3, 1]])  # loads 3, 2, 1, 1: mean 7/4
    assert cli.max_expert_load(ids, 4) == pytest.approx(3 / (7 / 4))
    assert cli.max_expert_load(ids, 8) == pytest.approx(3 / (7 / 8))  # empty experts count
    assert cli.max_expert_load(torch.full((2, 2), -1), 4) == 1.0  # no routes


def test_skewed_routing_reaches_the_layer_and_the_report(tmp_path, capsys):
    report = _run(
        tmp_path, "--shape", "small", "--tokens", "64", "--backend", "baseline",
        "--pass", "forward", "--dtype", "bf16", "--routing", "skewed", "--skew", "1.5",
    )  # fmt: skip
    assert report["routing"] == {"kind": "skewed", "skew": 1.5}
    (row,) = report["results"]
    shape = SHAPES["small"]
    ids, _ = make_routing(64, shape.num_local_experts, shape.top_k, kind="skewed", skew=1.5)
    assert row["max_load"] == pytest.approx(cli.max_expert_load(ids, shape.num_local_experts))
    assert row["max_load"] > 1.5 and row["routing"] == "skewed"
    header, line = capsys.readouterr().out.splitlines()[-2:]
    assert header.endswith("max load") and line.endswith(f"{row['max_load']:.2f}x")
    balanced = _run(tmp_path, "--shape", "small", "--backend", "baseline", "--pass", "forward")
    assert balanced["routing"] == {"kind": "balanced"}
    assert balanced["results"][0]["max_load"] == pytest.approx(1.0)
    assert "max load" not in capsys.readouterr().out


def test_cuda_graph_option_is_parsed():
    assert cli.build_parser().parse_args(["--cuda-graph"]).cuda_graph
    assert not cli.build_parser().parse_args([]).cuda_graph


def test_json_keeps_the_configurations_measured_before_a_run_is_cut_short(tmp_path, monkeypatch):
    """The report is written after every configuration (complete: false until the end), so
    a run stopped by a timeout leaves what it measured."""
    out = tmp_path / "bench.json"
    measured = cli.run_backend
    calls = []

    def stop_at_the_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measured(*args, **kwargs)

    monkeypatch.setattr(cli, "run_backend", stop_at_the_second)
    argv = [*QUICK, "--shape", "small", "--iters", "2", "--warmup", "1", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        cli.main([*argv, "--backend", "baseline,reference", "--pass", "forward"])
    partial = json.loads(out.read_text())
    assert partial["complete"] is False
    assert [(r["backend"], r["status"]) for r in partial["results"]] == [("baseline", "ok")]
    monkeypatch.setattr(cli, "run_backend", measured)
    assert cli.main([*argv, "--backend", "baseline", "--pass", "forward"]) == 0
    assert json.loads(out.read_text())["complete"] is True


def test_device_idle_merges_overlaps_and_ranks_the_gaps():
    """Idle time is the span less the union of the intervals (overlapping work on two
    streams counts once); gaps name the work around them, largest first."""
    from megamoe.bench.timing import device_idle

    work = [(0.0, 10.0, "a"), (5.0, 12.0, "b"), (20.0, 30.0, "c"), (31.0, 32.0, "d")]
    idle = device_idle(reversed(work), top=1)
    assert idle.span_us == 32.0
    assert idle.busy_us == 12.0 + 10.0 + 1.0
    assert idle.gaps == ((8.0, "b", "c"),)
    assert device_idle([]).busy_us == 0.0
    # Work nested inside a longer interval leaves no gap and keeps the longer one's end.
    nested = device_idle([(0.0, 10.0, "long"), (2.0, 3.0, "short"), (11.0, 12.0, "next")])
    assert nested.gaps == ((1.0, "long", "next"),) and nested.busy_us == 11.0


def test_select_device_sets_only_an_indexed_cuda_device(monkeypatch):
    """``--device cuda:N`` makes N current (its events and graphs use that stream); a bare
    ``cuda`` is the current device already, and ``set_device`` refuses a device without
    an index (every default bench run failed on the GPU that way). The stand-in resolves
    the index as ``torch.cuda.set_device`` does, then records it."""
    from torch.cuda._utils import _get_device_index

    with pytest.raises(ValueError, match="specified index"):  # what the bench used to call
        torch.cuda.set_device(torch.device("cuda"))  # (torch refuses before any CUDA call)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(_get_device_index(d)))
    assert cli.select_device("cuda") == torch.device("cuda")
    assert cli.select_device("cuda:1") == torch.device("cuda", 1)
    assert cli.select_device("cpu") == torch.device("cpu")
    assert calls == [1]


def test_the_floor_counts_only_the_experts_a_row_routes_to():
    """A few tokens reach only some experts, and an expert without rows has no tile: its
    weights are not read. The floor was every expert's weights at every token count, so
    a one-token row's x floor came out several times too small."""
    ids = torch.tensor([[0, 3], [3, -1]])
    assert cli.experts_routed(ids, 8) == 2
    rows = [
        {"status": "ok", "dtype": "bf16", "median_ms": 1.0, "experts_routed": 2, "num_experts": 8},
        {"status": "ok", "dtype": "bf16", "median_ms": 1.0, "experts_routed": 0, "num_experts": 8},
        {"status": "ok", "dtype": "bf16", "median_ms": 2.0},  # (a row without the counts)
    ]
    cli.add_floor_ratios(rows, {"bf16": 0.5})
    assert rows[0]["floor_ms"] == 0.125 and rows[0]["x_floor"] == 8.0
    assert "x_floor" not in rows[1]  # nothing routed: no weight to read
    assert rows[2]["x_floor"] == 4.0


def test_a_sweep_row_records_the_experts_it_routes_to(tmp_path):
    path = tmp_path / "sweep.json"
    code = cli.main(
        ["--shape", "small", "--tokens", "1,64", "--backend", "reference", "--pass", "forward",
         "--iters", "1", "--warmup", "0", "--quiet", "--json", str(path)]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    one, many = (next(r for r in rows if r["tokens"] == t) for t in (1, 64))
    assert one["experts_routed"] < many["experts_routed"] <= many["num_experts"]
    assert one["floor_ms"] < many["floor_ms"]


@pytest.mark.parametrize("replay_s, bursts", [(0.001, True), (0.006, False)])
def test_graph_replays_back_to_back_only_for_short_passes(monkeypatch, replay_s, bursts):
    """The one-replay and back-to-back timings around a stand-in graph (CUDA graphs need a
    GPU): the bursts run only under GRAPH_BACK_TO_BACK_MAX_MS, and their figure is per
    replay."""
    replays = []

    class Graph:
        def replay(self) -> None:
            replays.append(1)
            time.sleep(replay_s)

    monkeypatch.setattr(cli, "capture_graph", lambda body, device: Graph())
    args = argparse.Namespace(warmup=1, iters=3)
    one, burst = cli._graph_replay_ms(lambda: None, [], None, args, torch.device("cpu"))
    assert one >= replay_s * 1e3
    if bursts:
        assert burst is not None and replay_s * 1e3 <= burst < one + 2.0
        assert len(replays) == (1 + 3) + 3 * cli.GRAPH_REPLAYS_BACK_TO_BACK
    else:
        assert burst is None
        assert len(replays) == 1 + 3
