"""The sanitizer wrapper catches planted errors (and only those).

planted_errors.cu holds one deliberately broken kernel per tool; this test compiles
it with nvcc and runs each mode under its tool through megamoe.testing.sanitizer: the
run must find errors (and exit with the tool's ``--error-exitcode``, where the tool is
given one), and the per-kernel summary must name the planted kernel and the error kind.
The ``clean`` mode must pass every tool.

GPU-only. It starts compute-sanitizer itself, so it skips when it is already running
under one (``python -m megamoe.testing.sanitizer`` over tests/sanitizer): run it with
plain pytest, as ``nox -s sanitizer`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe.testing import sanitizer

pytestmark = pytest.mark.gpu

SOURCE = Path(__file__).with_name("planted_errors.cu")
# mode -> (tool, planted kernel, error kind the summary must show)
PLANTED = {
    "oob": ("memcheck", "planted_out_of_bounds_write", "Invalid __global__ write"),
    "race": ("racecheck", "planted_shared_race", "Race reported between"),
    "uninit": ("initcheck", "planted_uninitialized_read", "Uninitialized __global__ memory read"),
    "barrier": ("synccheck", "planted_divergent_barrier", "Barrier error"),
}
TIMEOUT_S = 300  # a hung barrier must fail the test, not the session


def find_nvcc() -> str | None:
    """nvcc from cuda.pathfinder, PATH or /usr/local/cuda/bin."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvcc")
    except Exception:  # no cuda-python: look on PATH and in the default toolkit
        found = None
    default = Path("/usr/local/cuda/bin/nvcc")
    return found or shutil.which("nvcc") or (str(default) if default.is_file() else None)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planted-errors executable, built for this GPU's sm_90."""
    if os.environ.get(sanitizer.UNDER_SANITIZER_ENV):
        pytest.skip("already under compute-sanitizer: run this file with plain pytest")
    if sanitizer.find_compute_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    exe = tmp_path_factory.mktemp("planted") / "planted_errors"
    # -lineinfo: the reports then carry file:line, which the test checks.
    subprocess.run(
        [nvcc, "-arch=sm_90", "-lineinfo", "-o", str(exe), str(SOURCE)],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe


@pytest.mark.parametrize("mode", list(PLANTED))
def test_planted_error_is_reported(planted: Path, mode: str, tmp_path: Path) -> None:
    tool, kernel, kind = PLANTED[mode]
    result = sanitizer.run(
        tool, [str(planted), mode], log_file=tmp_path / f"{tool}.log", timeout=TIMEOUT_S
    )
    summary = result.report.summary()
    assert not result.timed_out
    assert result.report.errors >= 1, result.report.format_summary()
    # racecheck keeps the target's exit status (it leaves other libraries' records out,
    # sanitizer.OWN_KERNELS_ONLY); the other tools exit with their own.
    own_only = tool in sanitizer.OWN_KERNELS_ONLY
    assert result.returncode == (0 if own_only else sanitizer.ERROR_EXITCODES[tool])
    assert result.found_errors and not result.clean
    # The kernels live in an anonymous namespace: match the name inside the key.
    names = [k for k in summary if kernel in k]
    assert len(names) == 1, result.report.format_summary()
    name = names[0]
    assert any(k.startswith(kind) for k in summary[name]), summary[name]
    finding = next(f for f in result.report.findings if f.kernel == name)
    assert finding.location and finding.location.split(":")[0].endswith("planted_errors.cu")


@pytest.mark.parametrize("tool", sanitizer.TOOLS)
def test_clean_kernel_passes_every_tool(planted: Path, tool: str, tmp_path: Path) -> None:
    result = sanitizer.run(
        tool, [str(planted), "clean"], log_file=tmp_path / f"{tool}.log", timeout=TIMEOUT_S
    )
    assert result.clean, (result.returncode, result.report.format_summary())
    assert result.report.summary() == {}
