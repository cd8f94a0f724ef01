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
#: Paths that leave the repository: the shared folder beside it, or this machine's.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/(work|root)/")
#: Placeholders, globs and build outputs that name no tracked file.
NOT_A_PATH = re.compile(r"[*<>{}$]|^build/|^dist/|^\.nox/")


#: Folders of build outputs and caches, skipped where the tree is walked.
NOT_SOURCE = {".git", ".nox", "build", "dist", "__pycache__", ".pytest_cache", ".whl"}


def tracked_files() -> list[Path]:
    """The repo's files: git's list in a checkout; else (the test image holds a copy of
    the tracked files, without .git) every file of the tree but build outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return [
            path
            for path in ROOT.rglob("*")
            if path.is_file() and not NOT_SOURCE & set(path.relative_to(ROOT).parts)
        ]
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


def broken_references(doc: Path, root: Path = ROOT) -> list[str]:
    """The links and backticked repo paths of markdown file ``doc`` that name nothing
    inside ``root``."""
    text = doc.read_text()
    broken = []
    for target in MARKDOWN_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists() or not path.is_relative_to(root.resolve()):
            broken.append(f"link ({target})")
    for token in BACKTICKED.findall(text):
        path = repo_path(token)
        if path is not None and not (root / path).exists():
            broken.append(f"`{token}`")
    return broken


def unresolved_citations(text: str, root: Path = ROOT) -> list[str]:
    """Docs that ``text`` cites (``docs/X.md``, or ``X.md`` alone: docs/ or the top
    level) and that are not in ``root``, and paths in it that leave the repository."""
    found = [c for c in sorted(set(DOC_CITATION.findall(text))) if not (root / c).exists()]
    found += [
        name
        for name in sorted(set(DOC_NAME.findall(text)))
        if not ((root / "docs" / name).exists() or (root / name).exists())
    ]
    found += [f"outside: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    return found


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.name)
def test_every_link_and_backticked_path_resolves(doc: Path) -> None:
    assert doc.exists(), doc
    assert broken_references(doc) == []


def test_cited_docs_exist_and_nothing_points_outside_the_repo() -> None:
    found = []
    for path in tracked_files():
        if path.suffix in {".png", ".whl", ".gz", ".json"} or not path.is_file():
            continue
        if path == Path(__file__):  # its own patterns and examples
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {c}" for c in unresolved_citations(text)]
    assert found == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "here.cuh").write_text("")
    (tmp_path / "docs" / "KEPT.md").write_text("")
    doc = tmp_path / "docs" / "x.md"
    doc.write_text(
        "[ok](https://example.org) [here](#part) [gone](missing.md) [kept](KEPT.md)\n"
        "[up](../../outside.md) `kernels/here.cuh` `kernels/missing.cuh:12` "
        "`kernels/here.cuh::test_x` `build/variants/` `a/b` `<pin>/x`\n"
    )
    (tmp_path.parent / "outside.md").write_text("")
    assert broken_references(doc, root=tmp_path) == [
        "link (missing.md)",
        "link (../../outside.md)",
        "`kernels/missing.cuh:12`",
    ]
    text = "see docs/KEPT.md, KEPT.md, docs/GONE.md, GONE.md, ../shared/X and /work/y"
    assert unresolved_citations(text, root=tmp_path) == [
        "docs/GONE.md",
        "GONE.md",
        "outside: ../shared",
        "outside: /work/",
    ]
