"""tools/tma_stream_probe.cu: every configuration's walk loads each box of its matrix once.

The probe's bandwidth figures divide the matrix's bytes by the time, so a walk that
loaded some boxes twice and others never would misstate them. `--check-walk` runs the
kernel's own walk for every configuration and three grid sizes on the host.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tools" / "tma_stream_probe.cu"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    binary = tmp_path_factory.mktemp("probe") / "tma_stream_probe"
    subprocess.run(
        [
            nvcc,
            "-std=c++17",
            "-O2",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-cudart",
            "static",
            str(PROBE),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def test_every_walk_loads_each_box_once(probe: Path) -> None:
    result = subprocess.run(
        [str(probe), "--check-walk"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("walks ok: "), result.stdout
    configurations = int(result.stdout.split()[2])
    assert configurations >= 20


def test_a_bad_argument_is_refused(probe: Path) -> None:
    result = subprocess.run(
        [str(probe), "--stages", "6"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr
