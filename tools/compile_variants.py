#!/usr/bin/env python3
"""Compile every registry variant for sm_90a and check its resources and SASS.

For each variant: nvcc -cubin with ptxas -v (registers, shared memory, stack, spills
per kernel), then, where cuobjdump is found (PATH or the nvidia-cuda-cuobjdump wheel
through cuda.pathfinder), the SASS: no LDL/STL local-memory traffic in any kernel,
and HGMMA present in every kernel of a GEMM family. Prints a table, writes
resources.json, exits non-zero on any failure. Runs at most two nvcc jobs at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gen_variants  # noqa: E402

GEMM_FAMILIES = {"grouped_gemm"}  # families whose kernels must issue HGMMA

PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\S+)' for 'sm_90a'")
PTXAS_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_USAGE = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def cutlass_include() -> Path:
    import cutlass_library

    return Path(cutlass_library.__file__).parent / "source" / "include"


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("cuobjdump")


def demangle(names: list[str]) -> dict[str, str]:
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, out.stdout.splitlines()))


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := PTXAS_FUNCTION.search(line):
            current = m.group(1)
            kernels[current] = {
                "registers": 0,
                "smem": 0,
                "stack": 0,
                "spill_stores": 0,
                "spill_loads": 0,
            }
        elif current and (m := PTXAS_STACK.search(line)):
            kernels[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current and (m := PTXAS_USAGE.search(line)):
            kernels[current].update(registers=int(m[1]), smem=int(m[2] or 0))
    return kernels


def sass_by_kernel(cuobjdump: str, cubin: Path) -> dict[str, str]:
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


def compile_one(source: Path, out_dir: Path, nvcc: str, includes: list[Path]) -> tuple[Path, str]:
    cubin = out_dir / (source.stem + ".cubin")
    cmd = [
        nvcc,
        "-cubin",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-std=c++17",
        "-O3",
        "--expt-relaxed-constexpr",
        "-Xptxas=-v",
        "-o",
        str(cubin),
        str(source),
    ]
    cmd += [f"-I{p}" for p in includes]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source.name}:\n{done.stderr}")
    return cubin, done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "variants")
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs (<= 2 here)")
    parser.add_argument(
        "--require-sass",
        action="store_true",
        help="fail if cuobjdump is not found instead of skipping SASS checks",
    )
    args = parser.parse_args()
    nvcc = os.environ.get("NVCC", shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    gen_dir = args.out / "generated"
    sources = gen_variants.generate(ROOT / "python/megamoe/variants.toml", gen_dir)
    families = {p.stem.removeprefix("variant_"): p for p in sources}
    registry = {
        v["name"]: v
        for v in gen_variants.tomllib.loads((ROOT / "python/megamoe/variants.toml").read_text())[
            "variant"
        ]
    }
    includes = [ROOT / "kernels", gen_dir, cutlass_include()]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: compile_one(s, args.out, nvcc, includes), sources))

    cuobjdump = find_cuobjdump()
    if cuobjdump is None and args.require_sass:
        print("cuobjdump not found (pip install nvidia-cuda-cuobjdump)", file=sys.stderr)
        return 1
    rows, failures = [], []
    for (name, _), (cubin, log) in zip(families.items(), results):
        kernels = parse_ptxas(log)
        sass = sass_by_kernel(cuobjdump, cubin) if cuobjdump else {}
        pretty = demangle(list(kernels))
        for mangled, usage in kernels.items():
            code = sass.get(mangled, "")
            local = len(re.findall(r"\b(LDL|STL)\b", code)) if sass else None
            hgmma = len(re.findall(r"\bHGMMA\b", code)) if sass else None
            row = {
                "variant": name,
                "kernel": pretty[mangled],
                **usage,
                "local_memory_instructions": local,
                "hgmma_instructions": hgmma,
            }
            rows.append(row)
            if usage["spill_stores"] or usage["spill_loads"]:
                failures.append(f"{name}: {pretty[mangled]} spills registers")
            if local:
                failures.append(f"{name}: {pretty[mangled]} has {local} LDL/STL instructions")
            if registry[name]["family"] in GEMM_FAMILIES and sass and not hgmma:
                failures.append(f"{name}: {pretty[mangled]} issues no HGMMA")

    header = (
        f"{'variant':<22} {'kernel':<44} {'regs':>5} {'smem':>7} {'stack':>6} "
        f"{'spill':>6} {'LDL/STL':>8} {'HGMMA':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        kernel = r["kernel"].split("(")[0].removeprefix("void ")[-44:]
        local = "n/a" if r["local_memory_instructions"] is None else r["local_memory_instructions"]
        hgmma = "n/a" if r["hgmma_instructions"] is None else r["hgmma_instructions"]
        print(
            f"{r['variant']:<22} {kernel:<44} {r['registers']:>5} {r['smem']:>7} "
            f"{r['stack']:>6} {r['spill_stores'] + r['spill_loads']:>6} {local:>8} {hgmma:>6}"
        )
    (args.out / "resources.json").write_text(json.dumps(rows, indent=1))
    if cuobjdump is None:
        print("SASS checks skipped: cuobjdump not found", file=sys.stderr)
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    print(f"{len(families)} variants, {len(rows)} kernels, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
