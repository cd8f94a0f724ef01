"""mm.moe's eager route (``megamoe.custom_ops.layer._EagerMoeForward``) against the custom ops.

Eagerly, on plain CUDA tensors, ``mm.moe`` calls the ops' implementations without the
custom-op dispatch. Both routes must give the same bits, keep the ops' autograd rules
(the in-place ``dg | du``, no second backward), and the op route must still be taken
where torch needs to see the ops (a torch-function or dispatch mode, torch.compile).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import megamoe as mm
from megamoe.custom_ops import layer
from megamoe.testing import LayerInputs, OpRoute, make_layer

pytestmark = pytest.mark.gpu


def _layer(mode: str, format: str) -> LayerInputs:
    ordinary = mode == "ordinary"
    return make_layer(
        512, 256, 8, 4, None if ordinary else 32, num_tokens=301, device="cuda", seed=5,
        routing="masked", format=format, activation_clamp=1.5, requires_grad=True,
        trainable_base=ordinary,
    )  # fmt: skip


def _run(layer: LayerInputs, dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = list(layer.grad_leaves().values())
    out = layer.call(mm.moe)
    return [out, *torch.autograd.grad(out, leaves, dout)]


@pytest.fixture
def routes(monkeypatch):
    """Counts of the eager route's forwards."""
    taken = {"eager": 0}
    apply = layer._EagerMoeForward.apply

    def counted(*args):
        taken["eager"] += 1
        return apply(*args)

    monkeypatch.setattr(layer._EagerMoeForward, "apply", counted)
    return taken


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_eager_route_is_bitwise_the_op_route(mode, format, routes):
    layer = _layer(mode, format)
    dout = torch.randn_like(layer.x)
    eager = _run(layer, dout)
    assert routes["eager"] == 1
    with OpRoute():
        via_op = _run(layer, dout)
    assert routes["eager"] == 1  # the mode sent the second call through the op
    for i, (a, b) in enumerate(zip(eager, via_op, strict=True)):
        assert torch.equal(a, b), i
    assert torch.isfinite(eager[0]).all() and eager[0].abs().amax() > 0


def test_eager_route_refuses_a_second_backward(routes):
    layer = _layer("side-lora", "bf16")
    out = layer.call(mm.moe)
    leaves = list(layer.grad_leaves().values())
    torch.autograd.grad(out, leaves, torch.ones_like(out), retain_graph=True)
    assert routes["eager"] == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, leaves, torch.ones_like(out))


def test_create_graph_gives_the_same_grads_and_refuses_a_second_order(routes):
    """backward(create_graph=True) (a trainer's gradient penalty, say) gets the plain
    first-order gradients; differentiating them again fails loudly instead of returning
    a partial second-order graph (the native kernels record none)."""
    layer = _layer("side-lora", "bf16")
    dout = torch.randn_like(layer.x)
    leaves = list(layer.grad_leaves().values())
    plain = _run(layer, dout)[1:]
    out = layer.call(mm.moe)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    assert routes["eager"] == 2
    for i, (a, b) in enumerate(zip(grads, plain, strict=True)):
        assert torch.equal(a.detach(), b), i
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable"):
        torch.autograd.grad(grads[0].float().sum(), leaves[0])


def test_inference_takes_the_eager_route_and_matches(routes):
    layer = _layer("side-lora", "bf16")
    with torch.no_grad():
        eager = layer.call(mm.moe)
        with OpRoute():
            via_op = layer.call(mm.moe)
    assert routes["eager"] == 1
    assert torch.equal(eager, via_op)


def test_flop_counter_sees_the_ops_on_cuda(routes):
    layer = _layer("side-lora", "bf16")
    with FlopCounterMode(display=False) as counter:
        out = layer.call(mm.moe)
        torch.autograd.grad(out, list(layer.grad_leaves().values()), torch.ones_like(out))
    assert routes["eager"] == 0
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert any("moe_forward" in op and n > 0 for op, n in counts.items()), counts
    assert any("moe_backward" in op and n > 0 for op, n in counts.items()), counts


def test_the_backward_op_aligns_a_misaligned_dout():
    """The backward op's implementation copies a ``dout`` whose address is not 16-byte
    aligned (a view into a flat buffer) before the kernels' TMA reads it: under
    torch.compile the autograd hook's own alignment is traced without data. The same bits
    as with an aligned ``dout``."""
    from megamoe.pipeline.fused_forward import moe_forward
    from megamoe.side_lora import SIDE_NAMES

    lay = make_layer(
        512, 256, 8, 4, 32, num_tokens=301, device="cuda", seed=5, routing="masked",
        activation_clamp=1.5,
    )  # fmt: skip
    block_m = mm.get_block_m(301, 4, 8)
    _, state = moe_forward(
        lay.x, lay.topk_ids, lay.topk_weights, lay.base, lay.side, activation_clamp=1.5,
        block_m=block_m, save="preact",
    )  # fmt: skip
    plan = state.plan
    saved = dict(
        expert_counts=plan.expert_counts, expert_pool_offsets=plan.expert_pool_offsets,
        route_to_pool_row=plan.route_to_pool_row, pool_row_to_route=plan.pool_row_to_route,
        preact=state.preact, q13=state.q13, p_sum=state.p_sum,
    )  # fmt: skip
    inputs = dict(
        x=lay.x, topk_weights=lay.topk_weights, w13=lay.base.w13, w2=lay.base.w2,
        w13_scales=lay.base.w13_scales, w2_scales=lay.base.w2_scales,
        **dict(zip(SIDE_NAMES, lay.side.tensors(), strict=True)),
        scale=lay.side.scale, activation="swiglu", activation_clamp=1.5,
        base_grads=False, side_grads=True, block_m=block_m,
    )  # fmt: skip
    dout = torch.randn_like(lay.x)
    buffer = torch.empty(dout.numel() + 1, dtype=dout.dtype, device=dout.device)
    misaligned = buffer[1:].view(dout.shape)
    misaligned.copy_(dout)
    assert misaligned.data_ptr() % 16 != 0
    # dgrad2 writes dg | du over the saved pre-activations: each call its own copy.
    fresh = lambda: {name: t.clone() for name, t in saved.items()}  # noqa: E731
    want = layer._moe_backward_op(dout=dout, **inputs, **fresh())
    got = layer._moe_backward_op(dout=misaligned, **inputs, **fresh())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
            b.view(torch.int16) if b.dtype == torch.bfloat16 else b,
        )
