"""Fixtures of the CPU tests that run device code on the host (tests/cpu/host/)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Random words after the 256 equal-byte ones (tests/cpu/host/mxfp4_test_words.h).
MXFP4_RANDOM_WORDS = 1024


@pytest.fixture(scope="session")
def mxfp4_words() -> np.ndarray:
    """The drivers' word list, as tests/cpu/host/mxfp4_test_words.h builds it (uint64)."""
    words = [byte * 0x01010101 for byte in range(256)]
    state = 12345
    for _ in range(MXFP4_RANDOM_WORDS):
        state = (state * 1664525 + 1013904223) & 0xFFFFFFFF
        words.append(state)
    return np.array(words, dtype=np.uint64)


@pytest.fixture(scope="session")
def run_host_driver(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``run(name)``: build tests/cpu/host/<name>.cu with nvcc (kernels/ on the include
    path), run it with an output path and return that path; skips without nvcc."""

    def run(name: str) -> Path:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            pytest.skip("nvcc is not on PATH")
        build = tmp_path_factory.mktemp(name)
        binary, out = build / name, build / f"{name}.bin"
        driver = ROOT / "tests" / "cpu" / "host" / f"{name}.cu"
        subprocess.run(
            [
                nvcc,
                "-std=c++17",
                "-O2",
                "-I",
                str(ROOT / "kernels"),
                str(driver),
                "-o",
                str(binary),
            ],
            check=True,
        )
        subprocess.run([str(binary), str(out)], check=True)
        return out

    return run
