"""``mm.moe``'s own decisions on the CPU (the op's CPU twins run where the CUDA check is
lifted): the save mode under vmap, and the order of its checks."""

from __future__ import annotations

import pytest
import torch

import megamoe as mm
from megamoe.custom_ops import layer as layer_ops
from megamoe.testing import make_layer
from megamoe.weights import BaseWeights


@pytest.fixture
def cpu_twins(monkeypatch):
    """The op's implementation on CPU tensors (its kernels' CPU twins)."""
    check = layer_ops.check_moe_inputs

    def checked(*args, **kwargs):
        return check(*args, **{**kwargs, "require_cuda": False})

    monkeypatch.setattr(layer_ops, "check_moe_inputs", checked)


def test_vmap_with_inputs_that_need_grad_saves_for_the_backward(cpu_twins):
    # Under vmap `requires_grad` reads False on the batched wrapper, yet autograd records
    # the op on the tensor it wraps: an inference save mode made the backward raise.
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=24, seed=1)

    def one(x):
        return mm.moe(x, layer.topk_ids, layer.topk_weights, layer.base, layer.side)

    batch = torch.stack([layer.x, layer.x * 0.5]).requires_grad_()
    torch.vmap(one)(batch).float().sum().backward()
    for i in range(2):
        x = batch[i].detach().clone().requires_grad_()
        one(x).float().sum().backward()
        assert torch.equal(batch.grad[i], x.grad), i
    assert batch.grad.abs().sum() > 0


def test_reduce_shared_grads_is_checked_before_the_base_is_prepared(monkeypatch):
    # A trainable MXFP4 base decodes (a launch) when prepared for the call: a bad
    # argument is refused before it.
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=8, seed=1)

    def prepared(self):
        raise AssertionError("the base was prepared before the arguments were checked")

    monkeypatch.setattr(BaseWeights, "for_call", prepared)
    with pytest.raises(ValueError, match="reduce_shared_grads: only meaningful with group="):
        mm.moe(
            layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side,
            reduce_shared_grads=False,
        )  # fmt: skip


@pytest.mark.parametrize("rank", [None, 16])
@pytest.mark.parametrize(
    ("tokens", "decodes"),
    [(24, 0), (1600, 2)],  # 12 and 800 routes per expert (E = 4, K = 2)
)
def test_a_trainable_mxfp4_base_is_the_straight_through_path_packed_or_decoded(
    cpu_twins, monkeypatch, rank, tokens, decodes
):
    """Ordinary mode on an MXFP4 base: with few rows per expert the op runs on the packed
    codes and its backward gives the masters their gradients (no whole-base decode); with
    many it runs the BF16 path on one decode. Either way every output and gradient is the
    straight-through path's, bit for bit, the masters' in their own dtype (FP32 here)."""
    import megamoe.weights as weights_module

    layer = make_layer(64, 64, 4, 2, rank, num_tokens=tokens, seed=3, requires_grad=True)
    masters = [w.detach().float().requires_grad_(True) for w in (layer.w13, layer.w2)]
    base = mm.prepare_base_weights(*masters, format="mxfp4")
    twin_base = base.straight_through()  # BF16, its gradient cast to the masters'
    seen = []
    decode = weights_module.decode_mxfp4_bf16
    monkeypatch.setattr(
        weights_module, "decode_mxfp4_bf16", lambda *a: seen.append(1) or decode(*a)
    )
    side = [] if layer.side is None else list(layer.side.tensors())
    leaves = [layer.x, layer.topk_weights, *masters, *side]
    dout = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = mm.moe(layer.x, layer.topk_ids, layer.topk_weights, base, layer.side)
    grads = torch.autograd.grad(out, leaves, dout)
    assert len(seen) == decodes
    twin_out = mm.moe(layer.x, layer.topk_ids, layer.topk_weights, twin_base, layer.side)
    twin = torch.autograd.grad(twin_out, leaves, dout)
    assert torch.equal(out, twin_out)
    for i, (got, want) in enumerate(zip(grads, twin, strict=True)):
        assert got.dtype == want.dtype and torch.equal(got, want), i
    assert grads[2].dtype == torch.float32 and grads[2].abs().sum() > 0


def test_a_second_backward_under_a_hook_that_keeps_the_saved_tensor_is_refused(cpu_twins):
    """The backward writes dg | du over the saved pre-activations; autograd's version
    check refuses a second backward, but not under a saved-tensor hook whose unpack
    returns the saved tensor itself: the second backward read dg | du as g | u and gave
    other gradients, silently (a review). Refused by name now; a hook that unpacks a
    copy still gets the first backward's bits."""
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=24, seed=1, requires_grad=True)
    args = (layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side)
    # The saved tensor itself, or an alias of its memory (a detach, a view).
    for unpack in (lambda t: t, lambda t: t.detach(), lambda t: t.view_as(t)):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            loss = mm.moe(*args).float().square().sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"^Trying to backward through the graph a"):
            loss.backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone()):
        loss = mm.moe(*args).float().square().sum()
    first = torch.autograd.grad(loss, [layer.x, layer.side.b1], retain_graph=True)
    second = torch.autograd.grad(loss, [layer.x, layer.side.b1])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
