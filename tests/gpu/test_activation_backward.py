"""The activation-backward kernel and GEMM1's pre-activation store, each against its
torch reference (the fused backward tests cover them end to end through the oracle)."""

import dataclasses
import math

import pytest
import torch

import megamoe as mm
from megamoe.activation_backward import (
    _join_interleave,
    _split_interleave,
    activation_backward,
    activation_backward_reference,
)
from megamoe.grouped_gemm import gated_grouped_gemm
from megamoe.registry import registry
from megamoe.testing.inputs import make_routing

pytestmark = pytest.mark.gpu

PLAN_FIELDS = ("expert_counts", "expert_pool_offsets", "route_to_pool_row", "pool_row_to_route")


def on_cpu(plan):
    return dataclasses.replace(plan, **{f: getattr(plan, f).cpu() for f in PLAN_FIELDS})


def case(tokens, top_k, experts, inter, *, kind="masked", seed=0):
    ids, weights = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, mm.get_block_m(tokens, top_k, experts))
    gen = torch.Generator().manual_seed(seed)
    preact = (torch.randn(plan.pool_capacity, 2 * inter, generator=gen) * 2).bfloat16()
    z = torch.randn(plan.pool_capacity, inter, generator=gen).bfloat16()
    return plan, preact, z, weights


def term_magnitudes(preact, z, weights, plan, activation, clamp):
    """Float64 sums of the absolute values of the terms behind dg, du and w*h per element.

    GeGLU's act = g(1+t)/2 and act' = (1+t)/2 + tail cancel (large negative g, and act'
    near its zero at g ~ -0.75), so one FP32 ulp of tanhf (kernel) vs torch.tanh moves
    the result by ulps of the *terms*, not of the result: the bound scales with these.
    """
    g, u = (t.double() for t in _split_interleave(preact, registry().gate_up_interleave))
    limit = math.inf if clamp is None else clamp
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    route = plan.pool_row_to_route.long()
    w = torch.where(route >= 0, weights.reshape(-1).double()[route.clamp(min=0)], 0.0)[:, None]
    if activation == "swiglu":
        sig = torch.sigmoid(gc)
        act_terms = (gc * sig).abs()
        derivative_terms = sig * (1 + gc.abs() * (1 - sig))
    else:
        k0, k1 = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(k0 * (gc + k1 * gc**3))
        act_terms = 0.5 * gc.abs() * (1 + t.abs())
        tail = 0.5 * gc.abs() * (1 - t * t) * k0 * (1 + 3 * k1 * gc * gc)
        derivative_terms = 0.5 * (1 + t.abs()) + tail
    dh = (w * z.double()).abs()
    interleave = registry().gate_up_interleave
    dgu_terms = _join_interleave(dh * uc.abs() * derivative_terms, dh * act_terms, interleave)
    return dgu_terms, w.abs() * act_terms * uc.abs()


def within_bound(got, want, terms):
    """One BF16 rounding of the result (2^-8, doubled for a tie flip) plus 64 FP32 ulps
    of the terms (tanhf/expf differ from torch's by a few ulps; the rest is rounding)."""
    error = (got.double() - want.double()).abs()
    bound = 2**-7 * want.double().abs() + 64 * 2**-24 * terms + 1e-30
    return bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", None), ("swiglu", 1.0)])
@pytest.mark.parametrize("tokens,top_k,inter", [(1, 1, 64), (333, 6, 256), (2048, 2, 512)])
def test_kernel_matches_reference(activation, clamp, tokens, top_k, inter):
    plan, preact, z, weights = case(tokens, top_k, 8, inter, seed=tokens)
    args = dict(activation=activation, activation_clamp=clamp)
    dgu, weighted, drouter = activation_backward(
        preact.cuda(), z.cuda(), weights.cuda(), plan, **args
    )
    cpu_plan = on_cpu(plan)
    want_dgu, want_weighted, want_router = activation_backward_reference(
        preact, z, weights, cpu_plan, **args
    )
    dgu_terms, weighted_terms = term_magnitudes(preact, z, weights, cpu_plan, activation, clamp)
    rows = int(plan.expert_pool_offsets[-1])  # rows past these are never written
    for name, got, want, terms in (
        ("dgu", dgu, want_dgu, dgu_terms),
        ("weighted", weighted, want_weighted, weighted_terms),
    ):
        ok, worst = within_bound(got[:rows].cpu(), want[:rows], terms[:rows])
        assert ok, f"{name}: error up to {worst:.2f}x the bound"
    assert torch.allclose(drouter[:rows].cpu(), want_router[:rows], rtol=1e-4, atol=1e-5)
    # Padding rows: exact zeros.
    padding = (plan.pool_row_to_route[:rows] < 0).cpu()
    assert torch.count_nonzero(dgu[:rows].cpu()[padding]) == 0
    assert torch.count_nonzero(drouter[:rows].cpu()[padding]) == 0


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("rank", [0, 16])
def test_gemm1_stores_the_pre_activations(block_n, rank):
    tokens, top_k, experts, hidden, inter = 600, 2, 8, 256, 256
    ids, _ = make_routing(tokens, experts, top_k, seed=1)
    plan = mm.plan_routes(ids.cuda(), experts, 128)
    gen = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(plan.pool_capacity, hidden + 2 * rank, device="cuda", generator=gen)
    a = a.bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 16).bfloat16()
    side = {}
    if rank:
        b_gate = (torch.randn(experts, inter, rank, device="cuda", generator=gen) / 4).bfloat16()
        b_up = (torch.randn(experts, inter, rank, device="cuda", generator=gen) / 4).bfloat16()
        side = dict(side_b_gate=b_gate, side_b_up=b_up, side_scale=0.5)
    preact = torch.empty(plan.pool_capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
    gated_grouped_gemm(a, w13, plan, k=hidden, preact_out=preact, block_n=block_n, **side)
    offsets = plan.expert_pool_offsets.tolist()
    for e in range(experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        want = a[lo:hi, :hidden].double() @ w13[e].double().T  # kernel (interleaved) order
        if rank:
            blocks = want.view(hi - lo, -1, 2, 64)
            q1, q3 = a[lo:hi, hidden : hidden + rank], a[lo:hi, hidden + rank :]
            blocks[:, :, 0] += 0.5 * (q1.double() @ b_gate[e].double().T).view(hi - lo, -1, 64)
            blocks[:, :, 1] += 0.5 * (q3.double() @ b_up[e].double().T).view(hi - lo, -1, 64)
        got = preact[lo:hi].double()
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-2), e


@pytest.mark.parametrize("act_case", ["swiglu", "geglu-clamp"])
@pytest.mark.parametrize("k,inter", [(256 + 16, 256), (512, 384), (512, 320)])
@pytest.mark.parametrize("weighted_h", [True, False])
def test_fused_dgrad2_matches_the_unfused_pass(act_case, k, inter, weighted_h):
    """The engine's ActivationBackward epilogue (MN-major B) against the Store GEMM with
    the same B followed by the activation-backward kernel: z is rounded to BF16 at the
    same point, so dg, du and w h agree to one BF16 ulp; the router dot is summed in a
    different order (per-tile partials)."""
    from megamoe.activation_backward import fused_dgrad2_activation_backward
    from megamoe.grouped_gemm import grouped_gemm

    activation, clamp = ("swiglu", None) if act_case == "swiglu" else ("geglu", 1.0)
    tokens, top_k, experts = 2048, 2, 8
    ids, weights = make_routing(tokens, experts, top_k, kind="masked", seed=k)
    plan = mm.plan_routes(ids.cuda(), experts, 128)
    gen = torch.Generator(device="cuda").manual_seed(inter)
    preact = torch.randn(plan.pool_capacity, 2 * inter, device="cuda", generator=gen) * 2
    preact = preact.bfloat16()
    dout_pool = torch.randn(plan.pool_capacity, k, device="cuda", generator=gen).bfloat16()
    w2 = (torch.randn(experts, k, inter, device="cuda", generator=gen) / 16).bfloat16()
    weights = weights.cuda()
    args = dict(activation=activation, activation_clamp=clamp, weighted_h=weighted_h)
    fused = fused_dgrad2_activation_backward(dout_pool, w2, preact, weights, plan, **args)
    z = grouped_gemm(dout_pool, w2, plan, b_major="mn", block_n=mm.get_block_n(128, inter))
    unfused = activation_backward(preact, z, weights, plan, **args)
    rows = int(plan.expert_pool_offsets[-1])
    assert (fused[1] is None) == (not weighted_h)
    for got, want in zip(fused[:2], unfused[:2], strict=True):
        if got is None:
            continue
        assert torch.allclose(got[:rows].float(), want[:rows].float(), rtol=2**-7, atol=1e-30)
    assert torch.allclose(fused[2][:rows], unfused[2][:rows], rtol=1e-4, atol=1e-4)
