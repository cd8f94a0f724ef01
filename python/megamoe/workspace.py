"""Scratch memory of one MoE call: one buffer, sized up front, checked before launch.

The layout is a list of named regions (each 256-byte aligned, which covers TMA's
16-byte and wgmma's 128-byte needs). ``get_workspace_size`` and ``Workspace`` use the
same layout function, so a workspace sized by one is always accepted by the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_int
from .heuristics import get_block_m
from .registry import registry
from .routing import pool_capacity, route_plan_num_tiles

REGION_ALIGNMENT = 256


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WorkspaceLayout:
    """Named regions of one call's scratch; ``size`` is the total in bytes."""

    regions: tuple[Region, ...]
    size: int
    block_m: int
    pool_capacity: int

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"workspace has no region {name!r}")


def workspace_layout(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_local_experts: int,
    top_k: int,
    side_rank: int = 0,
    *,
    block_m: int | None = None,
    ep_size: int = 1,
) -> WorkspaceLayout:
    """The forward layout for ``num_tokens`` tokens on this rank.

    Regions: the route plan (per-tile scratch, counts, offsets, both index maps), the
    gathered pool input ``[x | s q1 | s q3]`` (``H + 2r`` columns), the pool
    activations ``h`` (``I``) and the pool output ``[y | p]`` (``H + r``), all BF16.
    """
    check_int("num_tokens", num_tokens, minimum=1)
    check_int("hidden", hidden, minimum=1)
    check_int("intermediate", intermediate, minimum=1)
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_int("top_k", top_k, minimum=1)
    check_int("side_rank", side_rank, minimum=0)
    check_int("ep_size", ep_size, minimum=1)
    if block_m is None:
        block_m = get_block_m(num_tokens, top_k, num_local_experts * ep_size, ep_size)
    check_int("block_m", block_m, minimum=1)
    if block_m not in registry().block_m_choices:
        raise ValueError(
            f"block_m: expected one of {list(registry().block_m_choices)}, got {block_m}"
        )
    # In EP a rank's pool receives routes from every rank: size for all of them.
    num_routes = num_tokens * top_k * ep_size
    capacity = pool_capacity(num_routes, num_local_experts, block_m)
    specs = [
        ("route_plan_scratch", (route_plan_num_tiles(num_routes), num_local_experts), torch.int32),
        ("expert_counts", (num_local_experts,), torch.int32),
        ("expert_pool_offsets", (num_local_experts + 1,), torch.int32),
        ("route_to_pool_row", (num_routes,), torch.int32),
        ("pool_row_to_route", (capacity,), torch.int32),
        ("pool_input", (capacity, hidden + 2 * side_rank), torch.bfloat16),
        ("pool_hidden", (capacity, intermediate), torch.bfloat16),
        ("pool_output", (capacity, hidden + side_rank), torch.bfloat16),
    ]
    regions = []
    offset = 0
    for name, shape, dtype in specs:
        region = Region(name, offset, shape, dtype)
        regions.append(region)
        offset += -(-region.nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT
    return WorkspaceLayout(tuple(regions), offset, block_m, capacity)


def get_workspace_size(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_local_experts: int,
    top_k: int,
    side_rank: int = 0,
    *,
    block_m: int | None = None,
    ep_size: int = 1,
) -> int:
    """Bytes a :class:`Workspace` needs for these dims (see :func:`workspace_layout`)."""
    return workspace_layout(
        num_tokens,
        hidden,
        intermediate,
        num_local_experts,
        top_k,
        side_rank,
        block_m=block_m,
        ep_size=ep_size,
    ).size


class Workspace:
    """A reusable scratch buffer (uint8, ``REGION_ALIGNMENT``-aligned) on one device.

    Pass the same workspace to every call of a training loop to avoid allocator
    traffic; a call whose layout does not fit is rejected before any launch.
    """

    def __init__(self, size: int, device: torch.device | str | None = None) -> None:
        check_int("size", size, minimum=0)
        device = torch.device("cuda" if device is None else device)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if self.buffer.is_cuda and self.buffer.data_ptr() % REGION_ALIGNMENT != 0:
            raise ValueError(
                f"Workspace: allocator returned an address not aligned to {REGION_ALIGNMENT}"
            )

    @property
    def size(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def check_fits(self, layout: WorkspaceLayout, device: torch.device) -> None:
        """Raise ``ValueError`` naming ``workspace`` if it is too small or elsewhere."""
        if self.device != device:
            raise ValueError(f"workspace: expected device {device}, got {self.device}")
        if self.size < layout.size:
            raise ValueError(
                f"workspace: expected at least {layout.size} bytes "
                f"(get_workspace_size for this call), got {self.size}"
            )

    def view(self, region: Region) -> torch.Tensor:
        """The typed tensor of one region."""
        raw = self.buffer[region.offset : region.offset + region.nbytes]
        return raw.view(region.dtype).view(region.shape)
