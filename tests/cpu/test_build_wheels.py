"""ci/build_wheels.py's release checks that need no build: the commit a wheel embeds and
the build's timestamp (a review found both fell back silently: a wheel from a source
copy without .git named no commit and carried a made-up timestamp)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import build_wheels  # noqa: E402


def _wheel(tmp_path: Path, commit: str, dirty: bool = False) -> Path:
    path = tmp_path / "megamoe-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        info = f'"""Written by CMakeLists.txt."""\n\nCOMMIT = "{commit}"\nDIRTY = {dirty}\n'
        archive.writestr("megamoe/_build_info.py", info)
    return path


def test_a_release_wheel_must_embed_the_commit_it_was_built_from(tmp_path):
    head = "0123456789abcdef0123456789abcdef01234567"
    assert build_wheels.check_build_info(_wheel(tmp_path, head), head) == {
        "commit": head,
        "dirty": False,
    }
    with pytest.raises(SystemExit, match="embeds commit '', expected"):
        build_wheels.check_build_info(_wheel(tmp_path, ""), head)
    with pytest.raises(SystemExit, match="embeds commit 'ffff'"):
        build_wheels.check_build_info(_wheel(tmp_path, "ffff"), head)


def test_without_git_or_the_variables_the_build_stops(monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    monkeypatch.delenv("MEGAMOE_COMMIT", raising=False)
    monkeypatch.setattr(build_wheels, "_git", lambda *args: None)
    with pytest.raises(SystemExit, match="no SOURCE_DATE_EPOCH and no git history"):
        build_wheels.source_date_epoch()
    with pytest.raises(SystemExit, match="no MEGAMOE_COMMIT"):
        build_wheels.expected_commit()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764900000")
    monkeypatch.setenv("MEGAMOE_COMMIT", "abc")
    assert build_wheels.source_date_epoch() == "1764900000"
    assert build_wheels.expected_commit() == "abc"
