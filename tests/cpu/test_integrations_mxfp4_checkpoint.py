"""Pre-quantized MXFP4 checkpoints -> megamoe's MXFP4 base (``megamoe.mxfp4_checkpoint``).

Oracles: ``mm.quantize_mxfp4`` of the decoded values (bit for bit), and transformers'
own MXFP4 dequantizer (``transformers.integrations.mxfp4.convert_moe_packed_tensors``,
what HF runs to load a gpt-oss MXFP4 checkpoint in BF16/FP32) for the values.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megamoe as mm
from megamoe.mxfp4_checkpoint import base_weights_from_gpt_oss, base_weights_from_mxfp4

E, H, I = 4, 128, 64


def weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.05).to(torch.bfloat16)
    w13[0, 3, :32] = 0  # an all-zero block
    return w13, w2


def random_codes(shape, seed: int):
    """Any byte, including code 8 (-0) in both nibbles, and scales around 2^0."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    codes.view(-1)[:4] = torch.tensor([0x08, 0x80, 0x88, 0x18], dtype=torch.uint8)
    return codes


def random_scales(shape, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(110, 140, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def assert_same_base(got: mm.BaseWeights, want: mm.BaseWeights):
    assert got.format == want.format == "mxfp4"
    assert (got.num_experts, got.hidden, got.intermediate) == (E, H, I)
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b), name


def test_checkpoint_codes_equal_quantize_of_their_decoded_values_bitwise():
    w13, w2 = weights()
    codes13, scales13 = mm.quantize_mxfp4(w13, axis=-1)  # a checkpoint in nn.Linear rows
    codes2, scales2 = mm.quantize_mxfp4(w2, axis=-1)
    base = base_weights_from_mxfp4(codes13, scales13, codes2, scales2)
    # The same base as prepare_base_weights(format="mxfp4") of the decoded values ...
    decoded13 = mm.dequantize_mxfp4(codes13, scales13, axis=-1, dtype=torch.float32)
    decoded2 = mm.dequantize_mxfp4(codes2, scales2, axis=-1, dtype=torch.float32)
    assert_same_base(base, mm.prepare_base_weights(decoded13, decoded2, format="mxfp4"))
    # ... which is quantize_mxfp4 of them, bit for bit.
    again13, again_s13 = mm.quantize_mxfp4(decoded13, axis=-1)
    assert torch.equal(base.w13_linear(torch.float32), decoded13)
    assert torch.equal(mm.quantize_mxfp4(base.w13_linear(torch.float32), axis=-1)[0], again13)
    assert torch.equal(again13, codes13) and torch.equal(again_s13, scales13)


def test_negative_zero_codes_are_written_as_positive_zero():
    codes13 = random_codes((E, 2 * I, H // 2), seed=1)
    codes2 = random_codes((E, H, I // 2), seed=2)
    scales13 = random_scales((E, 2 * I, H // 32), seed=3)
    scales2 = random_scales((E, H, I // 32), seed=4)
    base = base_weights_from_mxfp4(codes13, scales13, codes2, scales2)
    for t in (base.w13, base.w2):
        assert not ((t & 0x0F) == 8).any() and not ((t >> 4) == 8).any()
    # Values unchanged: -0 == +0 (and the decode of the original equals ours).
    want = mm.dequantize_mxfp4(codes2, scales2, axis=-1, dtype=torch.float32)
    assert torch.equal(base.w2_linear(torch.float32), want)


def test_the_base_shares_no_memory_with_the_checkpoint_tensors():
    """The codes and scales are copied (the docstring's promise): a later write into a
    checkpoint tensor, a 0xFF (NaN) scale say, does not reach the checked base. The
    scales were returned as they were when already contiguous (a review)."""
    codes13 = random_codes((E, 2 * I, H // 2), seed=1)
    codes2 = random_codes((E, H, I // 2), seed=2)
    scales13 = random_scales((E, 2 * I, H // 32), seed=3)
    scales2 = random_scales((E, H, I // 32), seed=4)
    given = (codes13, scales13, codes2, scales2)
    kept = [t.clone() for t in given]
    base = base_weights_from_mxfp4(*given)
    for t in given:
        t.fill_(0xFF)
    held = (base.w13, base.w13_scales, base.w2, base.w2_scales)
    assert torch.equal(held[1], kept[1]) and torch.equal(held[3], kept[3])
    assert not any((t == 0xFF).all() for t in held)


def test_gpt_oss_checkpoint_matches_transformers_dequantizer():
    hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    # gpt-oss's MXFP4 experts as transformers stores them (Mxfp4GptOssExperts).
    prefix = "model.layers.0.mlp.experts"
    state = {
        f"{prefix}.gate_up_proj_blocks": random_codes((E, 2 * I, H // 32, 16), seed=5),
        f"{prefix}.gate_up_proj_scales": random_scales((E, 2 * I, H // 32), seed=6),
        f"{prefix}.down_proj_blocks": random_codes((E, H, I // 32, 16), seed=7),
        f"{prefix}.down_proj_scales": random_scales((E, H, I // 32), seed=8),
    }
    base = base_weights_from_gpt_oss(state, prefix)

    def hf(name):
        return hf_mxfp4.convert_moe_packed_tensors(
            state[f"{prefix}.{name}_blocks"], state[f"{prefix}.{name}_scales"], dtype=torch.float32
        )

    gate_up = hf("gate_up_proj")  # [E, H, 2I]: gpt-oss's transposed layout, gate/up interleaved
    down = hf("down_proj")  # [E, I, H]
    assert gate_up.shape == (E, H, 2 * I) and down.shape == (E, I, H)
    want13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    assert torch.equal(base.w13_linear(torch.float32), want13)
    assert torch.equal(base.w2_linear(torch.float32), down.transpose(1, 2))


def test_deepseek_v4_fp4_experts_match_transformers_dequantizer():
    """DeepSeek-V4's FP4 experts as transformers holds them (FP8Experts with
    ``expert_dtype="fp4"``): int8 codes ``[E, N, K/2]`` and float8_e8m0fnu scales
    ``[E, N, K/32]``, read as their bytes; the values equal transformers' own FP4
    dequantization (``Fp8Dequantize``)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    codes13 = random_codes((E, 2 * I, H // 2), seed=11).view(torch.int8)
    scales13 = random_scales((E, 2 * I, H // 32), seed=12).view(torch.float8_e8m0fnu)
    codes2 = random_codes((E, H, I // 2), seed=13).view(torch.int8)
    scales2 = random_scales((E, H, I // 32), seed=14).view(torch.float8_e8m0fnu)
    base = base_weights_from_mxfp4(codes13, scales13, codes2, scales2)
    assert base.w13.dtype == torch.uint8 and base.w13_scales.dtype == torch.uint8
    dequantize = fp8.Fp8Dequantize(None)._dequantize_one
    want13 = dequantize(codes13, scales13, torch.float32)
    want2 = dequantize(codes2, scales2, torch.float32)
    assert torch.equal(base.w13_linear(torch.float32), want13)
    assert torch.equal(base.w2_linear(torch.float32), want2)


def test_reference_layer_on_the_loaded_base_equals_the_decoded_bf16_base():
    w13, w2 = weights(seed=3)
    codes13, scales13 = mm.quantize_mxfp4(w13, axis=-1)
    codes2, scales2 = mm.quantize_mxfp4(w2, axis=-1)
    base = base_weights_from_mxfp4(codes13, scales13, codes2, scales2)
    decoded = mm.prepare_base_weights(
        mm.dequantize_mxfp4(codes13, scales13, axis=-1, dtype=torch.bfloat16),
        mm.dequantize_mxfp4(codes2, scales2, axis=-1, dtype=torch.bfloat16),
    )  # E2M1 x 2^e values are exact in BF16 here
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, H, generator=gen)
    ids = torch.randint(0, E, (16, 2), generator=gen)
    w = torch.rand(16, 2, generator=gen)
    assert torch.equal(mm.reference.moe(x, ids, w, base), mm.reference.moe(x, ids, w, decoded))


def _two_nan(scales: torch.Tensor) -> torch.Tensor:
    out = scales.clone()
    out[0, 0, 0] = out[-1, -1, -1] = 0xFF
    return out


def test_bad_checkpoints_are_rejected():
    codes13 = torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8)
    scales13 = torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)
    codes2 = torch.zeros(E, H, I // 2, dtype=torch.uint8)
    scales2 = torch.zeros(E, H, I // 32, dtype=torch.uint8)
    with pytest.raises(TypeError, match="w13_codes: expected dtype uint8"):
        base_weights_from_mxfp4(codes13.float(), scales13, codes2, scales2)
    # Not a tensor: a TypeError naming it (an AttributeError on .dim() before).
    for bad in ([1], None):
        with pytest.raises(TypeError, match=r"^w13_codes: expected a torch.Tensor"):
            base_weights_from_mxfp4(bad, scales13, codes2, scales2)
        with pytest.raises(TypeError, match=r"^w2_codes: expected a torch.Tensor"):
            base_weights_from_mxfp4(codes13, scales13, bad, scales2)
    with pytest.raises(ValueError, match="w13_scales: expected shape"):
        base_weights_from_mxfp4(codes13, scales13[:, :, :2], codes2, scales2)
    with pytest.raises(ValueError, match="w2_codes: expected shape"):
        base_weights_from_mxfp4(codes13, scales13, codes2[:, :64], scales2)
    with pytest.raises(ValueError, match="blocks of 16 bytes"):
        base_weights_from_mxfp4(codes13.view(E, 2 * I, 4, 16)[..., :8], scales13, codes2, scales2)
    with pytest.raises(ValueError, match="gate_up"):
        base_weights_from_mxfp4(codes13, scales13, codes2, scales2, gate_up="split")
    # No experts, or more than the route plan takes: refused where the base is built, as
    # prepare_base_weights refuses them (a layer call had refused them later).
    with pytest.raises(ValueError, match=r"^w13_codes: expected at least one expert"):
        base_weights_from_mxfp4(codes13[:0], scales13[:0], codes2[:0], scales2[:0])
    many = 1025

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((many, *t.shape[1:]), dtype=t.dtype, device="meta")

    with pytest.raises(ValueError, match=r"^w13_codes: expected at most 1024 local experts"):
        base_weights_from_mxfp4(*(empty(t) for t in (codes13, scales13, codes2, scales2)))
    nan13 = scales13.clone()
    nan13[1, 5, 0] = 0xFF  # the OCP MX NaN scale: the whole block would decode to NaN
    with pytest.raises(
        ValueError, match=r"^w13_scales: 1 UE8M0 scale byte\(s\) are 0xFF.*\[1, 5, 0\]"
    ):
        base_weights_from_mxfp4(codes13, nan13, codes2, scales2)
    with pytest.raises(ValueError, match=r"^w2_scales: 2 UE8M0"):
        base_weights_from_mxfp4(codes13, scales13, codes2, _two_nan(scales2))
    prefix = "model.layers.0.mlp.experts"
    checkpoint = {
        f"{prefix}.gate_up_proj_blocks": codes13.view(E, 2 * I, H // 32, 16),
        f"{prefix}.gate_up_proj_scales": scales13,
        f"{prefix}.down_proj_blocks": codes2.view(E, H, I // 32, 16),
        f"{prefix}.down_proj_scales": _two_nan(scales2),
    }
    with pytest.raises(ValueError, match=rf"^{prefix}\.down_proj_scales: 2 UE8M0"):
        base_weights_from_gpt_oss(checkpoint, prefix)
    # Fake tensors (torch.compile, FakeTensorMode) have no values to check: shapes only.
    with FakeTensorMode():
        shapes = [c.shape for c in (codes13, scales13, codes2, scales2)]
        fake = base_weights_from_mxfp4(*(torch.empty(sh, dtype=torch.uint8) for sh in shapes))
    assert fake.w13.shape == (E, 2 * I, H // 2)
    # A ValueError naming the argument, as every bad input (was a KeyError).
    with pytest.raises(ValueError, match=r"^state_dict: missing \[.*gate_up_proj_blocks"):
        base_weights_from_gpt_oss({}, "model.layers.0.mlp.experts")
