"""The forward's scratch layout (a size estimate), and that no caller-provided workspace
is part of the API: ``mm.moe`` allocates its scratch through torch's caching allocator."""

import inspect

import pytest
import torch

import megamoe as mm
from megamoe.workspace import REGION_ALIGNMENT


def test_no_workspace_in_the_public_api():
    for name in ("Workspace", "get_workspace_size"):
        assert not hasattr(mm, name), name
        assert name not in mm.__all__
    assert "workspace" not in inspect.signature(mm.moe).parameters
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    base = mm.prepare_base_weights(torch.zeros(1, 128, 64), torch.zeros(1, 64, 64))
    with pytest.raises(TypeError, match="workspace"):
        mm.moe(x, ids, torch.ones(2, 1), base, workspace=object())


def test_size_is_the_sum_of_aligned_regions_that_do_not_overlap():
    layout = mm.workspace_layout(1000, 256, 128, 8, 2, 32, block_m=64)
    assert layout.size == sum(
        -(-r.nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT for r in layout.regions
    )
    end = 0
    for region in layout.regions:
        assert region.offset % REGION_ALIGNMENT == 0
        assert region.offset >= end
        end = region.offset + region.nbytes
    assert end <= layout.size


def test_pool_regions_use_capacity_and_side_columns():
    layout = mm.workspace_layout(90, 64, 64, 4, 2, 16, block_m=64)
    capacity = mm.pool_capacity(180, 4, 64)
    assert layout.pool_capacity == capacity
    assert layout.region("pool_input").shape == (capacity, 64 + 2 * 16)
    assert layout.region("pool_output").shape == (capacity, 64 + 16)
    assert layout.region("pool_hidden").shape == (capacity, 64)


def test_default_block_m_comes_from_the_heuristic():
    layout = mm.workspace_layout(65536, 4096, 2048, 64, 6, 128, ep_size=4)
    assert layout.block_m == mm.get_block_m(65536, 6, 256, ep_size=4)


def test_grows_with_tokens_and_rank():
    small = mm.workspace_layout(100, 256, 128, 8, 2, 16).size
    assert mm.workspace_layout(200, 256, 128, 8, 2, 16).size > small
    assert mm.workspace_layout(100, 256, 128, 8, 2, 64).size > small


def test_pool_regions_match_what_the_forward_allocates():
    """The pool buffers of the layout are the shapes the fused forward's stages allocate
    (pool input [x | q13], GEMM1's h, GEMM2's [y | p]), at the plan's capacity."""
    tokens, hidden, inter, experts, top_k, rank = 300, 128, 64, 8, 2, 16
    layout = mm.workspace_layout(tokens, hidden, inter, experts, top_k, rank)
    ids = torch.arange(tokens * top_k, dtype=torch.int32).remainder(experts).view(tokens, top_k)
    plan = mm.plan_routes(ids, experts, mm.get_block_m(tokens, top_k, experts))
    assert layout.pool_capacity == plan.pool_capacity
    assert layout.region("pool_row_to_route").shape == tuple(plan.pool_row_to_route.shape)
    assert layout.region("route_to_pool_row").shape == (plan.route_to_pool_row.numel(),)


@pytest.mark.parametrize(
    "argument", ["num_tokens", "hidden", "intermediate", "num_local_experts", "top_k"]
)
def test_bad_dims_name_the_argument(argument):
    kwargs = dict(num_tokens=4, hidden=64, intermediate=64, num_local_experts=2, top_k=1)
    kwargs[argument] = 0
    with pytest.raises(ValueError, match=argument):
        mm.workspace_layout(**kwargs)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(hidden=48), r"^hidden: expected a multiple of 64"),
        (dict(intermediate=96), r"^intermediate: expected a multiple of 64"),
        (dict(side_rank=8), r"^side_rank: expected 0 \(no adapters\) or a multiple of 16"),
        (dict(side_rank=1000), r"^side_rank: expected 0 \(no adapters\) or a multiple of 16"),
        (dict(num_local_experts=1025), r"^num_local_experts: expected at most 1024"),
    ],
)
def test_dims_the_layer_refuses_get_no_layout(change, match):
    """A size for a configuration MegaMoE and SideLoRA refuse planned nothing (a review:
    H = 48, r = 8 and r = 1000 got layouts)."""
    kwargs = dict(num_tokens=10, hidden=64, intermediate=64, num_local_experts=4, top_k=2)
    with pytest.raises(ValueError, match=match):
        mm.workspace_layout(**{**kwargs, **change})
