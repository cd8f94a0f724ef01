"""The token sums' wrapper on the CPU: argument checks, the float32 twin against float64,
and the chunking rule (tests/gpu/test_token_sum.py runs the kernel)."""

import pytest
import torch

from megamoe.wrappers.k_grouped_gemm import BLOCK_M, FLOAT_BLOCK_N
from megamoe.wrappers.token_sum import (
    CHUNK_ALIGN,
    MIN_CHUNK_ROWS,
    chunk_bounds,
    token_chunk_rows,
    token_sum,
    token_sum_reference,
)


def bf16(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator).bfloat16()


def test_twin_matches_float64():
    a, b = bf16(777, 64, 0), bf16(777, 32, 1)
    out = token_sum(a, b)
    assert out.dtype == torch.float32 and out.shape == (64, 32)
    expected = token_sum_reference(a, b)
    assert float((out.double() - expected).norm() / expected.norm()) <= 1e-5


@pytest.mark.parametrize(
    "a, b, error, match",
    [
        ("not a tensor", bf16(4, 8, 0), TypeError, r"^a: expected a torch.Tensor"),
        (bf16(4, 8, 0).float(), bf16(4, 8, 1), TypeError, r"^a: expected dtype"),
        (bf16(4, 8, 0), bf16(4, 8, 1).half(), TypeError, r"^b: expected dtype"),
        (bf16(4, 8, 0)[None], bf16(4, 8, 1), ValueError, r"^a: expected 2 dimensions"),
        (bf16(4, 8, 0), bf16(5, 8, 1), ValueError, r"^b: expected 4 rows"),
        (bf16(4, 12, 0), bf16(4, 8, 1), ValueError, r"^a: expected a multiple of 8 columns"),
        (bf16(4, 8, 0), bf16(4, 4, 1), ValueError, r"^b: expected a multiple of 8 columns"),
    ],
)
def test_bad_operands_are_named(a, b, error, match):
    with pytest.raises(error, match=match):
        token_sum(a, b)


def test_bad_device_is_named():
    with pytest.raises(ValueError, match=r"^b: expected device"):
        token_sum(bf16(4, 8, 0), bf16(4, 8, 1).to("meta"))


@pytest.mark.parametrize("tokens", [0, 1, 511, 512, 1023, 2561, 10241, 65537, 1 << 20])
@pytest.mark.parametrize("m, n, sms", [(4096, 256, 132), (128, 4096, 132), (512, 32, 78)])
def test_chunks_fill_the_sms_once_and_cover_the_tokens(tokens, m, n, sms):
    rows = token_chunk_rows(tokens, m, n, sms)
    chunks = -(-max(tokens, 1) // rows)
    tiles = -(-m // BLOCK_M) * -(-n // FLOAT_BLOCK_N)
    assert rows % CHUNK_ALIGN == 0 and rows >= CHUNK_ALIGN
    assert chunks * rows >= tokens and (chunks - 1) * rows < max(tokens, 1)
    assert chunks * tiles <= max(sms, tiles), "more tiles than one wave of the SMs"
    if chunks > 1:
        assert rows >= MIN_CHUNK_ROWS


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 511, 512, 513, 2561, 4096, 10241, 65537])
@pytest.mark.parametrize("rows", [64, 512, 576, 4096])
def test_chunk_bounds_are_each_chunks_start_and_length(tokens, rows):
    offsets, counts = chunk_bounds(tokens, rows, "cpu")
    chunks = -(-tokens // rows)
    starts = [min(g * rows, tokens) for g in range(chunks + 1)]
    assert offsets.dtype == counts.dtype == torch.int32
    assert offsets.tolist() == starts
    assert counts.tolist() == [starts[g + 1] - starts[g] for g in range(chunks)]
    # The same, as properties: the chunks tile [0, T), each full but the last.
    assert offsets[0] == 0 and offsets[-1] == tokens and int(counts.sum()) == tokens
    assert all(c == rows for c in counts[:-1].tolist()) and 0 < int(counts[-1]) <= rows


@pytest.mark.parametrize("rows", [512, 4096])
def test_chunk_bounds_near_the_int32_limit(rows):
    """T within a chunk of 2^31 - 1: the last chunk's nominal end passes int32."""
    tokens = torch.iinfo(torch.int32).max - 1
    offsets, counts = chunk_bounds(tokens, rows, "cpu")
    assert offsets.dtype == counts.dtype == torch.int32
    assert int(offsets[-1]) == tokens and int(offsets[-2]) == (tokens // rows) * rows
    assert int(counts.min()) > 0 and int(counts.to(torch.int64).sum()) == tokens
