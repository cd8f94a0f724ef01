#!/usr/bin/env python3
"""Instructions per base step of a weight-streaming GEMM, counted in its SASS.

The weight-streaming kernels (kernels/engine/weight_stream_kernel.cuh) spend their time
in one loop: a consumer warp's base steps, each a decode of MXFP4 codes into A-fragment
registers and a batch of register-A wgmma (HGMMA with a register A operand). This tool
finds that loop in a kernel's SASS, drops the rare FP32 scale path (the branch of a
diamond whose block converts through FP32: FMUL or F2FP), and counts what is left per
step, by opcode: the static count ncu's per-warp instruction counts match (docs/ENGINE.md,
"The per-step overhead cut"), summed by issue pipe (ALU, FMA, uniform, ...: the decode
loads the ALU pipe most), and the stall cycles ptxas scheduled for it (the control
words' stall counts: what one warp alone needs to issue a step, not a time). Count
before tuning; compare trees by their counts, and time them.

    python tools/stream_step_sass.py --variant weight_stream_gated_t32
    python tools/stream_step_sass.py --sass kernel.sass   # cuobjdump -sass output

It also finds the producer warpgroup's base-step loop (the smallest loop that loads
scale bytes from global memory, stores words to shared memory and issues no HGMMA) and
reports its instructions per step and the scale loads whose register the loop reads
again after the load in the same iteration: such a read waits for the load, so the
step would pay a global load's latency instead of hiding it under the steps in between
(docs/ENGINE.md, "The producer's scale loads"); and, from the control words'
scoreboards, how many steps after its issue a scale load is first waited for (a wait
is for every load on the scoreboard, so one shared by all the loads makes them one step
ahead in effect, whatever the source says). Where the kernel has an epilogue that
loads (dgrad2's g | u), it reports how many rounds those loads come in.

``--variant`` generates the registry variant (tools/gen_variants.py), compiles it with
nvcc for sm_90a (the wheel's flags, tools/compile_variants.py) against the pinned CUTLASS
headers and reads its SASS with cuobjdump. Needs nvcc and cuobjdump; no GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "python" / "megamoe" / "variants.toml"

# One SASS instruction line of cuobjdump: /*addr*/ [@[!]P] OPCODE operands ;
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
# The line after it: the instruction's second 64-bit word alone, whose bits 41-44 hold
# the stall count ptxas scheduled after it (the cycles before the warp's next issue).
CONTROL_WORD = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
STALL_SHIFT, STALL_MASK = 41, 0xF
# The same word's scoreboards: bits 46-48 the one a variable-latency instruction (a
# global load) signals when its result is written (7: none), bits 52-57 the mask of
# those the instruction waits for before it issues. A scoreboard counts its instructions
# in flight and a wait is for all of them.
WRITE_BARRIER_SHIFT, WAIT_MASK_SHIFT, NO_BARRIER = 46, 52, 7
REGISTER_A_HGMMA = re.compile(r"HGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc")
# The FP32 scale path converts through FP32; the fast path never does.
SLOW_PATH = ("FMUL", "F2FP")
# Register-A HGMMA per step: two weights x four k16 sub-steps; the 192- and 256-row
# chunks (read off the kernel's name) decode one weight a step (the 128-row chunks keep
# two).
HGMMA_PER_STEP = 8
WIDE_HGMMA_PER_STEP = 4
KERNEL_CHUNK = re.compile(r"weight_stream_kernelILNS_10StreamKindE(\d)ELi(\d+)EE")
# The decode's byte placement: the base steps' loop has it, the wide GEMM1's side steps
# (register-A HGMMA from ldmatrix) do not.
DECODE_OPCODE = "PRMT"


@dataclass(frozen=True)
class Instruction:
    address: int
    predicated: bool
    opcode: str  # with its modifiers, e.g. "SHF.R.S32.HI"
    operands: str
    stall: int = 0  # the control word's stall count (0 where the listing has none)
    write_barrier: int = NO_BARRIER  # the scoreboard its result signals (7: none)
    wait_mask: int = 0  # the scoreboards it waits for

    @property
    def text(self) -> str:
        """Opcode and operands, as cuobjdump prints them."""
        return f"{self.opcode} {self.operands}"

    @property
    def name(self) -> str:
        """The opcode without modifiers (SHF, LOP3, HGMMA, ...)."""
        return self.opcode.split(".")[0]

    def branch_target(self) -> int | None:
        if self.name != "BRA":
            return None
        match = re.search(r"0x([0-9a-f]+)", self.operands)
        return int(match.group(1), 16) if match else None


def parse(sass: str) -> list[Instruction]:
    """The instructions of a cuobjdump -sass listing, in address order, each with the
    stall count and scoreboards of its control word (the next line) where the listing has
    one (else no stall and no scoreboard)."""
    found = []
    lines = sass.splitlines()
    for n, line in enumerate(lines):
        match = INSTRUCTION.search(line)
        if match:
            address, predicate, opcode, operands = match.groups()
            control = CONTROL_WORD.match(lines[n + 1]) if n + 1 < len(lines) else None
            word = int(control.group(1), 16) if control else NO_BARRIER << WRITE_BARRIER_SHIFT
            found.append(
                Instruction(
                    int(address, 16),
                    bool(predicate),
                    opcode,
                    operands,
                    (word >> STALL_SHIFT) & STALL_MASK,
                    (word >> WRITE_BARRIER_SHIFT) & 7,
                    (word >> WAIT_MASK_SHIFT) & 0x3F,
                )
            )
    return found


def smallest_loop(
    code: list[Instruction], holds: Callable[[list[Instruction]], bool]
) -> list[Instruction] | None:
    """The smallest loop (a backward branch's body) for which ``holds`` is true."""
    best: list[Instruction] | None = None
    for index, instruction in enumerate(code):
        target = instruction.branch_target()
        if target is None or target > instruction.address:
            continue
        body = [i for i in code[: index + 1] if i.address >= target]
        if (best is None or len(body) < len(best)) and holds(body):
            best = body
    return best


def base_step_loop(code: list[Instruction]) -> list[Instruction]:
    """The smallest loop holding register-A HGMMA and the decode."""
    best = smallest_loop(
        code,
        lambda body: (
            any(REGISTER_A_HGMMA.search(i.text) for i in body)
            and any(i.name == DECODE_OPCODE for i in body)
        ),
    )
    if best is None:
        raise ValueError("no loop with register-A HGMMA (is this a weight-streaming kernel?)")
    return best


def hgmma_per_step(sass: str) -> int:
    """Register-A HGMMA per base step: WIDE_HGMMA_PER_STEP where the listing names a
    kernel of 192- or 256-row chunks, else HGMMA_PER_STEP."""
    kernel = KERNEL_CHUNK.search(sass)
    one_tile = kernel and int(kernel[2]) > 128
    return WIDE_HGMMA_PER_STEP if one_tile else HGMMA_PER_STEP


def fast_path(loop: list[Instruction]) -> list[Instruction]:
    """The loop without its FP32-path blocks.

    A scale check is a diamond: ``@P BRA X`` skips a block that ends in an unconditional
    ``BRA Y``; the other block runs from X to Y (or to a BSYNC before it). Whichever of the two
    converts through FP32 (SLOW_PATH) is dropped. Where the fast values come before the
    check, ``@P BRA X`` skips the FP32 block alone (it does not end in a branch), and that
    block is dropped."""
    position = {i.address: n for n, i in enumerate(loop)}
    dropped: set[int] = set()
    for n, instruction in enumerate(loop):
        target = instruction.branch_target()
        if target is None or not instruction.predicated or target not in position:
            continue
        x = position[target]
        if x <= n:
            continue
        if loop[x - 1].name != "BRA" or loop[x - 1].predicated:
            # No else block: @P BRA X skips the FP32 block alone (the fast values were
            # formed before the check).
            skipped = range(n + 1, x)
            if any(loop[k].name in SLOW_PATH for k in skipped):
                dropped.update(skipped)
            continue
        first = range(n + 1, x)
        # The other block ends at the join (the first block's BRA target) or at the
        # BSYNC before it, where ptxas put one.
        join = position.get(loop[x - 1].branch_target(), len(loop))
        end = x
        while end < join and loop[end].name != "BSYNC":
            end += 1
        second = range(x, end)
        for block in (first, second):
            if any(loop[k].name in SLOW_PATH for k in block):
                dropped.update(block)
    return [i for n, i in enumerate(loop) if n not in dropped]


def fast_path_steps(sass: str) -> tuple[list[Instruction], float]:
    """The base-step loop's fast path and how many base steps it holds."""
    loop = fast_path(base_step_loop(parse(sass)))
    steps = sum(1 for i in loop if REGISTER_A_HGMMA.search(i.text)) / hgmma_per_step(sass)
    if steps == 0:
        raise ValueError("the loop's fast path holds no register-A HGMMA")
    return loop, steps


def count_per_step(sass: str) -> tuple[float, Counter[str]]:
    """(instructions per base step, per-opcode counts per step) of the kernel's loop."""
    loop, steps = fast_path_steps(sass)
    per_opcode = Counter(i.name for i in loop)
    return len(loop) / steps, Counter({k: v / steps for k, v in per_opcode.items()})


# A coarse grouping of the streaming loops' opcodes by the pipe they issue to: the
# decode's placement runs on the ALU pipe (byte permutes, logic, shifts, integer
# compares) except where ptxas issues a shift as IMAD.SHL on the FMA pipe, which also
# takes the scale multiplies (HMUL2); uniform-datapath instructions (U*) compute the
# descriptors and the ring's bookkeeping. Opcodes named in none go to "other".
ALU_PIPE = frozenset({"LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "PLOP3"})
FMA_PIPE = frozenset({"IMAD", "HMUL2", "HFMA2", "HADD2", "FFMA", "FMUL", "FADD"})
PIPES = ("ALU", "FMA", "uniform", "tensor", "shared", "other")


def pipe_of(opcode: str) -> str:
    """The pipe (one of PIPES) an opcode without modifiers issues to."""
    if opcode in ALU_PIPE:
        return "ALU"
    if opcode in FMA_PIPE:
        return "FMA"
    if opcode.startswith("U"):
        return "uniform"
    if opcode == "HGMMA":
        return "tensor"
    if opcode in ("LDS", "STS", "LDSM"):
        return "shared"
    return "other"


def pipes_per_step(per_opcode: Counter[str]) -> dict[str, float]:
    """Per-step counts (count_per_step's) summed by pipe, every pipe of PIPES listed."""
    pipes = dict.fromkeys(PIPES, 0.0)
    for opcode, count in per_opcode.items():
        pipes[pipe_of(opcode)] += count
    return pipes


def stall_cycles_per_step(sass: str) -> float:
    """The fast path's scheduled stall cycles per base step: the sum of its control words'
    stall counts, the cycles one warp alone needs to issue a step before any wait on a
    load or barrier. A count of the schedule, not a time: with two consumer warps per
    scheduler it did not predict which of two trees ran faster (docs/ENGINE.md, "The
    transposed decode's multiplies and the scale check")."""
    loop, steps = fast_path_steps(sass)
    return sum(i.stall for i in loop) / steps


GLOBAL_LOAD = re.compile(r"^LDG\b")
REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
STORES = ("STS", "STG", "ST")
# The producer's arrival on a stage's full barrier after writing its words.
PRODUCER_ARRIVE = "SYNCS.ARRIVE.TRANS64.A1T0"


def _registers(operand: str) -> set[int]:
    """The general registers an operand names (``R4.64`` names R4 and R5)."""
    found: set[int] = set()
    for number, wide in REGISTER.findall(operand):
        found.update({int(number), int(number) + 1} if wide else {int(number)})
    return found


def written_register(instruction: Instruction) -> int | None:
    """The register an instruction writes (its first operand), if any."""
    if instruction.name in STORES:
        return None
    first = instruction.operands.split(",")[0].strip()
    match = re.fullmatch(r"R(\d+)", first)
    return int(match.group(1)) if match else None


def read_registers(instruction: Instruction) -> set[int]:
    """The general registers an instruction reads (every operand but the one it writes)."""
    operands = instruction.operands.split(",")
    if written_register(instruction) is not None:
        operands = operands[1:]
    found: set[int] = set()
    for operand in operands:
        found |= _registers(operand)
    return found


def producer_loop(code: list[Instruction]) -> list[Instruction]:
    """The smallest loop that loads from global memory, stores to shared memory, arrives
    on a barrier and holds no HGMMA (nor a barrier's retry block, whose branch back into
    the loop spans the kernel's tail): the producer's base steps."""

    def holds(body: list[Instruction]) -> bool:
        names = {i.name for i in body}
        return (
            bool(names & {"LDG", "LDGSTS"})
            and "STS" in names
            and not names & {"HGMMA", "NANOSLEEP", "EXIT"}
            and any(i.opcode == PRODUCER_ARRIVE for i in body)
        )

    best = smallest_loop(code, holds)
    if best is None:
        raise ValueError("no producer loop (global loads, shared stores, an arrival, no HGMMA)")
    return best


def loads_read_in_their_iteration(loop: list[Instruction]) -> list[tuple[Instruction, Instruction]]:
    """(load, reader) for each global load of ``loop`` whose destination register a later
    instruction of the same iteration reads before an unpredicated write replaces it."""
    found = []
    for n, load in enumerate(loop):
        register = written_register(load)
        if not GLOBAL_LOAD.match(load.opcode) or register is None:
            continue
        for later in loop[n + 1 :]:
            if register in read_registers(later):
                found.append((load, later))
                break
            if written_register(later) == register and not later.predicated:
                break
    return found


def scale_load_steps_ahead(loop: list[Instruction]) -> int | None:
    """The fewest producer steps (arrivals) between a global load of ``loop`` and the
    first instruction after it, around the loop, that waits for the load's scoreboard:
    how many steps ahead the scale loads are in effect. A wait is for every load in flight
    on that scoreboard, so loads issued kScaleStepsAhead steps ahead that share one are
    waited on, together, one step after the newest was issued. None without such a load."""
    fewest = None
    twice = loop + loop
    for n, load in enumerate(loop):
        if not GLOBAL_LOAD.match(load.opcode) or load.write_barrier == NO_BARRIER:
            continue
        arrivals = 0
        for later in twice[n + 1 : n + len(loop)]:
            if later.wait_mask >> load.write_barrier & 1:
                fewest = arrivals if fewest is None else min(fewest, arrivals)
                break
            arrivals += later.opcode == PRODUCER_ARRIVE
    return fewest


def staged_steps_ahead(loop: list[Instruction]) -> int | None:
    """Steps ahead of scale loads staged through shared memory (cp.async: LDGSTS, one
    commit group, LDGDEPBAR, a step): a step's ``DEPBAR.LE SB0, n`` leaves the newest n
    groups in flight, so the loads it waits for were issued n + 1 steps before. None
    without staged loads."""
    if not any(i.name == "LDGSTS" for i in loop):
        return None
    waits = [re.search(r"SB0,\s*0x([0-9a-f]+)", i.operands) for i in loop if i.name == "DEPBAR"]
    counts = [int(m.group(1), 16) for m in waits if m]
    return min(counts) + 1 if counts else 0


def producer_per_step(sass: str) -> tuple[float, list[tuple[Instruction, Instruction]]]:
    """(instructions per producer step outside the copies' blocks, scale loads read in
    their own iteration) of the kernel's producer loop. A step is one arrival; the
    copies' blocks (one thread issues the TMA: BSSY .. BSYNC) are left out."""
    loop = producer_loop(parse(sass))
    steps = sum(1 for i in loop if i.opcode == PRODUCER_ARRIVE)
    inside, all_threads = False, 0
    for instruction in loop:
        if instruction.name == "BSSY":
            inside = True
        if not inside:
            all_threads += 1
        if instruction.name == "BSYNC":
            inside = False
    return all_threads / steps, loads_read_in_their_iteration(loop)


# The streaming dgrad2's epilogue reads g | u and writes dg | du with 8-byte accesses,
# and loads each row's route and weight with 4-byte coherent (.cg) loads; no other part
# of a streaming kernel makes coherent or 8-byte global loads (the producer's scale loads
# are read-only, dgrad1's epilogue stores but loads nothing, so it counts no round). A
# store splits a round where it is 4 or 8 bytes wide.
EPILOGUE_LOAD = re.compile(r"LDG\.E(\.64)?\.STRONG\.GPU\b|LDG\.E\.64$")
EPILOGUE_STORE = re.compile(r"STG\.E(\.64)?$")


def epilogue_load_rounds(code: list[Instruction]) -> tuple[int, int]:
    """(the epilogue's global loads, the rounds they come in): a round is a run of such
    loads that no 4- or 8-byte global store splits. The stores are volatile, so a load
    placed after one waits for the round before it: rows loaded one at a time between
    their stores give two loads (g and u) a round, and each round is a full memory round
    trip (docs/ENGINE.md, "The streaming dgrad2's epilogue loads")."""
    loads = rounds = 0
    after_store = True
    for instruction in code:
        if EPILOGUE_LOAD.match(instruction.opcode):
            loads += 1
            rounds += after_store
            after_store = False
        elif EPILOGUE_STORE.match(instruction.opcode):
            after_store = True
    return loads, rounds


def named_listing(kernels: dict[str, str]) -> str:
    """One listing of kernels' SASS (``compile_variants.sass_by_kernel``'s), each under its
    ``Function :`` line as cuobjdump prints it: hgmma_per_step reads the kernel's name."""
    return "\n".join(f"\t\tFunction : {name}\n{sass}" for name, sass in kernels.items())


def variant_sass(variant: str) -> str:
    """The SASS of a registry variant, compiled here (nvcc, cuobjdump, CUTLASS headers)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import compile_variants
    import gen_variants

    cuobjdump = compile_variants.find_cuobjdump()
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        sources = {s.stem.removeprefix("variant_"): s for s in gen_variants.generate(REGISTRY, out)}
        if variant not in sources:
            raise SystemExit(f"--variant: no variant {variant!r} in {REGISTRY}")
        cubin = out / f"{variant}.cubin"
        includes = [ROOT / "kernels", out, compile_variants.cutlass_include()]
        subprocess.run(
            [
                compile_variants.find_nvcc(),
                *compile_variants.NVCC_FLAGS,
                *(f"-I{d}" for d in includes),
                "-o",
                str(cubin),
                str(sources[variant]),
            ],
            check=True,
            capture_output=True,
        )
        return named_listing(compile_variants.sass_by_kernel(cuobjdump, cubin))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--variant", help="a weight_stream_* registry variant to compile")
    source.add_argument("--sass", type=Path, help="a cuobjdump -sass listing of one kernel")
    args = parser.parse_args(argv)
    sass = variant_sass(args.variant) if args.variant else args.sass.read_text()
    total, per_opcode = count_per_step(sass)
    print(f"{total:.1f} instructions per base step (fast path)")
    print(f"{stall_cycles_per_step(sass):.1f} scheduled stall cycles per base step (one warp)")
    pipes = pipes_per_step(per_opcode)
    print("per pipe: " + ", ".join(f"{pipe} {count:.1f}" for pipe, count in pipes.items()))
    for opcode, count in per_opcode.most_common():
        print(f"  {opcode:<10} {count:6.1f}")
    per_step, early = producer_per_step(sass)
    print(f"producer: {per_step:.1f} instructions per step outside the copies' blocks")
    print(f"producer: {len(early)} scale loads read in the iteration that issued them")
    loop = producer_loop(parse(sass))
    ahead = scale_load_steps_ahead(loop)
    staged = staged_steps_ahead(loop)
    if staged is not None:
        print(f"producer: scale loads staged in shared memory, {staged} step(s) ahead")
    if ahead is not None:
        print(f"producer: scale loads waited for {ahead} step(s) after their issue (scoreboards)")
    for load, reader in early:
        load_at, reader_at = f"{load.address:#07x}", f"{reader.address:#07x}"
        print(f"  {load_at} {load.text.strip()}  <- {reader_at} {reader.text.strip()}")
    loads, rounds = epilogue_load_rounds(parse(sass))
    if loads:
        print(f"epilogue: {loads} coherent global loads in {rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
