"""The weight-streaming GEMM's MXFP4 decode into wgmma A-fragment registers
(kernels/engine/fragment_decode.cuh), on the CPU.

A thread owning byte c of each 8-code word turns it into one BF16 pair with a byte
permute (in its sign-replicate mode), an arithmetic shift and a mask, then multiplies
by the BF16 pair 2^(scale - 1). The driver (tests/cpu/host/fragment_decode.cu, built
with nvcc) runs the placement for every byte position against 1,280 words and writes
the factors; the oracle is E2M1 x 2^(scale - 127) in float64. The multiply itself is
the GPU's (mul.rn.bf16x2): tests/gpu/test_weight_stream.py checks it bit for bit
against the transient decode.
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


@pytest.fixture(scope="module")
def placed(run_host_driver: Callable[[str], Path]) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(run_host_driver("fragment_decode"), dtype=np.uint32)
    return raw[:129], raw[129:].reshape(4, -1)


def test_factor_is_two_to_the_scale_minus_one(placed: tuple[np.ndarray, np.ndarray]) -> None:
    factors, _ = placed
    assert np.all(factors >> 16 == factors & 0xFFFF), "the same factor in both halves"
    expected = np.ldexp(1.0, np.arange(129) - 1)
    assert np.array_equal(_bf16_values(factors & 0xFFFF), expected)


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
    for scale in range(129):
        products = values * _bf16_values(factors[scale] & 0xFFFF)
        as_bf16 = _bf16_values(
            (products.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
        )
        np.testing.assert_array_equal(as_bf16, products)
