"""prepare_base_weights' trainable copies: a base made once from trainable weights and
reused after they change in place (an optimizer step) is refused, not run on the old
values (found by a review: the gradients kept landing in the new weights while the
layer computed with the copy made before the step)."""

from __future__ import annotations

import pytest
import torch

import megamoe as mm
from megamoe.testing import make_layer


def _masters(dtype: torch.dtype) -> tuple:
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=8, seed=1)
    w13 = layer.base.w13_linear(torch.float32).to(dtype).requires_grad_()
    w2 = layer.base.w2_linear(torch.float32).to(dtype).requires_grad_()
    return layer, w13, w2


def _call(layer, base) -> torch.Tensor:
    return mm.reference.moe(layer.x, layer.topk_ids, layer.topk_weights, base)


@pytest.mark.parametrize(
    ("format", "dtype"),
    [("bf16", torch.float32), ("mxfp4", torch.float32), ("mxfp4", torch.bfloat16)],
)
def test_a_stale_copy_of_trainable_weights_is_refused(format, dtype):
    layer, w13, w2 = _masters(dtype)
    base = mm.prepare_base_weights(w13, w2, format=format)
    before = _call(layer, base)  # unchanged sources: runs
    with torch.no_grad():
        w2.mul_(1.5)  # what optimizer.step() does
    with pytest.raises(ValueError, match=r"^base: w2 changed in place after prepare_base"):
        _call(layer, base)
    with pytest.raises(ValueError, match=r"^base: w2 changed in place"):
        base.for_call()  # mm.moe's and the EP layer's entry too
    # Prepared again: runs, and on the new values (a copy of them, not the old ones).
    fresh = mm.prepare_base_weights(w13, w2, format=format)
    current = mm.prepare_base_weights(w13.detach().clone(), w2.detach().clone(), format=format)
    after = _call(layer, fresh)
    torch.testing.assert_close(after, _call(layer, current), rtol=0, atol=0)
    assert not torch.equal(after, before)


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
def test_a_copy_rewritten_in_place_after_the_step_runs(format):
    """Re-preparing into the same buffers (the CUDA-graph pattern, whose replays read
    fixed addresses) keeps the base current: no refusal, and the later steps are
    checked again."""
    layer, w13, w2 = _masters(torch.float32)
    base = mm.prepare_base_weights(w13, w2, format=format)
    for _ in range(2):
        with torch.no_grad():
            w13.mul_(0.5)
            new = mm.prepare_base_weights(w13, w2, format=format)
            for name in ("w13", "w2", "w13_scales", "w2_scales"):
                static, value = getattr(base, name), getattr(new, name)
                if static is not None:
                    static.copy_(value)
        with torch.no_grad():  # `new`, made under no_grad, only donates its values
            expected = _call(layer, new)
        torch.testing.assert_close(_call(layer, base), expected, rtol=0, atol=0)
    with torch.no_grad():
        w13.mul_(0.5)
    with pytest.raises(ValueError, match=r"^base: w13 changed in place"):
        _call(layer, base)


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
def test_an_earlier_rewrite_does_not_excuse_a_later_step(format):
    """A rewrite of the copy while its source was unchanged (a warm-up re-prepare into
    the same buffers) was taken as the refresh of any later step: the call after an
    optimizer step with no re-prepare ran on the old values (a review)."""
    layer, w13, w2 = _masters(torch.float32)
    base = mm.prepare_base_weights(w13, w2, format=format)
    with torch.no_grad():
        new = mm.prepare_base_weights(w13, w2, format=format)
        for name in ("w13", "w2", "w13_scales", "w2_scales"):
            if getattr(base, name) is not None:
                getattr(base, name).copy_(getattr(new, name))
    _call(layer, base)  # sources unchanged: runs
    with torch.no_grad():
        w2.mul_(1.5)  # the step, and no re-prepare
    with pytest.raises(ValueError, match=r"^base: w2 changed in place"):
        _call(layer, base)


@pytest.mark.parametrize(
    ("format", "dtype"),
    [("bf16", torch.float32), ("mxfp4", torch.float32), ("mxfp4", torch.bfloat16)],
)
def test_a_base_prepared_under_no_grad_from_trainable_weights(format, dtype):
    """Prepared under no_grad, a copy of weights that require grad has no autograd link:
    a call with gradients on gave them no gradient, silently, and after a step ran on the
    old values (a review). It is refused with gradients on and stale after a step; under
    no_grad (inference) it runs; a BF16 base that is the weights themselves is linked."""
    layer, w13, w2 = _masters(dtype)
    with torch.no_grad():
        base = mm.prepare_base_weights(w13, w2, format=format)
        _call(layer, base)  # inference: runs
    assert base.unlinked == ("w13", "w2")
    with pytest.raises(
        ValueError, match=r"^base: prepared under torch.no_grad\(\) from w13 and w2"
    ):
        _call(layer, base)
    with torch.no_grad():
        w2.mul_(1.5)
        with pytest.raises(ValueError, match=r"^base: w2 changed in place"):
            _call(layer, base)
    bf16 = layer.base.w13_linear(torch.float32).bfloat16().requires_grad_()
    with torch.no_grad():
        same = mm.prepare_base_weights(bf16, w2.detach().bfloat16())
    assert same.w13 is bf16 and same.unlinked == ()


def test_bases_that_hold_the_weights_themselves_need_no_check():
    # BF16 weights are the base (no copy); a frozen base is a snapshot by design.
    layer, w13, w2 = _masters(torch.bfloat16)
    base = mm.prepare_base_weights(w13, w2)
    assert base.w13 is w13 and base.sources == ()
    frozen = mm.prepare_base_weights(w13.detach().float(), w2.detach().float())
    assert frozen.sources == ()
    with torch.no_grad():
        w13.mul_(2)
    _call(layer, base)
    _call(layer, frozen)


def test_the_oracle_decodes_a_trainable_mxfp4_base_itself(monkeypatch):
    """reference.moe checks the fused path; in ordinary mode on an MXFP4 base it took the
    fused path's own native decode for its straight-through weights, so a wrong decode
    would have agreed with itself (a review). It decodes with dequantize_mxfp4 now."""
    import megamoe.weights as weights

    layer, w13, w2 = _masters(torch.bfloat16)
    base = mm.prepare_base_weights(w13, w2, format="mxfp4")
    expected = _call(layer, base)

    def wrong_decode(*args, **kwargs):
        raise AssertionError("the native decode is the fused path's, not the oracle's")

    monkeypatch.setattr(weights, "decode_mxfp4_bf16", wrong_decode)
    torch.testing.assert_close(_call(layer, base), expected, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="native decode"):
        base.for_call()  # what mm.moe runs on


def test_the_no_grad_refusal_holds_while_torch_compile_traces():
    """The refusal was skipped while torch.compile traced, so a compiled call gave the
    weights no gradient, silently (a review). It is static (the base's own tuple and the
    grad mode), so the trace raises it: a graph break, and with fullgraph=True dynamo's
    error carrying the ValueError."""
    layer, w13, w2 = _masters(torch.float32)
    with torch.no_grad():
        base = mm.prepare_base_weights(w13, w2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _call(layer, base), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"base: prepared under torch.no_grad\(\) from w13 and w2"):
        compiled(layer.x)
    compiled = torch.compile(lambda x: _call(layer, base), backend="eager")
    with pytest.raises(ValueError, match=r"^base: prepared under torch.no_grad\(\)"):
        compiled(layer.x)


def test_compiled_mxfp4_preparation_quantizes_the_bf16_rounding_as_eager():
    """Under torch.compile (Inductor) the packed values are those of eager mode: the
    FP32 weights' BF16 rounding is quantized. Inductor folded the cast pair fp32 -> bf16
    -> fp32 into nothing, so a block whose amax rounds up to the next power of two got a
    smaller scale and other codes (a review)."""
    w13 = torch.full((2, 128, 64), 0.25)
    w13[..., 0] = 0.99999  # rounds to 1.0 in BF16: the block's scale exponent moves up
    w13[1, :, 32:] = torch.linspace(-3.0, 3.0, 32) + 1e-4  # codes off the BF16 grid
    w2 = torch.full((2, 64, 64), -0.75)
    w2[..., 31] = 1.99999
    eager = mm.prepare_base_weights(w13, w2, format="mxfp4")
    torch._dynamo.reset()
    prepare = torch.compile(
        lambda a, b: mm.prepare_base_weights(a, b, format="mxfp4"), fullgraph=True
    )
    compiled = prepare(w13, w2)
    for name in ("w13", "w2", "w13_scales", "w2_scales"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert eager.w13_scales[0, 0, 0].item() == 125  # amax 1.0 = 2^0: 2^(0 - 2), E8M0 125
