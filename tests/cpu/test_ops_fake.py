"""The fake (meta) implementations of the custom ops, which torch.compile traces with:
shapes and dtypes of every output, without running a kernel."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megamoe as mm  # also registers the megamoe:: ops
from megamoe.wrappers.routing import pool_capacity

T, H, I, E, K, R = 37, 128, 64, 8, 2, 16
BLOCK_M = mm.get_block_m(T, K, E)  # what mm.moe passes both ops


def _inputs(side: bool):
    x = torch.empty(T, H, dtype=torch.bfloat16)
    ids = torch.empty(T, K, dtype=torch.int32)
    weights = torch.empty(T, K, dtype=torch.float32)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16)
    adapters = [None] * 6
    if side:
        adapters = [
            torch.empty(H, R, dtype=torch.bfloat16),
            torch.empty(E, R, I, dtype=torch.bfloat16),
            torch.empty(H, R, dtype=torch.bfloat16),
            torch.empty(E, R, I, dtype=torch.bfloat16),
            torch.empty(E, I, R, dtype=torch.bfloat16),
            torch.empty(R, H, dtype=torch.bfloat16),
        ]
    return x, ids, weights, w13, w2, adapters


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_train_forward_and_backward_fakes(side, checkpoint):
    capacity = pool_capacity(T * K, E, BLOCK_M)
    with FakeTensorMode():
        x, ids, weights, w13, w2, adapters = _inputs(side)
        outputs = torch.ops.megamoe.moe_forward(
            x, ids, weights, w13, w2, None, None, *adapters, 0.5, "swiglu", None, BLOCK_M,
            "recompute" if checkpoint else "preact",
        )  # fmt: skip
        out, counts, offsets, r2p, p2r, preact, q13, p_sum = outputs
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        assert counts.shape == (E,) and offsets.shape == (E + 1,)
        assert r2p.shape == (T, K) and p2r.shape == (capacity,)
        assert preact.shape == ((0,) if checkpoint else (capacity, 2 * I))
        assert q13.shape == ((T, 2 * R) if side else (0,))
        assert p_sum.shape == ((T, R) if side else (0,))
        grads = torch.ops.megamoe.moe_backward(
            out, x, weights, w13, w2, None, None, *adapters, 0.5, "swiglu", None,
            counts, offsets, r2p, p2r, preact, q13, p_sum, True, side, BLOCK_M,
        )  # fmt: skip
        assert [tuple(g.shape) for g in grads[:4]] == [(T, H), (T, K), tuple(w13.shape), (E, H, I)]
        side_shapes = [tuple(g.shape) for g in grads[4:]]
        if side:
            assert side_shapes == [tuple(a.shape) for a in adapters]
        else:
            assert side_shapes == [(0,)] * 6


def test_inference_fake():
    with FakeTensorMode():
        x, ids, weights, w13, w2, adapters = _inputs(False)
        out, *state = torch.ops.megamoe.moe_forward(
            x, ids, weights, w13, w2, None, None, *adapters, 0.0, "swiglu", None, BLOCK_M, "none"
        )
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        assert [tuple(t.shape) for t in state] == [(0,)] * 7  # inference keeps nothing


def test_a_backward_through_an_inference_forward_is_refused():
    """``save="none"`` keeps no state: a backward through it raises instead of guessing
    (an empty pre-activation tensor would otherwise read as activation checkpointing)."""
    x, ids, weights, w13, w2, adapters = (
        t.to("meta") if isinstance(t, torch.Tensor) else t for t in _inputs(False)
    )
    x.requires_grad_(True)
    out = torch.ops.megamoe.moe_forward(
        x, ids, weights, w13, w2, None, None, *adapters, 0.0, "swiglu", None, BLOCK_M, "none"
    )[0]
    with pytest.raises(RuntimeError, match=r"save='none', which keeps no state"):
        out.backward(torch.empty_like(out))


def test_the_forward_op_checks_its_save_mode():
    with FakeTensorMode():
        x, ids, weights, w13, w2, adapters = _inputs(False)
        with pytest.raises(ValueError, match=r"^save: expected one of"):
            torch.ops.megamoe.moe_forward(
                x, ids, weights, w13, w2, None, None, *adapters, 0.0, "swiglu", None, BLOCK_M,
                "train",
            )  # fmt: skip


def test_compile_functionalizes_the_backward_that_writes_preact():
    """AOT autograd (what torch.compile runs) traces forward and backward on fake
    tensors; the backward op mutates ``preact``, which it can functionalize only when
    the op returns plain tensors (not a list)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.auto_functionalize import can_auto_functionalize

    assert can_auto_functionalize(torch.ops.megamoe.moe_backward.default)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    def forward(x, weights, *adapters, ids, w13, w2):
        return torch.ops.megamoe.moe_forward(
            x, ids, weights, w13, w2, None, None, *adapters, 0.5, "swiglu", None, BLOCK_M,
            "preact",
        )[0]  # fmt: skip

    compiled = aot_function(forward, fw_compiler=keep, bw_compiler=keep)
    with FakeTensorMode():
        x, ids, weights, w13, w2, adapters = _inputs(side=True)
        leaves = [x, weights, *adapters]
        for t in leaves:
            t.requires_grad_(True)
        out = compiled(*leaves, ids=ids.zero_(), w13=w13, w2=w2)
        grads = torch.autograd.grad(out.sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    backward_ops = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert any("auto_functionalized" in op for op in backward_ops), backward_ops


def test_fakes_take_symbolic_sizes():
    """Every dimension symbolic (``torch.compile(dynamic=True)``): the argument checks take
    SymInts, and the forward and backward fakes give outputs of symbolic shapes."""
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def symbolic(t):
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
        return mode.from_tensor(t, symbolic_context=context)

    x, ids, weights, w13, w2, adapters = (
        symbolic(t) if isinstance(t, torch.Tensor) else [symbolic(a) for a in t]
        for t in _inputs(side=True)
    )
    with mode:
        outputs = torch.ops.megamoe.moe_forward(
            x, ids, weights, w13, w2, None, None, *adapters, 0.5, "swiglu", None, BLOCK_M,
            "preact",
        )  # fmt: skip
        out, counts, offsets, r2p, p2r, preact, q13, p_sum = outputs
        grads = torch.ops.megamoe.moe_backward(
            out, x, weights, w13, w2, None, None, *adapters, 0.5, "swiglu", None,
            counts, offsets, r2p, p2r, preact, q13, p_sum, True, True, BLOCK_M,
        )  # fmt: skip
    assert isinstance(out.shape[0], torch.SymInt) and out.shape == x.shape
    assert [g.shape for g in grads[:4]] == [x.shape, weights.shape, w13.shape, w2.shape]


def test_an_mxfp4_base_gets_bf16_gradients_of_the_decoded_shape():
    """The real backward's base gradients are BF16 ``[E, 2I, H]`` / ``[E, H, I]``
    (with respect to the exact decode) for an MXFP4 base too, not the packed shapes."""
    with FakeTensorMode():
        x, ids, weights, w13, w2, adapters = _inputs(False)
        base = mm.prepare_base_weights(w13, w2, format="mxfp4")
        outputs = torch.ops.megamoe.moe_forward(
            x, ids, weights, base.w13, base.w2, base.w13_scales, base.w2_scales, *adapters,
            0.0, "swiglu", None, BLOCK_M, "preact",
        )  # fmt: skip
        grads = torch.ops.megamoe.moe_backward(
            outputs[0], x, weights, base.w13, base.w2, base.w13_scales, base.w2_scales,
            *adapters, 0.0, "swiglu", None, *outputs[1:], True, False, BLOCK_M,
        )  # fmt: skip
    assert [(tuple(g.shape), g.dtype) for g in grads[2:4]] == [
        ((E, 2 * I, H), torch.bfloat16),
        ((E, H, I), torch.bfloat16),
    ]
