"""Checks for pre-quantized MXFP4 tensors (packed E2M1 codes + UE8M0 scales).

``prepare_base_weights(format="mxfp4")`` quantizes BF16 weights itself and rejects
non-finite ones first, so its own output never holds a NaN scale. A caller that brings
weights already in MXFP4 (a quantized checkpoint) skips that step; these checks are
what such an entry point must run before any kernel decodes the bytes. A UE8M0 scale
byte of 0xFF is the OCP MX NaN encoding: the whole 32-element block decodes to NaN,
and in a GEMM one NaN weight poisons every output it touches, silently.

Layout (see :mod:`megamoe.mxfp4`): for a logical ``[..., n, ...]`` tensor blocked along
``axis``, ``packed`` is uint8 with ``n // 2`` there (two codes per byte) and ``scales``
uint8 with ``n // 32`` there; every other dimension is the logical one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mxfp4 import MXFP4_BLOCK
from .arguments import check_int, check_multiple, check_tensor

__all__ = ["SCALE_MAX_FINITE", "SCALE_NAN", "check_mxfp4_scales", "check_mxfp4_weights"]

#: The UE8M0 byte that encodes NaN (OCP Microscaling Formats v1.0).
SCALE_NAN = 0xFF
#: The largest scale byte a finite BF16 or FP32 weight quantizes to: amax < 2^128, so
#: floor(log2(amax)) - 2 (E2M1's largest exponent) <= 125, biased by 127.
SCALE_MAX_FINITE = 252
# TMA (which will load these bytes in the fused MXFP4 GEMM) needs 16-byte alignment.
_ALIGNMENT = 16


def check_mxfp4_scales(name: str, scales: object) -> torch.Tensor:
    """Reject a UE8M0 scale tensor that is not uint8, holds the NaN byte 0xFF, or a
    byte past ``SCALE_MAX_FINITE``.

    Reads two counts back to the host: a check for load/prepare time, not per step.
    """
    scales = check_tensor(name, scales, dtypes=(torch.uint8,))

    def first(mask: torch.Tensor) -> list[int]:
        flat = int(mask.reshape(-1).nonzero()[0])
        return [int(i) for i in torch.unravel_index(torch.tensor(flat), scales.shape)]

    nan = scales == SCALE_NAN
    count = int(nan.sum())
    if count:
        raise ValueError(
            f"{name}: {count} UE8M0 scale byte(s) are 0xFF, the OCP MX NaN encoding (the "
            f"whole 32-element block decodes to NaN), first at index {first(nan)}; "
            "quantize finite weights (megamoe.quantize_mxfp4 writes 0xFF only for blocks "
            "holding NaN or Inf)"
        )
    huge = (scales > SCALE_MAX_FINITE) & ~nan
    count = int(huge.sum())
    if count:
        raise ValueError(
            f"{name}: {count} UE8M0 scale byte(s) are 253 or 254 (2^126, 2^127), first at "
            f"index {first(huge)}: values of magnitude 4 or more at 253, 2 or more at 254, "
            f"decode past BF16's and FP32's largest value (to Inf), and no finite BF16 or FP32 "
            f"weight quantizes above {SCALE_MAX_FINITE} (a corrupt or mis-read scale tensor?)"
        )
    return scales


def check_mxfp4_weights(
    name: str,
    packed: object,
    scales: object,
    shape: Sequence[int],
    *,
    axis: int = -1,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate pre-quantized MXFP4 weights of logical ``shape``, blocked along ``axis``.

    Args:
        name: the argument name used in messages (``"w13"``); the scales are named
            ``name + "_scales"``.
        packed: uint8 codes, ``shape`` with ``shape[axis] // 2`` along ``axis``,
            contiguous, 16-byte aligned on CUDA.
        scales: uint8 UE8M0 bytes, ``shape`` with ``shape[axis] // 32`` along ``axis``,
            contiguous, on ``packed``'s device, no 0xFF (NaN) byte.
        shape: the logical (dequantized) shape, e.g. ``(E, 2 * I, H)`` for ``w13``;
            ``shape[axis]`` must be a multiple of 32.
        axis: the blocked axis (the forward GEMM's reduction dim).
        device: the device both must be on (default: ``packed``'s).

    Returns:
        ``(packed, scales)`` unchanged. Raises ``TypeError``/``ValueError`` naming the
        argument otherwise.
    """
    dims = [check_int(f"{name} shape[{i}]", d, minimum=1) for i, d in enumerate(shape)]
    if not dims:
        raise ValueError(f"{name}: expected a logical shape with at least 1 dimension")
    axis = check_int("axis", axis)
    if not -len(dims) <= axis < len(dims):
        raise ValueError(f"axis: expected an axis in [{-len(dims)}, {len(dims)}), got {axis}")
    axis %= len(dims)
    check_multiple(
        f"{name} (logical size along axis {axis})",
        dims[axis],
        MXFP4_BLOCK,
        "MXFP4 has one scale per 32 elements",
    )
    packed_shape = [*dims]
    packed_shape[axis] = dims[axis] // 2
    scale_shape = [*dims]
    scale_shape[axis] = dims[axis] // MXFP4_BLOCK
    packed = check_tensor(
        name,
        packed,
        shape=packed_shape,
        dtypes=(torch.uint8,),
        device=device,
        contiguous=True,
        alignment=_ALIGNMENT,
    )
    scales = check_tensor(
        f"{name}_scales",
        scales,
        shape=scale_shape,
        dtypes=(torch.uint8,),
        device=packed.device,
        contiguous=True,
    )
    check_mxfp4_scales(f"{name}_scales", scales)
    return packed, scales
