"""Warp-state samples per stall reason from Nsight Compute's source page, per kernel and
for an address range of its SASS (one warp role's code), from the CSV that

    ncu -k regex:engine_kernel --launch-skip 2 --launch-count 2 --set none \\
        --section SourceCounters --section WarpStateStats -o dg2 \\
        python tools/profile_fused_dgrad2.py
    ncu -i dg2.ncu-rep --page source --print-source sass --csv > dg2.csv

writes. ``python tools/ncu_source_stalls.py dg2.csv --range 0x8000:0xe000`` prints, for
each kernel, the stall reasons' shares of the samples inside the range (offsets from
the kernel's first instruction) and outside it, with
the warp instructions executed there. ``--find MUFU`` lists where instructions of an
opcode lie, to choose the range (the fused dgrad2's epilogue holds its ``MUFU``).
docs/PERFORMANCE.md (seventeenth session) has a reading.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Kernel:
    """One kernel's rows of the source page: its name and per-instruction columns."""

    name: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)

    def column(self, row: list[str], name: str) -> int:
        text = row[self.columns.index(name)].replace(",", "")
        return int(text) if text not in ("", "-") else 0

    def offset(self, row: list[str]) -> int:
        """The instruction's offset from the kernel's first instruction."""
        return int(row[0], 16) - int(self.rows[0][0], 16)

    def opcode(self, row: list[str]) -> str:
        """The instruction's opcode with its modifiers (``MUFU.EX2``), predicate dropped."""
        words = row[1].split()
        return words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]

    def stall_columns(self) -> list[str]:
        return [c for c in self.columns if c.startswith("stall_") and "Not Issued" not in c]


def read_kernels(lines: Iterable[str]) -> list[Kernel]:
    """The kernels of a ``--page source --csv`` export, in order."""
    kernels: list[Kernel] = []
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1]))
        elif row[0] == "Address" and kernels:
            kernels[-1].columns = row
        elif kernels and kernels[-1].columns and len(row) == len(kernels[-1].columns):
            kernels[-1].rows.append(row)
    return kernels


def stall_shares(kernel: Kernel, rows: list[list[str]]) -> tuple[int, int, list[tuple[str, float]]]:
    """``(samples, warp instructions executed, [(reason, share of the samples)])`` of
    ``rows``, reasons by share, largest first."""
    counts: collections.Counter[str] = collections.Counter()
    for row in rows:
        for name in kernel.stall_columns():
            counts[name.removeprefix("stall_")] += kernel.column(row, name)
    total = sum(counts.values())
    executed = sum(kernel.column(row, EXECUTED) for row in rows)
    shares = [(reason, count / total) for reason, count in counts.most_common() if count]
    return total, executed, shares


def parse_range(text: str) -> tuple[int, int]:
    """``START:END`` (hex or decimal code offsets, END excluded)."""
    start, sep, end = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--range: expected START:END, got {text!r}")
    low, high = int(start, 0), int(end, 0)
    if low >= high:
        raise argparse.ArgumentTypeError(f"--range: expected START < END, got {text!r}")
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv")
    parser.add_argument("--range", type=parse_range, help="code offsets START:END to split at")
    parser.add_argument("--find", metavar="OPCODE", help="list the offsets of an opcode")
    parser.add_argument("--top", type=int, default=8, help="reasons shown per line (8)")
    args = parser.parse_args(argv)
    kernels = read_kernels(args.csv.read_text().splitlines())
    if not kernels:
        print(f"{args.csv}: no kernel in this export", file=sys.stderr)
        return 1
    for kernel in kernels:
        print(f"== {kernel.name}")
        if args.find:
            hits = [
                kernel.offset(r) for r in kernel.rows if kernel.opcode(r).split(".")[0] == args.find
            ]
            print(f"   {args.find}: {len(hits)} at " + " ".join(f"{h:#x}" for h in hits))
        parts = {"all": kernel.rows}
        if args.range:
            low, high = args.range
            within = [low <= kernel.offset(r) < high for r in kernel.rows]
            parts = {
                f"[{low:#x}, {high:#x})": [r for r, w in zip(kernel.rows, within) if w],
                "outside": [r for r, w in zip(kernel.rows, within) if not w],
            }
        for label, rows in parts.items():
            samples, executed, shares = stall_shares(kernel, rows)
            top = ", ".join(f"{reason} {share:.1%}" for reason, share in shares[: args.top])
            print(f"   {label}: {samples} samples, {executed} warp instructions; {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
