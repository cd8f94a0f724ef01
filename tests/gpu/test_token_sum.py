"""The token sums (``a^T b`` over the rows, FP32) vs float64, at the token counts where
cuBLAS's ``torch.mm`` was measured wrong (T >= 2561, T % 64 in 1..3; docs/PERFORMANCE.md,
fifty-fifth session). The FP32 kind's masking of rows past a group's data is in
test_k_grouped_gemm.py."""

import pytest
import torch

from megamoe.env import num_sms as resolve_num_sms
from megamoe.wrappers.token_sum import token_chunk_rows, token_sum, token_sum_reference

pytestmark = pytest.mark.gpu


def max_relative(tokens, m, n):
    """The relative L2 bound of an FP32 sum of exact BF16 products: the tensor cores'
    accumulation truncates, so the error grows with a chunk's rows (about 1.5e-9 per row
    in a truncating model). A sum missing one token's share reads ~1/sqrt(T), 4e-3 at
    T = 65,537 and 2e-2 at 2561."""
    rows = min(tokens, token_chunk_rows(tokens, m, n, resolve_num_sms()))
    return 1e-5 + 4e-9 * rows


#: Token counts: the K step's edges, one chunk's edges, and the counts cuBLAS got wrong.
TOKENS = [1, 63, 64, 65, 511, 513, 2561, 2562, 2563, 4033, 5121, 10241]
#: (M, N): the side-LoRA backward's shapes at r = 16 (x^T [sg | su], p_sum^T dout at
#: H = 512) and at production width (H = 4096, r = 128).
SHAPES = [(512, 32), (16, 512), (4096, 256), (128, 4096)]


def bf16(rows, cols, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, cols, device="cuda", generator=generator).bfloat16()


def relative(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("tokens", TOKENS)
def test_token_sum_matches_float64(tokens, shape):
    m, n = shape
    if m * n >= 4096 * 256 and tokens < 2561:
        pytest.skip("the wide shapes at the long sums only")
    a, b = bf16(tokens, m, tokens), bf16(tokens, n, tokens + 1)
    out = token_sum(a, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    expected = token_sum_reference(a, b)
    bound = max_relative(tokens, m, n)
    assert relative(out, expected) <= bound, (tokens, shape, relative(out, expected))
    # Row by row too: a wrong tile or chunk is a few rows of the whole.
    rows = (out.double() - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-30)
    assert float(rows.max()) <= 10 * bound
    assert torch.equal(token_sum(a, b), out), "a repeated sum must give the same bits"


@pytest.mark.parametrize("shape", [(512, 32), (4096, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_token_sum_of_long_sums(shape):
    """T = 65,537: several chunks (their partials summed after the kernel), each a whole
    number of K steps but the last, which ends on one row; at production width few
    chunks of many rows (the SMs are filled by the output tiles)."""
    (m, n), tokens = shape, 65537
    if (m, n) == (512, 32):
        assert -(-tokens // token_chunk_rows(tokens, m, n, resolve_num_sms())) > 1
    a, b = bf16(tokens, m, 3), bf16(tokens, n, 4)
    out = token_sum(a, b)
    assert relative(out, token_sum_reference(a, b)) <= max_relative(tokens, m, n)
    assert torch.equal(token_sum(a, b), out)


def test_token_sum_of_no_tokens_is_zeros():
    out = token_sum(bf16(0, 64, 0), bf16(0, 32, 1))
    assert out.shape == (64, 32) and bool((out == 0).all())
    assert not bool(torch.signbit(out).any())


def test_token_sum_reads_column_slices():
    """Operands sliced out of wider rows (made contiguous first) sum as the slices do."""
    wide = bf16(3000, 640, 5)
    a, b = wide[:, 64:576], wide[:, 600:632]
    out = token_sum(a, b)
    assert relative(out, token_sum_reference(a, b)) <= max_relative(3000, 512, 32)
