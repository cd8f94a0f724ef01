#!/usr/bin/env python3
"""Is there a three-instruction placement of an MXFP4 code byte into a BF16 pair?

The weight-streaming decode (kernels/engine/fragment_decode.cuh) turns a thread's code
byte ``b`` (codes 2c and 2c + 1 of a word) into the BF16x2 word whose halves are the two
codes placed as BF16 denormal-range values: the sign at bit 15 (31) and the code's three
magnitude bits at bits 8..6 (24..22), which is the E2M1 value times 2^-126; one BF16x2
multiply by 2^(scale - 1) then gives the value. The placement takes a byte permute with
its sign-replicate mode, a shift and a mask per pair (plus a shift per word shared by its
four pairs); issue 17's MXFP4 targets need fewer instructions per code
(docs/ENGINE.md, "The weight-streaming GEMMs").

This tool checks every placement of three instructions of the forms the hardware has for
it, exhaustively over the byte's 256 values:

- ``P = PRMT(word, 0, selector)``: each byte of ``P`` is 0, ``b`` or ``b``'s sign
  replicated (0x00 / 0xFF): a clean copy of the thread's byte wherever the selector puts
  it (the only way to pick byte c of a word with c a per-thread value);
- ``Q = P * m`` (``IMAD``: ``m`` with up to three bits set, i.e. the sum of up to three
  shifted copies of ``P``) or ``Q = P >> k`` (``SHF``);
- ``out = LOP3(P, Q, K)``: any of the 256 truth tables, with any 32-bit immediate ``K``
  (decided per bit).

It prints how many forms it checked and every form that yields the placement for all 256
bytes; it finds none. The checker itself is tested on a form that must pass
(tests/cpu/test_decode_placement_search.py). Runs on the CPU in about 30 seconds:

    python tools/decode_placement_search.py

``--repacked`` asks the question for codes repacked once at load instead (a per-word
permutation of the 32 code bits, not built: the kernels read the caller's layout). Each
lane ``c`` of a quad then decodes its pair, codes ``2c`` and ``2c + 1`` of the word, in
three integer instructions, ``Q = word << k_c`` (``IMAD.SHL`` with a per-lane power of
two), ``P = PRMT(word, Q, selector_c)`` and ``P & 0x81C081C0``, if the four lanes' bits
can share one word. It lists every partition of the word's 32 bits into four lanes' bit
sets that such decodes reach (an exact cover; one decode is kept per lane bit set, and
each partition stands for several equivalent shifts and selectors) and checks each
listed layout on every value of each lane's byte.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

BITS = np.arange(32, dtype=np.uint64)
WORD = np.uint64(0xFFFFFFFF)
BYTES = np.arange(256, dtype=np.uint64)


def placement(b: np.ndarray) -> np.ndarray:
    """The BF16x2 word of code byte ``b``: low code in the low half, high code in the
    high half, each sign at the half's bit 15 and its magnitude bits at bits 8..6."""
    low, high = b & np.uint64(0xF), b >> np.uint64(4)

    def half(code: np.ndarray) -> np.ndarray:
        return ((code & np.uint64(7)) << np.uint64(6)) | ((code >> np.uint64(3)) << np.uint64(15))

    return half(low) | (half(high) << np.uint64(16))


def _bit_matrix(words: np.ndarray) -> np.ndarray:
    """``[256, 32]`` bits of 256 words."""
    return ((words[:, None] >> BITS[None, :]) & np.uint64(1)).astype(np.uint8)


TARGET_BITS = _bit_matrix(placement(BYTES))
# Truth table entry v = p + 2 q of each of the 16 two-input functions.
FUNCTIONS = np.array([[(f >> v) & 1 for v in range(4)] for f in range(16)], dtype=np.uint8)


def lop3_places(p: np.ndarray, q: np.ndarray, target_bits: np.ndarray = TARGET_BITS) -> bool:
    """Whether some ``LOP3(p, q, K)`` (a truth table and an immediate ``K``) gives
    ``target_bits`` for all 256 bytes. The immediate's bit i picks, at bit i, one of the
    two functions of (p, q) the truth table holds (K_i = 0 or 1): so a table works if
    every bit is served by one of its two functions."""
    index = _bit_matrix(p) | (_bit_matrix(q) << 1)  # [256, 32] values 0..3
    # need[v, i]: 1 if bit i must be 0 where (p, q) = v, 2 if it must be 1, 3 if both.
    need = np.zeros((4, 32), dtype=np.uint8)
    for v in range(4):
        seen = index == v
        need[v] = ((target_bits == 0) & seen).any(0) * 1 + ((target_bits == 1) & seen).any(0) * 2
    if (need == 3).any():
        return False  # the same (p, q) must give both 0 and 1 at one bit
    serves = np.ones((16, 32), dtype=bool)  # serves[f, i]: function f gives bit i
    for v in range(4):
        serves &= ~((FUNCTIONS[:, v, None] == 0) & (need[v] == 2)[None, :])
        serves &= ~((FUNCTIONS[:, v, None] == 1) & (need[v] == 1)[None, :])
    return bool((serves[:, None, :] | serves[None, :, :]).all(2).any())


def permuted_bytes() -> Iterator[tuple[str, np.ndarray]]:
    """Every ``PRMT(word, 0, selector)`` image of the byte: bytes 0..3 each 0, ``b`` or
    its sign replicated (``s``), with ``b`` at least once."""
    sign = np.where(BYTES >> np.uint64(7), np.uint64(0xFF), np.uint64(0))
    values = {"0": np.zeros(256, dtype=np.uint64), "b": BYTES, "s": sign}
    for layout in itertools.product("0bs", repeat=4):
        if "b" in layout:
            word = sum(values[x] << np.uint64(8 * i) for i, x in enumerate(layout))
            yield "".join(reversed(layout)), word & WORD


def second_operands(p: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """``P >> k`` and ``P * m`` for ``m`` with one to three bits set."""
    for k in range(1, 32):
        yield f">> {k}", p >> np.uint64(k)
    for count in (1, 2, 3):
        for bits in itertools.combinations(range(32), count):
            m = sum(1 << i for i in bits)
            yield f"* {m:#x}", (p * np.uint64(m)) & WORD


def search(layouts: Iterable[tuple[str, np.ndarray]] | None = None) -> tuple[int, list[str]]:
    """``(forms checked, forms that place every byte)``."""
    checked, found = 0, []
    for layout, p in layouts if layouts is not None else permuted_bytes():
        for op, q in second_operands(p):
            checked += 1
            if lop3_places(p, q):
                found.append(f"P = [{layout}] (bytes 3..0), Q = P {op}")
    return checked, found


# ---- codes repacked once (--repacked) ----
PAIR_MASK = 0x81C081C0
WORD_BITS = 0xFFFFFFFF
# The BF16 pair's code bits by the byte of P that holds them: bytes 0 / 2 hold the low /
# high code's m (bit 6) and e0 (bit 7), bytes 1 / 3 its e1 (bit 0) and sign (bit 7).
# Entries: bit of P's byte -> (half, code bit).
_PAIR_BYTE_BITS = (
    {6: (0, 0), 7: (0, 1)},
    {0: (0, 2), 7: (0, 3)},
    {6: (1, 0), 7: (1, 1)},
    {0: (1, 2), 7: (1, 3)},
)


class LaneDecode(NamedTuple):
    """One lane's decode of a repacked word: ``Q = word << shift``, then each byte u of
    ``P = PRMT(word, Q, selector)`` is byte ``sources[u][1]`` of the word (``sources[u][0]``
    0) or of ``Q`` (1); ``bits`` maps (half, code bit) to the word bit that holds it."""

    shift: int
    sources: tuple[tuple[int, int], ...]
    bits: tuple[tuple[tuple[int, int], int], ...]

    @property
    def selector(self) -> int:
        return sum((byte + 4 * src) << (4 * u) for u, (src, byte) in enumerate(self.sources))

    @property
    def mask(self) -> int:
        return sum(1 << bit for _, bit in self.bits)


def lane_decodes() -> dict[int, LaneDecode]:
    """Every lane decode whose eight code bits are distinct word bits, by their mask
    (one decode per mask)."""
    decodes: dict[int, LaneDecode] = {}
    for shift in range(32):
        for sources in itertools.product(itertools.product((0, 1), range(4)), repeat=4):
            bits, mask = [], 0
            for u, (src, byte) in enumerate(sources):
                for bit, role in _PAIR_BYTE_BITS[u].items():
                    position = 8 * byte + bit - shift * src
                    if position < 0 or mask >> position & 1:
                        break
                    mask |= 1 << position
                    bits.append((role, position))
                else:
                    continue
                break
            else:
                decodes.setdefault(mask, LaneDecode(shift, sources, tuple(sorted(bits))))
    return decodes


def repacked_layouts() -> list[tuple[LaneDecode, ...]]:
    """Every partition of the word's 32 bits into four lane decodes' bit sets (lane order
    aside; one decode per bit set, :func:`lane_decodes`)."""
    by_lowest: dict[int, list[tuple[int, LaneDecode]]] = {}
    for mask, decode in lane_decodes().items():
        by_lowest.setdefault((mask & -mask).bit_length() - 1, []).append((mask, decode))
    layouts: list[tuple[LaneDecode, ...]] = []

    def cover(covered: int, chosen: tuple[LaneDecode, ...]) -> None:
        if covered == WORD_BITS:
            layouts.append(chosen)
            return
        lowest = (~covered & (covered + 1)).bit_length() - 1
        for mask, decode in by_lowest.get(lowest, []):
            if not mask & covered:
                cover(covered | mask, (*chosen, decode))

    cover(0, ())
    return layouts


def prmt(a: int, b: int, selector: int) -> int:
    """PRMT's default mode without sign replication (selector nibbles 0..7)."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((selector >> (4 * u)) & 7))) & 0xFF) << (8 * u) for u in range(4))


def repack(word: int, layout: tuple[LaneDecode, ...]) -> int:
    """The natural word (code i in bits 4i..4i + 3) in ``layout``: lane c's pair is codes
    2c and 2c + 1."""
    out = 0
    for lane, decode in enumerate(layout):
        for (half, code_bit), position in decode.bits:
            out |= ((word >> (4 * (2 * lane + half) + code_bit)) & 1) << position
    return out


def lane_places(layout: tuple[LaneDecode, ...], lane: int, word: int) -> bool:
    """Whether lane ``lane``'s three instructions on the repacked ``word`` give the
    placement of the natural word's byte ``lane``."""
    decode, packed = layout[lane], repack(word, layout)
    placed = prmt(packed, (packed << decode.shift) & WORD_BITS, decode.selector) & PAIR_MASK
    return placed == int(placement(np.array([(word >> (8 * lane)) & 0xFF], dtype=np.uint64))[0])


def check_layout(layout: tuple[LaneDecode, ...], fills: int = 4, seed: int = 0) -> bool:
    """Every lane places every value of its byte, the other bytes random (``fills``
    draws per value)."""
    rng = np.random.default_rng(seed)
    for lane in range(4):
        for value in range(256):
            for other in rng.integers(0, 1 << 32, size=fills, dtype=np.uint64):
                word = (int(other) & ~(0xFF << (8 * lane))) | (value << (8 * lane))
                if not lane_places(layout, lane, word):
                    return False
    return True


def keeps_halves(layout: tuple[LaneDecode, ...]) -> bool:
    """Whether two lanes' bits lie in the word's low 16 bits and two in its high 16 (what
    the transposed dgrads' 16-bit loads of a stored row would need)."""
    return sorted(decode.mask >> 16 == 0 for decode in layout) == [
        False,
        False,
        True,
        True,
    ] and all(decode.mask & 0xFFFF == 0 or decode.mask >> 16 == 0 for decode in layout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repacked", action="store_true", help="codes repacked once at load")
    args = parser.parse_args(argv)
    if args.repacked:
        layouts = repacked_layouts()
        good = [layout for layout in layouts if check_layout(layout)]
        halves = sum(keeps_halves(layout) for layout in good)
        print(
            f"repacked layouts: {len(layouts)}; every lane placing every byte: {len(good)};"
            f" two lanes in each 16-bit half: {halves}"
        )
        for layout in good:
            lanes = ", ".join(f"<< {d.shift}, PRMT {d.selector:#06x}" for d in layout)
            print(f"  {lanes}; lane masks {[hex(d.mask) for d in layout]}")
        return 0
    checked, found = search()
    print(f"forms checked: {checked}; placing every byte: {len(found)}")
    for form in found:
        print("  " + form)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
