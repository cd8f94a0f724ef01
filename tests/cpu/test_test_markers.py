"""The test suite's own markers (tests/conftest.py): graph captures skip where torch's
caching allocator is off, as the sanitizer runs set it, and every capture is marked."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

_CAPTURE_TEST = """
import pytest

@pytest.mark.cuda_graph
def test_captures():
    pass

def test_plain():
    pass
"""


def _run_pytest(tmp_path: Path, caching_off: str | None) -> str:
    (tmp_path / "test_capture.py").write_text(_CAPTURE_TEST)
    # The project's conftest beside the file, so that its hooks and markers apply.
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NO_CUDA_MEMORY_CACHING"}
    if caching_off is not None:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = caching_off
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_captures_skip_with_the_caching_allocator_off(tmp_path):
    out = _run_pytest(tmp_path, "1")
    assert "1 passed, 1 skipped" in out
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING is set" in out


def test_captures_run_with_the_caching_allocator_on(tmp_path):
    for value in (None, "0"):
        assert "2 passed" in _run_pytest(tmp_path, value)


def _marked(decorators: list[ast.expr]) -> bool:
    return any("cuda_graph" in ast.unparse(d) for d in decorators)


def test_every_graph_capture_in_the_gpu_tests_is_marked():
    """A capture that is not marked fails under the sanitizer runs instead of skipping."""
    unmarked = []
    for path in sorted((TESTS / "gpu").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and "cuda_graph" in ast.unparse(node.value)
            for node in tree.body
        )
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            source = ast.unparse(node)
            captures = "CUDAGraph(" in source or "cuda.graph(" in source
            if captures and not (module_marked or _marked(node.decorator_list)):
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"graph captures without @pytest.mark.cuda_graph: {unmarked}"
