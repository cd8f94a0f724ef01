"""mm.moe's eager route (``megamoe.custom_ops.layer._EagerMoeForward``) on the CPU; the GPU suite
(tests/gpu/test_eager_route.py) runs it against the custom ops."""

from __future__ import annotations

import pytest
import torch

from megamoe.custom_ops import layer as layer_ops
from megamoe.pipeline.fused_backward import GRAD_NAMES
from megamoe.pipeline.fused_forward import moe_forward
from megamoe.side_lora import SIDE_NAMES
from megamoe.testing import make_layer


def test_eager_route_backward_runs_without_grad_mode():
    """mm.moe's eager route runs the backward implementation directly, inside autograd:
    its backward is once-differentiable (no grad mode inside), so ``create_graph=True``
    neither records a partial second-order graph nor trips the BF16 rounding's ``out=``."""
    seen = {}

    def probe(ctx, *grads):
        seen["grad_mode"] = torch.is_grad_enabled()
        return (None,) * len(layer_ops._FORWARD_INPUTS)

    ctx = type("Ctx", (), {})()
    eager = layer_ops._EagerMoeForward
    original = eager.run_backward
    try:
        eager.run_backward = staticmethod(probe)
        with torch.enable_grad():
            eager.backward(ctx, torch.ones(2, requires_grad=True))
    finally:
        eager.run_backward = original
    assert seen["grad_mode"] is False


def _forward_state(format: str):
    """A side-LoRA layer on the CPU, the forward pipeline's state for its backward (by
    the backward op's state names) and a ``dout``."""
    layer = make_layer(
        64, 128, 4, 2, 16, num_tokens=37, seed=3, routing="masked", format=format,
        activation_clamp=7.0,
    )  # fmt: skip
    _, state = moe_forward(
        layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side,
        activation_clamp=7.0, block_m=64, save="preact",
    )  # fmt: skip
    plan = state.plan
    saved = {
        "expert_counts": plan.expert_counts,
        "expert_pool_offsets": plan.expert_pool_offsets,
        "route_to_pool_row": plan.route_to_pool_row,
        "pool_row_to_route": plan.pool_row_to_route,
        "preact": state.preact,
        "q13": state.q13,
        "p_sum": state.p_sum,
    }
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(37, 64, generator=gen).bfloat16()
    return layer, saved, dout


def _op_inputs(layer) -> tuple[dict, dict]:
    base, side = layer.base, layer.side
    inputs = {
        "x": layer.x,
        "topk_weights": layer.topk_weights,
        "w13": base.w13,
        "w2": base.w2,
        "w13_scales": base.w13_scales,
        "w2_scales": base.w2_scales,
        **dict(zip(SIDE_NAMES, side.tensors(), strict=True)),
    }
    options = {"scale": side.scale, "activation": "swiglu", "activation_clamp": 7.0}
    return inputs, options


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
def test_eager_backward_is_the_backward_op(format):
    """The eager route's backward entry (which checks only ``dout`` again) gives the
    backward op's implementation's gradients bit for bit (on the CPU twins of the
    kernels; the GPU suite compares the two routes end to end)."""
    layer, saved, dout = _forward_state(format)
    inputs, options = _op_inputs(layer)
    which = dict(base_grads=False, side_grads=True, block_m=64)
    # dgrad2 writes dg | du over the saved pre-activations: each call gets its own copy.
    fresh = lambda: {name: t.clone() for name, t in saved.items()}  # noqa: E731
    eager = layer_ops._eager_backward(dout, inputs, options, fresh(), **which)
    op = layer_ops._moe_backward_impl(dout, **inputs, **options, **fresh(), **which)
    assert len(eager) == len(op) == len(GRAD_NAMES)
    for name, got, want in zip(GRAD_NAMES, eager, op, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert eager[GRAD_NAMES.index("x")].abs().sum() > 0  # a real gradient, not empties


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (lambda d: d.float(), TypeError, "dout: expected dtype bfloat16"),
        (lambda d: d[:, :32].contiguous(), ValueError, "dout: expected shape"),
        (lambda d: d.to("meta"), ValueError, "dout: expected device"),
    ],
)
def test_eager_backward_checks_dout(bad, error, match):
    """What the eager backward still checks: ``dout`` against the forward's ``x``."""
    layer, saved, dout = _forward_state("bf16")
    inputs, options = _op_inputs(layer)
    with pytest.raises(error, match=match):
        layer_ops._eager_backward(
            bad(dout), inputs, options, saved, base_grads=False, side_grads=True, block_m=64
        )
