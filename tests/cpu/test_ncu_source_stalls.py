"""tools/ncu_source_stalls.py on a small export of Nsight Compute's source page: the
kernels are told apart, offsets count from each kernel's first instruction, and the
samples split at the range add up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ncu_source_stalls.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("ncu_source_stalls", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_wait","stall_long_sb","stall_wait (Not Issued)"'
)


def _export() -> str:
    lines = [
        '"Kernel Name","void kernel_a(P)",',
        HEADER,
        '"0x7f0000001000","      LDC R1, c[0x0][0x28]","3","10","1","2","9"',
        '"0x7f0000001010","@!P0  MUFU.EX2 R2, R3","5","20","5","0","9"',
        '"0x7f0000001020","      STG.E [R4.64], R2","2","1,000","0","2","9"',
        '"Kernel Name","void kernel_b(P)",',
        HEADER,
        '"0x7f0000200000","      MUFU.RCP R2, R3","4","7","0","4","9"',
    ]
    return "\n".join(lines) + "\n"


def test_kernels_and_offsets(tool) -> None:
    kernels = tool.read_kernels(_export().splitlines())
    assert [k.name for k in kernels] == ["void kernel_a(P)", "void kernel_b(P)"]
    a = kernels[0]
    assert [a.offset(r) for r in a.rows] == [0x0, 0x10, 0x20]
    assert [a.opcode(r) for r in a.rows] == ["LDC", "MUFU.EX2", "STG.E"]
    assert a.stall_columns() == ["stall_wait", "stall_long_sb"]  # not the "Not Issued" ones


def test_the_range_splits_the_samples(tool, tmp_path: Path, capsys) -> None:
    kernels = tool.read_kernels(_export().splitlines())
    a = kernels[0]
    samples, executed, shares = tool.stall_shares(a, a.rows[1:])
    assert (samples, executed) == (7, 1020)  # 5 + 0 + 0 + 2 samples; "1,000" read as 1000
    assert shares == [("wait", 5 / 7), ("long_sb", 2 / 7)]
    path = tmp_path / "export.csv"
    path.write_text(_export())
    assert tool.main([str(path), "--range", "0x10:0x30", "--find", "MUFU"]) == 0
    out = capsys.readouterr().out
    assert "MUFU: 1 at 0x10" in out
    assert "[0x10, 0x30): 7 samples, 1020 warp instructions; wait 71.4%, long_sb 28.6%" in out
    assert "outside: 3 samples, 10 warp instructions; long_sb 66.7%, wait 33.3%" in out


def test_a_bad_range_is_rejected(tool) -> None:
    with pytest.raises(tool.argparse.ArgumentTypeError, match="START < END"):
        tool.parse_range("0x30:0x10")
    with pytest.raises(tool.argparse.ArgumentTypeError, match="START:END"):
        tool.parse_range("0x30")
