#!/usr/bin/env python3
"""The GEMMs with an MXFP4 base at few rows per expert: the weight-streaming kernels
(chunks of 32 and 64 rows; also 128, 192 and 256, the wide form) against the engine's
in-pipeline decode and the engine on BF16 weights, in one process, with the weight-read
floor of each format.

Times GEMM1 (gated SwiGLU, optional side segment), GEMM2 (optional a2 extra columns),
dgrad1 (``w13`` as stored, optional b1/b3 shrink columns) and dgrad2 with the activation
backward (``w2`` as stored, optional a2 side segment) at ep4rank dims for each token
count; CUDA-event medians of ``--iters`` launches after warm-up, each queued behind a
short GPU busy-wait so that the host's work for the launch (DLPack exports, tensor maps,
the launcher's checks: tens of microseconds against kernels of a few hundred) falls
outside the timed window. Checks that each streaming kernel's output is the engine's,
bit for bit, on the rows in use. ``--preact``: GEMM1 as the training forward runs it
(``g | u`` stored too, clamp 10; both outputs' bits compared). Needs a Hopper GPU:

    python tools/weight_stream_ab.py [--tokens 128,512,2048,4096] [--rank 128] [--preact]
"""

from __future__ import annotations

import argparse
import math

import torch

import megamoe as mm
from megamoe.bench.timing import time_fn
from megamoe.testing.inputs import DEFAULT_SKEW, make_routing
from megamoe.wrappers import _native
from megamoe.wrappers.grouped_gemm import (
    ACTIVATIONS,
    GROUP_M,
    gated_grouped_gemm,
    grouped_gemm,
    stream_widest_chunks,
)


def _side_args(side: dict) -> tuple:
    """The launchers' (side_gate, side_up, side_scale) arguments."""
    if not side:
        return None, None, 0.0
    dl = _native.dlpack
    return dl(side["side_b_gate"]), dl(side["side_b_up"]), float(side["side_scale"])


def _launch_context(dev: torch.device) -> tuple:
    """(SM count, current stream handle, DLPack export, native module) for the launchers."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return sms, torch.cuda.current_stream().cuda_stream, _native.dlpack, _native.native()


def _kernel_ms(fn, device: torch.device, iters: int) -> float:
    """Median ms of ``fn``'s kernels: each run's event pair is queued behind a GPU
    busy-wait (about 200 us, not synchronised away), which outlasts the host's work for
    the launch (the BF16 column's Python wrapper included), so the window
    holds the kernels and not the host's latency in reaching them."""
    sleep = lambda: torch.cuda._sleep(400_000)  # noqa: E731
    return time_fn(fn, device=device, warmup=3, iters=iters, setup=sleep, settle=False).median_ms


def _pool(tokens: int, args: argparse.Namespace, columns: int, dev: torch.device) -> tuple:
    """The route plan of ``tokens`` tokens (``--routing``) and a random BF16 pool of
    ``columns`` columns whose padding rows are zeros, as the layer's are."""
    extra = {"skew": args.skew} if args.routing == "skewed" else {}
    ids, _ = make_routing(tokens, args.experts, args.top_k, kind=args.routing, seed=0, **extra)
    plan = mm.plan_routes(
        ids.to(dev), args.experts, mm.get_block_m(tokens, args.top_k, args.experts)
    )
    a = torch.randn(plan.pool_capacity, columns, device=dev).bfloat16()
    a[plan.pool_row_to_route < 0] = 0
    return plan, a


def measure(tokens: int, args: argparse.Namespace, w13, codes, scales, side: dict) -> str:
    """One row of the table: GEMM1 at ``tokens`` tokens on each path; with
    ``args.preact`` as the training forward runs it (``g | u`` stored, clamp 10, the bits
    compared on both outputs)."""
    dev = w13.device
    h, i, r = args.hidden, args.intermediate, args.rank
    sms, stream, dl, native = _launch_context(dev)
    plan, a = _pool(tokens, args, h + 2 * r, dev)
    out = torch.empty(plan.pool_capacity, i, dtype=torch.bfloat16, device=dev)
    preact = torch.empty(plan.pool_capacity, 2 * i, dtype=torch.bfloat16, device=dev)
    clamp = 10.0 if args.preact else math.inf

    def engine_mxfp4() -> None:
        native.engine_gated(
            dl(a), h, dl(codes), dl(scales), dl(plan.expert_pool_offsets), dl(out),
            dl(preact) if args.preact else None, *_side_args(side), 0,
            clamp, plan.block_m, GROUP_M, sms, stream,
        )  # fmt: skip

    def stream_mxfp4(chunk: int) -> tuple:
        result, result_preact = torch.empty_like(out), torch.empty_like(preact)
        native.weight_stream_gated(
            dl(a), h, dl(codes), dl(scales), dl(plan.expert_pool_offsets),
            dl(plan.expert_counts), dl(result), dl(result_preact) if args.preact else None,
            *_side_args(side), 0, clamp, plan.block_m, chunk, sms, stream,
        )  # fmt: skip
        return (result, result_preact) if args.preact else (result,)

    bf16 = lambda: gated_grouped_gemm(  # noqa: E731
        a, w13, plan, k=h, activation_clamp=None if math.isinf(clamp) else clamp,
        preact_out=preact if args.preact else None, **side,
    )  # fmt: skip
    outs = (out, preact) if args.preact else (out,)
    return _row("gemm1", "Gated", tokens, args.iters, plan, outs, bf16, engine_mxfp4, stream_mxfp4)


#: The chunk columns of the table; a kind is timed at the chunks it has (dgrad2's widest
#: is 128 rows: ``stream_widest_chunks``), the others print "-".
CHUNKS = (32, 64, 128, 192, 256)


def _chunks_of(kind: str) -> tuple[int, ...]:
    """The table's chunks that streaming kind ``kind`` has a variant for."""
    widest = stream_widest_chunks()[kind]
    return tuple(c for c in CHUNKS if c <= widest)


def _row(gemm, kind, tokens, iters, plan, out, bf16, engine, stream) -> str:
    """Times the BF16 GEMM, the engine's MXFP4 one (writing ``out``: a tensor, or a tuple
    of them that ``stream`` returns too) and the streaming one at each chunk streaming
    kind ``kind`` has; checks the streaming outputs against the engine's on the rows in use."""
    outs = out if isinstance(out, tuple) else (out,)
    chunks = _chunks_of(kind)

    def median(fn) -> float:
        return _kernel_ms(fn, outs[0].device, iters)

    def streamed(c: int) -> tuple:
        got = stream(c)
        return got if isinstance(got, tuple) else (got,)

    t_bf16, t_engine = median(bf16), median(engine)
    times = {c: median(lambda c=c: stream(c)) for c in chunks}
    engine()
    rows = int(plan.expert_pool_offsets[-1])
    same = all(
        torch.equal(got[:rows].view(torch.int16), want[:rows].view(torch.int16))
        for c in chunks
        for got, want in zip(streamed(c), outs)
    )
    best = min(times.values())
    cells = " ".join(f"{times[c]:8.3f}" if c in times else f"{'-':>8}" for c in CHUNKS)
    return (
        f"{gemm:>5} {tokens:>6} {t_bf16:8.3f} {t_engine:8.3f} {cells} "
        f"{best / t_engine:8.3f} {t_bf16 / best:9.2f} {'same' if same else 'DIFFER'}"
    )


def measure_gemm2(tokens: int, args: argparse.Namespace, w2, codes, scales, a2) -> str:
    """GEMM2 at ``tokens`` tokens on each path (``a2``: the extra columns, or None)."""
    dev = w2.device
    h, i = args.hidden, args.intermediate
    sms, stream, dl, native = _launch_context(dev)
    plan, a = _pool(tokens, args, i, dev)
    n = h + (0 if a2 is None else a2.shape[2])
    out = torch.empty(plan.pool_capacity, n, dtype=torch.bfloat16, device=dev)

    def engine_mxfp4() -> None:
        native.engine_store(
            dl(a), i, dl(codes), dl(scales), False, None if a2 is None else dl(a2), None,
            dl(plan.expert_pool_offsets), dl(out),
            plan.block_m, GROUP_M, sms, stream,
        )  # fmt: skip

    def stream_mxfp4(chunk: int) -> torch.Tensor:
        result = torch.empty_like(out)
        native.weight_stream_store(
            dl(a), i, dl(codes), dl(scales), None if a2 is None else dl(a2),
            dl(plan.expert_pool_offsets), dl(plan.expert_counts), dl(result), plan.block_m,
            chunk, sms, stream,
        )  # fmt: skip
        return result

    bf16 = lambda: grouped_gemm(a, w2, plan, b_extra=a2)  # noqa: E731
    return _row("gemm2", "Store", tokens, args.iters, plan, out, bf16, engine_mxfp4, stream_mxfp4)


def measure_dgrad1(tokens: int, args: argparse.Namespace, w13, codes, scales, side: dict) -> str:
    """dgrad1 at ``tokens`` tokens on each path: ``(dg | du) . w13_e`` with ``w13`` as
    stored (``codes`` ``[E, 2I, H/2]`` quantized along H) and, with a side, the b1/b3
    shrinks as extra columns."""
    dev = w13.device
    h, i = args.hidden, args.intermediate
    sms, stream, dl, native = _launch_context(dev)
    plan, a = _pool(tokens, args, 2 * i, dev)
    extra = (side["side_b_gate"], side["side_b_up"]) if side else None
    n = h + (0 if extra is None else 2 * args.rank)
    out = torch.empty(plan.pool_capacity, n, dtype=torch.bfloat16, device=dev)

    def blocks() -> tuple:  # DLPack capsules are single-use: new ones per launch
        return (None, None) if extra is None else (dl(extra[0]), dl(extra[1]))

    def engine_mxfp4() -> None:
        native.engine_store(
            dl(a), 2 * i, dl(codes), dl(scales), True, *blocks(),
            dl(plan.expert_pool_offsets), dl(out), plan.block_m, GROUP_M, sms, stream,
        )  # fmt: skip

    def stream_mxfp4(chunk: int) -> torch.Tensor:
        result = torch.empty_like(out)
        native.weight_stream_store_mn(
            dl(a), dl(codes), dl(scales), *blocks(), dl(plan.expert_pool_offsets),
            dl(plan.expert_counts), dl(result), plan.block_m, chunk, sms, stream,
        )  # fmt: skip
        return result

    bf16 = lambda: grouped_gemm(a, w13, plan, b_major="mn", b_extra_blocks=extra)  # noqa: E731
    return _row("dgrd1", "StoreMN", tokens, args.iters, plan, out, bf16, engine_mxfp4, stream_mxfp4)


def measure_dgrad2(tokens: int, args: argparse.Namespace, w2, codes, scales, a2) -> str:
    """dgrad2 with the SwiGLU backward (clamp 10) at ``tokens`` tokens on each path:
    ``[dout | s dout b2^T] . [w2_e ; a2_e^T]`` with ``w2`` as stored (``codes``
    ``[E, H, I/2]`` quantized along I). The streaming columns are left out ("-") under a
    build without the streaming launcher; the bits compare dg | du, bf16(w h) and the
    router-dot partials."""
    dev = w2.device
    h, i = args.hidden, args.intermediate
    sms, stream, dl, native = _launch_context(dev)
    r = 0 if a2 is None else a2.shape[2]
    plan, dout = _pool(tokens, args, h + r, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    preact = (torch.randn(plan.pool_capacity, 2 * i, device=dev, generator=gen) * 4).bfloat16()
    weights = torch.rand(tokens, args.top_k, device=dev, generator=gen)
    row_weights = weights.reshape(-1)[plan.pool_row_to_route]
    routes = weights.numel()

    def outputs() -> tuple:
        return (
            torch.empty_like(preact),
            torch.empty(plan.pool_capacity, i, dtype=torch.bfloat16, device=dev),
            torch.zeros(plan.pool_capacity, i // 256, dtype=torch.float32, device=dev),
        )

    def tail(outs: tuple) -> tuple:
        return (
            dl(preact), dl(row_weights), routes, dl(plan.pool_row_to_route),
            *(dl(t) for t in outs), ACTIVATIONS["swiglu"], 10.0, plan.block_m,
        )  # fmt: skip

    engine_outs, bf16_outs = outputs(), outputs()

    def engine(b, b_scales, outs) -> None:
        native.engine_activation_backward(
            dl(dout), h, dl(b), None if b_scales is None else dl(b_scales),
            None if a2 is None else dl(a2), dl(plan.expert_pool_offsets), *tail(outs),
            GROUP_M, sms, stream,
        )  # fmt: skip

    stream_outs = outputs()  # the timed runs' outputs, allocated once (as the engine's)

    def streamed(chunk: int, outs: tuple | None = None) -> tuple:
        outs = outputs() if outs is None else outs
        native.weight_stream_activation_backward(
            dl(dout), dl(codes), dl(scales), None if a2 is None else dl(a2),
            dl(plan.expert_pool_offsets), dl(plan.expert_counts), *tail(outs), chunk, sms,
            stream,
        )  # fmt: skip
        return outs

    def median(fn) -> float:
        return _kernel_ms(fn, dev, args.iters)

    t_bf16 = median(lambda: engine(w2, None, bf16_outs))
    t_engine = median(lambda: engine(codes, scales, engine_outs))
    if not hasattr(native, "weight_stream_activation_backward"):
        return f"dgrd2 {tokens:>6} {t_bf16:8.3f} {t_engine:8.3f} " + " ".join(
            f"{'-':>8}" for _ in CHUNKS
        )
    chunks = _chunks_of("ActivationBackward")
    times = {c: median(lambda c=c: streamed(c, stream_outs)) for c in chunks}
    engine(codes, scales, engine_outs)
    rows = int(plan.expert_pool_offsets[-1])

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t[:rows].view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    same = all(
        torch.equal(bits(got), bits(want))
        for c in chunks
        for got, want in zip(streamed(c), engine_outs)
    )
    best = min(times.values())
    cells = " ".join(f"{times[c]:8.3f}" if c in times else f"{'-':>8}" for c in CHUNKS)
    return (
        f"dgrd2 {tokens:>6} {t_bf16:8.3f} {t_engine:8.3f} {cells} "
        f"{best / t_engine:8.3f} {t_bf16 / best:9.2f} {'same' if same else 'DIFFER'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="128,512,2048,4096")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=128, help="side-LoRA rank (0: none)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--gemms", default="gemm1,gemm2,dgrad1,dgrad2", help="which GEMMs to time")
    parser.add_argument(
        "--preact",
        action="store_true",
        help="GEMM1 as the training forward runs it: g | u stored, clamp 10",
    )
    parser.add_argument("--routing", choices=("balanced", "skewed"), default="balanced")
    parser.add_argument("--skew", type=float, help=f"Zipf exponent (skewed; {DEFAULT_SKEW})")
    args = parser.parse_args()
    if args.skew is not None and args.routing != "skewed":
        parser.error("--skew: applies to --routing skewed only")
    args.skew = DEFAULT_SKEW if args.skew is None else args.skew
    dev = torch.device("cuda")
    e, h, i, r = args.experts, args.hidden, args.intermediate, args.rank
    w13 = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).bfloat16()
    # Along H: GEMM1's K and, the weights as stored, dgrad1's N.
    codes, scales = mm.quantize_mxfp4(w13, axis=-1)
    side = {}
    if r:
        side = dict(
            side_b_gate=(torch.randn(e, r, i, device=dev) * r**-0.5).bfloat16(),
            side_b_up=(torch.randn(e, r, i, device=dev) * r**-0.5).bfloat16(),
            side_scale=0.25,
        )
    w2 = (torch.randn(e, h, i, device=dev) * i**-0.5).bfloat16()
    codes2, scales2 = mm.quantize_mxfp4(w2, axis=-1)
    a2 = (torch.randn(e, i, r, device=dev) * i**-0.5).bfloat16() if r else None
    bf16_bytes = w13.numel() * 2
    mxfp4_bytes = codes.numel() + scales.numel()
    copy = torch.empty_like(w13)
    copy_ms = time_fn(lambda: copy.copy_(w13), device=dev, warmup=3, iters=10).median_ms
    bandwidth = 2 * bf16_bytes / (copy_ms * 1e-3)
    print(
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; w13 read floor: BF16 "
        f"{bf16_bytes / bandwidth * 1e3:.3f} ms, MXFP4 {mxfp4_bytes / bandwidth * 1e3:.3f} ms"
    )
    print(
        f"{'gemm':>5} {'T':>6} {'bf16':>8} {'engine':>8} "
        + " ".join(f"{'s' + str(c):>8}" for c in CHUNKS)
        + f" {'best/eng':>8} bf16/best bits"
    )
    for tokens in (int(t) for t in args.tokens.split(",")):
        gemms = args.gemms.split(",")
        if "gemm1" in gemms:
            print(measure(tokens, args, w13, codes, scales, side), flush=True)
        if "gemm2" in gemms:
            print(measure_gemm2(tokens, args, w2, codes2, scales2, a2), flush=True)
        if "dgrad1" in gemms:
            print(measure_dgrad1(tokens, args, w13, codes, scales, side), flush=True)
        if "dgrad2" in gemms:
            print(measure_dgrad2(tokens, args, w2, codes2, scales2, a2), flush=True)


if __name__ == "__main__":
    main()
