#!/usr/bin/env python3
"""Build megamoe wheels for an integration pin: natively, or aarch64 cross-compiled on x86_64.

    python3 ci/build_wheels.py --pin host --arch x86_64 --repro --audit
    python3 ci/build_wheels.py --pin host --arch aarch64 --setup   # as root: apt, debootstrap

Per arch: build with SOURCE_DATE_EPOCH (HEAD's commit time unless set) and at most
``--jobs`` compile jobs, optionally build again from scratch and require the two wheels
to be bit-identical (``--repro``), write the ``auditwheel show`` report and retag the
wheel to the manylinux policy it meets (``--audit``; nothing is grafted: cudart is
static and the driver is loaded at run time), then smoke-import it: x86_64 in a fresh
venv (tools/smoke_wheel.py), aarch64 under qemu-user in an aarch64 Debian root.

aarch64 needs (``--setup`` installs/creates them; CI runs as root):
- ``g++-aarch64-linux-gnu``, ``qemu-user-static``, ``binfmt-support``, ``debootstrap``
  from Debian, and binfmt_misc mounted with qemu-aarch64 enabled;
- an aarch64 Debian root with python3-dev (headers for the module, smoke-test root),
  made by ``debootstrap --arch=arm64`` into the cache (about 3 minutes under qemu);
- a cross CUDA tree: symlinks to the x86_64 nvcc/nvvm plus ``targets/sbsa-linux``
  filled from the nvidia-cuda-runtime manylinux aarch64 wheel (hash-locked in
  ci/locks/cuda-runtime-aarch64.txt), and ci/aarch64-linux-gnu.cmake as toolchain.

The cache lives in ``$MEGAMOE_CACHE`` (default ``build/cache``, git-ignored). Every step's
wall time lands in ``OUT/reports/build-<pin>-<arches>.json`` beside the audit reports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pins as pinlib

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / "ci"
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
DEBIAN_MIRROR = os.environ.get("MEGAMOE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SUITE = "bookworm"  # its python3 is 3.11: the host pin's Python
CROSS_APT = ["g++-aarch64-linux-gnu", "qemu-user-static", "binfmt-support", "debootstrap"]
TRIPLET = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}

STEPS: dict[str, float] = {}


def log(message: str) -> None:
    print(f"[build_wheels] {message}", flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


class step:
    """Time a named step into STEPS."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        log(f"== {self.name}")
        self.start = time.monotonic()

    def __exit__(self, *exc):
        STEPS[self.name] = round(STEPS.get(self.name, 0) + time.monotonic() - self.start, 1)
        log(f"   {self.name}: {STEPS[self.name]} s")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def source_date_epoch() -> str:
    """The build's timestamp: SOURCE_DATE_EPOCH, else the commit's time. Without either
    (a source copy without .git) the build stops: a made-up timestamp would make the
    wheel reproducible only with itself."""
    if value := os.environ.get("SOURCE_DATE_EPOCH"):
        return value
    if value := _git("log", "-1", "--format=%ct"):
        return value
    raise SystemExit(
        "no SOURCE_DATE_EPOCH and no git history here: pass -e SOURCE_DATE_EPOCH=$(git log "
        "-1 --format=%ct) and -e MEGAMOE_COMMIT=$(git rev-parse HEAD) to a build without .git"
    )


def expected_commit() -> str:
    """The commit the wheel must name: MEGAMOE_COMMIT (as CMakeLists.txt reads it), else
    HEAD."""
    if value := os.environ.get("MEGAMOE_COMMIT"):
        return value
    if value := _git("rev-parse", "HEAD"):
        return value
    raise SystemExit("no MEGAMOE_COMMIT and no git history here: the wheel could name no commit")


def check_build_info(wheel: Path, commit: str) -> dict:
    """The commit the wheel embeds (``megamoe/_build_info.py``, written by CMake), which
    the bench JSON and bug reports quote: it must be ``commit`` (an empty one is what a
    build without .git or MEGAMOE_COMMIT gives); a ``commit`` given as ``<sha>-dirty``
    must be embedded as ``<sha>`` with ``DIRTY = True``."""
    dirty_given = commit.endswith("-dirty")
    commit = commit.removesuffix("-dirty")
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read("megamoe/_build_info.py").decode()
    found = {}
    for line in text.splitlines():
        if m := re.fullmatch(r'COMMIT = "([0-9a-f]*)"', line.strip()):
            found["commit"] = m.group(1)
        elif m := re.fullmatch(r"DIRTY = (True|False)", line.strip()):
            found["dirty"] = m.group(1) == "True"
    if found.get("commit") != commit:
        raise SystemExit(f"{wheel.name}: embeds commit {found.get('commit')!r}, expected {commit}")
    if dirty_given and not found.get("dirty"):
        raise SystemExit(f"{wheel.name}: built from {commit}-dirty but embeds DIRTY = False")
    if found.get("dirty"):
        log(f"warning: {wheel.name} was built from a tree with uncommitted changes")
    return found


# --------------------------------------------------------------------------- aarch64 setup


def setup_cross_tools(install: bool) -> None:
    missing = [t for t in ("aarch64-linux-gnu-g++", "debootstrap") if not shutil.which(t)]
    if missing and install:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *CROSS_APT], env=env)
        missing = [t for t in ("aarch64-linux-gnu-g++", "debootstrap") if not shutil.which(t)]
    if missing:
        raise SystemExit(f"missing {missing}: apt-get install {' '.join(CROSS_APT)} (or --setup)")
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "status").exists() and install:
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)])
    if not (binfmt / "qemu-aarch64").exists() and install:
        run(["update-binfmts", "--enable", "qemu-aarch64"])
    if not (binfmt / "qemu-aarch64").exists():
        raise SystemExit(
            "qemu-aarch64 binfmt not registered: mount binfmt_misc and "
            "`update-binfmts --enable qemu-aarch64` (or --setup)"
        )


def arm_root(cache: Path, install: bool) -> Path:
    """The aarch64 Debian root: Python headers for the build, the smoke-test root."""
    root = cache / f"arm64-{DEBIAN_SUITE}"
    stamp = root / ".megamoe-complete"
    if stamp.exists():
        return root
    if not install:
        raise SystemExit(f"no aarch64 root at {root}: run with --setup (debootstrap, as root)")
    shutil.rmtree(root, ignore_errors=True)
    run(
        [
            "debootstrap",
            "--arch=arm64",
            "--variant=minbase",
            "--include=python3-dev,libstdc++6",
            DEBIAN_SUITE,
            root,
            DEBIAN_MIRROR,
        ],
        stdout=subprocess.DEVNULL,
    )
    stamp.write_text("debootstrap done\n")
    return root


def nvcc_version(pin: pinlib.Pin) -> str:
    """The full version (``13.0.88``) of the nvcc that compiles the kernels, which must be
    the pin's CUDA X.Y: another toolkit makes other SASS, so its wheel is not the pin's."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"nvcc ({nvcc}) did not report its version: {error}") from None
    found = re.search(r"release (\d+\.\d+), V(\S+)", out.stdout)
    if found is None or found.group(1) != pin.cuda:
        have = found.group(1) if found else "unknown"
        raise SystemExit(f"pin {pin.name} compiles with CUDA {pin.cuda}; {nvcc} is {have}")
    # The patch release too: another nvcc of the same X.Y may make other SASS.
    locked = locked_nvcc(pin)
    if locked is not None and found.group(2) != locked:
        raise SystemExit(
            f"pin {pin.name} compiles with nvcc {locked} (ci/locks/cuda-{pin.cuda}.txt); "
            f"{nvcc} is {found.group(2)} (`python3 ci/lock.py install-cuda` installs it)"
        )
    return found.group(2)


def locked_nvcc(pin: pinlib.Pin) -> str | None:
    """The nvcc version the pin's toolkit lock names, or None without such a lock."""
    path = Path(__file__).parent / "locks" / f"cuda-{pin.cuda}.txt"
    if not path.exists():
        return None
    found = re.search(r"^nvidia-cuda-nvcc==(\S+) ", path.read_text(), re.M)
    return found.group(1) if found else None


def cross_cuda(cache: Path, pin: pinlib.Pin, nvcc: str) -> Path:
    """x86_64 nvcc + aarch64 CUDA runtime (from the hash-locked PyPI wheel). Keyed by the
    nvcc version too: the tree copies that toolkit's headers."""
    tree = cache / f"cuda-{pin.cuda_runtime}-nvcc{nvcc}-aarch64"
    stamp = tree / ".megamoe-complete"
    if stamp.exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    lock = CI / "locks" / "cuda-runtime-aarch64.txt"
    with tempfile.TemporaryDirectory() as tmp:
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "--platform=manylinux_2_28_aarch64",
                "--platform=manylinux_2_17_aarch64",
                "--platform=manylinux2014_aarch64",
                "-r",
                lock,
                "-d",
                tmp,
            ]
        )
        wheels = list(Path(tmp).glob(f"nvidia_cuda_runtime-{pin.cuda_runtime}-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"{lock} must lock nvidia-cuda-runtime=={pin.cuda_runtime}")
        target = tree / "targets" / "sbsa-linux"
        (tree / "bin").mkdir(parents=True)
        for tool in sorted((CUDA_HOME / "bin").iterdir()):
            (tree / "bin" / tool.name).symlink_to(tool)
        (tree / "nvvm").symlink_to(CUDA_HOME / "nvvm")
        (tree / "targets" / "x86_64-linux").parent.mkdir(parents=True)
        (tree / "targets" / "x86_64-linux").symlink_to(CUDA_HOME / "targets" / "x86_64-linux")
        # Headers: the x86_64 tree's (cccl, crt: arch-independent), then the aarch64
        # runtime wheel's on top; libraries: the aarch64 wheel's only.
        shutil.copytree(CUDA_HOME / "include", target / "include", symlinks=True)
        with zipfile.ZipFile(wheels[0]) as archive:
            archive.extractall(Path(tmp) / "rt")
        shutil.copytree(
            Path(tmp) / "rt/nvidia/cu13/include", target / "include", dirs_exist_ok=True
        )
        shutil.copytree(Path(tmp) / "rt/nvidia/cu13/lib", target / "lib")
    (target / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
    (tree / "targets" / "aarch64-linux").symlink_to("sbsa-linux")
    (tree / "include").symlink_to("targets/sbsa-linux/include")
    (tree / "lib").symlink_to("targets/sbsa-linux/lib")
    (tree / "lib64").symlink_to("lib")
    stamp.write_text(f"nvidia-cuda-runtime {pin.cuda_runtime} aarch64\n")
    return tree


def python_headers(cache: Path, root: Path, pin: pinlib.Pin) -> Path:
    """The aarch64 root's Python headers with its own pyconfig.h (Debian splits it)."""
    inc = cache / f"python{pin.python}-aarch64-include"
    source = root / "usr" / "include" / f"python{pin.python}"
    if not source.is_dir():
        raise SystemExit(
            f"{root} has no python{pin.python} headers: the pin's Python "
            f"must be Debian {DEBIAN_SUITE}'s (build it on an arm runner)"
        )
    shutil.rmtree(inc, ignore_errors=True)
    shutil.copytree(source, inc)
    shutil.copy2(
        root / "usr/include/aarch64-linux-gnu" / f"python{pin.python}" / "pyconfig.h",
        inc / "pyconfig.h",
    )
    return inc


# --------------------------------------------------------------------------- build


def build_once(
    arch: str, pin: pinlib.Pin, out: Path, build_dir: Path, jobs: int, cross: dict[str, Path] | None
) -> Path:
    shutil.rmtree(build_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "SOURCE_DATE_EPOCH": source_date_epoch(),
        "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs),
        "PYTHONHASHSEED": "0",
    }
    config = [f"build-dir={build_dir}"]
    if cross:
        soabi = f"cpython-{pin.cp[2:]}-{TRIPLET['aarch64']}"
        env.update(
            {
                "_PYTHON_HOST_PLATFORM": "linux-aarch64",
                "SETUPTOOLS_EXT_SUFFIX": f".{soabi}.so",
                "MEGAMOE_CROSS_CUDA": str(cross["cuda"]),
                "MEGAMOE_CROSS_ROOT": str(cross["root"]),
                "CUDACXX": str(cross["cuda"] / "bin" / "nvcc"),
            }
        )
        config += [
            f"cmake.define.CMAKE_TOOLCHAIN_FILE={CI / 'aarch64-linux-gnu.cmake'}",
            f"cmake.define.Python_INCLUDE_DIR={cross['include']}",
            f"cmake.define.Python3_INCLUDE_DIR={cross['include']}",
            f"cmake.define.PYTHON_INCLUDE_DIR={cross['include']}",
        ]
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]
    for item in config:
        cmd += ["-C", item]
    run([*cmd, "-w", out, ROOT], env=env)
    made = sorted(set(out.glob("*.whl")) - before)
    if len(made) != 1:
        raise SystemExit(f"expected one new wheel in {out}, got {made}")
    wheel = made[0]
    tag = f"linux_{arch}"
    if not wheel.name.endswith(f"-{pin.cp}-{pin.cp}-{tag}.whl"):
        raise SystemExit(
            f"{wheel.name}: expected a {pin.cp} {tag} wheel (is this Python {pin.python}?)"
        )
    return wheel


def compare(a: Path, b: Path) -> list[str]:
    """Members whose bytes differ between two wheels (empty: identical)."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        names = sorted(set(za.namelist()) | set(zb.namelist()))
        diff = []
        for name in names:
            try:
                if za.read(name) != zb.read(name):
                    diff.append(name)
            except KeyError:
                diff.append(name + " (only in one)")
            else:
                ia, ib = za.getinfo(name), zb.getinfo(name)
                if (ia.date_time, ia.external_attr) != (ib.date_time, ib.external_attr):
                    diff.append(name + " (zip metadata)")
        return diff


def audit(wheel: Path, arch: str, reports: Path) -> tuple[Path, str]:
    """auditwheel show -> report; retag to the manylinux policy it names.

    Nothing needs grafting (cudart is static, libcuda is opened at run time), so the
    release wheel is the built one with its platform tag set to the policy: ``wheel
    tags`` (auditwheel repair only retags host-arch wheels, and would do no more here).
    """
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    report = shown.stdout
    (reports / f"auditwheel-{wheel.stem}.txt").write_text(report)
    log("auditwheel show:\n" + report)
    words = [w.strip('".,') for w in report.split()]
    policy = next((w for w in words if w.startswith("manylinux_")), None)
    if policy is None or not policy.endswith(arch):
        raise SystemExit(f"auditwheel found no manylinux policy for {wheel.name}")
    out = subprocess.run(
        [sys.executable, "-m", "wheel", "tags", "--remove", f"--platform-tag={policy}", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "SOURCE_DATE_EPOCH": source_date_epoch()},
    )
    final = wheel.parent / out.stdout.strip().splitlines()[-1]
    again = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(final)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    if f'"{policy}"' not in again:
        raise SystemExit(f"{final.name} is not consistent with {policy}:\n{again}")
    return final, policy


def smoke(wheel: Path, arch: str, cross: dict[str, Path] | None) -> None:
    if cross is None:
        run([sys.executable, str(ROOT / "tools" / "smoke_wheel.py"), wheel])
    else:
        run(
            [sys.executable, str(ROOT / "tools" / "smoke_wheel.py"), "--root", cross["root"], wheel]
        )


def build_arch(arch: str, pin: pinlib.Pin, args, reports: Path) -> dict:
    cache = Path(os.environ.get("MEGAMOE_CACHE", ROOT / "build" / "cache")).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    cross = None
    host = os.uname().machine
    if arch == "aarch64" and host == "x86_64":
        with step("aarch64 tools (apt, binfmt)"):
            setup_cross_tools(args.setup)
        with step("aarch64 root (debootstrap)"):
            root = arm_root(cache, args.setup)
        with step("aarch64 CUDA runtime (pip download)"):
            cuda = cross_cuda(cache, pin, nvcc_version(pin))
            include = python_headers(cache, root, pin)
        cross = {"root": root, "cuda": cuda, "include": include}
    elif arch != host:
        raise SystemExit(f"{arch} wheels are built on {arch} (or cross on x86_64), not {host}")

    # One build dir for every arch: device line info names its generated sources, so
    # equal paths keep the sm_90a cubins of the two arches byte-comparable.
    build_dir = ROOT / "build" / f"wheel-{pin.name}"
    for stale in args.out.glob(f"megamoe-*-{pin.cp}-*{arch}.whl"):
        stale.unlink()
    result: dict = {"arch": arch}
    with step(f"{arch} build"):
        wheel = build_once(arch, pin, args.out, build_dir, args.jobs, cross)
    result["wheel_sha256_first"] = sha256(wheel)
    keep = Path(tempfile.mkdtemp(prefix="megamoe-repro-"))
    try:
        if args.repro:
            first = keep / wheel.name
            shutil.move(wheel, first)
            with step(f"{arch} rebuild (reproducibility)"):
                wheel = build_once(arch, pin, args.out, build_dir, args.jobs, cross)
            diff = compare(first, wheel)
            same = sha256(first) == sha256(wheel)
            result["reproducible"] = same
            result["reproducibility_diff"] = diff
            log(
                f"reproducibility {arch}: {'bit-identical' if same else 'DIFFERENT'}"
                f" ({sha256(wheel)}){'' if same else ': ' + ', '.join(diff)}"
            )
            if not same:
                raise SystemExit(f"{arch}: two SOURCE_DATE_EPOCH builds differ: {diff}")
        if args.audit:
            with step(f"{arch} auditwheel"):
                wheel, policy = audit(wheel, arch, reports)
            result["policy"] = policy
            if args.repro:
                # The released file is the retagged one: retag the first build too.
                again, _ = audit(first, arch, keep)
                same = sha256(again) == sha256(wheel)
                result["reproducible_release_wheel"] = same
                if not same:
                    raise SystemExit(f"{arch}: the retagged wheels differ")
    finally:
        shutil.rmtree(keep, ignore_errors=True)
    if args.audit:  # a release build: it must name its commit
        result["build_info"] = check_build_info(wheel, expected_commit())
    with step(f"{arch} smoke import" + (" (qemu)" if cross else "")):
        smoke(wheel, arch, cross)
    with zipfile.ZipFile(wheel) as archive:
        module = next(n for n in archive.namelist() if n.startswith("megamoe/_C"))
        result["module"] = module
        result["module_sha256"] = hashlib.sha256(archive.read(module)).hexdigest()
    result["wheel"] = wheel.name
    result["wheel_sha256"] = sha256(wheel)
    result["wheel_bytes"] = wheel.stat().st_size
    return result


def cubin_hashes(wheel: Path) -> dict[str, dict[str, str]] | None:
    """sha256 of each sm_90a cubin in the module and of its SASS (None: no cuobjdump and
    nvdisasm here; the wheel session installs both from the build lock)."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility as find
    except ImportError:
        find = shutil.which
    cuobjdump, nvdisasm = find("cuobjdump"), find("nvdisasm")
    if not cuobjdump or not nvdisasm:
        log("no cuobjdump/nvdisasm: skipping the cross-arch SASS comparison")
        return None
    env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}:{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
        module = next(n for n in archive.namelist() if n.startswith("megamoe/_C"))
        path = Path(tmp) / Path(module).name
        path.write_bytes(archive.read(module))
        subprocess.run(
            [cuobjdump, "-xelf", "all", path.name], cwd=tmp, check=True, capture_output=True
        )
        found = {}
        for cubin in sorted(Path(tmp).glob("*.cubin")):
            sass = subprocess.run(
                [cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, env=env
            ).stdout
            found[cubin.name] = {
                "cubin": sha256(cubin),
                "sass": hashlib.sha256(sass).hexdigest(),
            }
        return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", default="host", help="pin name from ci/pins.toml, or host")
    parser.add_argument(
        "--arch", default="x86_64", help="x86_64, aarch64, or all (the pin's arches)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("MEGAMOE_JOBS", "2")),
        help="parallel compile jobs (nvcc needs ~3 GB each)",
    )
    parser.add_argument(
        "--repro",
        action="store_true",
        help="build twice from scratch and require bit-identical wheels",
    )
    parser.add_argument(
        "--audit",
        action="store_true",
        help="auditwheel show report + retag to the manylinux policy",
    )
    parser.add_argument(
        "--setup",
        action="store_true",
        help="aarch64: install apt tools, enable binfmt, debootstrap the root",
    )
    args = parser.parse_args()
    args.out = args.out.resolve()

    pin = pinlib.get(args.pin)
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != pin.python:
        raise SystemExit(f"pin {pin.name} needs Python {pin.python}; this is {have}")
    log(f"nvcc {nvcc_version(pin)} (pin CUDA {pin.cuda})")
    arches = list(pin.arches) if args.arch == "all" else args.arch.split(",")
    if not set(arches) <= set(pin.arches):
        raise SystemExit(f"pin {pin.name} builds {pin.arches}, not {arches}")
    reports = args.out / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = [build_arch(arch, pin, args, reports) for arch in arches]
    summary = {
        "pin": pin.name,
        "source_date_epoch": source_date_epoch(),
        "jobs": args.jobs,
        "wheels": results,
        "seconds": STEPS,
        "total_seconds": round(time.monotonic() - start, 1),
    }
    if len(results) == 2:
        # The device code should not depend on the host arch. SASS is compared: the
        # cubins' line tables name the CUDA headers' paths, which differ for the cross
        # tree, so their bytes may differ by those strings alone.
        hashes = [cubin_hashes(args.out / r["wheel"]) for r in results]
        if None not in hashes:
            sass = [{k: v["sass"] for k, v in h.items()} for h in hashes]
            raw = [{k: v["cubin"] for k, v in h.items()} for h in hashes]
            summary["sass_identical_across_arches"] = sass[0] == sass[1]
            summary["cubins_identical_across_arches"] = raw[0] == raw[1]
            summary["cubins"] = hashes
            same_sass = "identical" if sass[0] == sass[1] else "DIFFERENT"
            same_raw = "identical" if raw[0] == raw[1] else "differ (line tables)"
            log(f"sm_90a x86_64 vs aarch64: SASS {same_sass}, cubin bytes {same_raw}")
            if sass[0] != sass[1]:
                raise SystemExit("the sm_90a SASS differs between the x86_64 and aarch64 wheels")
    report = reports / f"build-{pin.name}-{'-'.join(arches)}.json"
    report.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"report: {report}")
    for r in results:
        log(
            f"{r['wheel']}  sha256={r['wheel_sha256'][:16]}…  "
            f"module sha256={r['module_sha256'][:16]}…"
            + (f"  reproducible={r['reproducible']}" if "reproducible" in r else "")
        )
    for name, seconds in STEPS.items():
        log(f"{seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
