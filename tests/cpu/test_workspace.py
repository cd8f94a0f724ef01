"""Workspace sizing and the undersized-workspace rejection."""

import pytest
import torch

import megamoe as mm
from megamoe.workspace import REGION_ALIGNMENT


def test_size_matches_layout_and_regions_do_not_overlap():
    layout = mm.workspace_layout(1000, 256, 128, 8, 2, 32, block_m=64)
    assert mm.get_workspace_size(1000, 256, 128, 8, 2, 32, block_m=64) == layout.size
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
    small = mm.get_workspace_size(100, 256, 128, 8, 2, 16)
    assert mm.get_workspace_size(200, 256, 128, 8, 2, 16) > small
    assert mm.get_workspace_size(100, 256, 128, 8, 2, 64) > small


def test_views_are_typed_and_inside_the_buffer():
    layout = mm.workspace_layout(17, 64, 64, 4, 2, 16)
    workspace = mm.Workspace(layout.size, device="cpu")
    workspace.check_fits(layout, torch.device("cpu"))
    view = workspace.view(layout.region("pool_input"))
    assert view.dtype == torch.bfloat16 and view.shape == (layout.pool_capacity, 96)
    view.fill_(1)  # writable, and inside the buffer
    assert workspace.view(layout.region("expert_counts")).dtype == torch.int32


def test_undersized_workspace_is_rejected():
    layout = mm.workspace_layout(17, 64, 64, 4, 2, 16)
    workspace = mm.Workspace(layout.size - 1, device="cpu")
    with pytest.raises(ValueError, match="workspace: expected at least"):
        workspace.check_fits(layout, torch.device("cpu"))


def test_workspace_on_another_device_is_rejected():
    layout = mm.workspace_layout(17, 64, 64, 4, 2, 16)
    workspace = mm.Workspace(layout.size, device="cpu")
    with pytest.raises(ValueError, match="workspace: expected device"):
        workspace.check_fits(layout, torch.device("meta"))


@pytest.mark.parametrize(
    "argument", ["num_tokens", "hidden", "intermediate", "num_local_experts", "top_k"]
)
def test_bad_dims_name_the_argument(argument):
    kwargs = dict(num_tokens=4, hidden=64, intermediate=64, num_local_experts=2, top_k=1)
    kwargs[argument] = 0
    with pytest.raises(ValueError, match=argument):
        mm.get_workspace_size(**kwargs)


def test_negative_size_is_rejected():
    with pytest.raises(ValueError, match="size"):
        mm.Workspace(-1, device="cpu")
