"""The fused pipelines' unchecked entries (``*_unchecked``: no argument checks in Python,
docs/DESIGN-NOTES.md "The op layer") give bitwise the results of the checked public
entries on the same CUDA operands, and a bad operand still raises from the native
launcher, naming it, before any kernel runs."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import make_layer
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import pool
from megamoe.wrappers.activation_backward import (
    fused_dgrad2_activation_backward,
    fused_dgrad2_activation_backward_unchecked,
)
from megamoe.wrappers.grouped_gemm import (
    gated_grouped_gemm,
    gated_grouped_gemm_unchecked,
    grouped_gemm,
    grouped_gemm_unchecked,
)
from megamoe.wrappers.k_grouped_gemm import k_grouped_gemm, k_grouped_gemm_unchecked

pytestmark = pytest.mark.gpu

EXPERTS, HIDDEN, RANK = 8, 256, 16


def _case(tokens: int, top_k: int, seed: int):
    ids, weights = make_routing(tokens, EXPERTS, top_k, kind="masked", seed=seed)
    plan = mm.plan_routes(ids.cuda(), EXPERTS, 64)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    return plan, weights.cuda(), randn


# K = 1 takes the row-per-route gather (EP's received rows), K > 1 the token-major one.
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (40, 1), (40, 2), (300, 4)])
def test_pool_ops_match_the_checked_entries(tokens: int, top_k: int) -> None:
    plan, weights, randn = _case(tokens, top_k, seed=tokens + top_k)
    x, side = randn(tokens, HIDDEN), randn(tokens, 2 * RANK)
    rows_used = int(plan.expert_pool_offsets[-1])  # rows past it are not written
    checked = pool.gather_pool(x, side, plan)[:rows_used]
    assert torch.equal(pool.gather_pool_unchecked(x, side, plan)[:rows_used], checked)
    output = randn(plan.pool_capacity, HIDDEN + RANK)
    assert torch.equal(
        pool.side_sum_unchecked(output, plan, weights, HIDDEN),
        pool.side_sum(output, plan, weights, HIDDEN),
    )
    expand = randn(tokens, HIDDEN)
    assert torch.equal(
        pool.combine_unchecked(output, plan, weights, expand, scale=0.5, hidden=HIDDEN),
        pool.combine(output, plan, weights, expand, 0.5, hidden=HIDDEN),
    )


@pytest.mark.parametrize("tokens", [40, 300])
def test_k_grouped_gemm_matches_the_checked_entry(tokens: int) -> None:
    plan, _, randn = _case(tokens, 2, seed=tokens)
    a = randn(plan.pool_capacity, 128)
    b = randn(plan.pool_capacity, HIDDEN + RANK)[:, HIDDEN:]  # a column slice, as da2's
    assert torch.equal(
        k_grouped_gemm_unchecked(a, b, plan, scale=0.5), k_grouped_gemm(a, b, plan, scale=0.5)
    )


def test_bad_operands_raise_from_the_launchers() -> None:
    plan, weights, randn = _case(40, 2, seed=7)
    x = randn(40, HIDDEN)
    with pytest.raises((TypeError, ValueError), match=r"^x: .*bfloat16"):
        pool.gather_pool_unchecked(x.float(), None, plan)
    # A contiguous view 2 bytes into its storage: the 16-byte vectors need alignment.
    misaligned = torch.empty(40 * HIDDEN + 1, dtype=torch.bfloat16, device="cuda")[1:]
    with pytest.raises(ValueError, match=r"^x: expected a data pointer aligned to 16 bytes"):
        pool.gather_pool_unchecked(misaligned.view(40, HIDDEN), None, plan)
    one_route = weights[:, :1].contiguous()
    with pytest.raises(ValueError, match=r"^topk_weights: "):
        pool.combine_unchecked(
            randn(plan.pool_capacity, HIDDEN), plan, one_route, None, scale=0.0, hidden=HIDDEN
        )
    a = randn(plan.pool_capacity, 128)
    with pytest.raises(ValueError, match=r"^b: "):
        k_grouped_gemm_unchecked(a, randn(plan.pool_capacity - 1, 64), plan)


# 40 tokens: the MXFP4 GEMMs stream (few rows per expert); 2048: the engine's paths.
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("tokens", [40, 2048])
def test_gemm_entries_match_the_checked_ones(fmt: str, tokens: int) -> None:
    hidden, inter, experts, rank = 512, 256, 8, 16
    layer = make_layer(
        hidden, inter, experts, 2, rank, num_tokens=tokens, seed=tokens, device="cuda", format=fmt
    )
    base, side = layer.base, layer.side
    plan = mm.plan_routes(layer.topk_ids, experts, 64)
    rows_used = int(plan.expert_pool_offsets[-1])  # rows past it are not written
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.equal(got[:rows_used], want[:rows_used])

    a = pool.gather_pool(layer.x, randn(tokens, 2 * rank), plan)
    gated = dict(
        k=hidden, activation="swiglu", activation_clamp=None, side_b_gate=side.b1,
        side_b_up=side.b3, side_scale=side.scale, w13_scales=base.w13_scales,
    )  # fmt: skip
    preact = torch.empty(plan.pool_capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
    preact_unchecked = torch.empty_like(preact)
    h = gated_grouped_gemm(a, base.w13, plan, preact_out=preact, **gated)
    h_unchecked = gated_grouped_gemm_unchecked(
        a, base.w13, plan, preact_out=preact_unchecked, **gated
    )
    assert same(h_unchecked, h) and same(preact_unchecked, preact)

    gemm2 = dict(b_extra=side.a2, b_scales=base.w2_scales)
    assert same(
        grouped_gemm_unchecked(h, base.w2, plan, **gemm2), grouped_gemm(h, base.w2, plan, **gemm2)
    )

    dgrad1 = dict(b_major="mn", b_scales=base.w13_scales, b_extra_blocks=(side.b1, side.b3))
    dgu = randn(plan.pool_capacity, 2 * inter)
    assert same(
        grouped_gemm_unchecked(dgu, base.w13, plan, **dgrad1),
        grouped_gemm(dgu, base.w13, plan, **dgrad1),
    )

    dgrad2 = dict(
        side_a2=side.a2, activation="swiglu", activation_clamp=None, weighted_h=True,
        w2_scales=base.w2_scales, dgrad_out=None,
    )  # fmt: skip
    dout_pool = randn(plan.pool_capacity, hidden + rank)
    weights = layer.topk_weights
    checked = fused_dgrad2_activation_backward(dout_pool, base.w2, preact, weights, plan, **dgrad2)
    unchecked = fused_dgrad2_activation_backward_unchecked(
        dout_pool, base.w2, preact, weights, plan, **dgrad2
    )
    assert same(unchecked[0], checked[0]) and same(unchecked[1], checked[1])
    assert torch.equal(unchecked[2], checked[2])
