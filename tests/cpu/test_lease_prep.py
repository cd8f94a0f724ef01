"""tools/lease_prep.sh: the tarballs it makes hold exactly the named refs' trees.

A lease builds each tarball and compares them, so a tarball that held another ref's
files (or missed the working tree's change) would credit one tree's time to another.
The script runs in a scratch git repository of its own (it works in its own checkout's
root), with the wheel download left out (no network needed).
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "lease_prep.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "lease_prep.sh")
    (repo / "kernel.cuh").write_text("main\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "main")
    _git(repo, "checkout", "-q", "-b", "candidate/two-step")
    (repo / "kernel.cuh").write_text("two-step\n")
    (repo / "stage.h").write_text("stages\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "candidate")
    _git(repo, "checkout", "-q", "main")
    (repo / "kernel.cuh").write_text("uncommitted\n")
    return repo


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / "tools" / "lease_prep.sh"), "--no-wheels", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def _contents(tarball: Path) -> dict[str, str]:
    with tarfile.open(tarball) as tar:
        return {
            m.name: tar.extractfile(m).read().decode()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile() and not m.name.startswith("tools/")
        }


def test_each_ref_gets_its_own_tree(repo: Path, tmp_path: Path) -> None:
    ab = tmp_path / "ab"
    ab.mkdir()
    (ab / "stale.tar").write_bytes(b"")  # from an earlier lease: removed
    result = _run(repo, "--ab-dir", str(ab), "main", "candidate/two-step", "WORK")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in ab.iterdir()) == ["WORK.tar", "main.tar", "two-step.tar"]
    assert _contents(ab / "main.tar") == {"kernel.cuh": "main\n"}
    assert _contents(ab / "two-step.tar") == {"kernel.cuh": "two-step\n", "stage.h": "stages\n"}
    assert _contents(ab / "WORK.tar") == {"kernel.cuh": "uncommitted\n"}


def test_bad_refs_fail_loudly(repo: Path, tmp_path: Path) -> None:
    ab = tmp_path / "ab"
    missing = _run(repo, "--ab-dir", str(ab), "no-such-branch")
    assert missing.returncode == 2 and "not a commit: no-such-branch" in missing.stderr
    _git(repo, "branch", "other/main")
    clash = _run(repo, "--ab-dir", str(ab), "main", "other/main")
    assert clash.returncode == 2 and "two refs give the tarball name main.tar" in clash.stderr
    unknown = _run(repo, "--frobnicate")
    assert unknown.returncode == 2 and "unknown option --frobnicate" in unknown.stderr
