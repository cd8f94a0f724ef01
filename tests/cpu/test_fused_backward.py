"""The fused backward's orchestration on CPU, against the float64 closed-form oracle.

On CPU every stage of :func:`megamoe.pipeline.fused_backward.moe_backward` runs its torch twin
(pool gather/combine references, the engine GEMMs' CPU twins, the activation-backward
reference), so the index maps, the ``g | u`` layout, the K-grouped weight gradients and
the per-token sums are checked here without a GPU. The
forward state is built independently of the fused forward (per expert, in torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megamoe as mm
from megamoe.pipeline.fused_backward import GRAD_NAMES, moe_backward
from megamoe.pipeline.fused_forward import ForwardState
from megamoe.testing import GRAD_MIN_COSINE, make_layer
from megamoe.testing.metrics import assert_close_to_oracle
from megamoe.wrappers import pool
from megamoe.wrappers.activation_backward import activation_backward_reference
from megamoe.wrappers.routing import plan_routes_reference


def _state(layer, block_m: int) -> ForwardState:
    """The forward state, computed per expert in float32 with the kernels' rounding."""
    x, base, side = layer.x, layer.base, layer.side
    experts = base.num_experts
    plan = plan_routes_reference(layer.topk_ids, experts, block_m)
    use_side = side is not None and side.scale != 0.0
    q13 = None
    if use_side:
        q13 = torch.cat([x.float() @ side.a1.float(), x.float() @ side.a3.float()], 1).bfloat16()
    preact = torch.zeros(plan.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16)
    offsets = plan.expert_pool_offsets.tolist()
    route = plan.pool_row_to_route.long()
    top_k = layer.topk_ids.shape[1]
    pool_output_side = torch.zeros(plan.pool_capacity, side.rank if use_side else 0)
    for e in range(experts):
        begin, end = offsets[e], offsets[e + 1]
        if begin == end:
            continue
        rows = route[begin:end]
        tok = torch.where(rows >= 0, rows // top_k, 0)
        xe = torch.where((rows >= 0)[:, None], x.float()[tok], 0.0)
        gu = xe @ base.w13_for_gemm()[e].float().T  # [rows, 2I]: g | u
        inter = base.intermediate
        if use_side:
            r = side.rank
            q = torch.where((rows >= 0)[:, None], q13.float()[tok], 0.0)
            gu[:, :inter] += side.scale * (q[:, :r] @ side.b1[e].float())
            gu[:, inter:] += side.scale * (q[:, r:] @ side.b3[e].float())
        preact[begin:end] = gu.bfloat16()
        if use_side:
            g, u = preact[begin:end].float().split(inter, dim=1)
            c = layer.activation_clamp
            if c is not None:
                g, u = g.clamp(max=c), u.clamp(-c, c)
            act = F.silu(g) if layer.activation == "swiglu" else F.gelu(g, approximate="tanh")
            h = (act * u).reshape(end - begin, -1).bfloat16().float()
            pool_output_side[begin:end] = (h @ side.a2[e].float()).bfloat16().float()
    p_sum = None
    if use_side:
        zeros = torch.zeros(plan.pool_capacity, 8, dtype=torch.bfloat16)
        p_sum = pool.side_sum(
            torch.cat([zeros, pool_output_side.bfloat16()], 1), plan, layer.topk_weights, 8
        )
    return ForwardState(plan=plan, preact=preact, q13=q13, p_sum=p_sum)


def _oracle_grads(layer, dout, base_grads: bool, *, round_bf16: bool) -> dict:
    """float64 closed-form gradients, optionally at the kernels' BF16 rounding points.

    With a clamp, the gradient mask depends on which side of ``c`` the BF16-rounded
    ``g``/``u`` fall: only the oracle that rounds where the kernels do (``round_bf16``)
    makes the same decisions, the unrounded one differs on the ~0.5% of entries near
    ``c`` by whole gradient values.
    """
    _, ctx = mm.reference.forward(
        layer.x,
        layer.topk_ids,
        layer.topk_weights,
        # Dequantized for an MXFP4 base (exact in float32, so exact in float64).
        layer.base.w13_linear(torch.float32).double(),
        layer.base.w2_linear(torch.float32).double(),
        layer.side,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        round_bf16=round_bf16,
    )
    return mm.reference.backward(dout, ctx, base_grads=base_grads)


CASES = [
    # tokens, experts, top_k, rank, activation, clamp, routing
    (37, 4, 2, 16, "swiglu", None, "balanced"),
    (64, 8, 6, 32, "geglu", None, "skewed"),
    (50, 5, 2, None, "swiglu", 1.0, "masked"),
    (23, 6, 1, 16, "swiglu", 0.75, "empty"),
]


@pytest.mark.parametrize("tokens,experts,top_k,rank,activation,clamp,routing", CASES)
@pytest.mark.parametrize("trainable_base", [False, True])
def test_backward_matches_oracle(
    tokens, experts, top_k, rank, activation, clamp, routing, trainable_base
):
    kwargs = {"empty_experts": [0, experts // 2]} if routing == "empty" else {}
    layer = make_layer(
        64,
        128,
        experts,
        top_k,
        rank,
        num_tokens=tokens,
        seed=tokens,
        routing=routing,
        activation=activation,
        activation_clamp=clamp,
        **kwargs,
    )
    state = _state(layer, block_m=64)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(tokens, 64, generator=gen).bfloat16()
    grads = moe_backward(
        dout,
        layer.x,
        layer.topk_weights,
        layer.base,
        layer.side,
        state,
        activation=activation,
        activation_clamp=clamp,
        base_grads=trainable_base,
    )
    # With a clamp, compare with the oracle that rounds g, u where the kernels do (see
    # _oracle_grads); without, with the unrounded float64 oracle.
    expected = _oracle_grads(layer, dout, trainable_base, round_bf16=clamp is not None)
    names = ["x", "topk_weights"]
    if rank is not None:
        names += ["a1", "b1", "a3", "b3", "a2", "b2"]
    actual = dict(grads)
    if trainable_base:
        names += ["w13", "w2"]  # in the user's layout, like base.w13
    else:
        assert grads["w13"] is None and grads["w2"] is None
    for name in names:
        assert_close_to_oracle(name, actual[name], expected[name], min_cosine=GRAD_MIN_COSINE)
    # Masked routes get an exactly-zero router gradient; empty experts exact zeros.
    masked = layer.topk_ids < 0
    assert torch.all(grads["topk_weights"][masked] == 0)
    if rank is not None:
        counts = state.plan.expert_counts
        for name in ("b1", "b3", "a2"):
            assert torch.all(grads[name][counts == 0] == 0)
    assert set(grads) == set(GRAD_NAMES)


def test_activation_backward_rejects_bad_shapes():
    layer = make_layer(64, 128, 4, 2, None, num_tokens=20, seed=3)
    state = _state(layer, block_m=64)
    capacity = state.plan.pool_capacity
    z = torch.zeros(capacity, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^z:"):
        activation_backward_reference(state.preact, z, layer.topk_weights, state.plan)
    with pytest.raises(ValueError, match="preact"):
        activation_backward_reference(state.preact[:, :96], z, layer.topk_weights, state.plan)
    with pytest.raises(ValueError, match="activation"):
        activation_backward_reference(
            state.preact,
            torch.zeros(capacity, 128, dtype=torch.bfloat16),
            layer.topk_weights,
            state.plan,
            activation="relu",
        )


@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", 0.75)])
def test_backward_with_an_mxfp4_base(activation, clamp):
    """An MXFP4 base (the CPU twins dequantize it exactly): gradients match the oracle
    run on the dequantized weights."""
    layer = make_layer(
        64,
        128,
        4,
        2,
        16,
        num_tokens=41,
        seed=5,
        format="mxfp4",
        activation=activation,
        activation_clamp=clamp,
    )
    assert layer.base.format == "mxfp4"
    state = _state(layer, block_m=64)
    dout = torch.randn(41, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    grads = moe_backward(
        dout,
        layer.x,
        layer.topk_weights,
        layer.base,
        layer.side,
        state,
        activation=activation,
        activation_clamp=clamp,
    )
    expected = _oracle_grads(layer, dout, False, round_bf16=clamp is not None)
    for name in ("x", "topk_weights", "a1", "b1", "a3", "b3", "a2", "b2"):
        assert_close_to_oracle(name, grads[name], expected[name], min_cosine=GRAD_MIN_COSINE)


def test_mn_major_cpu_twin_matches_a_plain_product():
    from megamoe.wrappers.grouped_gemm import grouped_gemm, grouped_gemm_reference

    layer = make_layer(64, 128, 4, 2, None, num_tokens=50, seed=9)
    plan = plan_routes_reference(layer.topk_ids, 4, 64)
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(plan.pool_capacity, 80, generator=gen).bfloat16()
    b = (torch.randn(4, 80, 96, generator=gen) / 8).bfloat16()  # [E, K, N] as stored
    out = grouped_gemm(a, b, plan, b_major="mn")
    rows = int(plan.expert_pool_offsets[-1])
    assert_close_to_oracle("out", out[:rows], grouped_gemm_reference(a, b.transpose(1, 2), plan))


def test_ep_entry_trains_an_mxfp4_master_straight_through():
    """megamoe.ep.fused_moe called directly (CPU twins, group=None) converts a trainable
    MXFP4 base like mm.moe: the master gets the gradient of a BF16 base holding the
    decoded values, bit for bit (before, the packed base silently dropped it)."""
    from megamoe.testing.inputs import make_layer

    layer = make_layer(
        128, 128, 4, 2, 16, num_tokens=20, format="mxfp4", trainable_base=True,
        requires_grad=True, seed=9,
    )  # fmt: skip
    dout = torch.randn(20, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    call = (layer.x, layer.topk_ids, layer.topk_weights)
    out = mm.ep.fused_moe(*call, layer.base, layer.side, group=None)
    grads = torch.autograd.grad(out, [layer.w13, layer.w2], dout)

    w13 = layer.base.w13_linear().detach().requires_grad_(True)
    w2 = layer.base.w2_linear().detach().requires_grad_(True)
    twin = mm.ep.fused_moe(*call, mm.prepare_base_weights(w13, w2), layer.side, group=None)
    want = torch.autograd.grad(twin, [w13, w2], dout)
    assert torch.equal(out, twin)
    for got, expected in zip(grads, want, strict=True):
        assert torch.equal(got, expected)


def test_mxfp4_decode_op_and_straight_through_trace_in_one_graph():
    """The decode is a torch custom op (opcheck: fake impl, schema), and the
    straight-through conversion traces with torch.compile(fullgraph=True)."""
    from megamoe.wrappers.mxfp4_decode import _decode_op, decode_mxfp4_bf16

    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (6, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (6, 2), generator=gen, dtype=torch.uint8)
    torch.library.opcheck(_decode_op, (packed, scales))
    assert torch.equal(
        decode_mxfp4_bf16(packed, scales).view(torch.int16),
        mm.dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16).view(torch.int16),
    )

    w13 = torch.randn(2, 256, 64, generator=gen).bfloat16().requires_grad_(True)
    w2 = torch.randn(2, 64, 128, generator=gen).bfloat16().requires_grad_(True)
    base = mm.prepare_base_weights(w13, w2, format="mxfp4")

    def loss(b):
        bf16 = b.straight_through()
        return (bf16.w13.float() ** 2).sum() + bf16.w2.float().sum()

    eager = torch.autograd.grad(loss(base), [w13, w2])
    compiled = torch.compile(loss, backend="eager", fullgraph=True)
    traced = torch.autograd.grad(compiled(base), [w13, w2])
    for got, want in zip(traced, eager, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("strided", [False, True])
def test_scaled_bf16_is_the_two_step_rounding(strided):
    """One launch instead of a scale and a cast: the same bits, contiguous out."""
    from megamoe.pipeline.fused_backward import scaled_bf16

    gen = torch.Generator().manual_seed(7)
    product = torch.randn(64, 96, generator=gen) * torch.logspace(-30, 30, 96)
    product[0, :4] = torch.tensor([0.0, -0.0, 3.0e38, -1.0e-40])  # zeros, overflow, subnormal
    if strided:
        product = product[:, 16:80]
    for scale in (0.25, 3.0, -1.7):
        got = scaled_bf16(product, scale)
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        expected = (scale * product).to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_the_streaming_dgrad2_leaves_a2_past_int32_rows_to_the_engine():
    """The streaming dgrad2 forms ``a2``'s TMA row (``expert * I + column``) in int32: past
    ``E * I = 2^31`` it read zeros for the high experts (a review of the device code), so
    such shapes run the engine; without an adapter nothing changes."""
    from megamoe.wrappers.activation_backward import streaming_a2_fits

    a2 = torch.empty(0)
    assert streaming_a2_fits(1024, 2**21 - 64, a2)
    assert not streaming_a2_fits(1024, 2**21, a2)  # E * I = 2^31: past int32 (conservative)
    assert not streaming_a2_fits(8193, 262144, a2)
    assert streaming_a2_fits(8193, 262144, None)
