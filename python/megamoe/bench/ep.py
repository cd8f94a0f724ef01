"""``torchrun --nproc-per-node P -m megamoe.bench.ep``: expert-parallel F+B per rank.

Each rank holds ``T`` tokens (default 65,536) and ``E / P`` of ``E`` experts (default
256), balanced top-k routing over all ``E``, side-LoRA (or ``--mode ordinary``: a
trainable base, MXFP4 from BF16 masters), a BF16 (or ``--dtype mxfp4``) base. It
times, with CUDA events (warm-up, then ``--iters`` samples; a sample is the MAX over
ranks, the figure the median of those):

- the EP layer ``mm.moe(..., group=WORLD)``, forward and forward + backward;
- EP1 doing the same per-rank work: ``T`` tokens over ``E / P`` local experts on one
  GPU (no exchange), on each rank, timed without collectives (its samples are maxed
  over ranks afterwards, as EP's are);
- the exchanges alone: the six ``all_to_all_single`` calls of one F+B with this
  routing's splits and row widths (``[x | q13]`` out, ``[y | p]`` back, ``[dout | db2]``
  and the FP32 weights out, ``[dx | sg | su]`` and the router grads back).

Each EP and EP1 row also gives the host's time to return from the call (the median,
maxed over ranks as the device samples are: equal to the device time where the call
waits for the GPU inside or is host-bound) and the synchronising CUDA calls in one call
(CUDA's sync debug mode; an EP step makes one, in its dispatch plan, EP1 none).

In this version the exchanges run on the compute stream between the stages, so
nothing overlaps: EP F+B ~ EP1 F+B + exchanges. Prints a table (rank 0) and writes
``--json``. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch
import torch.distributed as dist

import megamoe as mm
from megamoe.bench.timing import sample_count, synchronizing_calls, warmup_count
from megamoe.testing.inputs import make_layer, make_routing


def _time(fn, warmup: int, iters: int, setup=None) -> tuple[list[float], list[float]]:
    """``(device, host)`` samples of ``fn`` in ms: CUDA events around the call, and the
    host's time to return from it (``perf_counter``; equal to the device time when the
    call waits for the GPU inside, as a host read does, or is host-bound). ``setup`` runs
    before each call, untimed and outside the peak-memory window (the peak after this is
    the last sample's)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        # A re-quantized MXFP4 master's temporaries are several times the weights.
        torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - begin) * 1e3)
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return samples, host


def _max_over_ranks(samples: list[float]) -> list[float]:
    t = torch.tensor(samples, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=256, help="experts over all ranks")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=128, help="adapter rank")
    parser.add_argument("--mode", choices=("side-lora", "ordinary"), default="side-lora")
    parser.add_argument("--dtype", choices=("bf16", "mxfp4"), default="bf16", help="base format")
    parser.add_argument("--warmup", type=warmup_count, default=3)
    parser.add_argument("--iters", type=sample_count, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    local_experts = args.experts // world
    ordinary = args.mode == "ordinary"
    layer = make_layer(
        args.hidden,
        args.intermediate,
        local_experts,
        args.top_k,
        None if ordinary else args.rank,
        num_tokens=args.tokens,
        seed=100 + rank,
        device="cuda",
        format=args.dtype,
        requires_grad=True,
        trainable_base=ordinary,
    )
    ep1_ids = layer.topk_ids  # routing over the local experts: EP1's per-rank work
    ep_ids, _ = make_routing(args.tokens, args.experts, args.top_k, seed=200 + rank, device="cuda")
    dout = torch.randn_like(layer.x)
    leaves = list(layer.grad_leaves().values())

    def setup() -> None:
        # A trainer prepares the base once per step, outside the layer (for MXFP4 a
        # quantization of the masters): untimed, as in megamoe.bench.
        if ordinary:
            layer.reprepare_base()

    def step(ids, ep_group, backward: bool):
        out = mm.moe(layer.x, ids, layer.topk_weights, layer.base, layer.side, group=ep_group)
        if backward:
            torch.autograd.grad(out, leaves, dout)

    results = {}
    for name, ids, ep_group in (("ep", ep_ids, group), ("ep1", ep1_ids, None)):
        for backward in (False, True):
            call = functools.partial(step, ids, ep_group, backward)
            samples, host = _time(call, args.warmup, args.iters, setup)
            samples = _max_over_ranks(samples)  # EP1 too: the same statistic on both
            host = _max_over_ranks(host)
            # The busiest rank's peak (routing skews the received rows per rank).
            (peak,) = _max_over_ranks([torch.cuda.max_memory_allocated() / 2**30])
            setup()
            (reads,) = _max_over_ranks([len(synchronizing_calls(call))])
            key = f"{name} {'fwd+bwd' if backward else 'forward'}"
            results[key] = {
                "median_ms": statistics.median(samples),
                "samples_ms": samples,
                "host_median_ms": statistics.median(host),
                "host_reads": int(reads),
                "peak_gib": peak,
            }

    # The six exchanges of one F+B, with this routing's splits.
    plan = mm.ep.plan_dispatch(ep_ids, args.experts, group=group)
    r = 0 if ordinary else args.rank
    widths = [
        (args.hidden + 2 * r, torch.bfloat16, plan.send_splits, plan.recv_splits),
        (args.hidden + r, torch.bfloat16, plan.recv_splits, plan.send_splits),
        (args.hidden + r, torch.bfloat16, plan.send_splits, plan.recv_splits),
        (1, torch.float32, plan.send_splits, plan.recv_splits),
        (args.hidden + 2 * r, torch.bfloat16, plan.recv_splits, plan.send_splits),
        (1, torch.float32, plan.recv_splits, plan.send_splits),
    ]
    buffers = [
        (
            torch.zeros(sum(out_splits), width, dtype=dtype, device="cuda"),
            torch.zeros(sum(in_splits), width, dtype=dtype, device="cuda"),
            list(out_splits),
            list(in_splits),
        )
        for width, dtype, out_splits, in_splits in widths
    ]

    def exchanges():
        for send, recv, out_splits, in_splits in buffers:
            dist.all_to_all_single(recv, send, in_splits, out_splits, group=group)

    comm = _max_over_ranks(_time(exchanges, args.warmup, args.iters)[0])
    sent_bytes = sum(b[0].numel() * b[0].element_size() for b in buffers)
    results["exchanges of one F+B"] = {
        "median_ms": statistics.median(comm),
        "samples_ms": comm,
        "bytes_sent_per_rank": sent_bytes,
    }
    if rank == 0:
        print(
            f"EP{world}: {args.tokens} tokens/rank, {args.experts} experts "
            f"({local_experts}/rank), top-{args.top_k}, H={args.hidden}, "
            f"I={args.intermediate}, mode={args.mode}, base={args.dtype}, "
            f"device={torch.cuda.get_device_name()}"
        )
        print(
            f"{'case':24s} {'median ms':>10s} {'host ms':>8s} {'host reads':>10s} {'peak GiB':>9s}"
        )
        for key, row in results.items():
            if "host_reads" in row:
                extra = (
                    f"{row['host_median_ms']:8.2f} {row['host_reads']:10d} {row['peak_gib']:9.1f}"
                )
            else:
                extra = ""
            print(f"{key:24s} {row['median_ms']:10.2f} {extra}")
        ep_fb = results["ep fwd+bwd"]["median_ms"]
        ep1_fb = results["ep1 fwd+bwd"]["median_ms"]
        print(
            f"EP F+B - EP1 F+B = {ep_fb - ep1_fb:.2f} ms; exchanges alone "
            f"{results['exchanges of one F+B']['median_ms']:.2f} ms "
            f"({sent_bytes / 2**30:.2f} GiB sent per rank); overlap: none in this version"
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "date": datetime.now(UTC).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name(),
                        "world": world,
                        "args": {k: str(v) for k, v in vars(args).items()},
                        "results": results,
                    },
                    indent=1,
                )
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
