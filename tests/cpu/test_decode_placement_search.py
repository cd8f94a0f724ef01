"""tools/decode_placement_search.py: its checker accepts what a LOP3 can do and refuses
what it cannot, so its "none found" over all forms is a result, not a checker that always
says no (the full search: ``python tools/decode_placement_search.py``, about 30 s)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

_PATH = Path(__file__).resolve().parents[2] / "tools" / "decode_placement_search.py"
_SPEC = importlib.util.spec_from_file_location("decode_placement_search", _PATH)
search = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(search)

B = search.BYTES


def test_placement_is_the_bf16_denormal_form():
    # Code 0b0010 (+1.0) in the low half is exponent field 1: 2^-126, the E2M1 value
    # times 2^-126; code 0b1111 (-6.0) in the high half: sign, exponent 3, mantissa top.
    word = int(search.placement(np.array([0xF2], dtype=np.uint64))[0])
    assert word & 0xFFFF == 0b0_00000001_0000000
    assert word >> 16 == 0b1_00000011_1000000


def test_the_checker_accepts_forms_a_lop3_can_do():
    # Q already the placement: LOP3 copies it.
    assert search.lop3_places(B, search.placement(B))
    # The low code's magnitude alone from P = b and Q = b * 64 (b << 6): Q & K.
    low_magnitude = search._bit_matrix((B & np.uint64(7)) << np.uint64(6))
    assert search.lop3_places(B, (B * np.uint64(64)) & search.WORD, low_magnitude)


def test_the_checker_refuses_forms_that_cannot_place():
    assert not search.lop3_places(B, B)
    assert not search.lop3_places(B, (B * np.uint64(64)) & search.WORD)


def test_no_form_of_one_byte_layout_places_every_byte():
    layouts = [(name, p) for name, p in search.permuted_bytes() if name in ("000b", "0b0b")]
    assert len(layouts) == 2
    checked, found = search.search(layouts)
    assert checked == 2 * (31 + 32 + 496 + 4960)
    assert found == []


def test_prmt_picks_bytes_as_byte_perm_does():
    # Selector nibbles 1, 3, 5, 7: bytes 1 and 3 of a, then bytes 1 and 3 of b.
    assert search.prmt(0x03020100, 0x07060504, 0x7531) == 0x07050301
    assert search.prmt(0x03020100, 0x07060504, 0x4567) == 0x04050607


def test_repacked_codes_have_three_instruction_layouts_each_checked_on_every_byte():
    layouts = search.repacked_layouts()
    assert len(layouts) == 14
    for layout in layouts:
        masks = [decode.mask for decode in layout]
        assert sum(masks) == search.WORD_BITS and all(bin(m).count("1") == 8 for m in masks)
        assert search.check_layout(layout, fills=1)
        assert not search.keeps_halves(layout)


def test_keeps_halves_sees_two_lanes_in_each_half():
    lane = search.LaneDecode(0, ((0, 0),) * 4, ())
    low, high = lane._replace(bits=(((0, 0), 3),)), lane._replace(bits=(((0, 0), 20),))
    straddles = lane._replace(bits=(((0, 0), 3), ((0, 1), 20)))
    assert search.keeps_halves((low, low, high, high))
    assert not search.keeps_halves((low, low, low, high))
    assert not search.keeps_halves((low, straddles, high, high))


def test_the_repacked_checker_refuses_a_wrong_lane():
    layout = search.repacked_layouts()[0]
    wrong_shift = layout[0]._replace(shift=layout[0].shift + 1)
    assert not search.check_layout((wrong_shift, *layout[1:]), fills=1)
    # A selector that reads another byte than the one the bits were packed into.
    (src, byte), *rest = layout[0].sources
    wrong_byte = layout[0]._replace(sources=((src, (byte + 1) % 4), *rest))
    assert not search.check_layout((wrong_byte, *layout[1:]), fills=1)
