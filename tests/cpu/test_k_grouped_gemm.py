"""The K-grouped weight-gradient GEMM's CPU twin and argument checks (no GPU)."""

import pytest
import torch

from megamoe.wrappers.k_grouped_gemm import (
    k_grouped_block_n,
    k_grouped_gemm,
    k_grouped_gemm_reference,
)
from megamoe.wrappers.routing import RoutePlan


def plan_of(counts, segments):
    offsets = [0]
    for length in segments:
        offsets.append(offsets[-1] + length)
    return RoutePlan(
        expert_counts=torch.tensor(counts, dtype=torch.int32),
        expert_pool_offsets=torch.tensor(offsets, dtype=torch.int32),
        route_to_pool_row=torch.zeros(1, 1, dtype=torch.int32),
        pool_row_to_route=torch.full((offsets[-1],), -1, dtype=torch.int32),
        block_m=1,
    )


def test_twin_reads_only_data_rows():
    plan = plan_of([3, 0, 5], [4, 2, 8])
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(14, 16, generator=gen).bfloat16()
    b = torch.randn(14, 8, generator=gen).bfloat16()
    data = torch.zeros(14, dtype=torch.bool)
    data[0:3] = True
    data[6:11] = True
    a[~data] = float("nan")
    out = k_grouped_gemm(a, b, plan, scale=0.5)
    assert out.shape == (3, 16, 8) and out.dtype == torch.bfloat16
    assert bool((out[1] == 0).all())
    expected = k_grouped_gemm_reference(a, b, plan, scale=0.5)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    # Experts 0 and 2 by hand: rows 0..2, and rows 6..10 of expert 2's segment 6..13
    # (the reference shares its row selection with the twin, so the rows are named here).
    manual = 0.5 * a[0:3].double().T @ b[0:3].double()
    torch.testing.assert_close(expected[0], manual)
    manual = 0.5 * a[6:11].double().T @ b[6:11].double()
    torch.testing.assert_close(expected[2], manual)
    torch.testing.assert_close(out[2].double(), manual, rtol=1e-2, atol=1e-2)


def test_block_n_choice():
    assert k_grouped_block_n(128) == 128
    assert k_grouped_block_n(16) == 128
    assert k_grouped_block_n(256) == 256
    assert k_grouped_block_n(4096) == 256


@pytest.mark.parametrize(
    "case,match",
    [
        ("a_dtype", "a: expected dtype"),
        ("b_rows", "b: expected shape"),
        ("odd_cols", "b: expected a multiple of 8 columns"),
        ("col_stride", "a: expected rows of unit column stride"),
        ("scale", "scale: expected a finite float, got nan"),
        ("scale_int", "scale: expected a finite float, got an int of"),
        ("scale_f32", "scale: expected a float finite in float32"),
        ("out", "out: expected shape"),
    ],
)
def test_bad_arguments_name_themselves(case, match):
    plan = plan_of([3, 5], [4, 8])
    a = torch.zeros(12, 16, dtype=torch.bfloat16)
    b = torch.zeros(12, 8, dtype=torch.bfloat16)
    kwargs = {}
    if case == "a_dtype":
        a = a.float()
    elif case == "b_rows":
        b = b[:-1]
    elif case == "odd_cols":
        b = torch.zeros(12, 12, dtype=torch.bfloat16)
    elif case == "col_stride":
        a = torch.zeros(16, 12, dtype=torch.bfloat16).T
    elif case == "scale":
        kwargs["scale"] = float("nan")
    elif case == "scale_int":
        kwargs["scale"] = 10**400  # past float's range: OverflowError before
    elif case == "scale_f32":
        kwargs["scale"] = 1e39
    else:
        kwargs["out"] = torch.zeros(2, 16, 5, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=match):
        k_grouped_gemm(a, b, plan, **kwargs)


def test_twin_clamps_a_corrupt_plan_like_the_kernel():
    counts = [500, 10, 40, 7, 64]
    offsets = [-50, 100, 90, 200, 10_000, 10_100]
    plan = RoutePlan(
        expert_counts=torch.tensor(counts, dtype=torch.int32),
        expert_pool_offsets=torch.tensor(offsets, dtype=torch.int32),
        route_to_pool_row=torch.zeros(1, 1, dtype=torch.int32),
        pool_row_to_route=torch.full((300,), -1, dtype=torch.int32),
        block_m=1,
    )
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(300, 8, generator=gen).bfloat16()
    b = torch.randn(300, 8, generator=gen).bfloat16()
    expected = k_grouped_gemm_reference(a, b, plan)
    torch.testing.assert_close(expected[0], a[0:100].double().T @ b[0:100].double())
    torch.testing.assert_close(expected[2], a[90:130].double().T @ b[90:130].double())
    torch.testing.assert_close(expected[3], a[200:207].double().T @ b[200:207].double())
    assert bool((expected[1] == 0).all()) and bool((expected[4] == 0).all())
    out = k_grouped_gemm(a, b, plan, scale=-2.0)
    assert not bool(torch.signbit(out[1]).any()), "empty experts give +0, even for scale < 0"
    torch.testing.assert_close(out.double(), -2.0 * expected, rtol=2e-2, atol=2e-2)


def test_the_plan_is_checked_before_the_twin_reads_it():
    """A review: the K-grouped wrapper checked no plan, so ``None`` raised AttributeError,
    a meta plan failed inside the twin's host read, and a plan on another device than
    ``a`` was read on the host (a hidden synchronisation) where the other GEMMs refuse it."""
    plan = plan_of([3, 5], [4, 8])
    a = torch.zeros(12, 16, dtype=torch.bfloat16)
    b = torch.zeros(12, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^plan: expected a megamoe.RoutePlan, got NoneType"):
        k_grouped_gemm(a, b, None)
    maps = (plan.expert_counts, plan.expert_pool_offsets, plan.route_to_pool_row)
    meta_plan = RoutePlan(*(m.to("meta") for m in maps), plan.pool_row_to_route.to("meta"), 1)
    with pytest.raises(ValueError, match=r"^plan.expert_counts: expected device cpu, got meta"):
        k_grouped_gemm(a, b, meta_plan)
    assert k_grouped_gemm(a, b, plan).shape == (2, 16, 8)
