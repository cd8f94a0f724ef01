"""mm.moe's eager route (``megamoe.custom_ops.layer._EagerMoeForward``) on the CPU; the GPU suite
(tests/gpu/test_eager_route.py) runs it against the custom ops."""

from __future__ import annotations

import torch

from megamoe.custom_ops import layer


def test_eager_route_backward_runs_without_grad_mode():
    """mm.moe's eager route runs the backward implementation directly, inside autograd:
    its backward is once-differentiable (no grad mode inside), so ``create_graph=True``
    neither records a partial second-order graph nor trips the BF16 rounding's ``out=``."""
    seen = {}

    def probe(ctx, *grads):
        seen["grad_mode"] = torch.is_grad_enabled()
        return (None,) * len(layer._FORWARD_INPUTS)

    ctx = type("Ctx", (), {})()
    wrapped = layer._EagerMoeForward.backward
    original = layer._forward_backward
    try:
        layer._forward_backward = probe
        with torch.enable_grad():
            wrapped(ctx, torch.ones(2, requires_grad=True))
    finally:
        layer._forward_backward = original
    assert seen["grad_mode"] is False
