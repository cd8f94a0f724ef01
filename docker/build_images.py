#!/usr/bin/env python3
"""Build the build and test images for a pin, and run the CPU suite in the test image.

    python3 docker/build_images.py                      # local path: podman, here
    python3 docker/build_images.py --engine docker --base-image IMAGE@sha256:...  # CI

Steps (each timed into ``build/images/report-<pin>.json``):
1. Base image. ``--base-image`` (an NVIDIA CUDA devel image by digest, as in
   ci/pins.toml) is used as given. Without it (the local path: no registry access
   here) a Debian bookworm root is made with ``debootstrap --variant=minbase`` plus
   python3/venv/dev and g++, the CUDA toolkit is laid out in /usr/local/cuda from the
   hash-locked PyPI wheels (ci/locks/cuda-<X.Y>.txt) as a CUDA devel image has it,
   the root is imported with ``podman import``, pushed to a local registry
   (127.0.0.1:5000, Debian's docker-registry) and referenced **by digest**.
2. Wheelhouses: ``pip download --require-hashes`` of the pin's build and test locks.
3. ``Dockerfile.build`` from the staged context; then the wheel is built **inside** the
   build image (``nox --no-venv -s wheel``, bind-mounted source copy) unless
   ``--wheel`` gives one.
4. ``Dockerfile.test`` with the test wheelhouse + that wheel (hash pinned).
5. ``IMAGE`` (= ``nox -s cpu``) in the test image must pass; ``gpu_edge`` must skip
   cleanly without a GPU.

Local prerequisites (``--setup`` installs them, as root): podman, buildah, runc,
debootstrap, docker-registry from Debian; podman runs with docker/containers.conf.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "ci"))
import lock as locklib  # noqa: E402
import pins as pinlib  # noqa: E402

DOCKER = ROOT / "docker"
REGISTRY = "127.0.0.1:5000"
DEBIAN_MIRROR = os.environ.get("MEGAMOE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,python3-dev,g++,ca-certificates"
APT = ["podman", "buildah", "runc", "debootstrap", "docker-registry", "uidmap"]
STEPS: dict[str, float] = {}


def log(message: str) -> None:
    print(f"[build_images] {message}", flush=True)


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


class step:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        log(f"== {self.name}")
        self.start = time.monotonic()

    def __exit__(self, *exc):
        STEPS[self.name] = round(time.monotonic() - self.start, 1)
        log(f"   {self.name}: {STEPS[self.name]} s")


def engine_env(engine: str) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "podman":
        env.setdefault("CONTAINERS_CONF", str(DOCKER / "containers.conf"))
    return env


def setup(install: bool, engine: str) -> None:
    need = [engine] + (["debootstrap", "docker-registry"] if engine == "podman" else [])
    missing = [t for t in need if not shutil.which(t)]
    if missing and install:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT], env=env)
        missing = [t for t in need if not shutil.which(t)]
    if missing:
        raise SystemExit(
            f"missing {missing}: apt-get install {' '.join(APT)}, or let this script do it "
            "as root with --setup (python3 -m nox -s images -- --setup)"
        )


# --------------------------------------------------------------------------- local base


STARTED: list[subprocess.Popen] = []


def registry_up(cache: Path) -> None:
    """Debian's docker-registry on 127.0.0.1:5000 (started here if not listening; it is
    stopped again when this script ends)."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 5000)) == 0:
            return
    config = cache / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "storage:\n"
        f"  filesystem:\n    rootdirectory: {cache / 'registry'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {REGISTRY}\n"
    )
    logfile = (cache / "registry.log").open("ab")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    STARTED.append(proc)
    for _ in range(50):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", 5000)) == 0:
                log(f"registry on {REGISTRY} (pid {proc.pid})")
                return
        time.sleep(0.2)
    raise SystemExit(f"docker-registry did not start; see {cache / 'registry.log'}")


def local_base(pin: pinlib.Pin, cache: Path, engine: str) -> str:
    """debootstrap + CUDA toolkit -> podman import -> local registry; IMAGE@sha256.

    The result is keyed by what goes in (Debian suite, packages, the toolkit lock):
    an unchanged key reuses the pushed image and its digest, so the images' layer
    cache stays valid between runs.
    """
    lock = ROOT / "ci" / "locks" / f"cuda-{pin.cuda}.txt"
    key = hashlib.sha256(
        f"bookworm {BASE_PACKAGES} {os.uname().machine}\n{lock.read_text()}".encode()
    ).hexdigest()[:16]
    env = engine_env(engine)
    tag = f"localhost/megamoe-base:cu{pin.cuda.replace('.', '')}-bookworm-{key}"
    remember = cache / f"base-{key}.digest"
    exists = subprocess.run([engine, "image", "exists", tag], env=env).returncode == 0
    if remember.exists() and exists:
        registry_up(cache)
        log(f"base image {tag} is current (key {key})")
        return f"{REGISTRY}/megamoe/base@{remember.read_text().strip()}"
    root = cache / "amd64-bookworm-base"
    stamp = root / ".megamoe-complete"
    if not stamp.exists():
        shutil.rmtree(root, ignore_errors=True)
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                "bookworm",
                root,
                DEBIAN_MIRROR,
            ],
            stdout=subprocess.DEVNULL,
        )
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (root / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)
        stamp.write_text("debootstrap done\n")
    # The toolkit is laid out afresh each time (seconds): the lock decides it.
    for old in (root / "usr" / "local").glob("cuda*"):
        if old.is_symlink() or old.is_file():
            old.unlink()
        else:
            shutil.rmtree(old)
    arch = os.uname().machine
    locklib.install_cuda(root, pin, arch, cache / f"cuda-{pin.cuda}-{arch}-wheels")
    path = "/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    tar = subprocess.Popen(
        ["tar", "-C", str(root), "--exclude=./.megamoe-complete", "--numeric-owner", "-c", "."],
        stdout=subprocess.PIPE,
    )
    run(
        [
            engine,
            "import",
            "--change",
            f"ENV PATH={path}",
            "--change",
            "ENV CUDA_HOME=/usr/local/cuda",
            "-",
            tag,
        ],
        stdin=tar.stdout,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    if tar.wait() != 0:
        raise SystemExit("tar of the base root failed")
    registry_up(cache)
    remote = f"{REGISTRY}/megamoe/base:cu{pin.cuda.replace('.', '')}-bookworm"
    with tempfile.TemporaryDirectory() as tmp:
        digestfile = Path(tmp) / "digest"
        run(
            [
                engine,
                "push",
                "--tls-verify=false",
                "--digestfile",
                digestfile,
                tag,
                f"docker://{remote}",
            ],
            env=env,
        )
        digest = digestfile.read_text().strip()
    remember.write_text(digest + "\n")
    return f"{REGISTRY}/megamoe/base@{digest}"


# --------------------------------------------------------------------------- contexts


def stage(context: Path, lock: Path, pin: pinlib.Pin, wheel: Path | None, src: bool) -> None:
    shutil.rmtree(context, ignore_errors=True)
    (context / "docker").mkdir(parents=True)
    shutil.copy2(DOCKER / "install_python.sh", context / "docker")
    house = context / "wheelhouse"
    locklib.fetch(lock, pin, os.uname().machine, house)
    requirements = lock.read_text()
    if wheel is not None:
        shutil.copy2(wheel, house)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        parts = wheel.name.split("-")
        if len(parts) != 5 or parts[0] != "megamoe":
            raise SystemExit(f"{wheel.name} is not a megamoe wheel file name")
        version = parts[1]
        requirements += f"megamoe=={version} \\\n    --hash=sha256:{digest}\n"
    (house / "requirements.txt").write_text(requirements)
    if src:
        # The suites read repo files (the registry, the generator): the whole tracked
        # source goes in (a few hundred KB); `import megamoe` still finds the wheel,
        # since the sessions run pytest from a temp dir.
        source_copy(context / "src")


def source_copy(dest: Path) -> None:
    """The working tree as git sees it (tracked + untracked, not ignored)."""
    shutil.rmtree(dest, ignore_errors=True)
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def source_commit() -> str:
    """HEAD's commit, with ``-dirty`` when tracked files differ from it (what the
    wheel's ``megamoe._build_info`` records); empty outside a git checkout."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode != 0:
        return ""
    clean = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--"]).returncode
    return head.stdout.strip() + ("" if clean == 0 else "-dirty")


def source_date_epoch() -> str:
    """HEAD's commit time (what ``ci/build_wheels.py`` takes from git where it has it);
    SOURCE_DATE_EPOCH wins when set."""
    if value := os.environ.get("SOURCE_DATE_EPOCH"):
        return value
    out = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit("no SOURCE_DATE_EPOCH and no git history: the wheel needs a timestamp")
    return out.stdout.strip()


def image_size(engine: str, image: str) -> int:
    out = run(
        [engine, "image", "inspect", "--format", "{{.Size}}", image],
        env=engine_env(engine),
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip())


def main() -> int:
    try:
        return build()
    finally:
        for proc in STARTED:
            proc.terminate()
            proc.wait(timeout=30)


def build() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", default="host")
    parser.add_argument("--engine", default="podman", choices=["podman", "docker"])
    parser.add_argument("--base-image", help="IMAGE@sha256:... (default: the local base)")
    parser.add_argument(
        "--torch",
        default="cpu",
        choices=["cpu", "cuda"],
        help="test lock: <pin>-test.txt (cpu) or <pin>-test-cuda.txt",
    )
    parser.add_argument("--wheel", type=Path, help="use this wheel, don't build one")
    parser.add_argument("--setup", action="store_true", help="apt-get the tools (root)")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()

    pin = pinlib.get(args.pin)
    work = ROOT / "build" / "images"
    cache = Path(os.environ.get("MEGAMOE_CACHE", ROOT / "build" / "cache")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env = engine_env(args.engine)
    build_tag = f"localhost/megamoe-build:{pin.name}"
    test_tag = f"localhost/megamoe-test:{pin.name}"
    tls = ["--tls-verify=false"] if args.engine == "podman" else []
    start = time.monotonic()

    with step("tools"):
        setup(args.setup, args.engine)
    with step("base image (debootstrap + CUDA wheels + registry)"):
        base = args.base_image or local_base(pin, cache, args.engine)
    log(f"BASE_IMAGE={base}")
    build_args = [
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"PYTHON_VERSION={pin.python}",
        "--build-arg",
        f"PIN={pin.name}",
    ]

    with step("build image"):
        context = work / "context-build"
        stage(context, ROOT / "ci" / "locks" / f"{pin.name}-build.txt", pin, None, src=False)
        run(
            [
                args.engine,
                "build",
                *tls,
                *build_args,
                "-f",
                DOCKER / "Dockerfile.build",
                "-t",
                build_tag,
                context,
            ],
            env=env,
        )

    wheel = args.wheel.resolve() if args.wheel else None
    if wheel is None:
        with step("wheel built in the build image"):
            src = work / "src"
            source_copy(src)
            run(
                [
                    args.engine,
                    "run",
                    "--rm",
                    # The copy has no .git: CMake embeds the commit from here instead,
                    # and the wheels' timestamps come from the commit's time.
                    "-e",
                    f"MEGAMOE_COMMIT={source_commit()}",
                    "-e",
                    f"SOURCE_DATE_EPOCH={source_date_epoch()}",
                    "-v",
                    f"{src}:/src",
                    build_tag,
                    "wheel",
                    "--",
                    "--arch",
                    os.uname().machine,
                    "--audit",
                ],
                env=env,
            )
            wheels = sorted((src / "dist").glob(f"megamoe-*-{pin.cp}-*{os.uname().machine}.whl"))
            if len(wheels) != 1:
                raise SystemExit(f"the build image made {wheels}")
            wheel = work / wheels[0].name
            shutil.copy2(wheels[0], wheel)

    with step("test image"):
        context = work / "context-test"
        suffix = "" if args.torch == "cpu" else "-cuda"
        lock = ROOT / "ci" / "locks" / f"{pin.name}-test{suffix}.txt"
        stage(context, lock, pin, wheel, src=True)
        run(
            [
                args.engine,
                "build",
                *tls,
                *build_args,
                "-f",
                DOCKER / "Dockerfile.test",
                "-t",
                test_tag,
                context,
            ],
            env=env,
        )

    results = {}
    if not args.skip_tests:
        with step("test image: default entrypoint (nox -s cpu)"):
            run([args.engine, "run", "--rm", test_tag], env=env)
        results["cpu"] = "passed"
        with step("test image: gpu_edge without a GPU (must skip)"):
            out = run(
                [args.engine, "run", "--rm", test_tag, "gpu_edge"],
                env=env,
                capture_output=True,
                text=True,
            )
            print(out.stdout[-2000:], out.stderr[-2000:])
            if "skip" not in (out.stdout + out.stderr).lower():
                raise SystemExit("gpu_edge did not skip without a GPU")
        results["gpu_edge"] = "skipped (no GPU)"

    report = {
        "pin": pin.name,
        "engine": args.engine,
        "base_image": base,
        "wheel": wheel.name,
        "images": {
            build_tag: image_size(args.engine, build_tag),
            test_tag: image_size(args.engine, test_tag),
        },
        "suites": results,
        "seconds": STEPS,
        "total_seconds": round(time.monotonic() - start, 1),
    }
    out = work / f"report-{pin.name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"report: {out}")
    for image, size in report["images"].items():
        log(f"{size / 2**30:7.2f} GiB  {image}")
    for name, seconds in STEPS.items():
        log(f"{seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
