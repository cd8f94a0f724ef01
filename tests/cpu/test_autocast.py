"""The layer under ``torch.autocast``: the ops' implementations and the reference run
at their own precision (trainers wrap forwards in autocast: HF Trainer ``bf16=True``).
Before, autocast reached the torch ops the implementations call: on the CPU twins every
output and gradient changed (the FP32 products ran in BF16), and the reference backend
failed (``index_copy_`` of a BF16 product into its FP32 buffer)."""

from __future__ import annotations

import pytest
import torch

import megamoe as mm
import megamoe.custom_ops.layer as op_layer
from megamoe.testing import make_layer


def _step(layer, autocast: bool) -> list[torch.Tensor]:
    x = layer.x.detach().clone().requires_grad_()
    weights = layer.topk_weights.detach().clone().requires_grad_()
    side = mm.SideLoRA(
        *(t.detach().clone().requires_grad_() for t in layer.side.tensors()),
        scale=layer.side.scale,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = mm.moe(x, layer.topk_ids, weights, layer.base, side)
        out.float().square().sum().backward()  # a backward inside the region too
    return [out, x.grad, weights.grad, *(t.grad for t in side.tensors())]


def test_the_ops_run_at_their_own_precision_under_autocast(monkeypatch):
    # The ops' real implementations on their CPU twins (they refuse CPU tensors only in
    # the CUDA check this lifts).
    real_check = op_layer.check_moe_inputs

    def check_on_any_device(*args, **kwargs):
        return real_check(*args, **{**kwargs, "require_cuda": False})

    monkeypatch.setattr(op_layer, "check_moe_inputs", check_on_any_device)
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=24, seed=1)
    plain, under = _step(layer, False), _step(layer, True)
    for a, b in zip(plain, under, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.float64])
def test_the_reference_runs_at_its_own_precision_under_autocast(compute_dtype):
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=24, seed=2)

    def run(autocast: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return mm.reference.moe(
                layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side,
                compute_dtype=compute_dtype,
            )  # fmt: skip

    assert torch.equal(run(False), run(True))
    module = mm.MegaMoE(64, 64, 4, 2, side_rank=16, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(layer.x, layer.topk_ids, layer.topk_weights)
