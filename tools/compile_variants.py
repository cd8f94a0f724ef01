#!/usr/bin/env python3
"""Compile every registry variant for sm_90a, check its resources and SASS, and fail on
a regression against the committed baseline (tools/variant_resources.json).

For each variant: ``nvcc -cubin`` with ``ptxas -v`` (registers, static shared memory,
stack and spill bytes per kernel) and, where cuobjdump is found (PATH, or the
nvidia-cuda-cuobjdump wheel through ``cuda.pathfinder``), its SASS.

Checks that hold whatever the baseline says:
- no spill stores or loads, and no LDL/STL (local-memory) instruction in any kernel;
- HGMMA in every kernel of a GEMM family (``GEMM_FAMILIES``): a grouped GEMM that
  compiles to plain FMA (e.g. built for the wrong arch) fails here, not in a benchmark;
- no ptxas "wgmma.mma_async instructions are serialized" advisory (C7510-C7520): ptxas
  then waits for every wgmma right after issuing it, so nothing overlaps the tensor
  cores (a branch around wgmma, or too few registers for the accumulators, does it);
- no weight-streaming producer loop reads a scale load again in the iteration that
  issued it (``tools/stream_step_sass.py``): the step would wait for its own load, and
  the consumers for the stage (docs/ENGINE.md, "The producer's scale loads");
- a weight-streaming epilogue that loads (dgrad2's g | u) issues at least
  ``EPILOGUE_LOADS_PER_ROUND`` loads per round between its stores: each round is a
  memory round trip on the consumers' path (docs/ENGINE.md, "The streaming dgrad2's
  epilogue loads");
- every variant defines at least one kernel.

Checks against the baseline (per variant and mangled kernel symbol):
- registers may grow by at most ``register_tolerance`` (stored in the baseline; one
  8-register allocation granule by default): more registers cost occupancy;
- static shared memory and the stack frame may not grow at all;
- a kernel missing from the baseline fails (record it with ``--update-baseline``);
  baseline entries for kernels no longer built are reported, not failed.

``--update-baseline`` rewrites the baseline from this run; it refuses while a check
that holds regardless of the baseline fails, or when SASS could not be read.

``--expect-same-sass RESOURCES`` checks a change that should not touch device code (a
refactor, a moved header): every kernel's SASS must be byte for byte that of another
tree's run, whose ``<out>/resources.json`` holds a SHA-256 of each kernel's SASS (written
by this version of the tool: run it on the base tree too, e.g. from a copy). Build the
base tree into one ``--out``, then run the change with this option:

    python3 tools/compile_variants.py --out build/variants-base   # on the base tree
    python3 tools/compile_variants.py --expect-same-sass build/variants-base/resources.json

Speed: at most two nvcc jobs at once (CI has 2 cores; a CUTLASS-sized TU peaks near
3 GB). Results are cached by content hash under ``<out>/cache``: the key covers the
nvcc version, the CUTLASS version, the flags and every local header the variant
includes, so an unchanged variant is not recompiled. Prints a table, writes
``<out>/resources.json`` and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gen_variants  # noqa: E402
import stream_step_sass  # noqa: E402

GEMM_FAMILIES = {"engine", "weight_stream"}  # families whose kernels must issue HGMMA
# A streaming epilogue's loads per round (check_absolute): eight rows' g | u in a round
# give 16; a row at a time between its stores gives 2.
EPILOGUE_LOADS_PER_ROUND = 8
REGISTRY = ROOT / "python" / "megamoe" / "variants.toml"
DEFAULT_BASELINE = ROOT / "tools" / "variant_resources.json"
# One register allocation granule (registers are allocated per warp in units of 256,
# i.e. 8 per thread): growth within it cannot change occupancy.
DEFAULT_REGISTER_TOLERANCE = 8
MAX_DEFAULT_JOBS = 2
BASELINE_SCHEMA = 1
# Bump when a change here alters what a cached compile result means.
CACHE_VERSION = "3"

# The flags of the wheel build (CMakeLists.txt) plus -cubin/-Xptxas=-v, so the numbers
# checked here are the numbers shipped.
NVCC_FLAGS = [
    "-cubin",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-Xptxas=-v",
    "-Xptxas=-warn-spills",
]

PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\S+)' for 'sm_90a'")
PTXAS_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_SERIALIZED = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.+?) in the function '(\S+?)'"
)
PTXAS_USAGE = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)

# Columns compared against the baseline and how: registers with a tolerance, these
# others may not grow at all.
NO_GROWTH = ("smem", "stack")


@dataclass(frozen=True)
class CompileResult:
    """One variant's cubin and ptxas log, and whether it came from the cache."""

    variant: str
    cubin: Path
    log: str
    seconds: float
    cached: bool
    # Per mangled symbol: (LDL/STL count, HGMMA count, producer scale loads read in their
    # own iteration, epilogue loads per round, the SASS's SHA-256; the third and fourth
    # None where the kernel has no producer loop or no loading epilogue); None without SASS.
    sass_counts: dict[str, tuple[int, int, int | None, float | None, str]] | None = None


def cutlass_include() -> Path:
    """The CuTe/CUTLASS headers of the pinned nvidia-cutlass wheel."""
    import cutlass_library

    return Path(cutlass_library.__file__).parent / "source" / "include"


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, else from an NVIDIA wheel (cuda.pathfinder), else None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("cuobjdump")


def find_nvcc() -> str:
    """$NVCC, else nvcc on PATH, else the toolkit default location."""
    return os.environ.get("NVCC", shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")


def toolchain_identity(nvcc: str) -> dict[str, str]:
    """What besides our sources decides a cubin: compiler build, CUTLASS version, flags."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    release = next(
        (line for line in version.stdout.splitlines() if "release" in line), version.stdout
    )
    try:
        cutlass = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        cutlass = "unknown"
    return {
        "nvcc": release.strip(),
        "nvcc_build": version.stdout.strip().splitlines()[-1],
        "cutlass": cutlass,
        "flags": " ".join(NVCC_FLAGS),
    }


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> demangled kernel names (unchanged where c++filt is missing)."""
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, out.stdout.splitlines()))


def short_name(pretty: str) -> str:
    """``void ns::kernel<1, 2>(Params)`` -> ``kernel<1, 2>`` for the table."""
    name = pretty.removeprefix("void ")
    depth = 0
    for i, char in enumerate(name):
        depth += char in "<("
        depth -= char in ">)"
        if char == "(" and depth == 1:
            name = name[:i]
            break
    head, _, tail = name.partition("<")
    return head.rsplit("::", 1)[-1] + ("<" + tail if tail else "")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per-kernel resources from a ``ptxas -v`` log, keyed by mangled symbol."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := PTXAS_FUNCTION.search(line):
            current = m.group(1)
            kernels.setdefault(current, {}).update(
                registers=0, smem=0, stack=0, spill_stores=0, spill_loads=0
            )
        elif m := PTXAS_SERIALIZED.search(line):
            # The advisory names its kernel and may come before its "Compiling" line.
            kernels.setdefault(m[2], {})["wgmma_serialized"] = m[1]
        elif current and (m := PTXAS_STACK.search(line)):
            kernels[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current and (m := PTXAS_USAGE.search(line)):
            kernels[current].update(registers=int(m[1]), smem=int(m[2] or 0))
    for usage in kernels.values():
        usage.setdefault("wgmma_serialized", None)
    return kernels


STAGED_STEPS_AHEAD = 4


def stream_checks(name: str, code: str) -> tuple[int | None, float | None]:
    """A weight-streaming kernel's producer scale loads read again in the iteration that
    issued them, and its epilogue's loads per round between its stores (None where the
    epilogue loads nothing); (None, None) for other kernels."""
    if "weight_stream_kernel" not in name:
        return None, None
    instructions = stream_step_sass.parse(code)
    loop = stream_step_sass.producer_loop(instructions)
    early = len(stream_step_sass.loads_read_in_their_iteration(loop))
    # Scale loads staged through shared memory (cp.async) must be waited for
    # kScaleStepsAhead (4) steps after their issue, as the source intends.
    staged = stream_step_sass.staged_steps_ahead(loop)
    if staged is not None and staged < STAGED_STEPS_AHEAD:
        early += 1
    loads, rounds = stream_step_sass.epilogue_load_rounds(instructions)
    return early, (loads / rounds if rounds else None)


def count_sass(
    sass: dict[str, str],
) -> dict[str, tuple[int, int, int | None, float | None, str]]:
    """(LDL/STL count, HGMMA count, producer loads read in their step, epilogue loads per
    round: stream_checks, the SASS's SHA-256) per kernel from its SASS."""
    return {
        name: (
            len(re.findall(r"\b(?:LDL|STL)\b", code)),
            len(re.findall(r"\bHGMMA\b", code)),
            *stream_checks(name, code),
            hashlib.sha256(code.encode()).hexdigest(),
        )
        for name, code in sass.items()
    }


def sass_by_kernel(cuobjdump: str, cubin: Path) -> dict[str, str]:
    """SASS text per mangled kernel symbol."""
    # cuobjdump runs nvdisasm for SASS: look beside it first (the PyPI wheels install
    # both into one bin/ folder), then on PATH.
    env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ['PATH']}")
    text = subprocess.run(
        [cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True, env=env
    ).stdout
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            current = m.group(1)
            sections[current] = []
        elif current:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def local_headers(source: Path, include_dirs: list[Path]) -> list[Path]:
    """Every header under ``include_dirs`` that ``source`` includes, transitively.

    Only our own folders are scanned: system, CUDA and CUTLASS headers are pinned by
    the toolchain identity that is also part of the cache key.
    """
    seen: dict[Path, None] = {}
    pending = [source]
    while pending:
        current = pending.pop()
        text = current.read_text()
        for name in LOCAL_INCLUDE.findall(text):
            # A quoted include is found next to the including file first (as nvcc does).
            for folder in [current.parent, *include_dirs]:
                candidate = (folder / name).resolve()
                if folder == current.parent and not any(
                    candidate.is_relative_to(d.resolve()) for d in include_dirs
                ):
                    continue
                if candidate.is_file():
                    if candidate not in seen:
                        seen[candidate] = None
                        pending.append(candidate)
                    break
    return sorted(seen)


def cache_key(source: Path, include_dirs: list[Path], toolchain: dict[str, str]) -> str:
    """Content hash of everything that decides the variant's cubin and ptxas log."""
    digest = hashlib.sha256(CACHE_VERSION.encode())
    digest.update(json.dumps(toolchain, sort_keys=True).encode())
    for path in [source, *local_headers(source, include_dirs)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def compile_one(
    source: Path,
    out_dir: Path,
    nvcc: str,
    includes: list[Path],
    local_dirs: list[Path],
    toolchain: dict[str, str],
    use_cache: bool,
    cuobjdump: str | None,
) -> CompileResult:
    """nvcc -cubin one variant and count its SASS, or take both from the cache."""
    variant = source.stem.removeprefix("variant_")
    started = time.perf_counter()
    entry = out_dir / "cache" / cache_key(source, local_dirs, toolchain)
    cubin, log_path = entry / f"{source.stem}.cubin", entry / "ptxas.log"
    sass_path = entry / "sass_counts.json"
    cached = use_cache and cubin.is_file() and log_path.is_file()
    if cached:
        log = log_path.read_text()
    else:
        entry.mkdir(parents=True, exist_ok=True)
        sass_path.unlink(missing_ok=True)
        cmd = [nvcc, *NVCC_FLAGS, "-o", str(cubin), str(source), *[f"-I{p}" for p in includes]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed for {source.name}:\n{done.stderr}")
        log = done.stderr
        # Written last: a cache entry with a log is a complete one.
        log_path.write_text(log)
    seconds = 0.0 if cached else time.perf_counter() - started
    counts = None
    if cuobjdump is not None:
        if cached and sass_path.is_file():
            counts = {k: tuple(v) for k, v in json.loads(sass_path.read_text()).items()}
            if any(len(v) != 5 for v in counts.values()):  # an older tool's entry: no digest
                counts = None
        if counts is None:
            counts = count_sass(sass_by_kernel(cuobjdump, cubin))
            sass_path.write_text(json.dumps(counts))
    return CompileResult(variant, cubin, log, seconds, cached, counts)


def prune_cache(out_dir: Path, keep: set[Path]) -> None:
    """Drop cache entries this run did not use, so the cache holds one build's worth."""
    cache = out_dir / "cache"
    if cache.is_dir():
        for entry in cache.iterdir():
            if entry not in keep:
                shutil.rmtree(entry, ignore_errors=True)


def measure(results: list[CompileResult], registry: dict[str, dict]) -> list[dict]:
    """One row per (variant, kernel): ptxas resources plus SASS counts (None without SASS)."""
    rows = []
    for result in results:
        kernels = parse_ptxas(result.log)
        pretty = demangle(list(kernels))
        for symbol, usage in sorted(kernels.items()):
            local, hgmma, early, per_round, digest = (None, None, None, None, None)
            if result.sass_counts is not None:
                # A kernel ptxas compiled but cuobjdump did not list counts as empty SASS.
                local, hgmma, early, per_round, digest = result.sass_counts.get(
                    symbol, (0, 0, None, None, None)
                )
            rows.append(
                {
                    "variant": result.variant,
                    "family": registry[result.variant]["family"],
                    "kernel": pretty[symbol],
                    "symbol": symbol,
                    **usage,
                    "local_memory_instructions": local,
                    "hgmma_instructions": hgmma,
                    "producer_loads_read_in_step": early,
                    "epilogue_loads_per_round": per_round,
                    "sass_sha256": digest,
                }
            )
    return rows


def check_absolute(rows: list[dict], variants: list[str]) -> list[str]:
    """Failures that no baseline can excuse: spills, local memory, GEMMs without HGMMA,
    wgmma serialized by ptxas, a streaming producer waiting for its own scale loads, a
    streaming epilogue loading a row at a time."""
    failures = []
    built = {row["variant"] for row in rows}
    for name in variants:
        if name not in built:
            failures.append(f"{name}: defines no kernel (instantiation compiled out?)")
    for row in rows:
        where = f"{row['variant']}: {short_name(row['kernel'])}"
        if row["spill_stores"] or row["spill_loads"]:
            failures.append(
                f"{where} spills registers ({row['spill_stores']} B stored, "
                f"{row['spill_loads']} B loaded)"
            )
        if row["local_memory_instructions"]:
            failures.append(f"{where} has {row['local_memory_instructions']} LDL/STL instructions")
        if row["family"] in GEMM_FAMILIES and row["hgmma_instructions"] == 0:
            failures.append(f"{where} issues no HGMMA (family {row['family']} must use wgmma)")
        if row.get("wgmma_serialized"):
            failures.append(
                f"{where} has its wgmma serialized by ptxas ({row['wgmma_serialized']})"
            )
        if row.get("producer_loads_read_in_step"):
            failures.append(
                f"{where}: its producer waits for its scale loads too soon "
                f"({row['producer_loads_read_in_step']}: loads read in the iteration that "
                f"issued them, or staged loads waited for fewer than {STAGED_STEPS_AHEAD} "
                "steps after their issue)"
            )
        per_round = row.get("epilogue_loads_per_round")
        if per_round is not None and per_round < EPILOGUE_LOADS_PER_ROUND:
            failures.append(
                f"{where}: its epilogue issues {per_round:.1f} loads per round between its "
                f"stores (at least {EPILOGUE_LOADS_PER_ROUND}: each round is a memory round trip)"
            )
    return failures


def compare_to_baseline(
    rows: list[dict], baseline: dict, tolerance: int
) -> tuple[list[str], list[str]]:
    """``(failures, notes)`` of this run against the committed baseline."""
    failures, notes = [], []
    known = {(k["variant"], k["symbol"]): k for k in baseline.get("kernels", [])}
    seen = set()
    for row in rows:
        key = (row["variant"], row["symbol"])
        seen.add(key)
        where = f"{row['variant']}: {short_name(row['kernel'])}"
        old = known.get(key)
        if old is None:
            failures.append(
                f"{where} is not in the baseline (new kernel: record it with --update-baseline)"
            )
            continue
        if row["registers"] > old["registers"] + tolerance:
            failures.append(
                f"{where} uses {row['registers']} registers, baseline {old['registers']} "
                f"(tolerance +{tolerance})"
            )
        elif row["registers"] != old["registers"]:
            notes.append(f"{where} registers {old['registers']} -> {row['registers']}")
        for column in NO_GROWTH:
            if row[column] > old[column]:
                failures.append(f"{where} {column} grew from {old[column]} to {row[column]} bytes")
            elif row[column] < old[column]:
                notes.append(f"{where} {column} {old[column]} -> {row[column]} bytes")
    for key in sorted(set(known) - seen):
        notes.append(f"{key[0]}: {key[1]} is in the baseline but was not built (stale entry)")
    return failures, notes


def compare_sass(rows: list[dict], reference: list[dict]) -> list[str]:
    """Failures for every kernel whose SASS is not byte for byte the reference run's (rows
    of another tree's ``resources.json``), and for kernels only one run built."""
    known = {(k["variant"], k["symbol"]): k for k in reference}
    failures = []
    seen = set()
    for row in rows:
        key = (row["variant"], row["symbol"])
        seen.add(key)
        where = f"{row['variant']}: {short_name(row['kernel'])}"
        if key not in known:
            failures.append(f"{where}: not built by the reference run")
        elif known[key].get("sass_sha256") is None or row.get("sass_sha256") is None:
            failures.append(
                f"{where}: no SASS digest in one of the runs (no SASS listed, no cuobjdump, "
                "or a reference written by a tool without --expect-same-sass)"
            )
        elif known[key]["sass_sha256"] != row["sass_sha256"]:
            failures.append(f"{where}: SASS differs from the reference run's")
    for key in sorted(set(known) - seen):
        failures.append(
            f"{key[0]}: {short_name(known[key]['kernel'])} built by the reference run only"
        )
    return failures


def same_sass_count(rows: list[dict], reference: list[dict]) -> int:
    """How many of this run's kernels have the reference run's SASS digest."""
    known = {(k["variant"], k["symbol"]): k.get("sass_sha256") for k in reference}
    return sum(
        1
        for row in rows
        if row.get("sass_sha256") is not None
        and known.get((row["variant"], row["symbol"])) == row["sass_sha256"]
    )


def load_baseline(path: Path) -> dict:
    """The committed baseline; raises FileNotFoundError/ValueError with a clear message."""
    if not path.is_file():
        raise FileNotFoundError(f"no baseline at {path}: create it with --update-baseline")
    data = json.loads(path.read_text())
    if data.get("schema") != BASELINE_SCHEMA:
        raise ValueError(f"{path}: expected schema {BASELINE_SCHEMA}, got {data.get('schema')}")
    return data


def baseline_document(rows: list[dict], toolchain: dict[str, str], tolerance: int) -> dict:
    """The baseline file's content for this run (sorted, so diffs stay small)."""
    columns = (
        "variant",
        "kernel",
        "symbol",
        "registers",
        "smem",
        "stack",
        "spill_stores",
        "spill_loads",
        "local_memory_instructions",
        "hgmma_instructions",
    )
    kernels = sorted(
        ({c: row[c] for c in columns} for row in rows), key=lambda k: (k["variant"], k["symbol"])
    )
    return {
        "schema": BASELINE_SCHEMA,
        "about": "Per-kernel sm_90a resources checked by tools/compile_variants.py; "
        "regenerate with `python3 tools/compile_variants.py --update-baseline`.",
        "register_tolerance": tolerance,
        "toolchain": toolchain,
        "kernels": kernels,
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'variant':<28} {'kernel':<40} {'regs':>5} {'smem':>6} {'stack':>6} "
        f"{'spill':>6} {'LDL/STL':>8} {'HGMMA':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        local = "n/a" if r["local_memory_instructions"] is None else r["local_memory_instructions"]
        hgmma = "n/a" if r["hgmma_instructions"] is None else r["hgmma_instructions"]
        print(
            f"{r['variant']:<28} {short_name(r['kernel'])[:40]:<40} {r['registers']:>5} "
            f"{r['smem']:>6} {r['stack']:>6} {r['spill_stores'] + r['spill_loads']:>6} "
            f"{local:>8} {hgmma:>6}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "variants")
    parser.add_argument(
        "--jobs",
        type=int,
        default=MAX_DEFAULT_JOBS,
        help="parallel nvcc jobs (default 2: CI's 2 cores and ~3 GB per CUTLASS TU)",
    )
    parser.add_argument(
        "--require-sass",
        action="store_true",
        help="fail if cuobjdump is not found instead of skipping SASS checks",
    )
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument(
        "--update-baseline",
        action="store_true",
        help="rewrite --baseline from this run (refused while an absolute check fails)",
    )
    parser.add_argument(
        "--register-tolerance",
        type=int,
        default=None,
        help="allowed register growth per kernel (default: the baseline's, else 8)",
    )
    parser.add_argument("--no-cache", action="store_true", help="recompile every variant")
    parser.add_argument(
        "--expect-same-sass",
        type=Path,
        metavar="RESOURCES",
        help="fail unless every kernel's SASS equals that of the run that wrote this "
        "resources.json (a change that should not touch device code)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    nvcc = find_nvcc()
    toolchain = toolchain_identity(nvcc)
    gen_dir = args.out / "generated"
    sources = gen_variants.generate(REGISTRY, gen_dir)
    registry = {v["name"]: v for v in gen_variants.tomllib.loads(REGISTRY.read_text())["variant"]}
    local_dirs = [ROOT / "kernels", gen_dir]
    includes = [*local_dirs, cutlass_include()]
    cuobjdump = find_cuobjdump()
    if cuobjdump is None and (args.require_sass or args.update_baseline or args.expect_same_sass):
        print("cuobjdump not found (pip install nvidia-cuda-cuobjdump)", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(
            pool.map(
                lambda s: compile_one(
                    s, args.out, nvcc, includes, local_dirs, toolchain, not args.no_cache, cuobjdump
                ),
                sources,
            )
        )
    prune_cache(args.out, {r.cubin.parent for r in results})
    rows = measure(results, registry)
    print_table(rows)
    (args.out / "resources.json").write_text(json.dumps(rows, indent=1))
    failures = check_absolute(rows, list(registry))

    compiled = [r for r in results if not r.cached]
    timing = (
        f"{len(results)} variants ({len(compiled)} compiled, {len(results) - len(compiled)} "
        f"from cache; nvcc {sum(r.seconds for r in compiled):.1f} s over {args.jobs} jobs) "
        f"in {time.perf_counter() - wall:.1f} s"
    )
    if args.update_baseline:
        for failure in failures:
            print("FAIL:", failure, file=sys.stderr)
        if failures:
            print("baseline not updated: fix the failures above first", file=sys.stderr)
            return 1
        tolerance = args.register_tolerance
        if tolerance is None:
            try:
                tolerance = load_baseline(args.baseline).get(
                    "register_tolerance", DEFAULT_REGISTER_TOLERANCE
                )
            except (FileNotFoundError, ValueError):
                tolerance = DEFAULT_REGISTER_TOLERANCE
        document = baseline_document(rows, toolchain, tolerance)
        args.baseline.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.baseline} ({len(rows)} kernels); {timing}")
        return 0

    try:
        baseline = load_baseline(args.baseline)
    except (FileNotFoundError, ValueError) as error:
        failures.append(str(error))
        baseline = {}
    tolerance = args.register_tolerance
    if tolerance is None:
        tolerance = baseline.get("register_tolerance", DEFAULT_REGISTER_TOLERANCE)
    regressions, notes = compare_to_baseline(rows, baseline, tolerance) if baseline else ([], [])
    failures += regressions
    if args.expect_same_sass is not None:
        reference = json.loads(args.expect_same_sass.read_text())
        failures += compare_sass(rows, reference)
        print(
            f"SASS against {args.expect_same_sass}: {same_sass_count(rows, reference)} of "
            f"{len(rows)} kernels byte for byte the same"
        )
    recorded = baseline.get("toolchain", {})
    if recorded and recorded.get("nvcc") != toolchain["nvcc"]:
        notes.append(
            f"baseline was recorded with {recorded.get('nvcc')!r}, this run uses "
            f"{toolchain['nvcc']!r}: register counts may shift"
        )
    if cuobjdump is None:
        print("SASS checks skipped: cuobjdump not found", file=sys.stderr)
    for note in notes:
        print("note:", note)
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    print(f"{len(rows)} kernels, {len(failures)} failures; {timing}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
