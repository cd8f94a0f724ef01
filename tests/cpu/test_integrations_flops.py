"""FLOP formulas of the megamoe custom ops (``megamoe.custom_ops.flop_formulas``), on the CPU.

``mm.moe`` runs under ``FakeTensorMode`` (the ops' fake implementations: shapes only,
no kernel), inside ``torch.utils.flop_counter.FlopCounterMode``; the counts must equal
DESIGN §1's multiply-adds written out independently here, per GEMM.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import megamoe as mm
import megamoe.custom_ops.flop_formulas  # registers the formulas

T, H, I, E, K, R = 48, 128, 64, 4, 3, 16
BF16 = torch.bfloat16


def gemm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def expected_forward(side: bool) -> int:
    routes = T * K
    flops = gemm(routes, 2 * I, H) + gemm(routes, H, I)  # GEMM1, GEMM2
    if side:
        flops += gemm(T, 2 * R, H)  # q13 = x [a1 | a3]
        flops += gemm(routes, 2 * I, R)  # q1 b1, q3 b3 (GEMM1's extra K blocks)
        flops += gemm(routes, R, I)  # p = h a2 (GEMM2's extra N columns)
        flops += gemm(T, H, R)  # (sum_k w p) b2
    return flops


def expected_backward(side: bool, base_grads: bool, recompute: bool) -> int:
    routes = T * K
    flops = gemm(routes, I, H) + gemm(routes, H, 2 * I)  # dgrad2 z, dgrad1 dx
    flops += 2 * routes * I  # router gradient <z, h>
    if base_grads:
        flops += gemm(2 * I, H, routes) + gemm(H, I, routes)  # dw13, dw2
    if side:
        flops += gemm(T, R, H)  # dout b2^T
        flops += gemm(routes, I, R)  # (dout b2^T) a2^T in z
        flops += gemm(routes, 2 * R, I)  # dg b1^T, du b3^T
        flops += gemm(T, H, 2 * R)  # dx side: (.) a1^T + (.) a3^T
        flops += gemm(H, 2 * R, T)  # da1, da3
        flops += gemm(2 * R, I, routes)  # db1, db3
        flops += gemm(I, R, routes)  # da2
        flops += gemm(R, H, T)  # db2
    if recompute:
        flops += gemm(routes, 2 * I, H) + (gemm(routes, 2 * I, R) if side else 0)
    return flops


def make(side: bool, trainable: bool, requires_grad: bool):
    x = torch.randn(T, H, dtype=BF16, requires_grad=requires_grad)
    ids = torch.randint(0, E, (T, K))
    weights = torch.rand(T, K, requires_grad=requires_grad)
    w13 = torch.randn(E, 2 * I, H, dtype=BF16, requires_grad=trainable)
    w2 = torch.randn(E, H, I, dtype=BF16, requires_grad=trainable)
    base = mm.prepare_base_weights(w13, w2)
    adapters = None
    if side:
        shapes = [(H, R), (E, R, I), (H, R), (E, R, I), (E, I, R), (R, H)]
        tensors = [torch.randn(s, dtype=BF16, requires_grad=True) for s in shapes]
        adapters = mm.SideLoRA(*tensors, scale=0.5)
    return x, ids, weights, base, adapters


@pytest.mark.parametrize("side", [False, True])
def test_inference_forward_is_counted(side):
    with FakeTensorMode():
        x, ids, weights, base, adapters = make(side, trainable=False, requires_grad=False)
        with FlopCounterMode(display=False) as counter:
            mm.moe(x, ids, weights, base, adapters)
    assert counter.get_total_flops() == expected_forward(side)


@pytest.mark.parametrize(
    ("side", "trainable", "checkpoint"),
    [(True, False, False), (False, True, False), (True, True, False), (True, False, True)],
)
def test_training_forward_and_backward_are_counted(side, trainable, checkpoint):
    with FakeTensorMode():
        x, ids, weights, base, adapters = make(side, trainable, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            out = mm.moe(x, ids, weights, base, adapters, activation_checkpoint=checkpoint)
            forward = counter.get_total_flops()
            out.backward(torch.ones_like(out))
    assert forward == expected_forward(side)
    backward = counter.get_total_flops() - forward
    assert backward == expected_backward(side, base_grads=trainable, recompute=checkpoint)


def test_zero_scale_counts_no_adapter_work():
    with FakeTensorMode():
        x, ids, weights, base, adapters = make(True, trainable=False, requires_grad=False)
        zero = mm.SideLoRA(*adapters.tensors(), scale=0.0)
        with FlopCounterMode(display=False) as counter:
            mm.moe(x, ids, weights, base, zero)
    assert counter.get_total_flops() == expected_forward(False)


def test_the_formulas_bind_arguments_by_name():
    """The ops called positionally (as a trace replays them) count what mm.moe's keyword
    calls count: the formulas read arguments by their schema names."""
    with FakeTensorMode():
        x, ids, weights, base, adapters = make(True, trainable=False, requires_grad=False)
        tensors = adapters.tensors()
        with FlopCounterMode(display=False) as counter:
            out, *state = torch.ops.megamoe.moe_forward(
                x, ids, weights, base.w13, base.w2, None, None, *tensors, 0.5, "swiglu", None,
                mm.get_block_m(T, K, E), "preact",
            )  # fmt: skip
            forward = counter.get_total_flops()
            torch.ops.megamoe.moe_backward(
                out, x, weights, base.w13, base.w2, None, None, *tensors, 0.5, "swiglu", None,
                *state, False, True, mm.get_block_m(T, K, E),
            )  # fmt: skip
    assert forward == expected_forward(True)
    backward = counter.get_total_flops() - forward
    assert backward == expected_backward(True, base_grads=False, recompute=False)
