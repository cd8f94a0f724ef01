"""The scratch of one fused MoE forward, region by region: what the call allocates from
torch's caching allocator (route plan, pool input, pool activations, pool output).

``mm.moe`` takes no caller-provided workspace: scratch comes from torch's caching
allocator, which reuses it across calls. This layout sizes those buffers, for a caller
planning memory (the bench's own memory check uses the coarser
``megamoe.bench.shapes.estimate_peak_bytes``, which also counts the backward), and
states the EP pool bound (``ep_size``: a rank's pool receives routes from every rank). Each
region is rounded up to 256 bytes, as an allocator block would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .heuristics import get_block_m
from .side_lora import check_side_rank
from .validation.arguments import check_int
from .validation.layer import check_kernel_dims
from .wrappers.registry import registry
from .wrappers.routing import check_local_experts, pool_capacity, route_plan_num_tiles

#: Each region's bytes are rounded up to this (the caching allocator's block granule;
#: it also covers TMA's 16-byte and wgmma's 128-byte alignment).
REGION_ALIGNMENT = 256


@dataclass(frozen=True)
class Region:
    """One scratch buffer: ``shape`` of ``dtype`` at ``offset`` bytes of the layout."""

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
    """Named regions of one forward's scratch; ``size`` is the total in bytes (what the
    call allocates, each region rounded up to :data:`REGION_ALIGNMENT`)."""

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
    """The forward's scratch for ``num_tokens`` tokens on this rank (a size estimate: the
    buffers come from torch's caching allocator, not from this layout).

    Regions: the route plan (per-tile scratch, counts, offsets, both index maps), the
    gathered pool input ``[x | q1 | q3]`` (``H + 2r`` columns; GEMM1 applies ``s``), the pool
    activations ``h`` (``I``) and the pool output ``[y | p]`` (``H + r``), all BF16.
    """
    check_int("num_tokens", num_tokens, minimum=1)
    check_int("hidden", hidden, minimum=1)
    check_int("intermediate", intermediate, minimum=1)
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_int("top_k", top_k, minimum=1)
    check_int("side_rank", side_rank, minimum=0)
    check_int("ep_size", ep_size, minimum=1)
    # Only what the layer runs: a size for a configuration it refuses plans nothing.
    check_kernel_dims("hidden", hidden, "intermediate", intermediate)
    check_local_experts("num_local_experts", num_local_experts)
    check_side_rank("side_rank", side_rank, zero="0 (no adapters)")
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
