"""The weight-streaming GEMM's MXFP4 decode into wgmma A-fragment registers
(kernels/engine/fragment_decode.cuh), on the CPU.

A thread owning byte c of each 8-code word turns it into one BF16 pair with a byte
permute (in its sign-replicate mode), a left shift by 2 and a mask, then multiplies
by 2^(scale - 1), one half of its row's factor pair (one factor per 32 codes). The
driver (tests/cpu/host/fragment_decode.cu, built with nvcc) runs the placement for
every byte position against 1,280 words and writes the factor pairs; the oracle is
E2M1 x 2^(scale - 127) in float64. The multiply itself is the GPU's (fma.rn.bf16x2):
tests/gpu/test_weight_stream.py checks it bit for bit against the transient decode.

The driver also runs ``decode_rows<2>``, the kernel's whole step for one thread (two
weights' rows r and r + 8: their words and scale bytes to each weight's 16 A-fragment
registers of four k16 MMAs), with the host's exact FP32 product in place of the device
multiply, from each row's scale word (``scale_word``: the factor pair for bytes below
128, else the bytes under a flag). Each call decodes two cases under one scale check,
so a case within the fast path beside one past it takes the FP32 path and must give the
same bits. Its oracle
places each decoded value by the PTX ISA's wgmma A-fragment layout for 16-bit types:
register i of k16 step j holds row r + 8 (i % 2), columns 16 j + 8 (i // 2) + 2c and + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """float64 values of BF16 bit patterns (uint16 or uint32 low halves)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _e2m1(codes: np.ndarray) -> np.ndarray:
    values = E2M1_MAGNITUDES[codes & 7]
    return np.where(codes & 8, -values, values)


#: Cases per byte position in the driver (kFragmentCases in tests/cpu/host/fragment_decode.cu).
FRAGMENT_CASES = 256
#: Per case: c, the scale pairs, 2 x 8 words, 4 x 4 fragment registers, the fast-path check.
CASE_WORDS = 2 + 16 + 16 + 1


@pytest.fixture(scope="module")
def driver_output(run_host_driver: Callable[[str], Path]) -> np.ndarray:
    return np.fromfile(run_host_driver("fragment_decode"), dtype=np.uint32)


@pytest.fixture(scope="module")
def placed(driver_output: np.ndarray, mxfp4_words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    placed_end = 128 + 4 * len(mxfp4_words)
    return driver_output[:128], driver_output[128:placed_end].reshape(4, -1)


@pytest.fixture(scope="module")
def fragment_cases(driver_output: np.ndarray, mxfp4_words: np.ndarray) -> np.ndarray:
    """[cases, CASE_WORDS]: c, pairs, words [2][8], fragment [4][4], then the fast-path
    check of the case's own rows (StepScales' fast flag), per row."""
    start = 128 + 4 * len(mxfp4_words)
    count = int(driver_output[start])
    cases = driver_output[start + 1 :]
    assert count == 4 * FRAGMENT_CASES and cases.size == count * CASE_WORDS
    return cases.reshape(count, CASE_WORDS)


def test_factor_pair_is_two_to_each_scale_minus_one(
    placed: tuple[np.ndarray, np.ndarray],
) -> None:
    """row_factors(b0 | b1 << 8) is the BF16 pair [2^(b0 - 1) | 2^(b1 - 1)], for every fast
    byte in each half (the driver pairs b with 127 - b)."""
    factors, _ = placed
    scales = np.arange(128)
    assert np.array_equal(_bf16_values(factors & 0xFFFF), np.ldexp(1.0, scales - 1))
    assert np.array_equal(_bf16_values(factors >> 16), np.ldexp(1.0, 126 - scales))


def test_placed_pairs_are_the_codes_times_2_pow_minus_126(
    placed: tuple[np.ndarray, np.ndarray], mxfp4_words: np.ndarray
) -> None:
    _, pairs = placed
    words = mxfp4_words
    for c in range(4):
        low_codes = ((words >> np.uint64(8 * c)) & 0xF).astype(np.int64)
        high_codes = ((words >> np.uint64(8 * c + 4)) & 0xF).astype(np.int64)
        low = _bf16_values(pairs[c] & 0xFFFF)
        high = _bf16_values(pairs[c] >> 16)
        # Signed zeros too: code 8 is -0.
        np.testing.assert_array_equal(low, np.ldexp(_e2m1(low_codes), -126))
        np.testing.assert_array_equal(np.signbit(low), (low_codes & 8) != 0)
        np.testing.assert_array_equal(high, np.ldexp(_e2m1(high_codes), -126))
        np.testing.assert_array_equal(np.signbit(high), (high_codes & 8) != 0)


def test_products_are_exact_bf16(placed: tuple[np.ndarray, np.ndarray]) -> None:
    """pair x factor is E2M1 x 2^(scale - 127), and a BF16 (subnormals included) for
    every fast scale: the device's rounded multiply has nothing to round."""
    factors, pairs = placed
    values = _bf16_values(pairs & 0xFFFF)
    for scale in range(128):
        products = values * _bf16_values(factors[scale] & 0xFFFF)
        as_bf16 = _bf16_values(
            (products.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
        )
        np.testing.assert_array_equal(as_bf16, products)


def _expected_fragment(c: int, pairs: int, words: np.ndarray) -> np.ndarray:
    """The [4][4] registers' (low, high) float64 values by the wgmma A-fragment layout:
    row (0: r, 1: r + 8) and column of each half, the code at that column, its scale."""
    expected = np.empty((4, 4, 2))
    for k16 in range(4):
        for reg in range(4):
            row = reg % 2
            for half in range(2):
                column = 16 * k16 + 8 * (reg // 2) + 2 * c + half
                code = (int(words[row, column // 8]) >> (4 * (column % 8))) & 0xF
                scale = (pairs >> (16 * row + 8 * (column // 32))) & 0xFF
                if scale == 0xFF:
                    expected[k16, reg, half] = np.nan
                else:
                    value = np.float32(np.ldexp(_e2m1(np.array(code)), scale - 127))
                    expected[k16, reg, half] = float(value)  # inf past the FP32 range
    return expected


def test_step_fragment_follows_the_wgmma_layout(fragment_cases: np.ndarray) -> None:
    """decode_rows puts each code of a thread's two rows, times its row's and column
    block's scale, where the wgmma A fragment wants it: every register of every case,
    both scale paths (bytes below 128, and any byte from 128 up, in either case of a
    call), bit for bit."""
    slow = 0
    with np.errstate(over="ignore"):
        for case in fragment_cases:
            c, pairs = int(case[0]), int(case[1])
            words = case[2:18].reshape(2, 8)
            fragment = case[18:34].reshape(4, 4)
            got = np.stack([_bf16_values(fragment & 0xFFFF), _bf16_values(fragment >> 16)], axis=-1)
            expected = _expected_fragment(c, pairs, words)
            np.testing.assert_array_equal(got, expected, err_msg=f"c={c} pairs={pairs:#010x}")
            # -0 codes stay -0 (the FMA's -0 addend; the FP32 path keeps it too).
            zeros = expected == 0
            np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(expected[zeros]))
            slow += any(((pairs >> (8 * b)) & 0xFF) >= 128 for b in range(4))
    assert 0 < slow < len(fragment_cases), "both scale paths ran"


def test_fast_path_check_is_every_scale_byte_below_128(fragment_cases: np.ndarray) -> None:
    """StepScales' fast flag, the check that picks the fast path, is true exactly when
    every scale byte of its rows is below 128: a check that picks the FP32 path too often
    would still give the right values, so it is compared on its own."""
    pairs = fragment_cases[:, 1].astype(np.int64)
    expected = np.all([((pairs >> (8 * b)) & 0xFF) < 128 for b in range(4)], axis=0)
    np.testing.assert_array_equal(fragment_cases[:, 34].astype(bool), expected)
    assert 0 < expected.sum() < len(expected)


# ---- the transposed step (the dgrads): decode_column_pairs ----

#: Cases of tests/cpu/host/fragment_decode_transposed.cu (kCases).
TRANSPOSED_CASES = 1024
#: Per case: 16 row loads, 8 scale pairs, 2 x 4 x 4 fragment registers, the fast flag.
TRANSPOSED_CASE_WORDS = 16 + 8 + 32 + 1


@pytest.fixture(scope="module")
def transposed_cases(run_host_driver: Callable[[str], Path]) -> np.ndarray:
    output = np.fromfile(run_host_driver("fragment_decode_transposed"), dtype=np.uint32)
    assert int(output[0]) == TRANSPOSED_CASES
    cases = output[1:]
    assert cases.size == TRANSPOSED_CASES * TRANSPOSED_CASE_WORDS
    return cases.reshape(TRANSPOSED_CASES, TRANSPOSED_CASE_WORDS)


def _expected_transposed(rows: np.ndarray, scale_pairs: np.ndarray) -> np.ndarray:
    """[tile][k16][reg][half] float64 by the wgmma A layout with the dgrad's column
    order: register a0 / a2 (fragment row g) holds the low codes of byte 2q + tile, a1 /
    a3 (row g + 8) its high codes; a0 / a1 the rows 2c, 2c + 1 of the k16 step, a2 / a3
    rows 2c + 8, 2c + 9; the low half row n, the high half row n + 1, each times its own
    row's scale."""
    expected = np.empty((2, 4, 4, 2))
    for tile in range(2):
        for k16 in range(4):
            for reg in range(4):
                j, high = reg // 2, reg % 2
                for half in range(2):
                    load = int(rows[4 * k16 + 2 * j + half])
                    code = (load >> (8 * tile + 4 * high)) & 0xF
                    scale = (int(scale_pairs[2 * k16 + j]) >> (8 * half)) & 0xFF
                    if scale == 0xFF:
                        value = np.nan
                    else:
                        value = float(np.float32(np.ldexp(_e2m1(np.array(code)), scale - 127)))
                    expected[tile, k16, reg, half] = value
    return expected


def test_transposed_step_follows_the_wgmma_layout(transposed_cases: np.ndarray) -> None:
    """decode_column_pairs puts each code of a thread's 16 stored rows, times its own
    row's scale, where the wgmma A fragment of the dgrad's column order wants it: every
    register of every case (every byte value in both bytes of every row), both scale
    paths, bit for bit, -0 kept."""
    slow = 0
    with np.errstate(over="ignore"):
        for case in transposed_cases:
            rows, pairs = case[:16], case[16:24]
            fragment = case[24:56].reshape(2, 4, 4)
            got = np.stack([_bf16_values(fragment & 0xFFFF), _bf16_values(fragment >> 16)], axis=-1)
            expected = _expected_transposed(rows, pairs)
            np.testing.assert_array_equal(got, expected, err_msg=f"rows={rows} pairs={pairs}")
            zeros = expected == 0
            np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(expected[zeros]))
            slow += bool(np.any(pairs & 0x8080))
    assert 0 < slow < len(transposed_cases), "both scale paths ran"


def test_transposed_fast_path_check(transposed_cases: np.ndarray) -> None:
    """The step's fast flag is true exactly when every scale byte of its 16 rows is below
    128."""
    pairs = transposed_cases[:, 16:24]
    expected = ~np.any(pairs & 0x8080, axis=1)
    np.testing.assert_array_equal(transposed_cases[:, 56].astype(bool), expected)
    assert 0 < expected.sum() < len(expected)
