"""The fused pipelines' unchecked entries (``*_unchecked``: no argument checks in Python,
docs/DESIGN-NOTES.md "The op layer") give bitwise the results of the checked public
entries on the same CUDA operands, and a bad operand still raises from the native
launcher, naming it, before any kernel runs."""

import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import pool
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
