"""tools/stream_ablations.py: every ablation's edits still find their text in the
checkout's kernels (a kernel change that moves the text fails here, not on a lent GPU),
each edit changes what it names, and a build's tar holds the tree with those files edited."""

from __future__ import annotations

import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_PATH = _ROOT / "tools" / "stream_ablations.py"
_SPEC = importlib.util.spec_from_file_location("stream_ablations", _PATH)
ablations = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = ablations  # its dataclasses look their module up
_SPEC.loader.exec_module(ablations)


def _files() -> dict[str, str]:
    paths = {e.path for edits in ablations.ABLATIONS.values() for e in edits}
    return {p: (_ROOT / p).read_text() for p in paths}


@pytest.mark.parametrize("name", sorted(ablations.ABLATIONS))
def test_each_ablation_applies_to_the_checkout(name):
    files = _files()
    edited = ablations.apply(files, [name])
    changed = {p for p in files if edited[p] != files[p]}
    assert changed == {e.path for e in ablations.ABLATIONS[name]}
    for edit in ablations.ABLATIONS[name]:
        assert edit.old not in edited[edit.path]
        assert edit.new in edited[edit.path]


def test_all_ablations_compose():
    files = _files()
    edited = ablations.apply(files, sorted(ablations.ABLATIONS))
    text = edited["kernels/engine/weight_stream_producer.cuh"]
    assert "__ldg" not in text and "prefetch.global.L2" not in text
    assert "pair_times_factor<0>(pair_bits" not in edited["kernels/engine/fragment_decode.cuh"]
    assert "registers(a[k16]" not in edited["kernels/engine/weight_stream_mma.cuh"]


def test_an_edit_that_no_longer_matches_fails_loudly():
    files = _files()
    files["kernels/engine/weight_stream_mma.cuh"] = "// moved"
    with pytest.raises(ValueError, match="mma.*0 times"):
        ablations.apply(files, ["mma"])
    with pytest.raises(ValueError, match="not one of"):
        ablations.apply(files, ["nothing"])


@pytest.mark.parametrize("spec", ["pipe", "base=decode", "x=", "x=decode+fast"])
def test_bad_build_specs_are_refused(spec):
    with pytest.raises(ValueError, match="build"):
        ablations.parse_build(spec)


def test_a_build_tar_holds_the_edited_tree(tmp_path):
    files = _files()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in {**files, "README.md": "untouched\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "pipe.tar"
    ablations.write_ablated(buf.getvalue(), ["decode", "mma"], out)
    with tarfile.open(out) as tar:
        got = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    want = ablations.apply(files, ["decode", "mma"])
    assert got["README.md"] == "untouched\n"
    for path in files:
        assert got[path] == want[path]
