"""Run a function on ``P`` local gloo processes (tests, examples, CPU debugging of EP).

``run_gloo(fn, P, *args)`` spawns ``P`` processes, joins them into one gloo process
group through a ``FileStore`` in a fresh temporary directory (no TCP port to pick),
calls ``fn(rank, P, *args)`` in each and returns the per-rank results. It never hangs:
the collectives time out after ``timeout_s``, the parent kills every worker still alive
at the deadline (or shortly after another worker failed), and any failure is raised in
the parent with each failing worker's traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_gloo"]

#: Seconds the other workers get to finish after one worker failed (they are usually
#: stuck in a collective with it).
FAILURE_GRACE_S = 5.0


def _worker(
    rank: int,
    world_size: int,
    tmp: str,
    fn: Callable[..., Any],
    args: tuple,
    timeout_s: float,
    num_threads: int,
) -> None:
    out = Path(tmp)
    try:
        torch.set_num_threads(num_threads)
        store = dist.FileStore(str(out / "store"), world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"result{rank}.pt")
        code = 0
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        code = 1  # and do not wait for peers that may be stuck in a collective
    # os._exit once the result is on disk: a normal interpreter exit of workers that built
    # DeviceMesh/DTensor/FSDP state aborted now and then ("terminate called without an
    # active exception", about 1 run in 6 in the torchtitan tests).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    num_threads: int = 1,
    failure_grace_s: float = FAILURE_GRACE_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        fn: a module-level (picklable) function; inside it the default process group
            (``torch.distributed.group.WORLD``) is the gloo group of the workers.
        world_size: number of processes ``P >= 1``.
        args: picklable arguments passed to every rank.
        timeout_s: deadline for the whole run, also the collectives' timeout.
        num_threads: ``torch.set_num_threads`` in each worker.
        failure_grace_s: seconds the others get after one worker failed, then killed.

    Returns:
        ``[result of rank 0, ..., result of rank P-1]`` (each passed through
        ``torch.save``/``torch.load``: tensors, lists, dicts, tuples, numbers, strings).

    Raises:
        RuntimeError: a worker raised or died (its traceback is in the message), or the
            deadline passed (the workers are killed first).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megamoe-gloo-") as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, tmp, fn, args, timeout_s, num_threads),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        timed_out = False
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > failure_grace_s):
                timed_out = now > deadline
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=10)
        problems = []
        for rank, p in enumerate(procs):
            err = Path(tmp) / f"error{rank}.txt"
            if err.exists():
                problems.append(f"--- rank {rank} raised:\n{err.read_text()}")
            elif p.exitcode != 0:
                problems.append(f"--- rank {rank} exited with code {p.exitcode}")
        if timed_out:
            problems.insert(0, f"run_gloo: deadline of {timeout_s:.0f} s passed, workers killed")
        if problems:
            raise RuntimeError("\n".join(problems))
        return [
            torch.load(Path(tmp) / f"result{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
