"""MXFP4 quantizer / dequantizer: golden values, an independent scalar oracle, edge cases.

Every expected value here is computed by hand or by ``_oracle_block`` (pure Python,
math.frexp + nearest-with-ties-to-even over the E2M1 table), never by the code under test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megamoe.mxfp4 import (
    E2M1_VALUES,
    MXFP4_BLOCK,
    dequantize_mxfp4,
    mxfp4_nbytes,
    quantize_mxfp4,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7


# ----------------------------------------------------------------------------- helpers


def _oracle_block(vals: list[float]) -> tuple[int, list[int]]:
    """Scalar reference for one block of 32 floats: (scale byte, 32 codes)."""
    assert len(vals) == MXFP4_BLOCK
    if any(not math.isfinite(v) for v in vals):
        return 0xFF, [0] * MXFP4_BLOCK
    amax = max(abs(v) for v in vals)
    if amax == 0.0:
        exp = -127
    else:
        _, ex = math.frexp(amax)  # amax = m * 2**ex with 0.5 <= m < 1: floor(log2) = ex - 1
        exp = max(-127, min(127, ex - 1 - 2))
    codes = []
    for v in vals:
        a = abs(v) / 2.0**exp  # exact in float64
        # nearest grid value; on a tie the even code (key c % 2 == 0 sorts first)
        mag = min(range(8), key=lambda c: (abs(GRID[c] - a), c % 2))
        codes.append(mag | 8 if (v < 0 and mag != 0) else mag)
    return exp + 127, codes


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes along the last axis, low nibble first (written independently of the module)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _block(*head: float, fill: float = 0.0) -> torch.Tensor:
    vals = list(head) + [fill] * (MXFP4_BLOCK - len(head))
    return torch.tensor(vals, dtype=torch.float32)


def _codes_of(x: torch.Tensor) -> tuple[list[int], list[int]]:
    packed, scales = quantize_mxfp4(x)
    return scales.reshape(-1).tolist(), _unpack(packed).reshape(-1).tolist()


def _random_tie_blocks(rng: random.Random, nblocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks mixing grid values, exact midpoints (ties), saturating and arbitrary values."""
    lo, hi = (-12, 10) if dtype == torch.float16 else (-100, 100)
    mids = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    rows = []
    for _ in range(nblocks):
        e = rng.randint(lo, hi)
        row = []
        for _ in range(MXFP4_BLOCK):
            kind = rng.random()
            if kind < 0.35:
                m = rng.choice(mids)
            elif kind < 0.6:
                m = rng.choice(GRID)
            elif kind < 0.7:
                m = rng.uniform(6.0, 7.9)
            else:
                m = rng.uniform(0.0, 6.0)
            row.append(rng.choice((-1.0, 1.0)) * m * 2.0**e)
        row[rng.randrange(MXFP4_BLOCK)] = rng.choice((-1.0, 1.0)) * rng.uniform(4.0, 7.9) * 2.0**e
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------- constants


def test_constants() -> None:
    assert MXFP4_BLOCK == 32
    assert isinstance(E2M1_VALUES, tuple) and len(E2M1_VALUES) == 16
    assert all(isinstance(v, float) for v in E2M1_VALUES)
    assert E2M1_VALUES[:8] == GRID
    assert E2M1_VALUES[8:] == tuple(-v for v in GRID)
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0  # code 8 is -0


def test_e2m1_values_follow_code_bits() -> None:
    # E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal.
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        e, m = (code >> 1) & 3, code & 1
        mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + 0.5 * m)
        assert E2M1_VALUES[code] == sign * mag


# ----------------------------------------------------------------------------- golden values


def test_golden_block_amax_6_has_exponent_0() -> None:
    # floor(log2(6)) - 2 = 0 -> byte 127; every value is already on the grid.
    x = _block(6.0, -6.0, 0.5, -0.5, 1.0, 1.5, -2.0, 3.0, 4.0, -4.0, 0.0)
    scales, codes = _codes_of(x)
    assert scales == [127]
    assert codes[:11] == [7, 15, 1, 9, 2, 3, 12, 5, 6, 14, 0]
    assert codes[11:] == [0] * 21


def test_golden_block_amax_1_has_exponent_minus_2() -> None:
    # floor(log2(1)) - 2 = -2 -> byte 125; values scale by 4: 1 -> 4, 0.375 -> 1.5, -0.25 -> -1
    x = _block(1.0, -0.375, 0.125, 0.75, -0.25, 0.5)
    scales, codes = _codes_of(x)
    assert scales == [125]
    assert codes[:6] == [6, 11, 1, 5, 10, 4]
    out = dequantize_mxfp4(*quantize_mxfp4(x), dtype=torch.float32)
    assert torch.equal(out, x)


# (scaled value, expected magnitude code): every midpoint of the grid, ties to the even code
TIES = [
    (0.25, 0),  # between 0 (code 0) and 0.5 (code 1)
    (0.75, 2),  # between 0.5 and 1.0
    (1.25, 2),  # between 1.0 and 1.5
    (1.75, 4),  # between 1.5 and 2.0
    (2.5, 4),  # between 2 and 3
    (3.5, 6),  # between 3 and 4
    (5.0, 6),  # between 4 and 6
]


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
@pytest.mark.parametrize(("scaled", "code"), TIES, ids=[str(t[0]) for t in TIES])
def test_ties_round_to_even_code(scaled: float, code: int, sign: float) -> None:
    # amax 6 pins the exponent to 0, so the stored value is the scaled value itself;
    # the same tie at exponent 5 (values times 32) must round identically.
    for exp in (0, 5):
        x = _block(6.0 * 2**exp, sign * scaled * 2**exp)
        scales, codes = _codes_of(x)
        assert scales == [127 + exp]
        want = code | 8 if (sign < 0 and code != 0) else code
        assert codes[1] == want, (scaled, sign, exp)


@pytest.mark.parametrize("value", [6.0001, 6.5, 7.0, 7.5, 7.99])
def test_saturation_between_6_and_8(value: float) -> None:
    # amax in [4, 8) -> exponent 0; (6, 8) saturates to 6 (code 7 / 15).
    x = _block(value, -value, 4.0)
    scales, codes = _codes_of(x)
    assert scales == [127]
    assert codes[:3] == [7, 15, 6]


def test_just_below_and_at_midpoint() -> None:
    below = torch.nextafter(torch.tensor(0.75), torch.tensor(0.0)).item()
    above = torch.nextafter(torch.tensor(0.25), torch.tensor(1.0)).item()
    _, codes = _codes_of(_block(6.0, below, 0.75, above, 0.25))
    assert codes[1:5] == [1, 2, 1, 0]


def test_nibble_order_golden_bytes() -> None:
    # codes: 0.5->1, 1.0->2, 1.5->3, -2.0->12, 6.0->7, 0->0, -0.5->9, 3->5
    x = _block(0.5, 1.0, 1.5, -2.0, 6.0, 0.0, -0.5, 3.0)
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (16,)
    assert packed[:4].tolist() == [0x21, 0xC3, 0x07, 0x59]
    assert packed[4:].tolist() == [0] * 12
    assert scales.tolist() == [127]


def test_scale_exponent_is_exact_floor_log2() -> None:
    # Powers of two and their float32 predecessors straddle the floor(log2) boundary,
    # where a float log2 could round the wrong way.
    for k in (-100, -3, 0, 2, 7, 100):
        p = 2.0**k
        below = torch.nextafter(torch.tensor(p), torch.tensor(0.0)).item()
        assert _codes_of(_block(p))[0] == [127 + k - 2]
        assert _codes_of(_block(below))[0] == [127 + k - 3]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_of_representable_values(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    nblocks = 64
    lo, hi = (-20, 12) if dtype == torch.float16 else (-120, 120)
    codes = torch.randint(0, 16, (nblocks, MXFP4_BLOCK), generator=gen)
    # element 0 is ±4 or ±6, so the block's exponent is the one its values were built with
    codes[:, 0] = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (nblocks,), generator=gen)]
    exps = torch.randint(lo, hi + 1, (nblocks, 1), generator=gen).double()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    x = (table[codes] * torch.exp2(exps)).to(dtype)
    packed, scales = quantize_mxfp4(x)
    assert torch.equal(scales, (exps + 127).to(torch.uint8))
    # -0 (code 8) is stored as +0 (code 0); everything else keeps its code
    assert torch.equal(_unpack(packed), torch.where(codes == 8, 0, codes).to(torch.uint8))
    out = dequantize_mxfp4(packed, scales, dtype=dtype)
    assert out.dtype == dtype
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_is_at_most_half_a_grid_step(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 8 * MXFP4_BLOCK, generator=gen)
    x *= torch.exp2(torch.randint(-8, 8, (256, 1), generator=gen).float())
    x = x.to(dtype)
    packed, scales = quantize_mxfp4(x)
    out = dequantize_mxfp4(packed, scales, dtype=torch.float32).double()
    xd = x.double()
    scale = torch.exp2(scales.double() - 127).repeat_interleave(MXFP4_BLOCK, dim=1)
    a = xd.abs() / scale
    assert a.max() < 8.0
    half_ulp = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    err = (out - xd).abs()
    inside = a <= 6
    assert torch.all(err[inside] <= half_ulp[inside] * scale[inside])
    # saturated values land exactly on ±6 * scale
    assert torch.equal(out[~inside], torch.sign(xd[~inside]) * 6 * scale[~inside])
    # overall relative L2 error of MXFP4 on Gaussian data is about 0.11
    assert (err.norm() / xd.norm()).item() < 0.15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_of_dequantized_is_idempotent(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 4 * MXFP4_BLOCK, generator=gen) * 50
    packed, scales = quantize_mxfp4(x)
    again = quantize_mxfp4(dequantize_mxfp4(packed, scales, dtype=dtype))
    assert torch.equal(again[0], packed)
    assert torch.equal(again[1], scales)


# ----------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_scalar_oracle_bit_for_bit(dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(1000 * seed + DTYPES.index(dtype))
    x = _random_tie_blocks(rng, 24, dtype)
    packed, scales = quantize_mxfp4(x)
    got_codes = _unpack(packed)
    ties = 0
    for i, row in enumerate(x.float().tolist()):
        want_scale, want_codes = _oracle_block(row)
        assert scales[i].item() == want_scale, (i, row)
        assert got_codes[i].tolist() == want_codes, (i, row)
        s = 2.0 ** (want_scale - 127)
        ties += sum(abs(v) / s in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0) for v in row)
    assert ties > 50  # the random blocks really exercised the tie rule


def test_matches_scalar_oracle_on_extreme_blocks() -> None:
    tiny = [2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126, 2.0**-125]
    rows = [
        [v * (1 if j % 2 else -1) for j in range(MXFP4_BLOCK)] for v in tiny
    ]  # one magnitude per block
    rows.append([3.0e38] + [1.0e37 * j for j in range(31)])
    rows.append([torch.finfo(torch.float32).max] + [-1.0] * 31)
    rows.append([2.0**-125, 2.0**-127 * 0.75, 2.0**-128] + [2.0**-130] * 29)
    x = torch.tensor(rows, dtype=torch.float32)
    packed, scales = quantize_mxfp4(x)
    for i, row in enumerate(x.tolist()):
        want_scale, want_codes = _oracle_block(row)
        assert scales[i].item() == want_scale, i
        assert _unpack(packed)[i].tolist() == want_codes, i


# ----------------------------------------------------------------------------- scale extremes


@pytest.mark.parametrize(
    ("amax", "byte", "code"),
    [
        (2.0**-130, 0, 0),  # fp32 subnormal: exponent -132 clamps to -127; 2^-130*2^127 = 1/8
        (2.0**-149, 0, 0),  # smallest fp32 subnormal
        (2.0**-128, 0, 1),  # subnormal that survives: 2^-128 * 2^127 = 0.5
        (2.0**-126, 0, 4),  # smallest normal: exponent -128 clamps; 2^-126 * 2^127 = 2
        (2.0**-125, 0, 6),  # exponent exactly -127: scaled 4
        (2.0**-124, 1, 6),  # exponent -126
    ],
)
def test_tiny_amax_clamps_exponent_to_minus_127(amax: float, byte: int, code: int) -> None:
    x = _block(amax)
    assert x[0].item() == amax  # representable in float32
    scales, codes = _codes_of(x)
    assert scales == [byte]
    assert codes[0] == code
    out = dequantize_mxfp4(*quantize_mxfp4(x), dtype=torch.float32)
    assert out[0].item() == GRID[code] * 2.0 ** (byte - 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_huge_amax_gives_exponent_125(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max  # ~3.4e38: floor(log2) = 127 -> exponent 125
    x = torch.tensor([3.0e38, -big, 2.0**126, 2.0**125] + [0.0] * 28, dtype=dtype)
    scales, codes = _codes_of(x)
    assert scales == [252]
    assert codes[:4] == [7, 15, 4, 2]  # 3e38/2^125 ~ 7.05 and big/2^125 ~ 8- saturate
    out = dequantize_mxfp4(*quantize_mxfp4(x), dtype=dtype)
    assert torch.isfinite(out).all()
    assert out[0].item() == 6.0 * 2.0**125


def test_float16_extremes() -> None:
    x = torch.zeros(2, MXFP4_BLOCK, dtype=torch.float16)
    x[0, 0] = 65504.0  # fp16 max: floor(log2) = 15 -> exponent 13 -> byte 140, ~8.0 -> 6
    x[1, 0] = 2.0**-24  # smallest fp16 subnormal (normal in fp32): exponent -26 -> byte 101
    packed, scales = quantize_mxfp4(x)
    assert scales.flatten().tolist() == [140, 101]
    codes = _unpack(packed)
    assert codes[0, 0].item() == 7
    assert codes[1, :2].tolist() == [6, 0]  # 2^-24 / 2^-26 = 4


# ----------------------------------------------------------------------------- zeros, NaN, Inf


def test_zero_and_negative_zero_blocks() -> None:
    x = torch.zeros(3, MXFP4_BLOCK)
    x[1] = -0.0
    x[2, 5] = -0.0
    packed, scales = quantize_mxfp4(x)
    assert scales.flatten().tolist() == [0, 0, 0]
    assert torch.all(packed == 0)
    out = dequantize_mxfp4(packed, scales, dtype=torch.float32)
    assert torch.equal(out, torch.zeros_like(out))
    assert not torch.signbit(out).any()  # convention: zero is always +0 (code 0)


def test_negative_values_rounding_to_zero_get_code_0() -> None:
    x = _block(6.0, -0.25, -0.1, -1e-30, -0.0)
    _, codes = _codes_of(x)
    assert codes[1:5] == [0, 0, 0, 0]


def test_dequantize_decodes_code_8_as_negative_zero() -> None:
    packed = torch.full((16,), 0x88, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, torch.tensor([127], dtype=torch.uint8), dtype=torch.float32)
    assert torch.equal(out, torch.zeros(32)) and torch.signbit(out).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_block_is_nan_scale(bad: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3 * MXFP4_BLOCK, generator=gen).to(dtype)
    x[1, 40] = bad  # block (1, 1)
    packed, scales = quantize_mxfp4(x)
    assert scales[1, 1].item() == 0xFF
    assert torch.all(packed[1, 16:32] == 0)
    assert (scales != 0xFF).sum().item() == 5
    clean = x.clone()
    clean[1, 32:64] = 0.0
    ref_packed, ref_scales = quantize_mxfp4(clean)
    other = torch.ones_like(scales, dtype=torch.bool)
    other[1, 1] = False
    assert torch.equal(scales[other], ref_scales[other])
    out = dequantize_mxfp4(packed, scales, dtype=torch.float32)
    assert torch.isnan(out[1, 32:64]).all()
    nan_mask = torch.isnan(out)
    assert nan_mask.sum().item() == MXFP4_BLOCK  # NaN only in that block
    ref_out = dequantize_mxfp4(ref_packed, ref_scales, dtype=torch.float32)
    assert torch.equal(out[~nan_mask], ref_out[~nan_mask])


def test_dequantize_nan_scale_byte_with_nonzero_codes() -> None:
    packed = torch.tensor([[0x21] * 16, [0x21] * 16], dtype=torch.uint8)
    scales = torch.tensor([[0xFF], [127]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert torch.isnan(out[0]).all()
    assert out[1, :2].tolist() == [0.5, 1.0]


# ----------------------------------------------------------------------------- axes, layout


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_any_axis_of_3d_input(axis: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, 96, generator=gen).to(torch.bfloat16)
    packed, scales = quantize_mxfp4(x, axis=axis)
    ax = axis % 3
    want_p = list(x.shape)
    want_p[ax] //= 2
    want_s = list(x.shape)
    want_s[ax] //= 32
    assert list(packed.shape) == want_p and list(scales.shape) == want_s
    assert packed.is_contiguous() and scales.is_contiguous()
    # same bytes as moving the axis last and quantizing there
    ref_p, ref_s = quantize_mxfp4(x.movedim(ax, -1).contiguous(), axis=-1)
    assert torch.equal(packed.movedim(ax, -1), ref_p)
    assert torch.equal(scales.movedim(ax, -1), ref_s)
    out = dequantize_mxfp4(packed, scales, axis=axis)
    assert out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out.movedim(ax, -1), dequantize_mxfp4(ref_p, ref_s))


def test_axis_0_golden() -> None:
    # Blocks run down the columns: column j holds [v_j, 0, ..., 0].
    x = torch.zeros(MXFP4_BLOCK, 3)
    x[0] = torch.tensor([6.0, 1.0, -0.5])
    x[1] = torch.tensor([0.5, 0.25, 0.0])
    packed, scales = quantize_mxfp4(x, axis=0)
    assert packed.shape == (16, 3) and scales.shape == (1, 3)
    # column 0: amax 6 -> exponent 0: 6 -> code 7, 0.5 -> code 1
    # column 1: amax 1 -> exponent -2: 1 -> 4 (code 6), 0.25 -> 1 (code 2)
    # column 2: amax 0.5 -> exponent -3: -0.5 -> -4 (code 14)
    assert scales.tolist() == [[127, 125, 124]]
    assert packed[0].tolist() == [0x17, 0x26, 0x0E]


def test_bf16_fp16_fp32_inputs_agree_on_common_values() -> None:
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 2 * MXFP4_BLOCK, generator=gen) * 4).to(torch.bfloat16).float()
    x = x.to(torch.float16).float()  # now exactly representable in all three
    results = [quantize_mxfp4(x.to(dt)) for dt in DTYPES]
    for p, s in results[1:]:
        assert torch.equal(p, results[0][0]) and torch.equal(s, results[0][1])


def test_output_dtypes_devices_and_contiguity() -> None:
    x = torch.randn(4, 64)
    packed, scales = quantize_mxfp4(x)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert packed.shape == (4, 32) and scales.shape == (4, 2)
    assert packed.is_contiguous() and scales.is_contiguous()
    assert packed.device == x.device
    for dt in DTYPES:
        assert dequantize_mxfp4(packed, scales, dtype=dt).dtype == dt
    assert dequantize_mxfp4(packed, scales).dtype == torch.bfloat16  # default


def test_non_contiguous_and_requires_grad_input() -> None:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(64, 96, generator=gen, requires_grad=True)
    t = base.t()  # [96, 64], not contiguous
    packed, scales = quantize_mxfp4(t, axis=-1)
    ref = quantize_mxfp4(t.detach().contiguous(), axis=-1)
    assert torch.equal(packed, ref[0]) and torch.equal(scales, ref[1])
    assert not packed.requires_grad


def test_empty_tensors() -> None:
    for shape, axis in (((0, 64), -1), ((4, 0), -1), ((0, 3), 0)):
        x = torch.empty(shape)
        packed, scales = quantize_mxfp4(x, axis=axis)
        assert packed.numel() == 0 and scales.numel() == 0
        out = dequantize_mxfp4(packed, scales, axis=axis)
        assert out.shape == x.shape


def test_dequantize_float16_output() -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, 128, generator=gen, dtype=torch.float16)
    packed, scales = quantize_mxfp4(x)
    out = dequantize_mxfp4(packed, scales, dtype=torch.float16)
    again = dequantize_mxfp4(packed, scales, dtype=torch.float32)
    assert torch.equal(out.float(), again)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"w": torch.zeros(4, 33)}, ValueError, r"w\.shape\[-1\].*multiple of 32.*33"),
        ({"w": torch.zeros(48, 64), "axis": 0}, ValueError, r"w\.shape\[0\].*48"),
        ({"w": torch.zeros(4, 64, dtype=torch.int32)}, TypeError, r"^w: .*int32"),
        ({"w": torch.zeros(4, 64, dtype=torch.float64)}, TypeError, r"^w: .*float64"),
        ({"w": [0.0] * 32}, TypeError, r"^w: expected a torch\.Tensor"),
        ({"w": torch.tensor(1.0)}, ValueError, r"^w: .*0-dim"),
        ({"w": torch.zeros(4, 64), "axis": 2}, ValueError, r"^axis: .*got 2"),
        ({"w": torch.zeros(4, 64), "axis": 1.0}, TypeError, r"^axis"),
    ],
)
def test_quantize_validation(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        quantize_mxfp4(**kwargs)


def _p(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((_p(4, 16, dtype=torch.int8), _p(4, 1)), {}, TypeError, r"^packed: .*uint8.*int8"),
        ((_p(4, 16), _p(4, 1, dtype=torch.float32)), {}, TypeError, r"^scales: .*uint8.*float32"),
        ((_p(4, 16), _p(4, 2)), {}, ValueError, r"^scales: expected shape \[4, 1\]"),
        ((_p(4, 16), _p(3, 1)), {}, ValueError, r"^scales: expected shape"),
        ((_p(4, 16), _p(4, 1, 1)), {}, ValueError, r"^scales: expected shape"),
        ((_p(4, 24), _p(4, 1)), {}, ValueError, r"^packed\.shape\[-1\].*multiple of 16.*24"),
        ((_p(16, 4), _p(16, 1)), {"axis": 0}, ValueError, r"^scales: expected shape \[1, 4\]"),
        ((_p(4, 16), _p(4, 1)), {"dtype": torch.int32}, TypeError, r"^dtype"),
        ((_p(4, 16), _p(4, 1)), {"axis": -3}, ValueError, r"^axis"),
        ((torch.tensor(3, dtype=torch.uint8), _p(1)), {}, ValueError, r"^packed: .*0-dim"),
        (("x", _p(1)), {}, TypeError, r"^packed: expected a torch\.Tensor"),
    ],
)
def test_dequantize_validation(args: tuple, kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        dequantize_mxfp4(*args, **kwargs)


# ----------------------------------------------------------------------------- sizes


def test_nbytes() -> None:
    shape = (64, 4096, 4096)
    n = 64 * 4096 * 4096
    assert mxfp4_nbytes(shape) == n // 2 + n // 32
    assert mxfp4_nbytes(torch.Size(shape), axis=1) == n // 2 + n // 32
    assert mxfp4_nbytes([32]) == 17
    assert mxfp4_nbytes(shape) / (2 * n) == 17 / 64  # 4.25 bits vs 16: ~0.27x BF16
    x = torch.randn(2, 3, 64)
    packed, scales = quantize_mxfp4(x)
    assert packed.numel() + scales.numel() == mxfp4_nbytes(x.shape)


@pytest.mark.parametrize(
    ("shape", "axis", "exc", "match"),
    [
        ((4, 33), -1, ValueError, r"shape\[-1\].*multiple of 32"),
        ((4, 64), 2, ValueError, r"^axis"),
        ((), -1, ValueError, r"^shape"),
        (64, -1, TypeError, r"^shape"),
        ((4, -32), -1, ValueError, r"^shape\[1\]"),
    ],
)
def test_nbytes_validation(shape: object, axis: int, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        mxfp4_nbytes(shape, axis=axis)


def test_mxfp4_b_checks_k():
    """An MXFP4 B's K comes from its codes and must be a multiple of 64."""
    from megamoe.wrappers.grouped_gemm import _check_mxfp4

    gen = torch.Generator().manual_seed(3)
    experts, rows, k = 3, 40, 192
    codes = torch.randint(0, 256, (experts, rows, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (experts, rows, k // 32), generator=gen, dtype=torch.uint8)
    assert _check_mxfp4("b", codes, scales, codes.device) == k
    with pytest.raises(ValueError, match="multiple of 64"):
        _check_mxfp4("b", codes[:, :, :80].contiguous(), scales[:, :, :5].contiguous(), None)


def test_cpu_twin_of_an_mxfp4_grouped_gemm_is_the_dequantized_gemm():
    import megamoe as mm
    from megamoe.wrappers.grouped_gemm import grouped_gemm

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 4, (50, 2), generator=gen)
    plan = mm.plan_routes(ids, 4, 64)
    a = torch.randn(plan.pool_capacity, 128, generator=gen).bfloat16()
    codes = torch.randint(0, 256, (4, 96, 64), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (4, 96, 4), generator=gen, dtype=torch.uint8)
    out = grouped_gemm(a, codes, plan, b_scales=scales)
    decoded = mm.dequantize_mxfp4(codes, scales, axis=-1, dtype=torch.bfloat16)
    rows = int(plan.expert_pool_offsets[-1])  # rows past it are not written
    assert torch.equal(out[:rows], grouped_gemm(a, decoded, plan)[:rows])


def test_the_tables_are_kept_per_device_but_never_as_meta_tensors():
    from megamoe import mxfp4

    packed, scales = quantize_mxfp4(torch.randn(4, 64).to("meta"))
    dequantize_mxfp4(packed, scales)
    assert not any(device.type == "meta" for _, device in mxfp4._TABLES_ON)
    packed, scales = quantize_mxfp4(torch.randn(4, 64))
    first = dequantize_mxfp4(packed, scales)
    cpu = torch.device("cpu")
    tables = {name: mxfp4._TABLES_ON[(name, cpu)] for name in ("pairs", "boundaries")}
    quantize_mxfp4(torch.randn(4, 64))
    assert torch.equal(dequantize_mxfp4(packed, scales), first)
    for name, table in tables.items():
        assert mxfp4._TABLES_ON[(name, cpu)] is table  # not copied again


def test_quantize_and_dequantize_run_on_fake_cpu_tensors():
    """Under FakeTensorMode the constant tables join as fake tensors too: on CPU fake
    tensors the real cached tables were refused by the mode (a review); the shapes and
    dtypes are those of a real call, and no fake table is cached."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from megamoe import mxfp4

    real_packed, real_scales = quantize_mxfp4(torch.randn(4, 64))
    real = dequantize_mxfp4(real_packed, real_scales)
    with FakeTensorMode():
        packed, scales = quantize_mxfp4(torch.empty(4, 64))
        decoded = dequantize_mxfp4(packed, scales)
    for fake, want in ((packed, real_packed), (scales, real_scales), (decoded, real)):
        assert is_fake(fake) and fake.shape == want.shape and fake.dtype == want.dtype
    assert not any(is_fake(table) for table in mxfp4._TABLES_ON.values())
