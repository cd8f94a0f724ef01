"""The repo stands on its own: every file the docs and the code point to is in it.

Checked in README.md and docs/*.md: relative markdown links (to a file or folder, an
anchor stripped) and backticked repo paths (`kernels/engine/pipeline.cuh`,
`tests/cpu/test_x.py::test_y`). Checked in every tracked text file: citations of a
`docs/*.md` file or of a doc by its name alone (`ENGINE.md`), and no path that leaves
the repository (`../shared/...`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_DIRS = ("python", "kernels", "bindings", "tests", "tools", "ci", "docs", "docker", ".ci")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\s]+)`")
DOC_CITATION = re.compile(r"\bdocs/[A-Za-z0-9_-]+\.md\b")
#: A doc named without its folder ("see ENGINE.md"): one of docs/ or the top level.
DOC_NAME = re.compile(r"\b[A-Z][A-Z0-9_-]+\.md\b")
OUTSIDE = re.compile(r"\.\./shared\b")
#: Placeholders, globs and build outputs that name no tracked file.
NOT_A_PATH = re.compile(r"[*<>{}$]|^build/|^dist/|^\.nox/")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    return [ROOT / line for line in out.splitlines() if line]


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def repo_path(token: str) -> str | None:
    """The repo-relative path a backticked token names, or None if it names none."""
    path = token.split("::")[0].rstrip(".,:;)")
    path = re.sub(r":\d+(-\d+)?$", "", path)  # file:line
    if NOT_A_PATH.search(path) or "/" not in path:
        return None
    if not path.startswith(tuple(d + "/" for d in TOP_DIRS)):
        return None
    return path


def broken_references(doc: Path) -> list[str]:
    text = doc.read_text()
    broken = []
    for target in MARKDOWN_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(f"link ({target})")
    for token in BACKTICKED.findall(text):
        path = repo_path(token)
        if path is not None and not (ROOT / path).exists():
            broken.append(f"`{token}`")
    return broken


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.name)
def test_every_link_and_backticked_path_resolves(doc: Path) -> None:
    assert doc.exists(), doc
    assert broken_references(doc) == []


def test_cited_docs_exist_and_nothing_points_outside_the_repo() -> None:
    missing, outside = [], []
    for path in tracked_files():
        if path.suffix in {".png", ".whl", ".gz", ".json"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT)
        for cited in set(DOC_CITATION.findall(text)):
            if not (ROOT / cited).exists():
                missing.append(f"{rel}: {cited}")
        for name in set(DOC_NAME.findall(text)):
            if not ((ROOT / "docs" / name).exists() or (ROOT / name).exists()):
                missing.append(f"{rel}: {name}")
        if rel != Path(__file__).relative_to(ROOT) and OUTSIDE.search(text):
            outside.append(str(rel))
    assert missing == []
    assert outside == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "[ok](https://example.org) [here](#part) [gone](missing.md)\n"
        "`kernels/engine/pipeline.cuh` `kernels/engine/missing.cuh:12` "
        "`tests/cpu/test_docs_references.py::test_x` `build/variants/` `a/b` `<pin>/x`\n"
    )
    assert broken_references(doc) == ["link (missing.md)", "`kernels/engine/missing.cuh:12`"]
