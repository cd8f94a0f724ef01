"""Bad input on CUDA tensors is rejected before any launch, naming the argument.

The fused forward checks devices, alignment and strides only for CUDA inputs, and the
engine's launchers (bindings/engine_launch.cpp) check the rest in C++; those checks
need a GPU and the compiled module. The CPU-reachable cases are in
tests/cpu/test_bad_input.py; the inventory of all of them is docs/BAD-INPUT.md. The
last group were checks the API lacked when these tests were written; they landed with
the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import megamoe as mm
from megamoe.testing import LayerInputs, make_layer, make_routing
from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
from megamoe.wrappers.grouped_gemm import gated_grouped_gemm, grouped_gemm
from megamoe.wrappers.routing import check_errors

pytestmark = pytest.mark.gpu

H, I, E, R, T, K = 128, 128, 8, 16, 10, 2


@dataclass
class GemmInputs:
    plan: mm.RoutePlan
    weights: torch.Tensor  # [100, 2] float32: the plan's route weights
    a: torch.Tensor  # [pool, 128] BF16: the Store GEMM's A (k = 128), dgrad2's dout pool
    b: torch.Tensor  # [4, 192, 128]
    a_gated: torch.Tensor  # [pool, 128 + 2 * 16]: [x | q1 | q3]
    w13: torch.Tensor  # [4, 256, 128]
    w2: torch.Tensor  # [4, 128, 128]: dgrad2's B as stored (H = I = 128)
    preact: torch.Tensor  # [pool, 256]: dgrad2's g | u


def bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16).cuda()


@pytest.fixture(scope="module")
def layer() -> LayerInputs:
    return make_layer(H, I, E, K, R, num_tokens=T, device="cuda", seed=1)


@pytest.fixture(scope="module")
def gemm() -> GemmInputs:
    ids, weights = make_routing(100, 4, 2, seed=3)
    plan = mm.plan_routes(ids.cuda(), 4, 64)
    rows = plan.pool_capacity
    return GemmInputs(
        plan,
        weights.cuda(),
        bf16(rows, 128),
        bf16(4, 192, 128),
        bf16(rows, 160, seed=1),
        bf16(4, 256, 128),
        bf16(4, 128, 128, seed=2),
        bf16(rows, 256, seed=3),
    )


def dgrad2(g: GemmInputs, **overrides: object) -> object:
    args = dict(dout_pool=g.a, w2=g.w2, preact=g.preact, topk_weights=g.weights, plan=g.plan)
    args.update(overrides)
    return fused_dgrad2_activation_backward(**args)


def moe(layer: LayerInputs, **overrides: object) -> torch.Tensor:
    args = dict(
        x=layer.x,
        topk_ids=layer.topk_ids,
        topk_weights=layer.topk_weights,
        base=layer.base,
        side=layer.side,
    )
    args.update(overrides)
    with torch.no_grad():
        return mm.moe(**args)


def misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at an address 2 bytes past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    return view


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a column-major (non-contiguous) layout."""
    return t.t().contiguous().t()


def adapters(layer: LayerInputs, **convert: object) -> mm.SideLoRA:
    return mm.SideLoRA(*(t.to(**convert) for t in layer.side.tensors()), scale=layer.side.scale)


def narrow_side() -> mm.SideLoRA:
    """Adapters for I = 64: valid by themselves, wrong for the layer's I = 128."""
    narrow = 64
    return mm.SideLoRA(
        bf16(H, R),
        bf16(E, R, narrow),
        bf16(H, R),
        bf16(E, R, narrow),
        bf16(E, narrow, R),
        bf16(R, H),
        scale=0.5,
    )


def with_id(layer: LayerInputs, value: int) -> torch.Tensor:
    ids = layer.topk_ids.clone()
    ids[0, 0] = value
    return ids


Case = tuple[Callable[[LayerInputs, GemmInputs], object], type[Exception], str]

CASES: dict[str, Case] = {
    # ---- mm.moe (the fused forward's checks)
    "x-on-cpu": (lambda L, g: moe(L, x=L.x.cpu()), ValueError, r"^x: expected device cuda"),
    "x-misaligned": (
        lambda L, g: moe(L, x=misaligned_copy(L.x)),
        ValueError,
        r"^x: expected a data pointer aligned to 16 bytes",
    ),
    # A contiguous view 2 bytes into a buffer: the TMA maps' encode refused it after the
    # route plan and the gather had run, naming the kernel's operand, not the argument.
    "base-w13-misaligned": (
        lambda L, g: moe(L, base=dataclasses.replace(L.base, w13=misaligned_copy(L.base.w13))),
        ValueError,
        r"^base.w13: expected a data pointer aligned to 16 bytes",
    ),
    "side-b1-misaligned": (
        lambda L, g: moe(L, side=dataclasses.replace(L.side, b1=misaligned_copy(L.side.b1))),
        ValueError,
        r"^side.b1: expected a data pointer aligned to 16 bytes",
    ),
    "x-strided": (
        lambda L, g: moe(L, x=strided(L.x)),
        ValueError,
        r"^x: expected a contiguous tensor",
    ),
    "x-hidden": (
        lambda L, g: moe(L, x=L.x[:, :64].contiguous()),
        ValueError,
        r"^x: expected shape \[\*, 128\]",
    ),
    "x-3d": (lambda L, g: moe(L, x=L.x.unsqueeze(0)), ValueError, r"^x: expected 2 dimensions"),
    "x-no-tokens": (
        lambda L, g: moe(L, x=L.x[:0], topk_ids=L.topk_ids[:0], topk_weights=L.topk_weights[:0]),
        ValueError,
        r"^x: expected at least one token",
    ),
    "ids-on-cpu": (
        lambda L, g: moe(L, topk_ids=L.topk_ids.cpu()),
        ValueError,
        r"^topk_ids: expected device cuda",
    ),
    "ids-tokens": (
        lambda L, g: moe(L, topk_ids=L.topk_ids[:-1]),
        ValueError,
        r"^topk_ids: expected shape",
    ),
    "ids-float": (
        lambda L, g: moe(L, topk_ids=L.topk_ids.float()),
        TypeError,
        r"^topk_ids: expected dtype int32 or int64",
    ),
    "ids-strided": (
        lambda L, g: moe(L, topk_ids=strided(L.topk_ids)),
        ValueError,
        r"^topk_ids: expected a contiguous tensor",
    ),
    # Checked on the device; check_errors waits for the result (no sync in the call).
    "ids-below-minus-one": (
        lambda L, g: (moe(L, topk_ids=with_id(L, -5)), check_errors()),
        ValueError,
        r"^topk_ids: expected expert ids in \[-1, 8\), got values in \[-5, ",
    ),
    "weights-bf16": (
        lambda L, g: moe(L, topk_weights=L.topk_weights.bfloat16()),
        TypeError,
        r"^topk_weights: expected dtype float32",
    ),
    "weights-top-k": (
        lambda L, g: moe(L, topk_weights=L.topk_weights[:, :1].contiguous()),
        ValueError,
        r"^topk_weights: expected shape",
    ),
    "weights-on-cpu": (
        lambda L, g: moe(L, topk_weights=L.topk_weights.cpu()),
        ValueError,
        r"^topk_weights: expected device cuda",
    ),
    "activation": (
        lambda L, g: moe(L, activation="relu"),
        ValueError,
        r"^activation: expected one of",
    ),
    "clamp-zero": (
        lambda L, g: moe(L, activation_clamp=0.0),
        ValueError,
        r"^activation_clamp: expected a positive finite float",
    ),
    "clamp-nan": (
        lambda L, g: moe(L, activation_clamp=float("nan")),
        ValueError,
        r"^activation_clamp: expected a positive finite float",
    ),
    "side-float32": (
        lambda L, g: moe(L, side=adapters(L, dtype=torch.float32)),
        TypeError,
        r"^side: expected bfloat16 tensors, got torch\.float32",
    ),
    "side-on-cpu": (
        lambda L, g: moe(L, side=adapters(L, device="cpu")),
        ValueError,
        r"^side\.a1: expected device cuda:0 \(where base is\), got cpu",
    ),
    "side-dims": (
        lambda L, g: moe(L, side=narrow_side()),
        ValueError,
        r"^side: \(H, I, E_l\) = \(128, 64, 8\) does not match base",
    ),
    # ---- grouped GEMM (Python wrapper, then the C++ launcher)
    "gemm-b-on-cpu": (
        lambda L, g: grouped_gemm(g.a, g.b.cpu(), g.plan),
        ValueError,
        r"^b: expected device cuda",
    ),
    "gemm-b-extra-k": (
        lambda L, g: grouped_gemm(g.a, g.b, g.plan, b_extra=bf16(4, 64, 16)),
        ValueError,
        r"^b_extra: expected shape",
    ),
    "gemm-k-not-multiple-of-8": (
        lambda L, g: grouped_gemm(g.a, bf16(4, 192, 100), g.plan, k=100),
        ValueError,
        r"^k: expected a multiple of 8",
    ),
    "gemm-pool-rows-not-block-multiple": (
        lambda L, g: grouped_gemm(g.a[:-1], g.b, g.plan),
        ValueError,
        r"^a: expected plan.pool_capacity = \d+ rows, got \d+",
    ),
    "gemm-unknown-block-m": (
        lambda L, g: grouped_gemm(g.a, g.b, dataclasses.replace(g.plan, block_m=32)),
        ValueError,
        r"^plan.block_m: expected one of \[64, 128\], got 32",
    ),
    "gemm-n-not-multiple-of-8": (
        lambda L, g: grouped_gemm(g.a, bf16(4, 100, 128), g.plan),
        ValueError,
        r"^b: expected N a multiple of 8, got 100",
    ),
    "gemm-b-extra-n-not-multiple-of-8": (
        lambda L, g: grouped_gemm(g.a, g.b, g.plan, b_extra=bf16(4, 128, 12)),
        ValueError,
        r"^b_extra: expected N_x a multiple of 8",
    ),
    "gemm-mxfp4-k-not-multiple-of-64": (
        lambda L, g: grouped_gemm(
            g.a,
            torch.zeros(4, 192, 48, dtype=torch.uint8, device="cuda"),
            g.plan,
            b_scales=torch.full((4, 192, 3), 127, dtype=torch.uint8, device="cuda"),
        ),
        ValueError,
        r"^b: an MXFP4 B needs K a multiple of 64, got K=96",
    ),
    "gemm-out-rows": (
        lambda L, g: grouped_gemm(g.a, g.b, g.plan, out=bf16(g.plan.pool_capacity - 64, 192)),
        ValueError,
        r"^out: expected shape",
    ),
    "gated-side-half-given": (
        lambda L, g: gated_grouped_gemm(
            g.a_gated, g.w13, g.plan, k=128, side_b_gate=bf16(4, 16, 128), side_scale=1.0
        ),
        ValueError,
        r"^side_b_gate/side_b_up: give both or neither",
    ),
    "gated-side-rank": (
        lambda L, g: gated_grouped_gemm(
            g.a_gated,
            g.w13,
            g.plan,
            k=128,
            side_b_gate=bf16(4, 12, 128),
            side_b_up=bf16(4, 12, 128),
            side_scale=1.0,
        ),
        ValueError,
        r"^side_b_gate: rank 12 must be a positive multiple of 8",
    ),
    "gated-pool-too-narrow-for-side": (
        lambda L, g: gated_grouped_gemm(
            g.a,
            g.w13,
            g.plan,
            k=128,
            side_b_gate=bf16(4, 16, 128),
            side_b_up=bf16(4, 16, 128),
            side_scale=1.0,
        ),
        ValueError,
        r"^side_b_gate: rank 16 must be a positive multiple of 8 with k_base \+ 2\*rank <= a's "
        r"columns",
    ),
    "gated-side-scale-nan": (
        lambda L, g: gated_grouped_gemm(
            g.a_gated,
            g.w13,
            g.plan,
            k=128,
            side_b_gate=bf16(4, 16, 128),
            side_b_up=bf16(4, 16, 128),
            side_scale=float("nan"),
        ),
        ValueError,
        r"^side_scale: expected a finite float, got nan",
    ),
    "gated-out-columns": (
        lambda L, g: gated_grouped_gemm(
            g.a, g.w13, g.plan, k=128, out=bf16(g.plan.pool_capacity, 64)
        ),
        ValueError,
        r"^out: expected shape \[\d+, 128\]",
    ),
    "gated-k-not-multiple-of-64": (
        lambda L, g: gated_grouped_gemm(g.a, bf16(4, 256, 96), g.plan, k=96),
        ValueError,
        r"^k: expected a multiple of 64 \(the kernels' K step\), got 96",
    ),
    # ---- dgrad2 + activation backward (Python wrapper, then the C++ launcher)
    "dgrad2-k-not-multiple-of-64": (
        lambda L, g: dgrad2(g, dout_pool=bf16(g.plan.pool_capacity, 96), w2=bf16(4, 96, 128)),
        ValueError,
        r"^w2: expected H and I multiples of 64, got H=96, I=128",
    ),
    "dgrad2-pool-too-narrow-for-side": (
        lambda L, g: dgrad2(g, side_a2=bf16(4, 128, 16)),
        ValueError,
        r"^dout_pool: expected at least H \+ r = 144 columns, got 128",
    ),
    "dgrad2-side-a2-intermediate": (
        lambda L, g: dgrad2(g, dout_pool=bf16(g.plan.pool_capacity, 144), side_a2=bf16(4, 64, 16)),
        ValueError,
        r"^side_a2: expected shape \[4, 128, \*\]",
    ),
    "dgrad2-preact-width": (
        lambda L, g: dgrad2(g, preact=bf16(g.plan.pool_capacity, 128)),
        ValueError,
        r"^preact: expected shape \[\d+, 256\]",
    ),
    "dgrad2-w2-on-cpu": (
        lambda L, g: dgrad2(g, w2=g.w2.cpu()),
        ValueError,
        r"^w2: expected device cuda",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_the_argument(case: str, layer: LayerInputs, gemm: GemmInputs) -> None:
    call, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call(layer, gemm)
    torch.cuda.synchronize()  # nothing was launched that could fail later


def test_the_valid_calls_run(layer: LayerInputs, gemm: GemmInputs) -> None:
    """The baselines the cases above perturb are themselves valid."""
    assert moe(layer).shape == (T, H)
    assert grouped_gemm(gemm.a, gemm.b, gemm.plan).shape == (gemm.plan.pool_capacity, 192)
    assert gated_grouped_gemm(gemm.a, gemm.w13, gemm.plan, k=128).shape[1] == 128
    dgu, weighted, drouter = dgrad2(gemm)
    assert dgu.shape == gemm.preact.shape and weighted.shape == (gemm.plan.pool_capacity, 128)
    assert drouter.shape == (gemm.plan.pool_capacity,)
    side = dgrad2(gemm, dout_pool=bf16(gemm.plan.pool_capacity, 144), side_a2=bf16(4, 128, 16))
    assert side[0].shape == gemm.preact.shape


# ------------------------------------------------------------- checks the API lacks


def test_moe_mxfp4_base_on_the_host_names_base(layer: LayerInputs) -> None:
    # The packed codes and scales must live where x does; nothing is copied implicitly.
    base = mm.prepare_base_weights(layer.w13.cpu(), layer.w2.cpu(), format="mxfp4")
    with pytest.raises(ValueError, match=r"where base is"):
        moe(layer, base=base)


def test_gated_w13_width_names_w13(gemm: GemmInputs) -> None:
    # 2I = 192: I = 96 is not a multiple of 64 (a gated tile's gate and up halves).
    with pytest.raises(ValueError, match=r"^w13: expected 2I rows with I a multiple of 64"):
        gated_grouped_gemm(gemm.a, bf16(4, 192, 128), gemm.plan, k=128)


def test_gemm_pool_smaller_than_the_plan(gemm: GemmInputs) -> None:
    # 128 rows: fewer than the plan's rows in use (>= 200 routes), a BLOCK_M multiple.
    rows = 128
    assert int(gemm.plan.expert_pool_offsets[-1]) > rows
    # Views into larger buffers: if the call is (wrongly) launched, the overrun lands
    # in memory this test owns instead of corrupting anything else.
    a = torch.zeros(gemm.plan.pool_capacity, 128, dtype=torch.bfloat16, device="cuda")[:rows]
    out = torch.empty(gemm.plan.pool_capacity, 192, dtype=torch.bfloat16, device="cuda")[:rows]
    with pytest.raises(ValueError, match=r"^a: expected plan\.pool_capacity"):
        grouped_gemm(a, gemm.b, gemm.plan, out=out)
    torch.cuda.synchronize()
