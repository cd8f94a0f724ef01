"""The pool gather kernels' own source (kernels/pool_gather_tokens.cuh, token-major, and
the row-major kernels/pool_gather.cuh for one route per token), run on the CPU against
:func:`megamoe.wrappers.pool.gather_pool_reference`, bit for bit.

The driver (tests/cpu/host/pool_gather_tokens.cpp) compiles the kernel with g++ over a
shim of CUDA's built-ins (tests/cpu/host/cuda_host_shim.h: each warp's 32 lanes are
threads, the ballot a barrier) and launches it over a chosen grid and row-slice count,
so the grid-stride loops, the (token, slice) split, the route batches and the zeroing
pass's ballot all run as written. Plans come from the CPU route planner, and corrupt
ones are made by hand.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing
from megamoe.wrappers import pool

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "tests" / "cpu" / "host"
THREADS_PER_BLOCK = 256
SENTINEL = 3.0


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not on PATH")
    binary = tmp_path_factory.mktemp("pool_gather_tokens") / "driver"
    subprocess.run(
        [cxx, "-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread", "-I", str(HOST),
         "-I", str(ROOT / "kernels"), str(HOST / "pool_gather_tokens.cpp"), "-o", str(binary)],
        check=True,
    )  # fmt: skip
    return binary


def run_kernel(driver, tmp_path, x, side, plan, *, blocks, slices, zero_parts=1, out=None,
               kernel="tokens"):  # fmt: skip
    """(the pool after one launch of ``blocks`` blocks with ``slices`` row slices and
    ``zero_parts`` warps per zeroed 32-row group, the bytes of ``x`` it read);
    ``kernel="rows"``: the row-major kernel with the inverse map, as for ``K = 1``."""
    num_tokens, hidden = x.shape
    side_cols = 0 if side is None else side.shape[1]
    capacity = plan.pool_capacity
    if out is None:
        out = torch.full((capacity, hidden + side_cols), SENTINEL, dtype=torch.bfloat16)
    head = np.array(
        [num_tokens, plan.route_to_pool_row.shape[1], hidden, side_cols, capacity,
         int(plan.expert_pool_offsets[-1]), blocks, slices, zero_parts, kernel == "rows"],
        dtype=np.int64,
    )  # fmt: skip
    parts = [
        head.tobytes(),
        x.view(torch.int16).numpy().tobytes(),
        b"" if side is None else side.view(torch.int16).numpy().tobytes(),
        plan.route_to_pool_row.to(torch.int32).numpy().tobytes(),
        plan.pool_row_to_route.to(torch.int32).numpy().tobytes(),
        out.view(torch.int16).numpy().tobytes(),
    ]
    (tmp_path / "in.bin").write_bytes(b"".join(parts))
    # A timeout: a kernel whose loops do not end fails here instead of stalling the suite.
    done = subprocess.run(
        [str(driver), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    result = np.fromfile(tmp_path / "out.bin", dtype=np.int16).reshape(capacity, -1)
    return torch.from_numpy(result.copy()).view(torch.bfloat16), int(done.stdout)


def host_grid(num_tokens: int, row_vecs: int, capacity: int, resident_warps: int):
    """bindings/pool_ops.cpp's (row slices, zero parts) for ``resident_warps`` warps."""
    max_slices = (row_vecs + 31) // 32
    slices = min(max(-(-resident_warps // max(num_tokens, 1)), 1), max_slices)
    slice_vecs = 32 * (-(-row_vecs // (32 * slices)))
    groups = -(-capacity // 32)
    return -(-row_vecs // slice_vecs), min(max(-(-resident_warps // groups), 1), 32)


def random_bf16(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def check(driver, tmp_path, num_tokens, top_k, hidden, side_cols, *, blocks, resident_warps,
          kind="masked", num_experts=12, seed=0, plan=None):  # fmt: skip
    if plan is None:
        ids, _ = make_routing(num_tokens, num_experts, top_k, kind=kind, seed=seed)
        plan = mm.plan_routes_reference(ids, num_experts, 64)
    x = random_bf16((num_tokens, hidden), seed + 1)
    side = random_bf16((num_tokens, side_cols), seed + 2) if side_cols else None
    slices, parts = host_grid(num_tokens, (hidden + side_cols) // 8, plan.pool_capacity,
                              resident_warps)  # fmt: skip
    got, _ = run_kernel(driver, tmp_path, x, side, plan, blocks=blocks, slices=slices,
                        zero_parts=parts)  # fmt: skip
    sentinel = torch.full_like(got, SENTINEL)
    expected = pool.gather_pool_reference(x, side, plan, sentinel)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (
        f"{int((got.view(torch.int16) != expected.view(torch.int16)).any(1).sum())} rows differ"
    )
    return plan, got


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "hidden", "side_cols", "blocks", "resident_warps"),
    [
        (1, 1, 64, 0, 1, 8),  # one token, its row split into slices
        (17, 6, 256, 32, 1, 64),  # slices of 32-vector strides, a short last one
        (90, 2, 64, 16, 2, 16),  # grid-strided over more items than warps
        (300, 6, 128, 256, 3, 2048),  # many slices per token
        (64, 9, 96, 8, 1, 8),  # K beyond one batch of 8 routes
        (200, 4, 8, 8, 2, 16),  # rows of 2 vectors: most lanes idle
        (5, 6, 4096, 256, 1, 64),  # ep4rank rows: 9 slices over 8 warps (slice carries)
    ],
)
def test_kernel_matches_the_reference(driver, tmp_path, num_tokens, top_k, hidden, side_cols,
                                      blocks, resident_warps):  # fmt: skip
    check(driver, tmp_path, num_tokens, top_k, hidden, side_cols, blocks=blocks,
          resident_warps=resident_warps, seed=num_tokens + top_k)  # fmt: skip


@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_routing_kinds(driver, tmp_path, kind):
    check(driver, tmp_path, 150, 6, 64, 32, blocks=2, resident_warps=16, kind=kind, seed=3)


def test_remote_routes_and_the_untouched_tail(driver, tmp_path):
    ids, _ = make_routing(120, 12, 4, kind="masked", seed=5)
    plan = mm.plan_routes_reference(ids, 6, 64, expert_begin=3)  # half the experts local
    _, got = check(driver, tmp_path, 120, 4, 32, 8, blocks=1, resident_warps=8, plan=plan)
    rows_used = int(plan.expert_pool_offsets[-1])
    assert rows_used < plan.pool_capacity
    assert (got[rows_used:] == SENTINEL).all()
    assert (got[:rows_used] == 0).all(dim=1).any()  # padding rows were zeroed


def test_all_masked_writes_nothing(driver, tmp_path):
    ids = torch.full((10, 2), -1, dtype=torch.int32)
    plan = mm.plan_routes_reference(ids, 3, 64)
    x = random_bf16((10, 16), 7)
    got, read = run_kernel(driver, tmp_path, x, None, plan, blocks=1, slices=1)
    assert (got == SENTINEL).all()
    assert read == 0


@pytest.mark.parametrize(("slices", "zero_parts"), [(1, 1), (3, 7), (2, 32)])
def test_reads_only_tokens_with_a_claimed_row(driver, tmp_path, slices, zero_parts):
    # The EP layer's receive buffer: a K = 1 plan over more rows than were received,
    # the rows past them never written. Their tokens claim no pool row and must not be
    # read (compute-sanitizer's initcheck); each received row is read exactly once.
    ids = torch.full((100, 1), -1, dtype=torch.int32)
    ids[:60, 0] = torch.arange(60, dtype=torch.int32) % 5
    plan = mm.plan_routes_reference(ids, 5, 64)
    x = random_bf16((100, 256), 11)
    got, read = run_kernel(driver, tmp_path, x, None, plan, blocks=2, slices=slices,
                           zero_parts=zero_parts)  # fmt: skip
    expected = pool.gather_pool_reference(x, None, plan, torch.full_like(got, SENTINEL))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert read == 60 * 256 * 2


def test_a_corrupt_plan_gives_one_writer_per_row(driver, tmp_path):
    # Two routes' rows swapped in route_to_pool_row only, one route pointed past the
    # rows in use, one pool row naming a route out of range: every row still has one
    # writer (its token where both maps agree, else zeros), as in the reference.
    ids, _ = make_routing(80, 12, 3, kind="masked", seed=9)
    plan = mm.plan_routes_reference(ids, 12, 64)
    r2p = plan.route_to_pool_row.clone()
    flat = r2p.view(-1)
    routed = (flat >= 0).nonzero().flatten().tolist()
    a, b, c = routed[2], routed[30], routed[55]
    flat[a], flat[b] = flat[b].clone(), flat[a].clone()
    flat[c] = plan.pool_capacity + 5
    p2r = plan.pool_row_to_route.clone()
    p2r[int(plan.route_to_pool_row.view(-1)[routed[60]])] = 80 * 3 + 7
    corrupt = dataclasses.replace(plan, route_to_pool_row=r2p, pool_row_to_route=p2r)
    _, got = check(driver, tmp_path, 80, 3, 64, 0, blocks=2, resident_warps=16, plan=corrupt)
    for route in (a, b, c, routed[60]):
        row = int(plan.route_to_pool_row.view(-1)[route])
        assert (got[row].view(torch.int16) == 0).all(), route


@pytest.mark.parametrize("corrupt", [False, True])
def test_one_route_per_token_takes_the_row_major_kernel(driver, tmp_path, corrupt):
    # K = 1 (the EP layer's received rows): the row-major kernel with the inverse map
    # follows the same claim rule, so a corrupt plan's disagreeing rows are zeros too.
    ids = torch.full((90, 1), -1, dtype=torch.int32)
    ids[:70, 0] = torch.arange(70, dtype=torch.int32) % 6
    plan = mm.plan_routes_reference(ids, 6, 64)
    if corrupt:
        r2p = plan.route_to_pool_row.clone()
        r2p[3, 0], r2p[50, 0] = r2p[50, 0].clone(), r2p[3, 0].clone()
        plan = dataclasses.replace(plan, route_to_pool_row=r2p)
    x = random_bf16((90, 128), 12)
    got, read = run_kernel(driver, tmp_path, x, None, plan, blocks=2, slices=1, kernel="rows")
    expected = pool.gather_pool_reference(x, None, plan, torch.full_like(got, SENTINEL))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert read == (68 if corrupt else 70) * 128 * 2
