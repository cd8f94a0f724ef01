"""``python -m megamoe.bench.hf`` end to end on the CPU (tiny cases, megamoe's reference)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("peft")
from megamoe.bench import hf


def test_tiny_cases_write_every_number(tmp_path, capsys):
    out = tmp_path / "hf.json"
    args = ["--cases", "tiny,tiny-adapters", "--impl", "megamoe_reference", "--iters", "10"]
    assert hf.main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["iters"] == 10 and data["meta"]["warmup"] == 3
    trainable, adapters = data["results"]
    assert trainable["case"]["mode"] == "trainable" and adapters["case"]["rank"] == 16
    for row, baseline in ((trainable, "grouped_mm"), (adapters, "grouped_mm+peft")):
        for side in (row[baseline], row["megamoe"]):
            assert len(side["samples_ms"]) == 10 and side["median_ms"] > 0
        assert row["speedup"] == row[baseline]["median_ms"] / row["megamoe"]["median_ms"]
    # Adapters: both sides train only adapter factors of rank 16 (2 layers' worth each).
    e, h, i, r = 8, 64, 64, 16
    peft_lora = e * r * h + 2 * i * r * e + e * r * i + h * r * e  # ParamWrapper A, B
    side_lora = 2 * h * r + 3 * e * r * i + r * h
    assert adapters["grouped_mm+peft"]["trainable_params"] == peft_lora
    assert adapters["megamoe"]["trainable_params"] == side_lora
    assert "tiny-adapters" in capsys.readouterr().out


def test_unknown_case_and_fused_without_gpu_are_refused(capsys):
    # Each refusal by its message: any exit passed before (a review), and without a GPU
    # the fused implementation's refusal exited for the unknown case too.
    with pytest.raises(SystemExit):
        hf.main(["--cases", "nope", "--impl", "megamoe_reference"])
    assert "--cases: unknown ['nope']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            hf.main(["--cases", "tiny-adapters"])
        assert "no GPU: the fused kernels need a Hopper GPU" in capsys.readouterr().err
