"""``python -m megamoe.bench.engine``: every GEMM of the layer on the engine, beside
``torch._grouped_mm`` and QuACK (when importable) in the same process.

GEMMs at the ep4rank shape (balanced routing: the pool has no padding at BLOCK_M 128,
so every case computes the same FLOPs over the same routed rows):

- ``gemm1`` (plain, the store epilogue), ``gemm1+act`` (the gated epilogue, the layer's
  GEMM1), ``gemm2`` (+ the ``a2`` shrink columns), ``dgrad1`` (+ the ``b1``/``b3`` shrink
  columns), ``dgrad2`` (plain) and ``dgrad2+act`` (the activation-backward epilogue, the
  layer's dgrad2), and the K-grouped weight gradients ``wgrad13`` (dw13 ``[2I, H]``),
  ``wgrad2`` (dw2 ``[H, I]``), ``db13`` (``db1``, ``db3`` ``[r, I]`` each: the two diagonal
  blocks of ``[q1 | q3]^T (dg | du)``), ``da2`` (``[I, r]``);
- for each weight GEMM also the MXFP4 base as the layer runs it (decoded inside the
  pipeline at few rows per expert, else one transient BF16 decode, timed with the GEMM);
- peers: ``torch._grouped_mm`` of the same product (the epilogue-free GEMM; the fused
  cases' ratio is against it), QuACK's varlen grouped GEMM (``quack.gemm_interface.gemm``,
  default config).

Timing: CUDA-event medians, the cases of one GEMM timed round-robin (each round runs
every case once, the starting case rotating: the cases see the same thermal and
power-cap history, so their ratios compare). ``--sustained N`` times N back-to-back
launches per sample (the H200 runs at its power cap under sustained GEMMs) and logs the
SM clock and power drawn during each case's samples (``nvidia-smi``). ``--ncu`` re-runs
every case once under Nsight Compute and adds the DRAM and L2 bytes of that launch to
the table and the JSON. ``--kernel-times`` (with ``--sustained`` >= 2) profiles one more
burst of ``--sustained`` launches per case (torch.profiler), each after a second of idle
GPU, and reports, per launch, the kernels' device time and the idle time inside the
burst, and the first and last run of the case's kernel with the most device time:
whether a sustained median is kernel time or host gaps, and whether the kernel slows
as the burst goes on from a cooler start. The extra bursts change the GPU's thermal
history, so time ratios from a run with it are not those of a run without.
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib.metadata
import io
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
from megamoe.wrappers.grouped_gemm import (
    gated_grouped_gemm,
    grouped_gemm,
)
from megamoe.wrappers.k_grouped_gemm import k_grouped_gemm

from .cli import build_commit
from .timing import (
    BurstTimes,
    launch_count,
    profile_burst,
    sample_count,
    time_interleaved,
    warmup_count,
)

GEMMS = (
    "gemm1",
    "gemm1+act",
    "gemm2",
    "dgrad1",
    "dgrad2",
    "dgrad2+act",
    "wgrad13",
    "wgrad2",
    "db13",
    "da2",
)
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum")
#: ncu's byte units (``--print-units base`` asks for bytes; a scaled unit is converted).
_BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def smi_index(device_index: int) -> int:
    """nvidia-smi's index of torch's CUDA device ``device_index``: nvidia-smi ignores
    ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_VISIBLE_DEVICES=1``, torch's device 0 is
    nvidia-smi's 1), so the mask is applied here, as torch's NVML queries do."""
    try:
        return torch.cuda._get_nvml_device_index(device_index)
    except (AttributeError, RuntimeError, OSError):  # no such helper, or no NVML library
        return device_index


class PowerLog:
    """``nvidia-smi`` sampled every 100 ms in the background: (time, SM MHz, watts)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.process = None
        if shutil.which("nvidia-smi") is None:
            return
        index = smi_index(torch.cuda.current_device())
        self.process = subprocess.Popen(
            ["nvidia-smi", f"--id={index}", "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), clock, power))

    def during(self, windows: Iterable[tuple[float, float]]) -> tuple[float | None, float | None]:
        """Mean SM clock and power over the samples inside any of ``windows``."""
        return mean_during(self.samples, windows)

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()


def mean_during(
    samples: list[tuple[float, float, float]], windows: Iterable[tuple[float, float]]
) -> tuple[float | None, float | None]:
    """Mean clock and power of the ``(time, clock, power)`` samples that fall inside any of
    the ``(start, end)`` windows; ``(None, None)`` when none does."""
    spans = list(windows)
    inside = [s for s in samples if any(start <= s[0] <= end for start, end in spans)]
    if not inside:
        return None, None
    return statistics.mean(s[1] for s in inside), statistics.mean(s[2] for s in inside)


def quack_gemm() -> tuple[Callable | None, str]:
    """QuACK's grouped GEMM, or None and why not."""
    try:
        from quack.gemm_interface import gemm
    except Exception as error:  # any import failure means no peer
        return None, f"{type(error).__name__}: {error}"
    return gemm, peer_versions(("quack-kernels", "nvidia-cutlass-dsl"))


def peer_versions(names: tuple[str, ...]) -> str:
    """``"name version"`` per installed distribution, for the report ("not found" where a
    package has no metadata, as when its files are on PYTHONPATH without a dist-info)."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (version not found)")
    return ", ".join(found)


def build_cases(args, plan, device) -> dict[str, dict[str, tuple[Callable[[], object], float]]]:
    """``{gemm: {case: (fn, flops)}}`` for the selected GEMMs (inputs built once)."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, e, r = args.hidden, args.intermediate, args.experts, args.rank
    routes = args.tokens * args.top_k
    rows = int(plan.expert_pool_offsets[-1])
    dense = rows == routes  # torch and QuACK take the routed rows without padding
    offs = torch.cumsum(plan.expert_counts.to(torch.int64), 0).to(torch.int32)
    cu = torch.cat([offs.new_zeros(1), offs])
    quack, _ = quack_gemm() if args.quack else (None, "")
    selected = set(args.gemms.split(","))
    capacity = plan.pool_capacity

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).bfloat16()

    cases: dict[str, dict[str, tuple[Callable[[], object], float]]] = {}

    def peers(name, a, b_kn, flops, cols=None):
        """torch._grouped_mm and QuACK of a [rows, K] x [E, K, N] product."""
        if not dense:
            return
        a_rows = (a[:routes] if cols is None else a[:routes, :cols]).contiguous()
        cases[name]["torch._grouped_mm"] = (
            lambda: torch._grouped_mm(a_rows, b_kn, offs=offs),
            flops,
        )
        if quack is not None:
            cases[name]["quack"] = (
                lambda: quack(a_rows, b_kn, cu_seqlens_m=cu, tuned=False),
                flops,
            )

    w13 = randn(e, 2 * i, h, scale=h**-0.5)
    w2 = randn(e, h, i, scale=i**-0.5)
    # MXFP4 of the same weights (quantized along each one's forward reduction). Every
    # name below is bound once: the cases' closures read them when they run.
    c13, s13 = mm.quantize_mxfp4(w13, axis=-1)
    c2, s2 = mm.quantize_mxfp4(w2, axis=-1)
    if selected & {"gemm1", "gemm1+act"}:
        x = randn(capacity, h + 2 * r)
        b1, b3 = randn(e, r, i, scale=r**-0.5), randn(e, r, i, scale=r**-0.5)  # as given
        preact_out = torch.empty(capacity, 2 * i, dtype=torch.bfloat16, device=device)
        flops = 2.0 * routes * h * 2 * i
        if "gemm1" in selected:
            cases["gemm1"] = {
                "engine": (lambda: grouped_gemm(x, w13, plan, k=h), flops),
                "engine mxfp4": (lambda: grouped_gemm(x, c13, plan, b_scales=s13), flops),
            }
            peers("gemm1", x, w13.transpose(1, 2), flops, cols=h)
        if "gemm1+act" in selected:
            side = dict(side_b_gate=b1, side_b_up=b3, side_scale=0.25)
            # Useful FLOPs (DESIGN §1): each of g, u adds its own r-wide side block
            # (q1 b1, q3 b3), K = H + r; the kernel's K = H + 2r holds zero blocks.
            side_flops = flops * (1 + r / h)
            cases["gemm1+act"] = {
                "engine": (
                    lambda: gated_grouped_gemm(x, w13, plan, k=h, preact_out=preact_out),
                    flops,
                ),
                "engine +side": (
                    lambda: gated_grouped_gemm(x, w13, plan, k=h, preact_out=preact_out, **side),
                    side_flops,
                ),
                "engine mxfp4 +side": (
                    lambda: gated_grouped_gemm(
                        x, c13, plan, k=h, preact_out=preact_out, w13_scales=s13, **side
                    ),
                    side_flops,
                ),
            }
            peers("gemm1+act", x, w13.transpose(1, 2), flops, cols=h)
    if "gemm2" in selected:
        hp = randn(capacity, i)
        a2 = randn(e, i, r, scale=i**-0.5)  # as given [E, I, r]: the extra N columns
        flops = 2.0 * routes * i * h
        cases["gemm2"] = {
            "engine": (lambda: grouped_gemm(hp, w2, plan), flops),
            "engine +a2": (lambda: grouped_gemm(hp, w2, plan, b_extra=a2), flops * (1 + r / h)),
            "engine mxfp4 +a2": (
                lambda: grouped_gemm(hp, c2, plan, b_extra=a2, b_scales=s2),
                flops * (1 + r / h),
            ),
        }
        peers("gemm2", hp, w2.transpose(1, 2), flops)
    if "dgrad1" in selected:
        dgu = randn(capacity, 2 * i)
        shrink = (randn(e, r, i), randn(e, r, i))  # b1, b3 as given: the extra blocks
        # MXFP4 w13 as stored, read MN-major: quantized along H (its N here).
        flops = 2.0 * routes * 2 * i * h
        cases["dgrad1"] = {
            "engine": (lambda: grouped_gemm(dgu, w13, plan, b_major="mn"), flops),
            # Useful FLOPs: dg b1^T and du b3^T, K = I each (the blocks' zero halves
            # are not counted), 2 n 2I r against the base's 2 n 2I H.
            "engine +shrink": (
                lambda: grouped_gemm(dgu, w13, plan, b_major="mn", b_extra_blocks=shrink),
                flops * (1 + r / h),
            ),
            "engine mxfp4 +shrink": (
                lambda: grouped_gemm(
                    dgu, c13, plan, b_major="mn", b_scales=s13, b_extra_blocks=shrink
                ),
                flops * (1 + r / h),
            ),
        }
        peers("dgrad1", dgu, w13, flops)
    if selected & {"dgrad2", "dgrad2+act"}:
        dout = randn(capacity, h + r)
        a2_side = randn(e, i, r, scale=i**-0.5)  # a2 as given [E, I, r]: the side K segment
        preact = randn(capacity, 2 * i)
        weights = torch.rand(args.tokens, args.top_k, device=device, generator=gen)
        flops = 2.0 * routes * h * i
        if "dgrad2" in selected:
            cases["dgrad2"] = {
                "engine": (lambda: grouped_gemm(dout, w2, plan, k=h, b_major="mn"), flops),
            }
            peers("dgrad2", dout, w2, flops, cols=h)
        if "dgrad2+act" in selected:

            def fused(b=w2, s=None, side=a2_side):
                return fused_dgrad2_activation_backward(
                    dout, b, preact, weights, plan, side_a2=side, w2_scales=s
                )

            cases["dgrad2+act"] = {
                "engine": (lambda: fused(side=None), flops),
                "engine +a2": (lambda: fused(), flops * (1 + r / h)),
                "engine mxfp4 +a2": (lambda: fused(c2, s2), flops * (1 + r / h)),
            }
            peers("dgrad2+act", dout, w2, flops, cols=h)
    if "db13" in selected:
        # As the layer runs it: the two diagonal blocks of [q1 | q3]^T (dg | du), db1 =
        # q1^T dg and db3 = q3^T du, each [E, r, I], over row-strided views of the pools.
        q13, dgu13 = randn(capacity, 2 * r), randn(capacity, 2 * i)
        flops = 2 * (2.0 * routes * r * i)
        cases["db13"] = {
            "engine": (
                lambda: (
                    k_grouped_gemm(q13[:, :r], dgu13[:, :i], plan),
                    k_grouped_gemm(q13[:, r:], dgu13[:, i:], plan),
                ),
                flops,
            )
        }
        if dense:  # the peers on contiguous copies of the blocks (their best layout)
            blocks = [
                (q13[:routes, :r].contiguous(), dgu13[:routes, :i].contiguous()),
                (q13[:routes, r:].contiguous(), dgu13[:routes, i:].contiguous()),
            ]
            cases["db13"]["torch._grouped_mm"] = (
                lambda: [torch._grouped_mm(q.T, g, offs=offs) for q, g in blocks],
                flops,
            )
            if quack is not None:
                cases["db13"]["quack"] = (
                    lambda: [quack(q.T, g, cu_seqlens_k=cu, tuned=False) for q, g in blocks],
                    flops,
                )
    wgrads = {"wgrad13": (2 * i, h), "wgrad2": (h, i), "da2": (i, r)}
    for name, (m, n) in wgrads.items():
        if name not in selected:
            continue
        a, b = randn(capacity, m), randn(capacity, n)
        flops = 2.0 * routes * m * n
        cases[name] = {"engine": (lambda a=a, b=b: k_grouped_gemm(a, b, plan), flops)}
        if dense:
            at, bt = a[:routes], b[:routes]
            cases[name]["torch._grouped_mm"] = (
                lambda at=at, bt=bt: torch._grouped_mm(at.T, bt, offs=offs),
                flops,
            )
            if quack is not None:
                cases[name]["quack"] = (
                    lambda at=at, bt=bt: quack(at.T, bt, cu_seqlens_k=cu, tuned=False),
                    flops,
                )
    return cases


def run_ncu(argv: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """Every case once under Nsight Compute (a child process); bytes per case, summed over
    the kernels of its NVTX range."""
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu: not found, no byte counts", file=sys.stderr)
        return {}
    cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
           "--nvtx",
           "--metrics", ",".join(NCU_METRICS), sys.executable, "-m", "megamoe.bench.engine",
           *argv, "--ncu-child"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('"')]
    if done.returncode != 0 or not lines:
        print(f"ncu failed ({done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return {}
    return ncu_bytes_by_case(lines)


def ncu_bytes_by_case(csv_lines: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """``ncu --csv --page raw --nvtx`` rows summed per ``(gemm, case)`` NVTX range; kernels
    outside a ``gemm|case`` range (set-up, warm-up) are left out."""
    rows = list(csv.DictReader(io.StringIO("\n".join(csv_lines))))
    if not rows:
        return {}
    totals: dict[tuple[str, str], dict[str, float]] = {}
    # ncu names the column "thread Domain:Push/Pop_Range:...", its values
    # "<default domain>:gemm1|engine:none:..." (the range's message among ':'-fields).
    range_key = next((k for k in rows[0] if "push/pop_range" in k.lower()), None)
    scale = {metric: _BYTE_UNITS.get(rows[0].get(metric, "byte")) for metric in NCU_METRICS}
    unknown = {rows[0].get(m) for m, f in scale.items() if f is None}
    if unknown:  # dropped, not raised: the timings taken before are still reported
        print(f"ncu: unexpected units {sorted(map(str, unknown))}, no byte counts", file=sys.stderr)
        return {}
    for row in rows[1:]:  # the first data row holds the units
        fields = ((row.get(range_key) or "") if range_key else "").split(":")
        label = next((f.strip('[]" ') for f in fields if "|" in f), None)
        if label is None:
            continue
        gemm, case = label.split("|", 1)
        entry = totals.setdefault((gemm, case), dict.fromkeys(NCU_METRICS, 0.0))
        for metric in NCU_METRICS:
            value = row.get(metric, "0").replace(",", "")
            entry[metric] += float(value) * scale[metric] if value else 0.0
    return totals


def add_burst_times(
    rows: list[dict],
    by_case: dict[str, tuple[Callable[[], object], float]],
    launches: int,
    profile: Callable[..., BurstTimes] = profile_burst,
) -> None:
    """``--kernel-times``: one profiled burst of ``launches`` calls of each row's case
    (after a second of idle GPU), its :class:`BurstTimes` added to the row in place."""
    for row in rows:
        burst = profile(by_case[row["case"]][0], launches, pause_s=1.0)
        row |= {"kernel_ms": burst.kernel_ms, "idle_ms": burst.idle_ms,
                "top_kernel": burst.top_kernel, "top_first_ms": burst.top_first_ms,
                "top_last_ms": burst.top_last_ms}  # fmt: skip


def kernel_times_table(results: list[dict], launches: int) -> list[str]:
    """The ``--kernel-times`` lines: per case, its burst's kernel and idle ms per launch
    and the first and last run of its kernel with the most device time (rows as ``main``
    fills them)."""
    lines = [
        f"one profiled burst of {launches} launches per case, per launch:",
        f"{'gemm':<11} {'case':<21} {'kernel ms':>9} {'idle ms':>8} "
        f"{'top first':>9} {'top last':>9}  top kernel",
    ]
    for r in results:
        lines.append(
            f"{r['gemm']:<11} {r['case']:<21} {r['kernel_ms']:>9.3f} {r['idle_ms']:>8.3f} "
            f"{r['top_first_ms']:>9.3f} {r['top_last_ms']:>9.3f}  {r['top_kernel'][:60]}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=65536, help="tokens T (default 65536)")
    parser.add_argument("--experts", type=int, default=64, help="local experts E (default 64)")
    parser.add_argument("--top-k", type=int, default=6, help="routes per token K (default 6)")
    parser.add_argument("--hidden", type=int, default=4096, help="H (default 4096)")
    parser.add_argument("--intermediate", type=int, default=2048, help="I (default 2048)")
    parser.add_argument("--rank", type=int, default=128, help="adapter rank r (default 128)")
    parser.add_argument(
        "--gemms", default=",".join(GEMMS), help=f"comma-separated subset of {', '.join(GEMMS)}"
    )
    parser.add_argument("--warmup", type=warmup_count, default=3, help="untimed runs per case (3)")
    parser.add_argument(
        "--iters", type=sample_count, default=10, help="timed samples per case (10)"
    )
    parser.add_argument(
        "--sustained",
        type=launch_count,
        default=1,
        help="back-to-back launches per timed sample (default 1; >= 10 for sustained "
        "numbers at the power cap)",
    )
    parser.add_argument("--no-quack", dest="quack", action="store_false", help="skip QuACK")
    parser.add_argument("--ncu", action="store_true", help="add DRAM/L2 bytes per case (ncu)")
    parser.add_argument(
        "--kernel-times",
        action="store_true",
        help="per case, kernel and idle time of one profiled burst of --sustained launches "
        "(needs --sustained >= 2)",
    )
    parser.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    unknown = set(args.gemms.split(",")) - set(GEMMS)
    if unknown:
        parser.error(f"--gemms: unknown {sorted(unknown)}")
    if args.kernel_times and args.sustained < 2:  # one launch has no gaps, no first and last
        parser.error("--kernel-times needs --sustained 2 or more")
    if not torch.cuda.is_available():
        print("megamoe.bench.engine: needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ids, _ = make_routing(args.tokens, args.experts, args.top_k, kind="balanced", seed=0)
    block_m = mm.get_block_m(args.tokens, args.top_k, args.experts)
    plan = mm.plan_routes(ids.to(device), args.experts, block_m)
    cases = build_cases(args, plan, device)

    if args.ncu_child:  # one launch per case, each inside an NVTX range "gemm|case"
        for gemm, by_case in cases.items():
            for case, (fn, _) in by_case.items():
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"{gemm}|{case}")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
        return 0

    def repeated(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.sustained):
                fn()

        return run

    log = PowerLog()
    results = []
    for gemm, by_case in cases.items():
        timed = time_interleaved(
            {case: repeated(fn) for case, (fn, _) in by_case.items()},
            device=device,
            warmup=args.warmup,
            iters=args.iters,
        )
        for case, (_fn, flops) in by_case.items():
            clock, power = log.during(timed[case].windows)
            median = timed[case].timing.median_ms / args.sustained
            results.append(
                {"gemm": gemm, "case": case, "median_ms": median, "tflops": flops / median / 1e9,
                 "sm_mhz": clock, "watts": power}
            )  # fmt: skip
        if args.kernel_times:
            add_burst_times(results[-len(by_case) :], by_case, args.sustained)
    log.close()
    if args.ncu:
        # The ncu child builds every case again on this GPU: at ep4rank the inputs are
        # about 52 GiB, twice that does not fit an H100. Only the timings are kept.
        del cases, by_case, timed, _fn
        gc.collect()
        torch.cuda.empty_cache()
        own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--ncu"]
        counts = run_ncu([*own, "--no-quack"] if "--no-quack" not in own else own)
        for row in results:
            got = counts.get((row["gemm"], row["case"]))
            if got:
                row["dram_read_gb"] = got["dram__bytes_read.sum"] / 1e9
                row["dram_write_gb"] = got["dram__bytes_write.sum"] / 1e9
                row["l2_gb"] = got["lts__t_bytes.sum"] / 1e9

    torch_ms = {r["gemm"]: r["median_ms"] for r in results if r["case"] == "torch._grouped_mm"}
    quack_ms = {r["gemm"]: r["median_ms"] for r in results if r["case"] == "quack"}
    _, quack_note = quack_gemm() if args.quack else (None, "skipped (--no-quack)")
    print(
        f"T={args.tokens} E={args.experts} K={args.top_k} H={args.hidden} I={args.intermediate} "
        f"r={args.rank} BLOCK_M={block_m} sustained={args.sustained} "
        f"GPU={torch.cuda.get_device_name()} QuACK: {quack_note}"
    )
    print(
        f"{'gemm':<11} {'case':<21} {'ms':>8} {'TFLOP/s':>8} {'/torch':>7} {'/quack':>7} "
        f"{'MHz':>5} {'W':>4} {'DRAM GB':>8} {'L2 GB':>7}"
    )
    for r in results:
        r["vs_torch"] = torch_ms[r["gemm"]] / r["median_ms"] if r["gemm"] in torch_ms else None
        r["vs_quack"] = quack_ms[r["gemm"]] / r["median_ms"] if r["gemm"] in quack_ms else None
        ratio_t = "-" if r["vs_torch"] is None else f"{r['vs_torch']:.3f}"
        ratio_q = "-" if r["vs_quack"] is None else f"{r['vs_quack']:.3f}"
        dram = r.get("dram_read_gb", 0) + r.get("dram_write_gb", 0) if "l2_gb" in r else None
        print(
            f"{r['gemm']:<11} {r['case']:<21} {r['median_ms']:>8.3f} {r['tflops']:>8.1f} "
            f"{ratio_t:>7} {ratio_q:>7} {r['sm_mhz'] or 0:>5.0f} {r['watts'] or 0:>4.0f} "
            f"{dram if dram is not None else float('nan'):>8.1f} "
            f"{r.get('l2_gb', float('nan')):>7.1f}"
        )
    if args.kernel_times:
        print("\n".join(kernel_times_table(results, args.sustained)))
    if args.json:
        meta = vars(args) | {"json": None, "block_m": block_m, "quack": quack_note,
                             "gpu": torch.cuda.get_device_name(),
                             "commit": build_commit()[0]}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
