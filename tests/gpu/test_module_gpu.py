"""mm.MegaMoE on the fused backend: a training step matches the reference backend."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import GRAD_MIN_COSINE, assert_close_to_oracle, make_routing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("trainable_base", [False, True])
def test_module_fused_matches_reference_backend(trainable_base):
    torch.manual_seed(0)
    kwargs = dict(side_rank=16, side_scale=0.5, trainable_base=trainable_base, device="cuda")
    fused = mm.MegaMoE(256, 128, 8, 2, backend="fused", **kwargs)
    exact = mm.MegaMoE(256, 128, 8, 2, backend="reference", **kwargs)
    exact.load_state_dict(fused.state_dict())
    with torch.no_grad():  # LoRA init leaves the expand factors at zero: give them values
        for a, b in zip(fused.adapter_parameters(), exact.adapter_parameters(), strict=True):
            values = torch.randn_like(a, dtype=torch.float32) * 0.05
            a.copy_(values)
            b.copy_(values)
    ids, weights = make_routing(300, 8, 2, seed=3, device="cuda")
    x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    dout = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    out = fused(x, ids, weights)
    expected = exact(x, ids, weights)
    assert_close_to_oracle("out", out, expected.detach())
    out.backward(dout)
    expected.backward(dout.to(expected.dtype))
    params = dict(exact.named_parameters())
    for name, p in fused.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert_close_to_oracle(
                f"d{name}", p.grad, params[name].grad, min_cosine=GRAD_MIN_COSINE
            )
        else:
            assert p.grad is None, name
