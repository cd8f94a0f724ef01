"""The bench CLI on the CPU and its FLOP model."""

import json

import pytest

from megamoe.bench import cli
from megamoe.bench.flops import backward_flops, forward_flops
from megamoe.bench.shapes import SHAPES


def test_flop_model_hand_counts():
    # T=1 token, N=2 routes, H=4, I=2, r=0: GEMM1 2*2*4*4 + GEMM2 2*2*2*4 = 64 + 32.
    assert forward_flops(1, 2, 4, 2, 0) == 96
    # dgrad2 2*N*H*I + dgrad1 2*N*2I*H = 32 + 64; ordinary adds the same again.
    assert backward_flops(1, 2, 4, 2, 0, base_grads=False) == 96
    assert backward_flops(1, 2, 4, 2, 0, base_grads=True) == 192


def test_ordinary_ep4rank_matches_design_figure():
    # DESIGN §7: ordinary F+B 139.9 ms is 424 TFLOP/s effective.
    s = SHAPES["ep4rank"]
    total = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0)
    total += backward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0, True)
    assert total / 0.1399 / 1e12 == pytest.approx(424, abs=1)


def test_side_path_is_a_few_percent_of_the_base():
    s = SHAPES["ep4rank"]
    base = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, 0)
    side = forward_flops(s.num_tokens, s.num_routes, s.hidden, s.intermediate, s.side_rank)
    assert 0.03 < side / base - 1 < 0.05  # DESIGN §1: ~4% of the base FLOPs


@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_cli_runs_small_shape_on_cpu(tmp_path, capsys, mode):
    out = tmp_path / "bench.json"
    argv = [
        "--shape",
        "small",
        "--device",
        "cpu",
        "--backend",
        "fused,baseline,reference",
        "--mode",
        mode,
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out),
        "--quiet",
    ]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["backend"], r["pass"]): r for r in report["results"]}
    assert rows[("fused", "forward")]["status"] != "ok"  # no Hopper GPU here
    for backend in ("baseline", "reference"):
        for pass_name in ("forward", "fwd+bwd"):
            row = rows[(backend, pass_name)]
            assert row["status"] == "ok" and len(row["samples_ms"]) == 2
            assert row["median_ms"] > 0 and row["tflops"] > 0
    assert rows[("baseline", "fwd+bwd")]["flops"] > rows[("baseline", "forward")]["flops"]
    assert report["shape"]["name"] == "small" and report["mode"] == mode
    table = capsys.readouterr().out
    assert "baseline" in table and "vs baseline" in table


def test_cli_mxfp4_base(tmp_path):
    argv = [
        "--shape",
        "small",
        "--device",
        "cpu",
        "--backend",
        "baseline",
        "--dtype",
        "mxfp4",
        "--pass",
        "forward",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--quiet",
    ]
    assert cli.main(argv) == 0


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--backend", "cublas"], "--backend"),
        (["--pass", "backward"], "--pass"),
        (["--dtype", "fp8"], "--dtype"),
        (["--iters", "0"], "--iters"),
        (["--ep", "0"], "--ep"),
    ],
)
def test_cli_rejects_bad_options(argv, match, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", *argv])
    assert match in capsys.readouterr().err


def test_cli_ep_needs_the_gpus(capsys):
    # --ep P hands over to torchrun only when P local GPUs exist.
    assert cli.main(["--device", "cpu", "--ep", "2"]) == 2
    assert "--ep 2: needs 2 GPUs" in capsys.readouterr().err


def test_memory_bench_watches_stages_that_exist():
    """The memory bench wraps the pipeline's module-level calls by name: a renamed stage
    must fail here, not on the GPU."""
    from megamoe.bench.memory import STAGES

    for module, name in STAGES:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name}"
