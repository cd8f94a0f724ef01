"""Timing with CUDA events (GPU) or perf_counter (CPU): warm-up, then median of samples;
the device copy bandwidth behind the weight-read floor; the device work one call
issues (kernel launches and copies, from torch.profiler); and its synchronising CUDA
calls (CUDA's sync debug mode)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


def sample_count(text: str) -> int:
    """argparse type of ``--iters``: at least one timed sample, refused at parse time
    rather than after the GPU work (a median needs one). DESIGN §7's recorded figures
    take the median of 10 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 timed sample, got {value}")
    return value


def launch_count(text: str) -> int:
    """argparse type of ``--sustained``: at least one launch per timed sample (a sample
    of none would time nothing, and the per-launch time divides by it)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 launch per sample, got {value}")
    return value


def seed_value(text: str) -> int:
    """argparse type of ``--seed``: a seed torch's generators take, 0 .. 2^63 - 1."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, 2^63), got {value}")
    return value


def warmup_count(text: str) -> int:
    """argparse type of ``--warmup``: 0 or more untimed runs."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more warm-up runs, got {value}")
    return value


@dataclass(frozen=True)
class Timing:
    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def time_fn(
    fn: Callable[[], None],
    *,
    device: torch.device,
    warmup: int,
    iters: int,
    setup: Callable[[], None] | None = None,
    settle: bool = True,
    label: str = "",
    progress: Progress | None = None,
) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``iters`` runs one by one.

    ``setup`` runs before each run outside the timed window (e.g. dropping grads; on
    CUDA, with ``settle``, the device is synchronised after it). ``settle=False`` keeps
    setup's device work queued ahead of the timed run: a setup that queues a GPU
    busy-wait then lets the host queue the run's kernels while the device waits, so the
    window holds the kernels and not the host's launch work. On CUDA each sample is an
    event pair around one run on the current stream.
    """
    progress = progress or Progress(enabled=False)
    for step in range(warmup):
        progress.update(f"{label}: warm-up {step + 1}/{warmup}")
        if setup:
            setup()
        fn()
    samples = []
    for step in range(iters):
        if setup:
            setup()
            if device.type == "cuda" and settle:
                # Setup's own kernels (a re-quantized MXFP4 master) would otherwise keep
                # the GPU busy while the host queues the timed run: its launch time hidden.
                torch.cuda.synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
        progress.update(
            f"{label}: {step + 1}/{iters}, median so far {statistics.median(samples):.2f} ms"
        )
    progress.done()
    return Timing(tuple(samples))


def time_back_to_back(
    fn: Callable[[], None], *, device: torch.device, warmup: int, iters: int, calls: int
) -> Timing:
    """Per-call ms of ``fn`` run ``calls`` times back to back in each of ``iters`` samples
    (after ``warmup`` such bursts): on CUDA one event pair around each burst, so every call
    but the first is queued while the one before runs and no launch latency lies between
    them, as in a training step's stream. Each sample is its burst's time over ``calls``.
    """
    if calls < 1:
        raise ValueError(f"calls >= 1 expected, got {calls}")

    def burst() -> None:
        for _ in range(calls):
            fn()

    timing = time_fn(burst, device=device, warmup=warmup, iters=iters)
    return Timing(tuple(ms / calls for ms in timing.samples_ms))


@dataclass(frozen=True)
class InterleavedTiming:
    """One case's samples from :func:`time_interleaved`, with the wall-clock window of
    each (``time.monotonic`` seconds, the device idle at both ends)."""

    timing: Timing
    windows: tuple[tuple[float, float], ...]


def _one_sample(fn: Callable[[], None], device: torch.device) -> tuple[float, float, float]:
    """(ms, wall start, wall end) of one run of ``fn``, the device idle before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        begin = time.monotonic()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), begin, time.monotonic()
    begin = time.monotonic()
    tick = time.perf_counter()
    fn()
    return (time.perf_counter() - tick) * 1e3, begin, time.monotonic()


def time_interleaved(
    fns: dict[str, Callable[[], None]],
    *,
    device: torch.device,
    warmup: int,
    iters: int,
    progress: Progress | None = None,
) -> dict[str, InterleavedTiming]:
    """Time several cases round-robin: every round runs each case once, starting one case
    later than the round before, so that each case's samples meet the same thermal and
    power-cap history (a case timed alone after another case's heat, or after an idle
    gap, is flattered or penalised by the clock it finds). ``warmup`` rounds first.

    Returns each case's ``iters`` samples (CUDA events on ``device``'s current stream,
    else ``perf_counter``) and their wall-clock windows, in the order of ``fns``.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup >= 0 and iters >= 1 expected, got {warmup} and {iters}")
    names = list(fns)
    progress = progress or Progress(enabled=False)
    for step in range(warmup):
        progress.update(f"warm-up round {step + 1}/{warmup}")
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for step in range(iters):
        for offset in range(len(names)):
            name = names[(step + offset) % len(names)]
            ms, begin, end = _one_sample(fns[name], device)
            samples[name].append(ms)
            windows[name].append((begin, end))
        progress.update(f"round {step + 1}/{iters}")
    progress.done()
    return {
        name: InterleavedTiming(Timing(tuple(samples[name])), tuple(windows[name]))
        for name in names
    }


def copy_bandwidth(device: torch.device, nbytes: int, *, warmup: int = 3, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s, measured as one large copy on ``device``.

    A ``dst.copy_(src)`` of ``nbytes`` bytes (far larger than any cache) reads and
    writes ``nbytes`` each, so the figure is ``2 * nbytes / median time``: the rate a
    kernel that streams the weights once can reach at best (about 4.2 TB/s on an
    H200, 83-88 % of its 4.8 TB/s peak).
    """
    if nbytes < 1:
        raise ValueError(f"nbytes: expected >= 1, got {nbytes}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)  # first touch: on the CPU, allocate the pages outside the timing
    dst.fill_(0)
    timing = time_fn(lambda: dst.copy_(src), device=device, warmup=warmup, iters=iters)
    return 2 * nbytes / (timing.median_ms * 1e-3)


def floor_ms(weight_bytes: int, bandwidth: float) -> float:
    """The weight-read floor: ``weight_bytes`` read once at ``bandwidth`` bytes/s, in ms."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth: expected > 0 bytes/s, got {bandwidth}")
    return weight_bytes / bandwidth * 1e3


def capture_graph(body: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """``body`` captured in a CUDA graph on ``device`` (``graph.replay()`` runs it), after
    two warm-up calls on a side stream, as CUDA graph capture asks (allocator pools and
    lazy initialisation settle outside the capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


@dataclass(frozen=True)
class DeviceWork:
    """What one call puts on the GPU's streams: ``kernels`` launched and ``copies``
    (memcpy and memset operations). Each is a node a CUDA graph of the call holds."""

    kernels: int
    copies: int


def device_event_kind(event: object) -> str | None:
    """``"kernel"``, ``"copy"`` (memcpy or memset) or None (a CPU-side operator, or the
    GPU span of a ``record_function`` range) for one torch.profiler event.

    By the Kineto activity type where the event carries it (torch >= 2.12); before that
    by the device type and name: GPU spans of ranges carry the range's name, which for
    megamoe's is ``megamoe::<stage>``.
    """
    kind = getattr(event, "activity_type", None)
    if kind is not None:
        if kind == "kernel":
            return "kernel"
        return "copy" if kind in ("gpu_memcpy", "gpu_memset") else None
    if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
        return None
    name = str(getattr(event, "name", ""))
    if getattr(event, "is_user_annotation", False) or name.startswith("megamoe::"):
        return None
    return "copy" if name.startswith(("Memcpy", "Memset")) else "kernel"


def kernel_times_by_name(events: Iterable[object]) -> dict[str, list[float]]:
    """Each kernel's or copy's device times (us) by name, of torch.profiler events
    (:func:`device_event_kind`: a range's GPU span would count its kernels twice)."""
    times: dict[str, list[float]] = {}
    for event in events:
        if device_event_kind(event) is not None:
            times.setdefault(event.name, []).append(event.device_time_total)
    return times


def count_device_work(events: Iterable[object]) -> DeviceWork:
    """Kernels and copies among torch.profiler events (``prof.events()``), classified by
    :func:`device_event_kind` (the GPU spans of ``record_function`` ranges and the
    CPU-side operators do not count)."""
    kinds = [device_event_kind(event) for event in events]
    return DeviceWork(kernels=kinds.count("kernel"), copies=kinds.count("copy"))


def profile_device_work(
    fn: Callable[[], None], *, setup: Callable[[], None] | None = None
) -> DeviceWork:
    """The :class:`DeviceWork` of one untimed ``fn()`` on the current CUDA device, under
    torch.profiler (CUDA activity only). ``setup`` runs first, outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    if setup:
        setup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return count_device_work(prof.events())


@dataclass(frozen=True)
class DeviceIdle:
    """Where the GPU sat idle inside a window of device work (:func:`device_idle`).

    ``span_us``: first start to last end; ``busy_us``: the union of the work's intervals;
    ``gaps``: the largest idle gaps as ``(gap_us, name_before, name_after)``, largest first.
    """

    span_us: float
    busy_us: float
    gaps: tuple[tuple[float, str, str], ...]


def device_idle(intervals: Iterable[tuple[float, float, str]], top: int = 5) -> DeviceIdle:
    """The idle time between device work given as ``(start_us, end_us, name)`` (kernels
    and copies of one stream or several: overlapping intervals are merged)."""
    work = sorted(intervals)
    if not work:
        return DeviceIdle(0.0, 0.0, ())
    busy, gaps = 0.0, []
    run_start, run_end, last_name = work[0][0], work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last_name, name))
            run_start = start
        if end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    gaps.sort(key=lambda gap: -gap[0])
    return DeviceIdle(run_end - work[0][0], busy, tuple(gaps[:top]))


@dataclass(frozen=True)
class BurstTimes:
    """One burst of back-to-back launches under the profiler, per launch (ms).

    ``kernel_ms``: the device's busy time; ``idle_ms``: idle time inside the burst's span
    (the GPU waiting for the host, the profiler's own overhead included);
    ``top_kernel``: the kernel (or copy) with the most device time in the burst,
    ``top_first_ms`` / ``top_last_ms``: its first and last run in the burst (a kernel that
    slows as the burst goes on, under a power cap, say). A call that runs the top kernel
    more than once gives the first and last of those runs, not of its calls.
    """

    kernel_ms: float
    idle_ms: float
    top_kernel: str
    top_first_ms: float
    top_last_ms: float


def burst_times(events: Iterable[object], launches: int) -> BurstTimes:
    """:class:`BurstTimes` of torch.profiler events recorded over ``launches`` back-to-back
    calls (kernels and copies by :func:`device_event_kind`; ranges' GPU spans left out)."""
    if launches < 1:
        raise ValueError(f"launches: expected at least 1, got {launches}")
    work = [
        (event.time_range.start, event.time_range.end, event.name)
        for event in events
        if device_event_kind(event) is not None
    ]
    if not work:
        raise ValueError("burst_times: the profiler recorded no kernel")
    idle = device_idle(work)
    totals: dict[str, float] = {}
    for start, end, name in work:
        totals[name] = totals.get(name, 0.0) + (end - start)
    top = max(totals, key=totals.__getitem__)
    runs = sorted((start, end) for start, end, name in work if name == top)
    return BurstTimes(
        kernel_ms=idle.busy_us / launches / 1e3,
        idle_ms=(idle.span_us - idle.busy_us) / launches / 1e3,
        top_kernel=top,
        top_first_ms=(runs[0][1] - runs[0][0]) / 1e3,
        top_last_ms=(runs[-1][1] - runs[-1][0]) / 1e3,
    )


def profile_burst(fn: Callable[[], object], launches: int, *, pause_s: float = 0.0) -> BurstTimes:
    """``fn()`` ``launches`` times back to back on the current CUDA device under
    torch.profiler (CUDA activity), after a sync and ``pause_s`` seconds of idle GPU (so
    that the first launch starts cooler than the last): :func:`burst_times` of the burst."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    time.sleep(pause_s)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(launches):
            fn()
        torch.cuda.synchronize()
    return burst_times(prof.events(), launches)


def synchronizing_calls(fn: Callable[[], None]) -> list[warnings.WarningMessage]:
    """The synchronising CUDA calls of one ``fn()`` (host reads of device values,
    blocking copies), as CUDA's sync debug mode reports them: a warning each, attributed
    to the Python line that made the call (also for calls in the backward, whose
    warnings autograd replays on the calling thread)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if "synchronizing" in str(w.message)]
