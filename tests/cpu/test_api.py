"""Public containers: SideLoRA and prepare_base_weights validate and lay out weights."""

import pytest
import torch

import megamoe as mm

H, I, E, R = 128, 128, 4, 16


def side_tensors(dtype=torch.bfloat16, hidden=H, intermediate=I, experts=E, rank=R):
    return dict(
        a1=torch.randn(hidden, rank, dtype=dtype),
        b1=torch.randn(experts, rank, intermediate, dtype=dtype),
        a3=torch.randn(hidden, rank, dtype=dtype),
        b3=torch.randn(experts, rank, intermediate, dtype=dtype),
        a2=torch.randn(experts, intermediate, rank, dtype=dtype),
        b2=torch.randn(rank, hidden, dtype=dtype),
    )


def test_side_lora_properties():
    side = mm.SideLoRA(**side_tensors(), scale=0.5)
    assert (side.rank, side.hidden, side.intermediate, side.num_experts) == (R, H, I, E)
    assert side.scale == 0.5 and side.dtype == torch.bfloat16
    assert len(side.tensors()) == 6


@pytest.mark.parametrize("rank", [16, 64, 128, 256])
def test_side_lora_accepts_supported_ranks(rank):
    assert mm.SideLoRA(**side_tensors(rank=rank)).rank == rank


@pytest.mark.parametrize("rank", [8, 24, 272])
def test_side_lora_rejects_unsupported_ranks(rank):
    with pytest.raises(ValueError, match="rank must be a multiple of 16"):
        mm.SideLoRA(**side_tensors(rank=rank))


@pytest.mark.parametrize(
    "name,bad,error,match",
    [
        ("b1", torch.randn(E, R + 16, I), ValueError, "side.b1: expected shape"),
        ("a3", torch.randn(H, R + 16), ValueError, "side.a3: expected shape"),
        ("b3", torch.randn(E + 1, R, I), ValueError, "side.b3"),
        ("a2", torch.randn(E, R, I), ValueError, "side.a2"),
        ("b2", torch.randn(H, R), ValueError, "side.b2"),
        ("a1", torch.randn(H, R, 1), ValueError, "side.a1: expected 2 dimensions"),
        ("b2", torch.randn(R, H, dtype=torch.float16), TypeError, "side.b2: expected dtype"),
        ("a1", torch.randint(0, 3, (H, R)), TypeError, "side.a1"),
        ("b1", [[1.0]], TypeError, "side.b1: expected a torch.Tensor"),
    ],
)
def test_side_lora_bad_tensors(name, bad, error, match):
    tensors = side_tensors(dtype=torch.float32)
    tensors[name] = bad
    with pytest.raises(error, match=match):
        mm.SideLoRA(**tensors)


def test_side_lora_mixed_dtypes_rejected():
    tensors = side_tensors()
    tensors["b2"] = tensors["b2"].float()
    with pytest.raises(TypeError, match="side.b2: expected dtype torch.bfloat16 like side.a1"):
        mm.SideLoRA(**tensors)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_side_lora_non_finite_scale(scale):
    with pytest.raises(ValueError, match="side.scale"):
        mm.SideLoRA(**side_tensors(), scale=scale)


def test_side_lora_scale_type():
    with pytest.raises(TypeError, match="side.scale"):
        mm.SideLoRA(**side_tensors(), scale="0.5")


def base_tensors(experts=E, hidden=H, intermediate=I, dtype=torch.bfloat16):
    w13 = torch.randn(experts, 2 * intermediate, hidden, dtype=dtype)
    w2 = torch.randn(experts, hidden, intermediate, dtype=dtype)
    return w13, w2


def test_bf16_base_is_the_callers_tensors():
    """The kernels read the user's layout: a contiguous BF16 base is used as given, with
    no copy (gate rows 0..I-1, up rows I..2I-1)."""
    w13, w2 = base_tensors()
    base = mm.prepare_base_weights(w13, w2)
    assert base.format == "bf16"
    assert base.w13 is w13 and base.w2 is w2
    assert torch.equal(base.w13_linear(), w13)
    assert torch.equal(base.w2_linear(), w2)
    # A non-contiguous or FP32 input gets one contiguous BF16 copy, same values.
    t13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(mm.prepare_base_weights(t13, w2).w13, w13)


def test_bf16_prepare_keeps_autograd_for_ordinary_mode():
    w13, w2 = base_tensors(dtype=torch.float32)
    w13.requires_grad_(True)
    w2.requires_grad_(True)
    base = mm.prepare_base_weights(w13, w2)
    (base.w13_linear(torch.float32).sum() * 2 + base.w2_linear(torch.float32).sum()).backward()
    assert torch.equal(w13.grad, torch.full_like(w13, 2.0))
    assert torch.equal(w2.grad, torch.ones_like(w2))


def test_mxfp4_prepare_bytes_and_values():
    w13, w2 = base_tensors()
    base = mm.prepare_base_weights(w13, w2, format="mxfp4")
    assert base.format == "mxfp4"
    assert base.w13.dtype == torch.uint8 and base.w13.shape == (E, 2 * I, H // 2)
    assert base.w13_scales.shape == (E, 2 * I, H // 32)
    assert base.w2.shape == (E, H, I // 2) and base.w2_scales.shape == (E, H, I // 32)
    bf16_bytes = 2 * (w13.numel() + w2.numel())
    assert base.nbytes() / bf16_bytes == pytest.approx(4.25 / 16)
    # Dequantized weights match quantizing the nn.Linear layout directly.
    packed, scales = mm.quantize_mxfp4(w13, axis=-1)
    assert torch.equal(base.w13_linear(), mm.dequantize_mxfp4(packed, scales, axis=-1))
    assert torch.equal(base.w2_linear(), mm.dequantize_mxfp4(*mm.quantize_mxfp4(w2, -1), -1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mxfp4_rejects_non_finite_weights(bad):
    w13, w2 = base_tensors()
    w2[1, 2, 3] = bad
    with pytest.raises(ValueError, match="w2: MXFP4 quantization needs finite weights"):
        mm.prepare_base_weights(w13, w2, format="mxfp4")


@pytest.mark.parametrize(
    "w13_shape,w2_shape,match",
    [
        ((E, 2 * I, H), (E, H, I + 64), "w2: expected shape"),
        ((E, 2 * I + 1, H), (E, H, I), "w13: expected an even"),
        ((E, 2 * I, H), (E + 1, H, I), "w2: expected shape"),
        ((E, 2 * I, 96), (E, 96, I), "hidden size H=96 is not a multiple of 64"),
        ((E, 2 * 96, H), (E, H, 96), "intermediate size I=96 is not a multiple of 64"),
        ((2 * I, H), (E, H, I), "w13: expected 3 dimensions"),
    ],
)
def test_prepare_rejects_bad_shapes(w13_shape, w2_shape, match):
    with pytest.raises(ValueError, match=match):
        mm.prepare_base_weights(torch.randn(w13_shape), torch.randn(w2_shape))


def test_prepare_rejects_bad_format_and_dtypes():
    w13, w2 = base_tensors()
    with pytest.raises(ValueError, match="format"):
        mm.prepare_base_weights(w13, w2, format="fp8")
    with pytest.raises(TypeError, match="w13: expected dtype"):
        mm.prepare_base_weights(w13.half(), w2.half())
    with pytest.raises(TypeError, match="w2: expected dtype"):
        mm.prepare_base_weights(w13, w2.float())


def test_mxfp4_base_on_meta_has_the_packed_shapes_and_runs_a_meta_call():
    """A module built on meta (or traced with fake tensors) prepares an MXFP4 base of the
    packed shapes without reading values, and mm.moe on it gives the output's shape."""
    w13 = torch.empty(4, 2 * I, H, device="meta", dtype=torch.bfloat16)
    w2 = torch.empty(4, H, I, device="meta", dtype=torch.bfloat16)
    base = mm.prepare_base_weights(w13, w2, format="mxfp4")
    assert base.format == "mxfp4" and base.w13.device.type == "meta"
    assert tuple(base.w13.shape) == (4, 2 * I, H // 2) and base.w13.dtype == torch.uint8
    assert tuple(base.w13_scales.shape) == (4, 2 * I, H // 32)
    assert tuple(base.w2.shape) == (4, H, I // 2) and tuple(base.w2_scales.shape) == (4, H, I // 32)
    x = torch.empty(5, H, device="meta", dtype=torch.bfloat16)
    ids = torch.zeros(5, 2, device="meta", dtype=torch.int32)
    out = mm.moe(x, ids, torch.empty(5, 2, device="meta"), base)
    assert out.shape == x.shape and out.device.type == "meta"


def test_the_version_is_the_packages():
    """``megamoe.__version__`` and pyproject.toml's version are written by hand in two
    places; the release job checks the tag against pyproject.toml."""
    import tomllib
    from pathlib import Path

    import megamoe

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    with pyproject.open("rb") as f:
        assert megamoe.__version__ == tomllib.load(f)["project"]["version"]
