"""K-grouped weight gradients over the expert pool (the engine's KGrouped kind,
kernels/engine/: its expert-rows tile scheduler and scaled-store epilogue).

``out[e] = scale * a_e^T b_e``, where ``a_e``/``b_e`` are expert ``e``'s data rows of
two pool-shaped operands: rows ``offsets[e] .. offsets[e] + counts[e] - 1``. This is
the backward's weight-gradient shape (``db1/db3``, ``da2``; ``dw13/dw2`` in ordinary
mode): the reduction runs over each expert's routes, a different length per expert.

The kernel never reads a padding row as data: the rows of a K step past the expert's
data are zeroed in shared memory before the MMA, so whatever the pool holds there
(padding, or the next expert's rows) cannot enter the sum; an expert without rows gets
exact zeros. FP32 accumulation, ``scale`` applied before the one rounding to BF16.
Deterministic (a fixed reduction order per output tile, no atomics).

On CPU tensors a torch twin computes the same (float32 per expert) so that pipelines
built on it run in CPU tests; :func:`k_grouped_gemm_reference` is the float64 oracle.
"""

from __future__ import annotations

import torch

from ..env import num_sms as resolve_device_sms
from ..validation.arguments import check_finite_float, check_tensor
from . import _native
from .routing import RoutePlan

#: BLOCK_M of the K-grouped variants (output rows per tile; registry ``engine_k_grouped_*``).
BLOCK_M = 128
#: BLOCK_N of the FP32-output variant, the only one (``engine_k_grouped_float_n128``).
FLOAT_BLOCK_N = 128


def k_grouped_block_n(out_columns: int) -> int:
    """Output tile width: 256 where the output has more than 128 columns, else 128
    (``N = r`` outputs, like ``da2``, would leave half of a 256-wide tile idle)."""
    return 256 if out_columns > 128 else 128


def _check_row_operand(name: str, t: torch.Tensor, rows: int, device: torch.device) -> None:
    check_tensor(name, t, shape=(rows, None), dtypes=(torch.bfloat16,), device=device)
    if t.shape[1] < 8 or t.shape[1] % 8 != 0:
        raise ValueError(
            f"{name}: expected a multiple of 8 columns (16-byte rows for TMA), got {t.shape[1]}"
        )
    if t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        raise ValueError(
            f"{name}: expected rows of unit column stride (a column slice of a pool is fine), "
            f"got strides {tuple(t.stride())}"
        )
    if t.is_cuda and (t.stride(0) * 2 % 16 != 0 or t.data_ptr() % 16 != 0):
        raise ValueError(
            f"{name}: TMA needs a 16-byte aligned start and a row stride of a multiple of 16 "
            f"bytes, got stride {t.stride(0)} elements at address {t.data_ptr():#x}"
        )


def k_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert ``scale * a_e^T b_e`` over each expert's data rows.

    Args:
        a: ``[pool rows, M]`` BF16, rows as ``plan`` groups them (unit column stride; the
            row stride may be wider, e.g. a column slice of a wider pool).
        b: ``[pool rows, N]`` BF16, the same rows.
        plan: the route plan (``expert_pool_offsets`` and ``expert_counts`` are read).
        scale: multiplies the FP32 sum before its one rounding.
        out: optional ``[E, M, N]`` BF16 contiguous output.

    Returns:
        ``[E, M, N]`` BF16.
    """
    check_tensor("a", a, ndim=2)
    if not isinstance(plan, RoutePlan):
        raise TypeError(f"plan: expected a megamoe.RoutePlan, got {type(plan).__name__}")
    for map_name in ("expert_counts", "expert_pool_offsets"):  # what the kernel reads
        check_tensor(f"plan.{map_name}", getattr(plan, map_name), device=a.device)
    rows = plan.pool_capacity
    _check_row_operand("a", a, rows, a.device)
    _check_row_operand("b", b, rows, a.device)
    scale = check_finite_float("scale", scale, float32=True)
    experts = plan.expert_counts.shape[0]
    m, n = a.shape[1], b.shape[1]
    if out is None:
        out = torch.empty(experts, m, n, dtype=torch.bfloat16, device=a.device)
    else:
        check_tensor(
            "out",
            out,
            shape=(experts, m, n),
            dtypes=(torch.bfloat16,),
            device=a.device,
            contiguous=True,
            alignment=16,
        )
    if not a.is_cuda:
        for e, start, count in _expert_data_rows(plan):
            product = a[start : start + count].float().T @ b[start : start + count].float()
            out[e] = (float(scale) * product + 0.0).bfloat16()  # + 0: no -0 (as the kernel)
        return out
    return launch_k_grouped(a, b, plan.expert_pool_offsets, plan.expert_counts, out, scale)


def k_grouped_gemm_unchecked(
    a: torch.Tensor, b: torch.Tensor, plan: RoutePlan, *, scale: float = 1.0
) -> torch.Tensor:
    """:func:`k_grouped_gemm` for the fused backward, whose operands are made from inputs
    already checked: no argument checks in Python (host time a small-token step pays per
    check); the native launcher still checks shapes, strides, alignment and devices."""
    if not a.is_cuda:
        return k_grouped_gemm(a, b, plan, scale=scale)
    out = torch.empty(
        plan.expert_counts.shape[0], a.shape[1], b.shape[1], dtype=torch.bfloat16, device=a.device
    )
    return launch_k_grouped(a, b, plan.expert_pool_offsets, plan.expert_counts, out, scale)


def launch_k_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """The engine's K-grouped launch on CUDA operands, no Python checks (the native
    launcher checks shapes, strides, alignment and devices): ``out[g] = scale * a_g^T b_g``
    over rows ``offsets[g] .. offsets[g] + counts[g] - 1``. ``out`` BF16 (one rounding) or
    float32 (no rounding; :data:`FLOAT_BLOCK_N`)."""
    n = b.shape[1]
    block_n = FLOAT_BLOCK_N if out.dtype == torch.float32 else k_grouped_block_n(n)
    dl = _native.dlpack
    with _native.on_device(a.device):
        _native.native().engine_k_grouped(
            dl(a),
            dl(b),
            dl(offsets),
            dl(counts),
            dl(out),
            block_n,
            float(scale),
            resolve_device_sms(_native.device_index(a.device)),
            _native.current_stream(a.device),
        )
    return out


def _expert_data_rows(plan: RoutePlan) -> list[tuple[int, int, int]]:
    """``(expert, first pool row, data rows)`` per expert (host reads), clamped like the
    kernel's: to the expert's segment and to the pool."""
    offsets = plan.expert_pool_offsets.tolist()
    counts = plan.expert_counts.tolist()
    rows = plan.pool_capacity
    result = []
    for e, count in enumerate(counts):
        start = min(max(offsets[e], 0), rows)
        end = min(max(offsets[e + 1], start), rows)
        result.append((e, start, max(0, min(count, end - start))))
    return result


def k_grouped_gemm_reference(
    a: torch.Tensor, b: torch.Tensor, plan: RoutePlan, *, scale: float = 1.0
) -> torch.Tensor:
    """Float64 ``[E, M, N]`` of :func:`k_grouped_gemm` (not rounded): only each expert's
    data rows enter the sum."""
    experts = plan.expert_counts.shape[0]
    out = torch.zeros(experts, a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    for e, start, count in _expert_data_rows(plan):
        rows = slice(start, start + count)
        out[e] = scale * (a[rows].double().T @ b[rows].double())
    return out
