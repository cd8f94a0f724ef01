"""The transient MXFP4 -> BF16 decode (kernels/mxfp4_decode.cuh) against the CPU
dequantizer, bit for bit: every code byte under every scale byte, and sizes that run the
kernel's unrolled grid-stride pass, its tail, or only the tail."""

import pytest
import torch

import megamoe as mm
from megamoe.wrappers.mxfp4_decode import decode_mxfp4_bf16

pytestmark = pytest.mark.gpu


def assert_same_bits_or_nan(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same BF16 bits wherever ``expected`` is a number; NaN exactly where it is NaN
    (the GPU's canonical NaN has other payload bits than torch's CPU one)."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    differ = actual[~nan].view(torch.int16) != expected[~nan].view(torch.int16)
    assert not bool(differ.any()), f"{int(differ.sum())} values differ"


def test_every_code_byte_under_every_scale_byte():
    """Row s: 16 blocks under scale byte s whose 256 code bytes are 0..255 (both codes of
    every byte, -0 included); scale 0 is 2^-127 (subnormal products), 128 and up the
    FP32 path, 0xFF NaN."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    expected = mm.dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16)
    actual = decode_mxfp4_bf16(packed.cuda(), scales.cuda()).cpu()
    assert bool(torch.isnan(expected[255]).all()) and not bool(torch.isnan(expected[:255]).any())
    assert_same_bits_or_nan(actual, expected)


@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 5), (257, 4), (1031, 300)])
def test_sizes(rows, blocks):
    """One block; odd counts; and (1031, 300): 1.24M code words, more than four passes of
    the grid a 132-SM device holds (grid-stride passes, the last one partial)."""
    gen = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (rows, 16 * blocks), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (rows, blocks), generator=gen, dtype=torch.uint8)
    expected = mm.dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16)
    assert_same_bits_or_nan(decode_mxfp4_bf16(packed.cuda(), scales.cuda()).cpu(), expected)


def test_extreme_scales_zero_blocks_and_negative_zero():
    """Every code with scale bytes at the extremes (0 = 2^-127, 1, 126, 127, 128, 253,
    254, and 0xFF = NaN), all-zero blocks and -0 codes."""
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (64, 8, 48), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (64, 8, 3), generator=gen, dtype=torch.uint8)
    extremes = torch.tensor([0, 1, 126, 127, 128, 253, 254, 255], dtype=torch.uint8)
    scales[:8, 0, 0] = extremes
    packed[8, 0, :16] = 0  # an all-zero block
    packed[9, 0, :16] = 0x88  # -0 codes
    expected = mm.dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16)
    assert bool(torch.isnan(expected).any())  # the 0xFF block
    assert_same_bits_or_nan(decode_mxfp4_bf16(packed.cuda(), scales.cuda()).cpu(), expected)
