"""The in-pipeline MXFP4 decode's table path (kernels/mxfp4_tile_decode.cuh), on the CPU.

`ScaleTables` turns eight E2M1 codes and a block's E8M0 scale byte into eight BF16 with
byte permutes; on the device it is `__byte_perm`, here the same selection on the host.
The driver (tests/cpu/host/mxfp4_scale_tables.cu, built with nvcc) decodes every fast
scale byte against 1,280 words (every code pair in every byte, then random words); the
oracle is E2M1 x 2^(scale - 127) in float64, whose BF16 bits are exact in that range.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _reference_bf16(words: np.ndarray, scale: int) -> np.ndarray:
    """[len(words), 8] BF16 bits of E2M1(code k of each word) x 2^(scale - 127)."""
    shifts = np.arange(8, dtype=np.uint64) * 4
    codes = ((words[:, None] >> shifts) & 0xF).astype(np.int64)
    values = E2M1_MAGNITUDES[codes & 7] * np.ldexp(1.0, scale - 127)
    values = np.where(codes & 8, -values, values).astype(np.float32)
    bits = values.view(np.uint32)
    assert not np.any(bits & 0xFFFF), "every product is a BF16 in the fast range"
    return (bits >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def decoded(run_host_driver: Callable[[str], Path]) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(run_host_driver("mxfp4_scale_tables"), dtype=np.uint8)
    return raw[:256].astype(bool), raw[256:].view(np.uint16)


def test_fast_range_is_the_normal_bf16_products(decoded: tuple[np.ndarray, np.ndarray]) -> None:
    fast, _ = decoded
    # 2 <= scale <= 252: 0.5 x 2^(scale - 127) is at least 2^-126 and 6 x 2^125 is finite.
    assert fast.tolist() == [2 <= scale <= 252 for scale in range(256)]


def test_table_path_matches_e2m1_times_scale(
    decoded: tuple[np.ndarray, np.ndarray], mxfp4_words: np.ndarray
) -> None:
    fast, values = decoded
    words = mxfp4_words
    scales = [scale for scale in range(256) if fast[scale]]
    got = values.reshape(len(scales), len(words), 8)
    for index, scale in enumerate(scales):
        expected = _reference_bf16(words, scale)
        mismatch = np.argwhere(got[index] != expected)
        if mismatch.size:
            word, code = (int(i) for i in mismatch[0])
            pytest.fail(
                f"scale {scale}: word {int(words[word]):#010x} code {code}: "
                f"{int(got[index, word, code]):#06x} != {int(expected[word, code]):#06x}"
            )
