"""``nox -s production -- <parts>``: the part names select what runs and never reach
pytest as paths (noxfile.py). The session function runs against a recording session
(no GPU and no installs needed); where nox itself is not installed, a stand-in for its
decorator lets noxfile.py import."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_noxfile() -> types.ModuleType:
    if importlib.util.find_spec("nox") is None:
        stub = types.ModuleType("nox")
        stub.session = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)
        stub.Session = object
        stub.options = types.SimpleNamespace()
        sys.modules.setdefault("nox", stub)
    spec = importlib.util.spec_from_file_location("megamoe_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingSession:
    """What production() calls on a nox session, recorded; a GPU count of one."""

    venv_backend = "none"

    def __init__(self, posargs: list[str], tmp: Path) -> None:
        self.posargs = posargs
        self.runs: list[tuple[str, ...]] = []
        self._tmp = tmp

    def run(self, *args: str, silent: bool = False) -> str:
        self.runs.append(args)
        code = args[-1] if len(args) > 2 and args[1] == "-c" else ""
        if "device_count" in code:
            return "1\n"
        if "is_available" in code or "find_spec" in code:
            return "1\n"
        return "table\n"

    def chdir(self, path: Path) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def create_tmp(self) -> str:
        return str(self._tmp)

    def log(self, *args: object) -> None:
        pass

    def warn(self, *args: object) -> None:
        pass

    def skip(self, reason: str) -> None:
        raise AssertionError(f"skipped: {reason}")

    def error(self, reason: str) -> None:
        raise ValueError(reason)


@pytest.fixture(scope="module")
def noxfile() -> types.ModuleType:
    return _load_noxfile()


def _pytest_runs(session: RecordingSession) -> list[tuple[str, ...]]:
    return [r for r in session.runs if r[:3] == ("python", "-m", "pytest")]


def _bench_runs(session: RecordingSession) -> list[tuple[str, ...]]:
    return [r for r in session.runs if r[:3] == ("python", "-m", "megamoe.bench")]


def test_the_oracle_part_runs_the_production_tests_without_the_part_name(noxfile, tmp_path):
    session = RecordingSession(["oracle"], tmp_path)
    noxfile.production(session)
    (pytest_run,) = _pytest_runs(session)
    assert pytest_run[-1] == str(ROOT / "tests" / "production")
    assert "oracle" not in pytest_run
    assert _bench_runs(session) == []


def test_the_timing_and_sweep_parts_run_only_the_bench(noxfile, tmp_path):
    session = RecordingSession(["timing", "sweep"], tmp_path)
    noxfile.production(session)
    assert _pytest_runs(session) == []
    benches = _bench_runs(session)
    assert len(benches) == 2
    assert any("side-lora,ordinary" in run for run in benches)
    assert any("128,512,2048,8192,65536" in run for run in benches)


def test_an_unknown_part_is_an_error_naming_it(noxfile, tmp_path):
    with pytest.raises(ValueError, match="orcale"):
        noxfile.production(RecordingSession(["orcale"], tmp_path))


def test_the_cpu_torch_wheel_is_installed_alone_from_its_index(noxfile, tmp_path):
    """The CPU torch step named only the torch requirement in intention, but it carried
    the earlier kinds' locks along: every build package was looked up on the torch
    index too (a review found it in CI's process list)."""
    installs: list[tuple[str, ...]] = []

    class Installing(RecordingSession):
        venv_backend = "virtualenv"

        def install(self, *args: str) -> None:
            installs.append(args)

    noxfile._install_locked(Installing([], tmp_path), "build", "test")
    torch_step, locks = installs
    assert torch_step.count("-r") == 1 and torch_step[-1].endswith("torch-cpu.txt")
    assert "--no-deps" in torch_step
    assert [a for a in locks if a.endswith(".txt")] == [
        str(noxfile.lock_file("build")),
        str(noxfile.lock_file("test")),
    ]
