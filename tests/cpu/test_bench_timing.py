"""Round-robin timing (megamoe.bench.timing.time_interleaved), back-to-back bursts
(time_back_to_back) and the power log's mean over a case's sample windows
(megamoe.bench.engine.mean_during), on the CPU."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from megamoe.bench.engine import mean_during
from megamoe.bench.timing import time_back_to_back, time_interleaved

CPU = torch.device("cpu")


def _recorders(names: list[str], calls: list[str], sleep_s: dict[str, float] | None = None):
    def make(name: str):
        def run() -> None:
            calls.append(name)
            if sleep_s:
                time.sleep(sleep_s[name])

        return run

    return {name: make(name) for name in names}


def test_every_round_runs_each_case_once_from_a_rotating_start():
    calls: list[str] = []
    timed = time_interleaved(_recorders(["a", "b", "c"], calls), device=CPU, warmup=2, iters=4)
    warm, rounds = calls[:6], calls[6:]
    assert warm == ["a", "b", "c"] * 2
    assert rounds == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert list(timed) == ["a", "b", "c"]
    assert all(len(t.timing.samples_ms) == 4 and len(t.windows) == 4 for t in timed.values())


def test_samples_and_windows_measure_each_case():
    calls: list[str] = []
    sleeps = {"short": 0.002, "long": 0.02}
    timed = time_interleaved(
        _recorders(["short", "long"], calls, sleeps), device=CPU, warmup=0, iters=3
    )
    assert timed["long"].timing.median_ms > 5 * timed["short"].timing.median_ms
    assert timed["long"].timing.min_ms >= 20.0
    for t in timed.values():
        for begin, end in t.windows:
            assert end >= begin
    # The windows of different cases do not overlap (one case runs at a time).
    spans = sorted(w for t in timed.values() for w in t.windows)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize(("warmup", "iters"), [(-1, 3), (0, 0)])
def test_bad_counts_are_refused(warmup, iters):
    with pytest.raises(ValueError, match="warmup >= 0 and iters >= 1"):
        time_interleaved({"a": lambda: None}, device=CPU, warmup=warmup, iters=iters)


def test_power_is_averaged_over_the_case_windows_only():
    samples = [(0.5, 1000.0, 300.0), (1.5, 1800.0, 690.0), (2.5, 1400.0, 500.0),
               (3.5, 1500.0, 700.0)]  # fmt: skip
    # Windows [1, 2] and [3, 4] hold the samples at 1.5 and 3.5 only.
    assert mean_during(samples, [(1.0, 2.0), (3.0, 4.0)]) == (1650.0, 695.0)
    assert mean_during(samples, [(10.0, 11.0)]) == (None, None)
    assert mean_during([], [(0.0, 1.0)]) == (None, None)


def test_a_setup_that_queues_device_work_is_finished_before_the_timed_run(monkeypatch):
    """Setup's own kernels (an MXFP4 master re-quantized each step) kept the GPU busy
    while the host queued the timed run, hiding its launch time inside the window. The
    device is now synchronised between setup and the start event. (CUDA calls faked.)"""
    from megamoe.bench.timing import time_fn

    calls = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: object) -> float:
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    timing = time_fn(
        lambda: calls.append("run"),
        device=torch.device("cuda"),
        warmup=0,
        iters=2,
        setup=lambda: calls.append("setup"),
    )
    assert timing.samples_ms == (1.0, 1.0)
    assert calls == ["setup", "sync", "record", "run", "record"] * 2

    # settle=False: a setup that queues a GPU busy-wait stays ahead of the run (the host
    # queues the run while the device waits; tools/weight_stream_ab.py). The sync above
    # had made its busy-wait end before the start event.
    calls.clear()
    time_fn(
        lambda: calls.append("run"),
        device=torch.device("cuda"),
        warmup=0,
        iters=2,
        setup=lambda: calls.append("setup"),
        settle=False,
    )
    assert calls == ["setup", "record", "run", "record"] * 2


def test_back_to_back_bursts_give_the_per_call_time():
    calls = []
    timing = time_back_to_back(
        lambda: (calls.append(1), time.sleep(0.004)), device=CPU, warmup=2, iters=3, calls=5
    )
    assert len(calls) == (2 + 3) * 5  # the warm-up bursts too
    assert len(timing.samples_ms) == 3
    # Each sample is a burst of five 4 ms calls over five: at least 4 ms, and far from
    # the burst's 20 ms.
    assert all(4.0 <= ms < 10.0 for ms in timing.samples_ms)


@pytest.mark.parametrize("calls", [0, -1])
def test_back_to_back_needs_a_call(calls):
    with pytest.raises(ValueError, match="calls >= 1"):
        time_back_to_back(lambda: None, device=CPU, warmup=0, iters=1, calls=calls)


def _event(name: str, start: float, end: float, kind: str = "kernel"):
    from types import SimpleNamespace

    return SimpleNamespace(
        name=name, activity_type=kind, time_range=SimpleNamespace(start=start, end=end)
    )


def test_a_burst_splits_kernel_time_from_idle_time_per_launch():
    """Two launches of a case (a short kernel, then the big one, twice each), with host
    gaps: busy and idle per launch; the top kernel is the one with the most device time
    (not the first seen nor the longest single run), and its first and last runs are by
    start time (the last is the shorter here). A range's GPU span, which would
    double-count its kernels, and a CPU operator are left out."""
    from megamoe.bench.timing import burst_times

    events = [
        _event("prep", 0.0, 10.0),
        _event("gemm", 10.0, 1310.0),
        _event("megamoe::range", 0.0, 1350.0, kind="user_annotation"),
        _event("prep", 1350.0, 1360.0),
        _event("aten::empty", 2360.0, 2500.0, kind="cpu_op"),
        _event("gemm", 1360.0, 2360.0),
        _event("side", 2400.0, 3500.0),
    ]
    burst = burst_times(events, launches=2)
    assert burst.kernel_ms == pytest.approx((1310.0 + 1010.0 + 1100.0) / 2 / 1e3)
    assert burst.idle_ms == pytest.approx((40.0 + 40.0) / 2 / 1e3)
    assert burst.top_kernel == "gemm"
    assert (burst.top_first_ms, burst.top_last_ms) == (1.3, 1.0)


def test_a_burst_without_kernels_or_launches_is_refused():
    from megamoe.bench.timing import burst_times

    with pytest.raises(ValueError, match="no kernel"):
        burst_times([_event("aten::mm", 0.0, 1.0, kind="cpu_op")], launches=1)
    with pytest.raises(ValueError, match="launches"):
        burst_times([_event("gemm", 0.0, 1.0)], launches=0)
