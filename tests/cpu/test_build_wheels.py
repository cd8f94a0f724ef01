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


def test_a_dirty_commit_is_embedded_as_the_commit_and_the_flag(tmp_path):
    """``nox -s images`` passes a changed tree's commit as ``<sha>-dirty``: CMake now
    embeds ``<sha>`` with ``DIRTY = True`` (it embedded the string as given, which this
    check could not read, so every such build stopped), and the check holds the wheel to
    both (a review)."""
    head = "0123456789abcdef0123456789abcdef01234567"
    found = build_wheels.check_build_info(_wheel(tmp_path, head, dirty=True), f"{head}-dirty")
    assert found == {"commit": head, "dirty": True}
    with pytest.raises(SystemExit, match="-dirty but embeds DIRTY = False"):
        build_wheels.check_build_info(_wheel(tmp_path, head), f"{head}-dirty")
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert 'if(MEGAMOE_COMMIT MATCHES "^([0-9a-f]+)-dirty$")' in cmake


def test_the_wheel_is_compiled_by_the_pins_cuda(monkeypatch, tmp_path):
    """Another toolkit than the pin's CUDA X.Y compiles other SASS: the build stops."""
    import pins

    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(fake))
    with pytest.raises(SystemExit, match=r"compiles with CUDA 13\.0; .* is 12\.8"):
        build_wheels.nvcc_version(pins.ci_host())
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    assert build_wheels.nvcc_version(pins.ci_host()) == "13.0.88"


def test_the_wheel_build_requires_the_locked_nvcc_release(monkeypatch, tmp_path) -> None:
    """Another nvcc of the pin's CUDA X.Y may make other SASS: the build names the
    toolkit lock's nvcc release (a review: only X.Y was compared)."""
    import stat

    host = build_wheels.pinlib.ci_host()
    locked = build_wheels.locked_nvcc(host)
    assert locked is not None and locked.startswith(host.cuda + ".")
    fake = tmp_path / "nvcc"
    for release, ok in ((locked, True), (host.cuda + ".1", False)):
        fake.write_text(
            f"#!/bin/sh\necho 'Cuda compilation tools, release {host.cuda}, V{release}'\n"
        )
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("CUDACXX", str(fake))
        if ok:
            assert build_wheels.nvcc_version(host) == locked
        else:
            with pytest.raises(SystemExit, match=rf"compiles with nvcc {locked}"):
                build_wheels.nvcc_version(host)
