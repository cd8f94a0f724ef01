"""tools/quack_peer.sh: the DSL library's two halves, carried in separate calls, join into
the same files on the machine; a bench without them stops with a clear message.

The halves here are a small stand-in archive made and split the way `prepare` makes the
real one (xz tarball, `split -n 2`); the oracle is the original file tree's bytes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "quack_peer.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("xz") is None, reason="needs bash and xz"
)


def run(
    root: Path, *args: str, site: Path, path: str = "/usr/bin:/bin", cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "tools" / "quack_peer.sh"), *args],
        env={"PATH": path, "QUACK_PEER_SITE": str(site)},
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )


# A stand-in `python3` for the bench step: `-m zipfile` is the real one, the import
# checks pass, and the engine bench writes the JSON it is given.
STUB_PYTHON = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = zipfile ]; then exec REAL "$@"; fi
if [ "$1" = -m ] && [ "$2" = megamoe.bench.engine ]; then
  while [ $# -gt 0 ]; do
    if [ "$1" = --json ]; then echo '{"stand-in": true}' > "$2"; fi
    shift
  done
  echo "engine bench ran"
fi
exit 0
"""


@pytest.fixture
def checkout(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A stand-in checkout with the script and a split archive of a small library tree."""
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "tools" / "quack_peer.sh")
    library = tmp_path / "library"
    files = {
        "nvidia_cutlass_dsl/__init__.py": b"# stand-in\n",
        "nvidia_cutlass_dsl/lib/libstandin.so": bytes(range(256)) * 513,
        "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": b"VERSION = '4.8.1'\n",
    }
    for name, data in files.items():
        (library / name).parent.mkdir(parents=True, exist_ok=True)
        (library / name).write_bytes(data)
    archive = tmp_path / "libs.tar.xz"
    subprocess.run(f"tar -cf - -C {library} . | xz -9 > {archive}", shell=True, check=True)
    subprocess.run(["split", "-n", "2", "-d", str(archive), str(tmp_path / "part.")], check=True)
    for half, part in ((1, "part.00"), (2, "part.01")):
        (root / ".quack" / f"half{half}").mkdir(parents=True)
        shutil.move(tmp_path / part, root / ".quack" / f"half{half}" / "libs.part")
    return root, files


def test_halves_join_across_calls(checkout: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    root, files = checkout
    site = tmp_path / "site"
    half2 = root / ".quack" / "half2"
    held = tmp_path / "held-half2"
    shutil.move(half2, held)  # call 1 carries half 1 only
    first = run(root, "carry", site=site)
    assert first.returncode == 0, first.stderr
    assert "half 1 kept" in first.stdout
    assert not (site / "packages").exists()

    shutil.move(root / ".quack" / "half1", tmp_path / "held-half1")  # call 2: half 2 only
    shutil.move(held, half2)
    second = run(root, "carry", site=site)
    assert second.returncode == 0, second.stderr
    assert "unpacked" in second.stdout
    for name, data in files.items():
        assert (site / "packages" / name).read_bytes() == data
    assert not (site / "parts").exists()


def test_bench_without_the_library_stops(
    checkout: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, _ = checkout
    result = run(root, "bench", str(tmp_path / "out"), site=tmp_path / "empty-site")
    assert result.returncode == 2
    assert "no DSL library" in result.stderr


@pytest.mark.parametrize("args", [(), ("unpack",)])
def test_usage(
    checkout: tuple[Path, dict[str, bytes]], tmp_path: Path, args: tuple[str, ...]
) -> None:
    root, _ = checkout
    result = run(root, *args, site=tmp_path / "site")
    assert result.returncode == 2
    assert "usage: tools/quack_peer.sh" in result.stderr


def test_bench_writes_into_a_relative_out_dir(
    checkout: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """The bench runs from /tmp; a relative OUT_DIR still means the caller's folder."""
    root, _ = checkout
    site = tmp_path / "site"
    (site / "packages" / "nvidia_cutlass_dsl").mkdir(parents=True)
    wheels = root / ".quack" / "wheels"
    wheels.mkdir()
    subprocess.run(
        ["python3", "-c", f"import zipfile; zipfile.ZipFile('{wheels / 'x.whl'}', 'w')"
         ".writestr('standin_pkg/__init__.py', '')"],
        check=True,
    )  # fmt: skip
    stub = tmp_path / "bin"
    stub.mkdir()
    real = shutil.which("python3")
    assert real is not None
    (stub / "python3").write_text(STUB_PYTHON.replace("REAL", real))
    (stub / "python3").chmod(0o755)
    caller = tmp_path / "caller"
    caller.mkdir()
    result = run(root, "bench", "out", site=site, path=f"{stub}:/usr/bin:/bin", cwd=caller)
    assert result.returncode == 0, result.stderr
    assert "engine bench ran" in (caller / "out" / "engine.log").read_text()
    assert (caller / "out" / "engine.json").read_text().strip() == '{"stand-in": true}'
    assert (site / "packages" / "standin_pkg" / "__init__.py").exists()


def test_refusals_name_what_is_missing(
    checkout: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, _ = checkout
    for half in ("half1", "half2"):
        shutil.rmtree(root / ".quack" / half)
    carried = run(root, "carry", site=tmp_path / "site")
    assert carried.returncode == 2
    assert "no half" in carried.stderr
    no_out = run(root, "bench", site=tmp_path / "site")
    assert no_out.returncode == 2
    assert "usage: tools/quack_peer.sh" in no_out.stderr
    site = tmp_path / "unpacked"
    (site / "packages" / "nvidia_cutlass_dsl").mkdir(parents=True)
    no_wheels = run(root, "bench", str(tmp_path / "out"), site=site)
    assert no_wheels.returncode == 2
    assert "no wheels" in no_wheels.stderr
