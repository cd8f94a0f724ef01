"""tools/stream_step_sass.py on synthetic SASS: which loop it picks, which scale-path
block it drops, and the per-step count it reports (the tool on a real kernel needs nvcc
and cuobjdump: ``python tools/stream_step_sass.py --variant weight_stream_gated_t32``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "stream_step_sass", ROOT / "tools" / "stream_step_sass.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def _listing(lines: list[str], start: int = 0x100, stalls: list[int] | None = None) -> str:
    """cuobjdump-style lines, one instruction every 0x10 bytes from ``start``; with
    ``stalls``, each followed by its control word (the stall count in bits 41-44, the other
    fields set, as ptxas writes them)."""
    out = []
    for n, line in enumerate(lines):
        out.append(
            f"        /*{start + 16 * n:04x}*/                   {line} ;  /* 0x000000000000 */"
        )
        if stalls is not None:
            control = (stalls[n] << 41) | (1 << 45) | (7 << 46) | (7 << 49) | 0xC00
            out.append(f"                                                 /* 0x{control:016x} */")
    return "\n".join(out)


def _skip_step(first: int) -> list[str]:
    """One base step at address ``first`` whose fast values come before the scale check:
    the load, a fast block of 2, the check, a branch over an FP32 block of 2 (no else),
    8 register-A HGMMA and a wait. Its fast path is 16 instructions."""
    after = first + 16 * 8  # the BSYNC after the FP32 block
    return [
        "LDS.128 R20, [R10]",
        "PRMT R4, R5, R6, R7",
        "HMUL2.BF16_V2 R4, R4, R8.H0_H0",
        "LOP3.LUT R11, R12, R13, R14, 0xfe, !PT",
        "ISETP.GE.AND P0, PT, R11, RZ, PT",
        f"@P0 BRA 0x{after:x}",
        "FMUL R1, R2, R3",
        "F2FP.BF16.F32.PACK_AB R1, R2, R1",
        "BSYNC B0",
        *[f"HGMMA.64x32x16.F32.BF16 R40, R{120 + 4 * k}, gdesc[UR8], R40" for k in range(8)],
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    ]


def _step(first: int, slow_first: bool | None) -> list[str]:
    """One base step at address ``first``: 3 setup instructions, a scale diamond (the
    branch, a fast block of 2 and an FP32 block of 2, the first of them ending in a
    branch to the BSYNC), 8 register-A HGMMA and a wait. Its fast path is 16 instructions
    with the FP32 block first (its branch goes with it), 17 with the fast block first.
    ``slow_first=None``: the fast values before the check instead (_skip_step)."""
    if slow_first is None:
        return _skip_step(first)
    body_end = first + 16 * 4  # the block after the branch starts here
    if slow_first:
        slow = ["FMUL R1, R2, R3", "F2FP.BF16.F32.PACK_AB R1, R2, R1", "BRA 0x{end:x}"]
        other = ["PRMT R4, R5, R6, R7", "HMUL2.BF16_V2 R4, R4, R8.H0_H0"]
        first_block, second_block = slow, other
    else:
        fast = ["PRMT R4, R5, R6, R7", "HMUL2.BF16_V2 R4, R4, R8.H0_H0", "BRA 0x{end:x}"]
        slow = ["FMUL R1, R2, R3", "F2FP.BF16.F32.PACK_AB R1, R2, R1"]
        first_block, second_block = fast, slow
    second = body_end + 16 * len(first_block)
    end = second + 16 * len(second_block)
    lines = [
        "LDS.128 R20, [R10]",
        "LOP3.LUT R11, R12, R13, R14, 0xfe, !PT",
        "ISETP.GE.AND P0, PT, R11, RZ, PT",
        f"@!P0 BRA 0x{second:x}",
        *[line.format(end=end) for line in first_block],
        *second_block,
        "BSYNC B0",
        *[f"HGMMA.64x32x16.F32.BF16 R40, R{120 + 4 * k}, gdesc[UR8], R40" for k in range(8)],
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    ]
    return lines


@pytest.mark.parametrize("slow_first", [True, False, None])
def test_counts_the_fast_path_of_the_register_a_loop(slow_first: bool | None) -> None:
    start = 0x100
    step = _step(start, slow_first)
    second = _step(start + 16 * len(step), slow_first)
    loop = [*step, *second, f"@!P1 BRA 0x{start:x}"]
    # Code before and after the loop (a shared-memory wgmma outside it, an exit).
    prologue = ["MOV R1, R2", "HGMMA.64x32x16.F32.BF16 R40, gdesc[UR4], R40", "MOV R3, R4"]
    sass = "\n".join(
        [
            _listing(prologue, start - 16 * len(prologue)),
            _listing(loop, start),
            _listing(["EXIT"], start + 16 * len(loop)),
        ]
    )
    total, per_opcode = tool.count_per_step(sass)
    # Per step: the fast path, plus half of the loop's closing branch.
    assert total == pytest.approx((17 if slow_first is False else 16) + 0.5)
    assert per_opcode["HGMMA"] == 8
    assert per_opcode["HMUL2"] == 1
    assert "FMUL" not in per_opcode and "F2FP" not in per_opcode
    assert per_opcode["BRA"] == pytest.approx(2.5 if slow_first is False else 1.5)


def test_sums_a_steps_opcodes_by_pipe() -> None:
    """Shifts count on the ALU pipe as SHF and on the FMA pipe as IMAD (IMAD.SHL);
    uniform-datapath opcodes, HGMMA and shared-memory accesses have pipes of their own;
    an opcode the table does not name is "other", never dropped."""
    from collections import Counter

    per_opcode = Counter(
        {"PRMT": 32, "LOP3": 34, "SHF": 23, "IMAD": 43, "HMUL2": 32, "UIADD3": 16,
         "UMOV": 13, "HGMMA": 8, "LDS": 10, "BRA": 6, "SYNCS": 2}
    )  # fmt: skip
    pipes = tool.pipes_per_step(per_opcode)
    assert pipes == {
        "ALU": 89, "FMA": 75, "uniform": 29, "tensor": 8, "shared": 10, "other": 8,
    }  # fmt: skip
    assert sum(pipes.values()) == sum(per_opcode.values())
    assert tool.pipes_per_step(Counter())["ALU"] == 0


def test_sums_the_fast_paths_scheduled_stalls() -> None:
    """The stall counts of the control words are read per instruction and summed over the
    fast path per step: the FP32 block's stalls are left out, the closing branch's halved."""
    start = 0x100
    step = _step(start, slow_first=None)
    second = _step(start + 16 * len(step), slow_first=None)
    loop = [*step, *second, f"@!P1 BRA 0x{start:x}"]
    # Stall 2 on each fast-path instruction, 9 on the FP32 block's, 5 on the loop branch.
    slow = {"FMUL", "F2FP"}
    stalls = [9 if line.split()[0].split(".")[0] in slow else 2 for line in loop[:-1]] + [5]
    assert len(stalls) == len(loop)
    sass = _listing(loop, start, stalls)
    code = tool.parse(sass)
    assert [i.stall for i in code] == stalls
    assert tool.stall_cycles_per_step(sass) == pytest.approx(16 * 2 + 5 / 2)
    # Listings without control words (as the other tests here) read as stall 0.
    assert all(i.stall == 0 for i in tool.parse(_listing(loop, start)))


def test_picks_the_smallest_loop_with_register_a_hgmma() -> None:
    start = 0x100
    step = _step(start, slow_first=False)
    inner = [*step, f"@!P1 BRA 0x{start:x}"]
    outer_end = start + 16 * len(inner)
    sass = _listing([*inner, "IADD3 R1, R1, 0x1, RZ", f"@!P2 BRA 0x{start:x}"], start)
    loop = tool.base_step_loop(tool.parse(sass))
    assert loop[0].address == start and loop[-1].address == outer_end - 16


def test_wide_kernels_step_over_one_weight_and_skip_the_side_loop() -> None:
    """The wide form (a kernel of 256-row chunks, named in the listing) issues four
    register-A HGMMA a step; its GEMM1's side steps are a smaller loop of register-A HGMMA
    without a decode, which the count skips."""
    start = 0x100
    side = [
        "LDSM.16.MT88.4 R120, [R10]",
        *[f"HGMMA.64x32x16.F32.BF16 R40, R{120 + 4 * k}, gdesc[UR8], R40" for k in range(4)],
        f"@!P1 BRA 0x{start:x}",
    ]
    base_start = start + 16 * len(side)
    step = _step(base_start, slow_first=False)
    # One step of four HGMMA: the last four of the synthetic step's eight dropped.
    hgmma = [f"HGMMA.64x32x16.F32.BF16 R40, R{120 + 4 * k}, gdesc[UR8], R40" for k in range(4)]
    decode = [line for line in step if "HGMMA" not in line][:-1]
    base = [*decode, *hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1", f"@!P2 BRA 0x{base_start:x}"]
    name = (
        "_ZN7megamoe7kernels20weight_stream_kernelILNS_10StreamKindE0ELi256EEEvNS_"
        "18WeightStreamParamsE"
    )
    sass = f"\t\tFunction : {name}\n" + _listing([*side, *base], start)
    assert tool.hgmma_per_step(sass) == 4
    loop = tool.base_step_loop(tool.parse(sass))
    assert loop[0].address == base_start
    total, per_opcode = tool.count_per_step(sass)
    assert per_opcode["HGMMA"] == 4 and "LDSM" not in per_opcode
    assert total == pytest.approx(len(base) - 2)  # the FP32 block of 2 dropped
    assert tool.hgmma_per_step(sass.replace("Li256EE", "Li64EE")) == 8
    # Every kind's 128-row chunks (GEMM1, GEMM2 and the dgrads) keep two tiles a step.
    for kind in ("0", "1", "2", "3"):
        two_tiles = sass.replace("StreamKindE0ELi256EE", f"StreamKindE{kind}ELi128EE")
        assert tool.hgmma_per_step(two_tiles) == 8
    assert tool.hgmma_per_step(sass.replace("StreamKindE0", "StreamKindE1")) == 4
    # A compiled variant's listing keeps the name (without it the one-tile kernels were
    # counted per two steps).
    body = _listing([*side, *base], start)
    assert tool.hgmma_per_step(tool.named_listing({name: body})) == 4
    assert tool.count_per_step(tool.named_listing({name: body})) == (total, per_opcode)


def test_rejects_a_kernel_without_the_loop() -> None:
    sass = _listing(["HGMMA.64x32x16.F32.BF16 R40, gdesc[UR4], R40", "@!P0 BRA 0x100"])
    with pytest.raises(ValueError, match="register-A HGMMA"):
        tool.count_per_step(sass)


def _producer_step(pair: int, rotated: bool) -> list[str]:
    """One producer step of a loop unrolled over the steps in flight: the words from the
    pairs loaded an iteration before (R<pair>, R<pair + 1>), the loads for the next
    iteration, the barrier wait, the copies' block (BSSY .. BSYNC), the words' store and
    the arrival. ``rotated``: the loads go to temporaries (R12, R13) that the step copies
    back into the pairs' registers, so the step waits for them."""
    first, second = f"R{pair}", f"R{pair + 1}"
    loads = ["LDG.E.U16.CONSTANT R12, desc[UR4][R2.64]", "LDG.E.U16.CONSTANT R13, desc[UR4][R4.64]"]
    if not rotated:
        loads = [line.replace("R12", first).replace("R13", second) for line in loads]
    lines = [
        f"PRMT R6, {first}, 0x4140, RZ",  # the words from the pairs loaded before
        f"PRMT R7, {second}, 0x4140, RZ",
        *loads,
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x30], R14",
        "BSSY B0, 0x0",
        "UTMALDG.2D [UR8], [UR10], desc[UR12]",
        "BSYNC B0",
        "STS.64 [R17+UR8+0x5000], R6",
        "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR9], RZ",
    ]
    if rotated:
        lines += [f"IMAD.MOV.U32 {first}, RZ, RZ, R12", f"IMAD.MOV.U32 {second}, RZ, RZ, R13"]
    return lines


@pytest.mark.parametrize("rotated", [True, False])
def test_finds_scale_loads_read_in_their_own_iteration(rotated: bool) -> None:
    start = 0x200
    body = [*_producer_step(20, rotated), *_producer_step(22, rotated)]
    loop = [*body, f"@!P1 BRA 0x{start:x}"]
    # A barrier's retry block after the loop branches back into its last step (a smaller
    # "loop" that loads, stores and arrives): not the loop.
    back_to = start + 16 * (len(body) // 2 + 2)
    retry = [
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x30], R14",
        "NANOSLEEP.SYNCS 0x989680",
        f"BRA 0x{back_to:x}",
    ]
    sass = _listing([*loop, "EXIT", *retry], start)
    per_step, early = tool.producer_per_step(sass)
    # Per step, the copies' block (BSSY .. BSYNC) left out, half the loop's branch in.
    assert per_step == pytest.approx((9 if rotated else 7) + 0.5)
    if rotated:
        assert [(load.operands.split(",")[0].strip(), reader.opcode) for load, reader in early] == [
            ("R12", "IMAD.MOV.U32"),
            ("R13", "IMAD.MOV.U32"),
        ] * 2
    else:
        assert early == []


def test_registers_an_instruction_reads_and_writes() -> None:
    (load,) = tool.parse(_listing(["LDG.E.U16.CONSTANT R13, desc[UR4][R4.64]"]))
    assert tool.written_register(load) == 13
    assert tool.read_registers(load) == {4, 5}  # the 64-bit address pair
    (store,) = tool.parse(_listing(["STS.64 [R17+UR8+0x5000], R6"]))
    assert tool.written_register(store) is None
    assert tool.read_registers(store) == {17, 6}
    (test,) = tool.parse(_listing(["LOP3.LUT P1, RZ, R15, 0x8080, RZ, 0xc0, !PT"]))
    assert tool.written_register(test) is None and tool.read_registers(test) == {15}


def test_counts_the_epilogue_loads_rounds_between_stores() -> None:
    """Rounds of the epilogue's coherent global loads (8-byte g | u, 4-byte g, u, routes
    and weights) split by 4- or 8-byte global stores; other accesses (the producer's
    read-only 2-byte scale loads, 2-byte stores) split nothing."""
    code = tool.parse(
        _listing(
            [
                "LDG.E.U16.CONSTANT R13, desc[UR4][R4.64]",
                "LDG.E.64.STRONG.GPU R20, desc[UR4][R2.64]",
                "@!P0 LDG.E.64.STRONG.GPU R22, desc[UR4][R6.64]",
                "LDG.E.STRONG.GPU R9, desc[UR4][R10.64]",
                "STG.E.U16 desc[UR4][R8.64], R11",
                "LDG.E.64.STRONG.GPU R24, desc[UR4][R2.64+0x8]",
                "STG.E desc[UR4][R8.64], R11",
                "LDG.E.STRONG.GPU R12, desc[UR4][R2.64+0x4]",
                "STG.E.64 desc[UR4][R8.64], R20",
                "STG.E.64 desc[UR4][R8.64+0x8], R22",
                "LDG.E.64.STRONG.GPU R26, desc[UR4][R2.64+0x10]",
            ]
        )
    )
    assert tool.epilogue_load_rounds(code) == (6, 3)
    assert tool.epilogue_load_rounds(tool.parse(_listing(["FFMA R1, R2, R3, R4"]))) == (0, 0)


def _controlled(lines: list[tuple[str, int, int]], start: int = 0x200) -> str:
    """cuobjdump-style lines with control words: (instruction, the scoreboard it signals
    (7: none), the mask of those it waits for)."""
    out = []
    for n, (line, signals, waits) in enumerate(lines):
        out.append(f"        /*{start + 16 * n:04x}*/                   {line} ;  /* 0x0 */")
        control = (1 << 41) | (signals << 46) | (7 << 49) | (waits << 52)
        out.append(f"                                                 /* 0x{control:016x} */")
    return "\n".join(out)


def _scoreboard_step(register: int, load_signals: int, words_wait: int) -> list:
    return [
        (f"PRMT R6, R{register}, 0x4140, RZ", 7, words_wait),  # the words of an older load
        (f"LDG.E.U16.CONSTANT R{register}, desc[UR4][R4.64]", load_signals, 0),
        ("STS [R17+UR8+0x5000], R6", 7, 0),
        ("SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR9], RZ", 7, 0),
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_scale_loads_on_one_scoreboard_are_one_step_ahead(shared: bool) -> None:
    """Four steps, each forming words from the load issued four steps before (its own
    register) and loading again: on one scoreboard, each step's wait covers the load the
    step before issued; on a scoreboard per slot, the wait comes four steps later."""
    steps = []
    for slot in range(4):
        board = 5 if shared else slot
        steps += _scoreboard_step(20 + slot, board, 1 << board)
    start = 0x200
    sass = _controlled([*steps, (f"@!P1 BRA 0x{start:x}", 7, 0)], start)
    loop = tool.producer_loop(tool.parse(sass))
    assert tool.scale_load_steps_ahead(loop) == (1 if shared else 4)


def test_control_word_fields() -> None:
    (load,) = tool.parse(_controlled([("LDG.E.U16.CONSTANT R13, desc[UR4][R4.64]", 5, 0b100011)]))
    assert (load.stall, load.write_barrier, load.wait_mask) == (1, 5, 0b100011)


@pytest.mark.parametrize("keep,ahead", [(3, 4), (0, 1)])
def test_staged_scale_loads_steps_ahead(keep: int, ahead: int) -> None:
    """cp.async scale loads (LDGSTS, a commit group a step) waited for with DEPBAR.LE SB0,
    keep: the loads were issued keep + 1 steps before the wait."""
    step = [
        f"DEPBAR.LE SB0, 0x{keep:x}",
        "LDS.64 R22, [R19+0x1f800]",
        "LDGSTS.E [R19+0x1f800], desc[UR32][R12.64]",
        "LDGDEPBAR",
        "STS [R20+UR36+0x5000], R5",
        "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR37], RZ",
    ]
    start = 0x200
    sass = _listing([*step, *step, f"@!P1 BRA 0x{start:x}"], start)
    loop = tool.producer_loop(tool.parse(sass))
    assert tool.staged_steps_ahead(loop) == ahead
    assert tool.scale_load_steps_ahead(loop) is None  # no register loads


def test_register_loads_are_not_staged() -> None:
    sass = _controlled(
        [
            *_scoreboard_step(20, 5, 1 << 5),
            *_scoreboard_step(21, 5, 1 << 5),
            ("@!P1 BRA 0x200", 7, 0),
        ]
    )
    assert tool.staged_steps_ahead(tool.producer_loop(tool.parse(sass))) is None
