"""MXFP4 (OCP Microscaling FP4) quantizer and dequantizer for the base weights (DESIGN §1).

Format (OCP Microscaling Formats v1.0, "MXFP4"):

- Elements are E2M1 (1 sign, 2 exponent, 1 mantissa bit, no Inf/NaN): the magnitudes
  of codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; bit 3 is the sign. Two codes per
  byte, the element with the even index along the blocked axis in the low nibble.
- One UE8M0 scale per block of 32 consecutive elements along the blocked axis: the byte
  is ``exponent + 127`` and the block's value is ``2^exponent * E2M1(code)``. The byte
  ``0xFF`` is the OCP NaN encoding: the whole block is NaN.

Conventions chosen here (the OCP spec leaves them to the implementation):

- Scale exponent ``floor(log2(amax)) - 2`` (amax = max |x| of the block; 2 = the largest
  E2M1 exponent), clamped to ``[-127, 127]``. For finite bf16/fp16/fp32 inputs the upper
  clamp is never reached (fp32 max gives 125); the lower one is reached by tiny blocks.
- Elements are ``x / 2^exponent`` rounded to the nearest E2M1 value, ties to the even
  code (the one whose mantissa bit is 0), saturating at ±6 (the scaled amax is < 8, so
  only values in (6, 8) saturate).
- A zero is always encoded as code 0 (+0): ``-0.0`` and negative values that round to
  zero get code 0, never code 8 (-0), so every value has exactly one encoding and
  quantize(dequantize(q)) == q holds. :func:`dequantize_mxfp4` still decodes a code 8
  written by someone else as ``-0.0``.
- An all-zero block (amax == 0, including ``-0.0``) has scale byte 0 (floor(log2(0)) is
  -inf, clamped to -127) and codes 0.
- A block containing NaN or ±Inf anywhere gets scale byte ``0xFF`` (NaN) and codes 0;
  :func:`dequantize_mxfp4` returns NaN for the whole block.

Size: 4 bits per element plus 8 bits per 32 elements = 4.25 bits per element, i.e.
17/64 ≈ 0.27x the bytes of BF16 (see :func:`mxfp4_nbytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .validation.arguments import check_int, check_multiple, check_tensor, has_data

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "dequantize_mxfp4",
    "mxfp4_nbytes",
    "quantize_mxfp4",
]

MXFP4_BLOCK = 32
"""Elements per UE8M0 scale (consecutive along the blocked axis)."""

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""Value of each 4-bit E2M1 code (index = code; bit 3 is the sign)."""

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_BIAS = 127
_SCALE_NAN = 0xFF
_EXP_MIN, _EXP_MAX = -127, 127
_E2M1_EMAX = 2  # floor(log2(6)): the largest E2M1 exponent
_FP32_MANT_BITS = 23

# Rounding boundaries for |x| / 2^exponent -> magnitude code. The code is the number of
# boundaries strictly below the value (torch.bucketize, right=False). Between codes i and
# i + 1 the midpoint is a tie; ties go to the even code, so a midpoint whose upper code is
# even must count when the value *equals* it: for float32 values, "v >= m" is exactly
# "v > nextafter(m, 0)", hence those midpoints are nudged down by one float32 ULP.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between codes (0,1), (1,2), ... (6,7)
_BOUNDARIES = torch.tensor(_MIDPOINTS, dtype=torch.float32)
_UPPER_EVEN = torch.tensor([(i + 1) % 2 == 0 for i in range(len(_MIDPOINTS))])
_BOUNDARIES = torch.where(
    _UPPER_EVEN, torch.nextafter(_BOUNDARIES, torch.zeros_like(_BOUNDARIES)), _BOUNDARIES
)

# Byte -> (value of the low nibble, value of the high nibble): one gather decodes a byte.
_PAIR_LUT = torch.tensor(
    [(E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]) for b in range(256)], dtype=torch.float32
)
#: The constant tables on each device they were used on: copied once, not on every call
#: (a copy from pageable host memory each call, which a CUDA graph capture also refuses).
_TABLES_ON: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table_on(name: str, table: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``table`` on ``like``'s device, and fake where ``like`` is a fake tensor outside
    torch.compile (under FakeTensorMode a real constant beside fake tensors is refused;
    while torch.compile traces, the real constant is what the graph takes in)."""
    device = like.device
    if not torch.compiler.is_compiling():
        from torch._subclasses.fake_tensor import maybe_get_fake_mode

        mode = maybe_get_fake_mode(like)
        if mode is not None:
            with mode:
                return mode.from_tensor(table).to(device)
    on_device = _TABLES_ON.get((name, device))
    if on_device is None:
        on_device = table.to(device)
        if has_data(on_device):  # never keep a meta or fake tensor
            _TABLES_ON[(name, device)] = on_device
    return on_device


# float32 bit patterns of 2^(byte - 127) that the shift trick below cannot build:
# byte 0 is 2^-127, a float32 subnormal (only mantissa bit 22 set); byte 0xFF is NaN.
_FP32_TWO_POW_M127_BITS = 0x00400000
_FP32_QNAN_BITS = 0x7FC00000


def _normalize_axis(axis: object, ndim: int) -> int:
    axis = check_int("axis", axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: expected an axis in [{-ndim}, {ndim}), got {axis}")
    return axis % ndim


def _check_blocked(label: str, size: int) -> None:
    check_multiple(label, size, MXFP4_BLOCK, "MXFP4 has one scale per 32 elements")


def quantize_mxfp4(w: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` to MXFP4 with blocks of 32 consecutive elements along ``axis``.

    Args:
        w: bfloat16, float16 or float32 tensor, any device, at least 1-D; its size along
            ``axis`` must be a multiple of 32. Not differentiated (detached).
        axis: the blocked axis (the GEMM reduction dim), negative values count from the end.

    Returns:
        ``(packed, scales)``, both uint8, contiguous, on ``w``'s device, with ``axis`` in
        its original position: ``packed`` has ``w.shape[axis] // 2`` there (two E2M1
        codes per byte, the even-index element in the low nibble), ``scales`` has
        ``w.shape[axis] // 32`` (UE8M0 bytes, ``exponent + 127``; 0xFF marks a block
        containing NaN/Inf). Conventions for zeros and non-finite values: module docstring.
    """
    check_tensor("w", w, dtypes=_INPUT_DTYPES)
    if w.dim() == 0:
        raise ValueError("w: expected at least 1 dimension, got a 0-dim tensor")
    ax = _normalize_axis(axis, w.dim())
    n = w.shape[ax]
    _check_blocked(f"w.shape[{axis}]", n)

    # Blocked axis last, split into [.., blocks, 32], widened to a contiguous float32
    # copy in one pass. bf16/fp16 -> fp32 is exact, and all later scaling is by powers of
    # two, so float32 is exact throughout (no float64 copy of the tensor).
    moved = w.detach().movedim(ax, -1)
    lead = moved.shape[:-1]
    x = moved.reshape(*lead, n // MXFP4_BLOCK, MXFP4_BLOCK)
    # reshape may return a strided view (axis != -1) and bucketize wants contiguous input.
    # .to() returns a float32 input unchanged whatever memory_format says, hence the
    # .contiguous(): one copy either way.
    if x.dtype == torch.bfloat16 and torch.compiler.is_compiling():
        # Widened by its bits under torch.compile: Inductor folds a cast pair fp32 ->
        # bf16 -> fp32 in the caller's graph into nothing, and would quantize the values
        # before their BF16 rounding. Integer ops are not folded; the bits are the cast's.
        bits = x.view(torch.int16).to(torch.int32)
        bits <<= 16
        x = bits.view(torch.float32).contiguous()
    else:
        x = x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()

    # Block amax from two reductions (no |x| temporary); max/min propagate NaN, so a
    # block with NaN or ±Inf has a non-finite amax.
    amax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg())
    bad = ~torch.isfinite(amax)
    amax = amax.masked_fill(bad, 0.0)

    # floor(log2(amax)) read from the float32 exponent field: exact integer arithmetic,
    # unlike log2() whose rounding can land on the wrong side of a power of two, and
    # independent of how a device's frexp treats subnormals. For a normal float32 the
    # field minus 127 *is* floor(log2). Zero and subnormal amax (field 0, true floor(log2)
    # <= -127, including fp32/bf16 subnormal inputs; fp16 subnormals are normal in fp32)
    # read as -127: off, but after "- 2" both are <= -129 and clamp to -127 alike.
    # The mask drops the sign bit of a -0.0 amax.
    field = (amax.view(torch.int32) >> _FP32_MANT_BITS) & 0xFF
    exponent = (field - _SCALE_BIAS - _E2M1_EMAX).clamp_(_EXP_MIN, _EXP_MAX)

    # 2^-exponent built from its bits: -exponent is in [-125, 127] (exponent <= 125 as
    # field <= 254), a normal float32, so the multiply below is exact unless the product
    # is subnormal, and then it is < 2^-126, far below the first rounding boundary 0.25.
    inv_scale = ((_SCALE_BIAS - exponent) << _FP32_MANT_BITS).view(torch.float32)
    mag = x.abs().mul_(inv_scale.unsqueeze(-1))
    boundaries = _table_on("boundaries", _BOUNDARIES, mag)
    codes = torch.bucketize(mag, boundaries, out_int32=True).to(torch.uint8)
    del mag
    # Sign bit only on non-zero magnitudes: zero is always code 0 (module docstring).
    codes = torch.where((x < 0) & (codes != 0), codes | 8, codes)
    del x
    codes.masked_fill_(bad.unsqueeze(-1), 0)

    codes = codes.reshape(*lead, n)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + _SCALE_BIAS).to(torch.uint8).masked_fill_(bad, _SCALE_NAN)
    return packed.movedim(-1, ax).contiguous(), scales.movedim(-1, ax).contiguous()


def dequantize_mxfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    axis: int = -1,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode MXFP4 bytes back to floating point (inverse of :func:`quantize_mxfp4`).

    Args:
        packed: uint8, two E2M1 codes per byte along ``axis`` (low nibble first); its size
            along ``axis`` must be a multiple of 16.
        scales: uint8 UE8M0 bytes, same shape as ``packed`` except ``packed.shape[axis] //
            16`` along ``axis``, same device. 0xFF decodes the whole block as NaN.
        axis: the blocked axis.
        dtype: bfloat16, float16 or float32 output. Decoding is exact in float32 and
            bfloat16 (same exponent range) for every scale byte a finite weight
            quantizes to (up to 252); byte 253 with values of magnitude 4 or more
            (codes 6, 7, 14, 15) and byte 254 with magnitudes of 2 or more (codes 4-7,
            12-15) overflow to Inf (the checkpoint loader refuses both bytes).
            float16 overflows/underflows for scales outside its range.

    Returns:
        Contiguous ``dtype`` tensor shaped like ``packed`` with ``2 * packed.shape[axis]``
        along ``axis``.
    """
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    check_tensor("scales", scales, dtypes=(torch.uint8,))
    if dtype not in _OUTPUT_DTYPES:
        allowed = " or ".join(str(d).replace("torch.", "") for d in _OUTPUT_DTYPES)
        raise TypeError(f"dtype: expected {allowed}, got {dtype}")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dimension, got a 0-dim tensor")
    ax = _normalize_axis(axis, packed.dim())
    half = packed.shape[ax]
    bytes_per_block = MXFP4_BLOCK // 2
    check_multiple(
        f"packed.shape[{axis}]", half, bytes_per_block, "16 bytes = one block of 32 codes"
    )
    want = list(packed.shape)
    want[ax] = half // bytes_per_block
    if scales.dim() != packed.dim() or list(scales.shape) != want:
        raise ValueError(
            f"scales: expected shape {want} (packed shape {list(packed.shape)} with "
            f"{half} // 16 along axis {axis}), got {list(scales.shape)}"
        )
    if scales.device != packed.device:
        raise ValueError(
            f"scales: expected device {packed.device} (as packed), got {scales.device}"
        )

    p = packed.movedim(ax, -1)
    lead = p.shape[:-1]
    nb = half // bytes_per_block
    # One gather per byte (an int32 index the size of packed, not of the output).
    pairs = _table_on("pairs", _PAIR_LUT, p).index_select(0, p.reshape(-1).to(torch.int32))
    vals = pairs.view(*lead, nb, MXFP4_BLOCK)

    # 2^(byte - 127) from its float32 bits: exact, with byte 0 (subnormal 2^-127) and
    # 0xFF (NaN) spelled out; NaN times any code, including 0, is NaN.
    s = scales.movedim(ax, -1).to(torch.int32)
    bits = torch.where(s == 0, _FP32_TWO_POW_M127_BITS, s << _FP32_MANT_BITS)
    bits = torch.where(s == _SCALE_NAN, _FP32_QNAN_BITS, bits)
    scale = bits.view(torch.float32)
    # |code value| has at most 2 significant bits: the float32 product is exact.
    out = (vals * scale.unsqueeze(-1)).to(dtype)
    return out.reshape(*lead, 2 * half).movedim(-1, ax).contiguous()


def mxfp4_nbytes(shape: Sequence[int], axis: int = -1) -> int:
    """Bytes of the packed codes plus scales of a tensor of ``shape`` blocked along ``axis``.

    ``numel / 2 + numel / 32``: 4.25 bits per element, 17/64 ≈ 0.27x the BF16 bytes.
    """
    if isinstance(shape, torch.Tensor) or not isinstance(shape, Sequence):
        raise TypeError(f"shape: expected a sequence of ints, got {type(shape).__name__}")
    dims = [check_int(f"shape[{i}]", d, minimum=0) for i, d in enumerate(shape)]
    if not dims:
        raise ValueError("shape: expected at least 1 dimension, got []")
    ax = _normalize_axis(axis, len(dims))
    _check_blocked(f"shape[{axis}]", dims[ax])
    numel = math.prod(dims)
    return numel // 2 + numel // MXFP4_BLOCK
