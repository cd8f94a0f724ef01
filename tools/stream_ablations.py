#!/usr/bin/env python3
"""Ablated source trees of the weight-streaming kernels, for measurement only.

Each ablation removes one part of the streaming kernels' work (kernels/engine/
weight_stream_*.cuh) by a text edit of a copy of the tree, so that timing the copies
beside the real tree (tools/ab_builds.sh, tools/weight_stream_ab.py) says what each part
costs. The outputs are wrong by design (the bits check of weight_stream_ab.py says
DIFFER); no ablated tree is ever built into a wheel or committed.

Ablations:
  decode  the decode's fast path becomes one XOR per A-fragment register (forward and
          transposed); the code and scale words are still loaded from shared memory
  mma     every register-A MMA (the base steps', and the one-tile GEMM1's side steps')
          becomes an empty asm that reads the fragment; the segment steps' MMAs from
          shared memory stay
  scales  the producer warpgroup writes constant scale words (the fast path's): no
          scale loads from global memory (nor their cp.async staging) and no L2
          prefetch of scale rows
  codes   the producer issues no TMA load of a base step's codes; the pool tile is
          still loaded
  pool    the producer issues no TMA load of a base step's pool tile (it completes the
          tile's bytes on the stage's barrier itself); the codes are still loaded

Two probes change a setting instead of removing work (their outputs are right):
  poollast   the pool tiles' TMA loads carry the L2 evict-last hint (the codes' keep
             evict-normal): a chunk's pool tile is read again by each of its tiles
  stagesfit  the ring holds as many stages as fit, not 6 (10 with 32-row chunks, 9 with
             64-row ones, 8 for dgrad2's 64-row ones; wider chunks keep theirs): more
             code bytes in flight per SM, and that much less L1

A build is NAME=ABLATION[+ABLATION...]; each becomes OUT_DIR/NAME.tar (the tree of
``--rev`` with the edits), beside OUT_DIR/base.tar (the tree itself), for
tools/ab_builds.sh:

    python tools/stream_ablations.py .ab pipe=decode+mma pipe_noscales=decode+mma+scales
    bash tools/ab_builds.sh .ab OUT 1 90 -- python tools/weight_stream_ab.py --tokens 128

Every edit names the text it replaces and fails loudly if the tree no longer holds it
as often as the edit says (tests/cpu/test_stream_ablations.py applies them all to the checkout).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DECODE = "kernels/engine/fragment_decode.cuh"
MMA = "kernels/engine/weight_stream_mma.cuh"
PRODUCER = "kernels/engine/weight_stream_producer.cuh"
CONFIG = "kernels/engine/weight_stream_config.cuh"


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (present exactly ``count`` times) in ``path`` with ``new``."""

    path: str
    old: str
    new: str
    count: int = 1


ABLATIONS: dict[str, tuple[Edit, ...]] = {
    "decode": (
        Edit(
            DECODE,
            "        out[row][w] = pair_times_factor<0>(pair_bits_times_2_pow_minus_126("
            "words[row][w], selector),\n"
            "                                           scales.words[row]);\n"
            "        out[row][w + 4] = pair_times_factor<1>(\n"
            "            pair_bits_times_2_pow_minus_126(words[row][w + 4], selector), "
            "scales.words[row]);",
            "        out[row][w] = words[row][w] ^ scales.words[row];\n"
            "        out[row][w + 4] = words[row][w + 4] ^ scales.words[row];",
        ),
        Edit(
            DECODE,
            "  place_column_pairs<true>(row_pairs, placed);\n  if constexpr",
            "#pragma unroll\n  for (int pair = 0; pair < 8; ++pair)\n#pragma unroll\n"
            "    for (int r = 0; r < 4; ++r) placed[pair][r] = row_pairs[pair] ^ "
            "scales.words[(pair + r) % 8];\n  if constexpr",
        ),
        Edit(
            DECODE,
            "      out[pair][r] = pair_times_factors(placed[pair][r], scales.words[pair]);",
            "      out[pair][r] = placed[pair][r];",
        ),
        Edit(
            DECODE,
            "      const uint32_t low = column_pair_bits_times_2_pow_minus_126("
            "row_pairs[pair] << 4, selector);\n"
            "      const uint32_t high = column_pair_bits_times_2_pow_minus_126(row_pairs[pair], "
            "selector);\n"
            "      fragment[pair / 2][2 * (pair % 2)] = pair_times_factors(low, "
            "scales.words[pair]);\n"
            "      fragment[pair / 2][2 * (pair % 2) + 1] = pair_times_factors(high, "
            "scales.words[pair]);",
            "      fragment[pair / 2][2 * (pair % 2)] = row_pairs[pair] ^ selector;\n"
            "      fragment[pair / 2][2 * (pair % 2) + 1] = row_pairs[pair] ^ "
            "scales.words[pair];",
        ),
    ),
    "mma": (
        Edit(
            MMA,
            "      registers(a[k16], advance_k16_low_word<false>(desc_b, k16), acc,\n"
            "                std::make_index_sequence<N / 2>{});",
            '      asm volatile("" ::"r"(a[k16][0]), "r"(a[k16][1]), "r"(a[k16][2]), '
            '"r"(a[k16][3]));',
        ),
    ),
    "scales": (
        # The cursor still advances and is still read (here), so the loaders' address
        # math stays as in the kernel; only the loads go.
        Edit(
            PRODUCER,
            "static_cast<uint32_t>(__ldg(cursor))",
            "0x7F7Fu * (cursor != nullptr)",
            count=2,
        ),
        Edit(PRODUCER, "static_cast<uint32_t>(__ldg(cursor + eight_rows))", "0x7F7Fu"),
        Edit(
            PRODUCER,
            "    chunks[0] = __ldg(next_chunk);\n"
            "    chunks[1] = __ldg(next_chunk + eight_row_chunks);",
            "    chunks[0] = make_uint2(0x7F7F7F7Fu * (next_chunk != nullptr), 0x7F7F7F7Fu);\n"
            "    chunks[1] = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu + 0u * eight_row_chunks);",
        ),
        # The transposed kinds' loads staged through shared memory: no copies, and the
        # staged words replaced by the same constants (the waits and shared loads stay).
        Edit(
            PRODUCER,
            '      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(at), "l"(first) '
            ': "memory");\n'
            '      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(at + 4), '
            '"l"(second)\n'
            '                   : "memory");',
            "      (void)at;\n      (void)first;\n      (void)second;",
        ),
        Edit(
            PRODUCER,
            "    raw[0] = raw[0] >> shift & kUnitMask;\n    raw[1] = raw[1] >> shift & kUnitMask;",
            "    raw[0] = 0x7F7Fu * (cursor != nullptr) + 0u * (raw[0] >> shift & kUnitMask);\n"
            "    raw[1] = 0x7F7Fu + 0u * raw[1];",
        ),
        Edit(
            PRODUCER,
            '      asm volatile("prefetch.global.L2 [%0];" ::"l"(at));\n'
            '      asm volatile("prefetch.global.L2 [%0];" ::"l"(at + next_row));',
            "      (void)at;",
        ),
    ),
    "codes": (
        Edit(
            PRODUCER,
            "TransactionBarrier::arrive_and_expect_tx(bar, C::kCodeBytes + pool_bytes);",
            "TransactionBarrier::arrive_and_expect_tx(bar, pool_bytes);",
        ),
        Edit(
            PRODUCER,
            "          if constexpr (C::kGated)\n"
            "            cute::SM90_TMA_LOAD_4D::copy(&p.codes, bar, kCacheHint, a, "
            "k_step * (kBlockK / 2),\n",
            "          (void)a;\n          if constexpr (false)\n"
            "            cute::SM90_TMA_LOAD_4D::copy(&p.codes, bar, kCacheHint, a, "
            "k_step * (kBlockK / 2),\n",
        ),
        Edit(
            PRODUCER,
            "          else if constexpr (C::kTransposed)\n"
            "            cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, tile.n0 / 2,\n"
            "                                         k_step * kBlockK, tile.expert);\n"
            "          else\n",
            "          else if constexpr (false)\n"
            "            cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, tile.n0 / 2,\n"
            "                                         k_step * kBlockK, tile.expert);\n"
            "          else if constexpr (false)\n",
        ),
    ),
    "pool": (
        # The base steps' pool tiles: the producer completes their bytes on the stage's
        # barrier itself instead of loading them (the MMAs read the stage's stale tile);
        # the segment steps still load theirs.
        Edit(
            PRODUCER,
            "          load_pool(bar, k_step * kBlockK);",
            '          asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;" ::"r"('
            "shared_address(bar)),\n"
            '                       "r"(pool_bytes)\n'
            '                       : "memory");',
        ),
    ),
    "poollast": (
        Edit(
            PRODUCER,
            "copy(&p.pool, bar, kCacheHint,",
            "copy(&p.pool, bar,\n"
            "                                       static_cast<uint64_t>("
            "cute::TMA::CacheHintSm90::EVICT_LAST),",
            count=2,
        ),
    ),
    "stagesfit": (
        Edit(
            CONFIG,
            "static constexpr int kStages = kStagesFit > 6 ? 6 : kStagesFit;",
            "static constexpr int kStages = kStagesFit;",
        ),
    ),
}


def apply(files: dict[str, str], ablations: list[str]) -> dict[str, str]:
    """``files`` (path -> text) with the edits of ``ablations`` applied, in order."""
    out = dict(files)
    for name in ablations:
        if name not in ABLATIONS:
            raise ValueError(f"ablation {name!r}: not one of {sorted(ABLATIONS)}")
        for edit in ABLATIONS[name]:
            text = out[edit.path]
            found = text.count(edit.old)
            if found != edit.count:
                raise ValueError(
                    f"ablation {name!r}: {edit.path} holds the text to replace {found} times, "
                    f"expected {edit.count} (the kernel changed: update the edit)"
                )
            out[edit.path] = text.replace(edit.old, edit.new)
    return out


def parse_build(spec: str) -> tuple[str, list[str]]:
    """``NAME=A+B`` -> (NAME, [A, B])."""
    name, sep, parts = spec.partition("=")
    if not sep or not name.isidentifier() or not parts or name == "base":
        raise ValueError(
            f"build {spec!r}: expected NAME=ABLATION[+ABLATION...], NAME an identifier "
            "other than base"
        )
    ablations = parts.split("+")
    for a in ablations:
        if a not in ABLATIONS:
            raise ValueError(f"build {spec!r}: {a!r} is not one of {sorted(ABLATIONS)}")
    if len(set(ablations)) != len(ablations):
        raise ValueError(f"build {spec!r}: an ablation named twice")
    return name, ablations


def archive(rev: str, root: Path = ROOT) -> bytes:
    """The tree of ``rev`` in the checkout at ``root`` as a tar (git archive)."""
    top = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        raise ValueError(f"{root} is not the top of a git checkout: {top.stderr.strip()}")
    got = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", rev],
        capture_output=True,
    )
    if got.returncode != 0:
        raise ValueError(f"git archive {rev}: {got.stderr.decode().strip()}")
    return got.stdout


def edited_files(base_tar: bytes, ablations: list[str]) -> dict[str, str]:
    """The files ``ablations`` edit, from ``base_tar``, edited (path -> text)."""
    edited_paths = {e.path for a in ablations for e in ABLATIONS[a]}
    with tarfile.open(fileobj=io.BytesIO(base_tar)) as src:
        texts = {
            m.name: src.extractfile(m).read().decode()
            for m in src.getmembers()
            if m.name in edited_paths
        }
    missing = edited_paths - texts.keys()
    if missing:
        raise ValueError(f"the tree has no {sorted(missing)}")
    return apply(texts, ablations)


def write_ablated(base_tar: bytes, edited: dict[str, str], path: Path) -> None:
    """``base_tar`` with the files of ``edited`` (path -> text) replaced, to ``path``."""
    with tarfile.open(fileobj=io.BytesIO(base_tar)) as src:
        members = src.getmembers()
        with tarfile.open(path, "w") as dst:
            for m in members:
                if m.name in edited:
                    data = edited[m.name].encode()
                    info = tarfile.TarInfo(m.name)
                    info.size, info.mode, info.mtime = len(data), m.mode, m.mtime
                    dst.addfile(info, io.BytesIO(data))
                else:
                    dst.addfile(m, src.extractfile(m) if m.isfile() else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where NAME.tar and base.tar go (.ab)")
    parser.add_argument("builds", nargs="+", help="NAME=ABLATION[+ABLATION...]")
    parser.add_argument("--rev", default="HEAD", help="the tree to ablate (git revision)")
    args = parser.parse_args(argv)
    builds = [parse_build(b) for b in args.builds]
    names = [name for name, _ in builds]
    if len(set(names)) != len(names):
        raise SystemExit(f"stream_ablations: a build name given twice: {names}")
    base_tar = archive(args.rev, ROOT)
    # Every edit before anything is written: a stale edit leaves no half-made set.
    edits = {name: edited_files(base_tar, ablations) for name, ablations in builds}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "base.tar").write_bytes(base_tar)
    for name, ablations in builds:
        write_ablated(base_tar, edits[name], args.out_dir / f"{name}.tar")
        print(f"{args.out_dir / name}.tar: {'+'.join(ablations)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
