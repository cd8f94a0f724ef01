"""``python -m megamoe.bench`` reports the fused layer's kernel launches per pass, and
the count is bounded: it does not grow with the token count (no per-expert or
per-token host loops)."""

import json

import pytest

from megamoe.bench import cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "mxfp4"])
@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_the_fused_rows_carry_their_launches(tmp_path, capsys, mode, dtype):
    out = tmp_path / "bench.json"
    argv = ["--shape", "small", "--tokens", "16,64", "--backend", "fused", "--mode", mode]
    argv += ["--dtype", dtype, "--iters", "1", "--warmup", "1", "--quiet", "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    by_pass: dict[str, set[int]] = {}
    for row in rows:
        assert 0 < row["launches"] < 100 and row["copies"] >= 0
        by_pass.setdefault(row["pass"], set()).add(row["launches"])
    assert all(len(counts) == 1 for counts in by_pass.values()), by_pass  # same at 16 and 64
    assert by_pass["fwd+bwd"].pop() > by_pass["forward"].pop()
    assert "launches" in capsys.readouterr().out
