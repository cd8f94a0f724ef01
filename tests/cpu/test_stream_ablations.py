"""tools/stream_ablations.py: every ablation's edits still find their text in the
checkout's kernels (a kernel change that moves the text fails here, not on a lent GPU),
each edit changes what it names, and a build's tar holds the tree with those files edited."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_PATH = _ROOT / "tools" / "stream_ablations.py"
_SPEC = importlib.util.spec_from_file_location("stream_ablations", _PATH)
stream_ablations = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = stream_ablations  # its dataclasses look their module up
_SPEC.loader.exec_module(stream_ablations)
ABLATIONS = stream_ablations.ABLATIONS


def _files() -> dict[str, str]:
    paths = {e.path for edits in ABLATIONS.values() for e in edits}
    return {p: (_ROOT / p).read_text() for p in paths}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_ablation_applies_to_the_checkout(name):
    files = _files()
    edited = stream_ablations.apply(files, [name])
    changed = {p for p in files if edited[p] != files[p]}
    assert changed == {e.path for e in ABLATIONS[name]}
    for edit in ABLATIONS[name]:
        assert edit.old not in edited[edit.path]
        assert edit.new in edited[edit.path]


def test_all_ablations_compose():
    edited = stream_ablations.apply(_files(), sorted(ABLATIONS))
    producer = edited["kernels/engine/weight_stream_producer.cuh"]
    assert "__ldg" not in producer and "prefetch.global.L2" not in producer
    assert "cp.async.ca" not in producer
    assert "C::kCodeBytes + pool_bytes" not in producer
    assert "load_pool(bar, k_step * kBlockK)" not in producer
    assert "load_pool(bar, pool_column)" in producer  # the segment steps keep theirs
    decode = edited["kernels/engine/fragment_decode.cuh"]
    # The forward decode, the transposed placements and their products, the tile decode.
    assert "pair_times_factor<0>(pair_bits" not in decode
    assert "place_column_pairs<true>(row_pairs, placed);" not in decode
    assert "pair_times_factors(placed[pair][r]" not in decode
    assert "pair_times_factors(low, scales.words[pair])" not in decode
    assert "registers(a[k16]" not in edited["kernels/engine/weight_stream_mma.cuh"]
    assert "int kStages = kStagesFit;" in edited["kernels/engine/weight_stream_config.cuh"]
    assert producer.count("CacheHintSm90::EVICT_LAST") == 2  # both pool-tile loads


def test_an_edit_that_no_longer_matches_fails_loudly():
    files = _files()
    files["kernels/engine/weight_stream_mma.cuh"] = "// moved"
    with pytest.raises(ValueError, match="mma.*0 times"):
        stream_ablations.apply(files, ["mma"])
    with pytest.raises(ValueError, match="not one of"):
        stream_ablations.apply(files, ["nothing"])


@pytest.mark.parametrize(
    "spec", ["pipe", "base=decode", "x=", "x=decode+fast", "a/b=decode", "x=decode+decode"]
)
def test_bad_build_specs_are_refused(spec):
    with pytest.raises(ValueError, match="build"):
        stream_ablations.parse_build(spec)


def _tar(entries: list[tuple[str, str | None, int]]) -> bytes:
    """A tar of (path, text or None for a directory, mode) entries."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text, mode in entries:
            info = tarfile.TarInfo(path)
            info.mode = mode
            if text is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                data = text.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_build_tar_holds_the_edited_tree(tmp_path):
    files = _files()
    entries = [("kernels", None, 0o755), ("tools/run.sh", "#!/bin/sh\n", 0o755)]
    entries += [(path, text, 0o644) for path, text in files.items()]
    base = _tar(entries)
    edited = stream_ablations.edited_files(base, ["decode", "mma"])
    out = tmp_path / "pipe.tar"
    stream_ablations.write_ablated(base, edited, out)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        got = {n: tar.extractfile(m).read().decode() for n, m in members.items() if m.isfile()}
    want = stream_ablations.apply(files, ["decode", "mma"])
    assert members["kernels"].isdir() and members["kernels"].mode == 0o755
    assert got["tools/run.sh"] == "#!/bin/sh\n" and members["tools/run.sh"].mode == 0o755
    for path in files:
        assert got[path] == want[path] and members[path].mode == 0o644
    with pytest.raises(ValueError, match="the tree has no"):
        stream_ablations.edited_files(_tar([("README.md", "x\n", 0o644)]), ["mma"])


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_main_writes_base_and_builds_from_a_revision(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    for path, text in _files().items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tree")
    base = stream_ablations.archive("HEAD", repo)
    with pytest.raises(ValueError, match="git archive nope"):
        stream_ablations.archive("nope", repo)
    with pytest.raises(ValueError, match="not the top of a git checkout"):
        stream_ablations.archive("HEAD", repo / "kernels")
    out = tmp_path / "ab"
    monkeypatch.setattr(stream_ablations, "ROOT", repo)
    assert stream_ablations.main([str(out), "pipe=decode+mma", "noscales=scales"]) == 0
    with pytest.raises(SystemExit, match="given twice"):
        stream_ablations.main([str(out), "x=mma", "x=decode"])
    assert (out / "base.tar").read_bytes() == base
    with tarfile.open(out / "noscales.tar") as tar:
        text = tar.extractfile("kernels/engine/weight_stream_producer.cuh").read().decode()
    assert "__ldg" not in text and "cp.async.ca" not in text
