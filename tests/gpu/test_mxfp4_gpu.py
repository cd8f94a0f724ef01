"""The MXFP4 quantizer on the GPU gives the CPU's bytes."""

import pytest
import torch

import megamoe as mm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis", [-1, 0])
def test_gpu_bytes_equal_cpu_bytes(dtype, axis):
    generator = torch.Generator().manual_seed(11)
    w = (torch.randn(64, 256, 512, generator=generator) * 3).to(dtype)
    w[0, :, :64] = 0  # zero blocks
    w[1, 0, 0] = float("nan")  # a NaN block
    packed, scales = mm.quantize_mxfp4(w, axis=axis)
    packed_gpu, scales_gpu = mm.quantize_mxfp4(w.cuda(), axis=axis)
    assert torch.equal(packed_gpu.cpu(), packed) and torch.equal(scales_gpu.cpu(), scales)
    back = mm.dequantize_mxfp4(packed_gpu, scales_gpu, axis=axis)
    expected = mm.dequantize_mxfp4(packed, scales, axis=axis).float()
    assert torch.allclose(back.cpu().float(), expected, rtol=0, atol=0, equal_nan=True)


def test_prepare_mxfp4_on_the_gpu():
    w13 = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(8, 256, 256, device="cuda", dtype=torch.bfloat16)
    base = mm.prepare_base_weights(w13, w2, format="mxfp4")
    cpu = mm.prepare_base_weights(w13.cpu(), w2.cpu(), format="mxfp4")
    assert torch.equal(base.w13.cpu(), cpu.w13) and torch.equal(base.w2_scales.cpu(), cpu.w2_scales)
