"""Sums over the tokens: ``a^T b`` in FP32 for ``[T, M]`` and ``[T, N]`` BF16 operands
(the reduction runs over the T rows), by the engine's K-grouped kind with FP32 output
(``KGroupedFloat``, kernels/engine/).

The side-LoRA backward's shared-factor gradients are such sums: ``x^T [sg | su]`` for
``a1 | a3`` and ``p_sum^T dout`` for ``b2``. They were cuBLAS GEMMs (``torch.mm`` with an
FP32 result, ``x.T`` a transposed view) until those were measured wrong at some T: with
torch 2.11 + CUDA 13.0 on an H100, about one token's share (1-2e-2 relative) is missing
from the sum at some T >= 2561, every one listed with T % 64 in 1..3
(docs/PERFORMANCE.md, fifty-fifth session). The engine's K loop masks the rows of a
partial last step in shared memory, and a float64 oracle test covers these T.

The tokens are split into chunks for parallelism (the kernel's "experts"): each chunk's
FP32 partial is a tile of its own, and one ``torch.sum`` over the chunks adds them in a
fixed order. The chunking depends only on T, M, N and the SM budget
(:func:`megamoe.env.num_sms`: the device's SMs less ``MEGAMOE_SM_HEADROOM``, or
``MEGAMOE_NUM_SMS``), so the result is the same bits run after run with the same budget;
a different budget may chunk differently and round differently.

Accuracy: the tensor cores' FP32 accumulation truncates, so a chunk's error grows with
its rows (about 5e-5 relative at 32K rows in a truncating model of it), far below the
BF16 rounding (2^-9) of the gradients these sums become.
"""

from __future__ import annotations

import torch

from ..env import num_sms as resolve_device_sms
from ..validation.arguments import check_tensor
from . import _native
from .k_grouped_gemm import BLOCK_M, FLOAT_BLOCK_N, launch_k_grouped

#: A chunk is at least this many rows, so that the partials (``chunks x M x N`` FP32, read
#: once more by the sum) stay small next to the operands' ``T x (M + N)``.
MIN_CHUNK_ROWS = 512
#: Chunks start on a K step (64 rows): only the last step of the last chunk is partial.
CHUNK_ALIGN = 64


def token_chunk_rows(tokens: int, m: int, n: int, num_sms: int) -> int:
    """Rows per chunk: enough chunks that ``chunks x`` the output tiles fill the SMs once,
    each at least :data:`MIN_CHUNK_ROWS` rows (one chunk when T is small), a multiple of
    :data:`CHUNK_ALIGN`."""
    tiles = -(-m // BLOCK_M) * -(-n // FLOAT_BLOCK_N)
    chunks = max(1, min(num_sms // tiles, tokens // MIN_CHUNK_ROWS))
    rows = -(-max(tokens, 1) // chunks)
    return -(-rows // CHUNK_ALIGN) * CHUNK_ALIGN


def chunk_bounds(
    tokens: int, rows: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [chunks + 1], counts [chunks])`` int32 of the chunks of ``rows`` rows
    (the last one shorter) over ``tokens > 0`` rows, made on ``device`` without a host
    copy (graph-capturable): chunk g is rows ``[g rows, min((g + 1) rows, T))``. One
    chunk, the small-T case, is one launch: ``[0, T]`` and a view of its last element."""
    if tokens <= rows:
        offsets = torch.arange(0, tokens + 1, tokens, dtype=torch.int32, device=device)
        return offsets, offsets[1:]
    chunks = -(-tokens // rows)
    # The last chunk's nominal end, chunks x rows, passes 2^31 - 1 when T is within a
    # chunk of it: count in int64 there (then clamped to T, which int32 holds).
    wide = chunks * rows > torch.iinfo(torch.int32).max
    offsets = torch.arange(
        0, chunks * rows + 1, rows, dtype=torch.int64 if wide else torch.int32, device=device
    ).clamp_(max=tokens)
    if wide:
        offsets = offsets.int()
    return offsets, offsets.diff()


def _check_operand(name: str, t: torch.Tensor, rows: int | None, device: torch.device) -> None:
    check_tensor(name, t, ndim=2, dtypes=(torch.bfloat16,), device=device)
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows (the tokens of a), got {t.shape[0]}")
    if t.shape[1] < 8 or t.shape[1] % 8 != 0:
        raise ValueError(
            f"{name}: expected a multiple of 8 columns (16-byte rows for TMA), got {t.shape[1]}"
        )


def token_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T b`` summed in FP32 over the rows (tokens), not rounded.

    Args:
        a: ``[T, M]`` BF16, ``M`` a multiple of 8.
        b: ``[T, N]`` BF16 on the same device, ``N`` a multiple of 8.

    Returns:
        ``[M, N]`` float32 (exact zeros for T = 0). CUDA: the engine (any strides are
        made contiguous first); CPU: a float32 torch twin, for CPU tests of the pipelines.
    """
    _check_operand("a", a, None, a.device if isinstance(a, torch.Tensor) else None)
    _check_operand("b", b, a.shape[0], a.device)
    return token_sum_unchecked(a, b)


def token_sum_unchecked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`token_sum` for the pipelines, whose operands are made from checked inputs:
    no Python checks (the native launcher still checks shapes, strides and devices,
    except at T = 0, where no launch is made and the result is zeros)."""
    if not a.is_cuda:
        return a.float().T @ b.float()
    tokens, m, n = a.shape[0], a.shape[1], b.shape[1]
    if tokens == 0:  # an EP rank without tokens
        return torch.zeros(m, n, dtype=torch.float32, device=a.device)
    a, b = a.contiguous(), b.contiguous()
    rows = token_chunk_rows(tokens, m, n, resolve_device_sms(_native.device_index(a.device)))
    offsets, counts = chunk_bounds(tokens, rows, a.device)
    chunks = counts.shape[0]
    partials = torch.empty(chunks, m, n, dtype=torch.float32, device=a.device)
    launch_k_grouped(a, b, offsets, counts, partials)
    return partials[0] if chunks == 1 else partials.sum(0)


def token_sum_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Float64 ``a^T b`` of :func:`token_sum` (the oracle)."""
    return a.double().T @ b.double()
