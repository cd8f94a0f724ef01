"""The engine bench's host-side parts: Nsight Compute parsing (a CSV in the layout ncu 2025
writes), the peer versions, the kernel-times bursts (CPU)."""

import pytest

from megamoe.bench.engine import NCU_METRICS, ncu_bytes_by_case, smi_index

RANGE = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
NONE6 = ":none" * 6


def _csv(rows: list[tuple[str, list[str]]], units: tuple[str, ...] = ("byte",) * 3) -> list[str]:
    head = ['"ID"', f'"{RANGE}"', '"Kernel Name"', *(f'"{m}"' for m in NCU_METRICS)]
    units = ['""', '""', '""', *(f'"{u}"' for u in units)]
    lines = [",".join(head), ",".join(units)]
    for i, (rng, values) in enumerate(rows):
        lines.append(",".join([f'"{i}"', f'"{rng}"', '"k"', *(f'"{v}"' for v in values)]))
    return lines


def test_bytes_are_summed_per_case_range():
    lines = _csv(
        [
            ("", ["9", "9", "9"]),  # a set-up kernel outside every range
            (f"<default domain>:gemm2|engine +a2{NONE6}", ["1,000", "200", "5000"]),
            (f"<default domain>:da2|torch._grouped_mm{NONE6}", ["10", "1", "30"]),
            (f"<default domain>:da2|torch._grouped_mm{NONE6}", ["5", "2", "20"]),
        ]
    )
    totals = ncu_bytes_by_case(lines)
    assert set(totals) == {("gemm2", "engine +a2"), ("da2", "torch._grouped_mm")}
    assert list(totals[("gemm2", "engine +a2")].values()) == [1000.0, 200.0, 5000.0]
    assert list(totals[("da2", "torch._grouped_mm")].values()) == [15.0, 3.0, 50.0]


def test_no_rows_give_no_counts():
    assert ncu_bytes_by_case([]) == {}
    assert ncu_bytes_by_case(_csv([("", ["1", "1", "1"])])) == {}


def test_scaled_units_are_converted_to_bytes(capsys):
    """ncu scales its units unless told --print-units base; a scaled row still counts in
    bytes (the units row was skipped and every value read as bytes). An unknown unit
    drops the counts with a message (the timings taken before are still reported)."""
    rows = [(f"<default domain>:gemm1|engine{NONE6}", ["1.5", "2", "3"])]
    totals = ncu_bytes_by_case(_csv(rows, units=("Mbyte", "Kbyte", "Gbyte")))
    assert list(totals[("gemm1", "engine")].values()) == [1.5e6, 2e3, 3e9]
    assert ncu_bytes_by_case(_csv(rows, units=("byte", "byte", "cycle"))) == {}
    assert "unexpected units ['cycle']" in capsys.readouterr().err


def test_power_log_samples_the_gpu_torch_runs_on(monkeypatch):
    """nvidia-smi numbers GPUs without CUDA_VISIBLE_DEVICES: with it set to "3,5", torch's
    device 0 is nvidia-smi's 3 (the bench lane of a two-GPU session ran on GPU 1 while
    its clock and power were read from GPU 0)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert smi_index(0) == 3 and smi_index(1) == 5
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert smi_index(1) == 1


def test_peer_versions_name_each_distribution():
    import importlib.metadata

    from megamoe.bench.engine import peer_versions

    pytest_version = importlib.metadata.version("pytest")
    report = peer_versions(("pytest", "no-such-distribution-megamoe"))
    assert report == (f"pytest {pytest_version}, no-such-distribution-megamoe (version not found)")


def test_kernel_times_table_formats_each_row():
    from megamoe.bench.engine import kernel_times_table

    rows = [
        {"gemm": "wgrad13", "case": "engine", "kernel_ms": 24.9, "idle_ms": 0.0125,
         "top_kernel": "engine_kernel<4, 0, 128, 256>", "top_first_ms": 19.5,
         "top_last_ms": 25.25},
        {"gemm": "wgrad13", "case": "torch._grouped_mm", "kernel_ms": 19.5, "idle_ms": 0.0,
         "top_kernel": "cutlass::device_kernel", "top_first_ms": 19.4, "top_last_ms": 19.6},
    ]  # fmt: skip
    lines = kernel_times_table(rows, 10)
    assert lines[0] == "one profiled burst of 10 launches per case, per launch:"
    assert lines[2].split() == [
        "wgrad13", "engine", "24.900", "0.013", "19.500", "25.250", "engine_kernel<4,", "0,",
        "128,", "256>",
    ]  # fmt: skip
    assert lines[3].split()[:6] == ["wgrad13", "torch._grouped_mm", "19.500", "0.000", "19.400",
                                    "19.600"]  # fmt: skip


def test_each_row_gets_the_burst_of_its_own_case():
    """``add_burst_times`` profiles each row's case (by name, not position) for the
    asked launches after an idle pause, and adds the burst's fields to that row."""
    from megamoe.bench.engine import add_burst_times
    from megamoe.bench.timing import BurstTimes

    def engine():
        return None

    def torch_peer():
        return None

    by_case = {"engine": (engine, 1.0), "torch._grouped_mm": (torch_peer, 1.0)}
    calls = []

    def profile(fn, launches, *, pause_s):
        calls.append((fn, launches, pause_s))
        ms = 25.0 if fn is engine else 19.5
        return BurstTimes(ms, 0.01, fn.__name__, ms - 1.0, ms + 1.0)

    rows = [{"gemm": "wgrad13", "case": "torch._grouped_mm"}, {"gemm": "wgrad13", "case": "engine"}]
    add_burst_times(rows, by_case, 10, profile=profile)
    assert calls == [(torch_peer, 10, 1.0), (engine, 10, 1.0)]
    assert rows[0] == {"gemm": "wgrad13", "case": "torch._grouped_mm", "kernel_ms": 19.5,
                           "idle_ms": 0.01, "top_kernel": "torch_peer", "top_first_ms": 18.5,
                           "top_last_ms": 20.5}  # fmt: skip
    assert (rows[1]["kernel_ms"], rows[1]["top_kernel"]) == (25.0, "engine")


def test_kernel_times_need_a_burst_of_two_or_more(capsys):
    from megamoe.bench.engine import main

    with pytest.raises(SystemExit):
        main(["--kernel-times", "--sustained", "1"])
    assert "--kernel-times needs --sustained 2 or more" in capsys.readouterr().err
