"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device, layout or value) whose message names the argument, what was expected and
what was given, so a user can fix the call without reading our source.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

# TMA needs 16-byte aligned global addresses and row strides.
TMA_ALIGNMENT_BYTES = 16


def _shape_str(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    alignment: int | None = None,
) -> torch.Tensor:
    """Check one tensor argument; return it unchanged.

    ``shape`` entries of ``None`` match any size. ``alignment`` is in bytes and applies
    to the data pointer of tensors on a CUDA device.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"{name}: expected {ndim} dimensions"
            + (f" {_shape_str(shape)}" if shape is not None else "")
            + f", got shape {list(value.shape)}"
        )
    if shape is not None:
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                raise ValueError(
                    f"{name}: expected shape {_shape_str(shape)}, got {list(value.shape)}"
                )
    if dtypes is not None and value.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name}: expected dtype {allowed}, got {str(value.dtype).replace('torch.', '')}"
        )
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected device {device}, got {value.device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {list(value.stride())} "
            f"for shape {list(value.shape)}"
        )
    aligned = alignment is None or not value.is_cuda or value.data_ptr() % alignment == 0
    if not aligned and value.numel() > 0:
        raise ValueError(
            f"{name}: expected a data pointer aligned to {alignment} bytes, "
            f"got address 0x{value.data_ptr():x}"
        )
    return value


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Check an integer argument (bools are rejected); return it."""
    # A torch.SymInt is a size traced under torch.compile's dynamic shapes.
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    """Reject a dimension that is not a multiple of ``multiple`` (``why`` says who needs it)."""
    if value % multiple != 0:
        raise ValueError(f"{name}: expected a multiple of {multiple} ({why}), got {value}")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_str_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """A string option: ``TypeError`` for another kind (None included), ``ValueError``
    for a string outside ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    check_choice(name, value, choices)
    return value


#: The largest finite float32: the kernels take scales as float32.
FLOAT32_MAX = 3.4028234663852886e38


def float32_value(value: float) -> float:
    """``value`` rounded to float32 (to nearest even), as the kernels receive it; a value
    finite in float32 (at most :data:`FLOAT32_MAX` in magnitude)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def check_finite_float(name: str, value: object, *, float32: bool = False) -> float:
    """A finite float (an int converts); with ``float32``, also finite as a float32 (a
    scale the kernels take as float32: 1e39 would be inf there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(
            f"{name}: expected a finite float, got an int of {value.bit_length()} bits"
        ) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    if float32 and abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name}: expected a float finite in float32, got {value}")
    return value


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has real memory behind it: False for meta and fake tensors (what
    torch.compile and FakeTensorMode trace with) and under torch.compile tracing, where
    neither values nor data pointers may be read."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    if type(t) is torch.Tensor:  # fake tensors are a subclass: no import on the hot path
        return True
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)
