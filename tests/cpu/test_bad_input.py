"""Bad input is rejected with a TypeError/ValueError naming the argument, before any
launch (docs/DESIGN.md §5), on the CPU: no GPU and no compiled module needed.

The argument checks of ``mm.moe`` itself (before the device check, mixed devices, the
fake implementations) are in test_validation.py. These add to the cases already in
test_api, test_routing, test_workspace,
test_heuristics, test_env, test_pool, test_mxfp4 and test_reference (the inventory
is docs/BAD-INPUT.md). Devices are exercised with the ``meta`` device: a tensor on
another device than its partners must be named just as a CPU tensor beside CUDA ones.

The last group were checks the API lacked when these tests were written; they landed
with the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megamoe as mm
from megamoe.validation.mxfp4 import check_mxfp4_scales, check_mxfp4_weights
from megamoe.wrappers import pool
from megamoe.wrappers.grouped_gemm import gated_grouped_gemm, grouped_gemm

H, I, E, R, T, K = 64, 64, 4, 16, 12, 2
META = torch.device("meta")


def side_tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return dict(
        a1=torch.randn(H, R, dtype=dtype),
        b1=torch.randn(E, R, I, dtype=dtype),
        a3=torch.randn(H, R, dtype=dtype),
        b3=torch.randn(E, R, I, dtype=dtype),
        a2=torch.randn(E, I, R, dtype=dtype),
        b2=torch.randn(R, H, dtype=dtype),
    )


def base_tensors(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(E, 2 * I, H, dtype=dtype), torch.randn(E, H, I, dtype=dtype)


def routing() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[e % E, (e + 1) % E] for e in range(T)], dtype=torch.int32)
    return ids, torch.full((T, K), 0.5)


def plan() -> mm.RoutePlan:
    return mm.plan_routes(routing()[0], E, 64)


def pool_output(columns: int = H + R) -> torch.Tensor:
    return torch.randn(plan().pool_capacity, columns).to(torch.bfloat16)


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def moe(**overrides: object) -> torch.Tensor:
    """mm.moe on CPU inputs with ``overrides``, under no_grad (the inference op)."""
    ids, weights = routing()
    args = dict(
        x=bf16(T, H),
        topk_ids=ids,
        topk_weights=weights,
        base=mm.prepare_base_weights(*base_tensors()),
        side=None,
    )
    args.update(overrides)
    with torch.no_grad():
        return mm.moe(**args)


def gemm(**overrides: object) -> torch.Tensor:
    p = plan()
    args = dict(a=bf16(p.pool_capacity, I), b=bf16(E, H, I), plan=p)
    args.update(overrides)
    return grouped_gemm(**args)


def gated(**overrides: object) -> torch.Tensor:
    p = plan()
    args = dict(a=bf16(p.pool_capacity, H), w13=bf16(E, 2 * I, H), plan=p, k=H)
    args.update(overrides)
    return gated_grouped_gemm(**args)


def quantized(shape: tuple[int, ...] = (E, 2 * I, H)) -> tuple[torch.Tensor, torch.Tensor]:
    return mm.quantize_mxfp4(torch.randn(shape), axis=-1)


def with_nan_scale(index: tuple[int, ...]) -> torch.Tensor:
    _, scales = quantized()
    scales[index] = 0xFF
    return scales


def side_with(**changes: torch.Tensor) -> mm.SideLoRA:
    return mm.SideLoRA(**{**side_tensors(), **changes})


def plan_with(**changes: torch.Tensor) -> mm.RoutePlan:
    return dataclasses.replace(plan(), **changes)


Case = tuple[Callable[[], object], type[Exception], str]

CASES: dict[str, Case] = {
    # ---- mm.moe (most of its checks: test_validation.py; alignment needs CUDA inputs,
    # tests/gpu/test_bad_input_gpu.py)
    "moe-group": (lambda: moe(group=object()), TypeError, r"^group:"),
    "moe-base-type": (lambda: moe(base=base_tensors()[0]), TypeError, r"^base: expected"),
    # ---- prepare_base_weights
    "prepare-w13-not-tensor": (
        lambda: mm.prepare_base_weights([[1.0]], base_tensors()[1]),
        TypeError,
        r"^w13: expected a torch\.Tensor",
    ),
    "prepare-w2-not-tensor": (
        lambda: mm.prepare_base_weights(base_tensors()[0], None),
        TypeError,
        r"^w2: expected a torch\.Tensor",
    ),
    "prepare-w13-int-dtype": (
        lambda: mm.prepare_base_weights(torch.zeros(E, 2 * I, H, dtype=torch.int32), None),
        TypeError,
        r"^w13: expected dtype",
    ),
    "prepare-w2-other-device": (
        lambda: mm.prepare_base_weights(
            base_tensors()[0], torch.empty(E, H, I, dtype=torch.bfloat16, device=META)
        ),
        ValueError,
        r"^w2: expected device cpu",
    ),
    "prepare-zero-experts": (
        lambda: mm.prepare_base_weights(
            torch.zeros(0, 2 * I, H, dtype=torch.bfloat16),
            torch.zeros(0, H, I, dtype=torch.bfloat16),
        ),
        ValueError,
        r"^w13: expected at least one expert",
    ),
    "prepare-format-none": (
        lambda: mm.prepare_base_weights(*base_tensors(), format=None),
        TypeError,  # a wrong kind (DESIGN §5)
        r"^format: expected a str",
    ),
    "prepare-mxfp4-nan-w13": (
        lambda: mm.prepare_base_weights(
            base_tensors()[0].index_fill(0, torch.tensor([1]), float("nan")),
            base_tensors()[1],
            format="mxfp4",
        ),
        ValueError,
        r"^w13: MXFP4 quantization needs finite weights",
    ),
    # ---- SideLoRA
    "side-a2-other-device": (
        lambda: side_with(a2=torch.empty(E, I, R, device=META)),
        ValueError,
        r"^side\.a2: expected device cpu",
    ),
    "side-b1-intermediate-mismatch": (
        lambda: side_with(b3=torch.randn(E, R, I + 64)),
        ValueError,
        r"^side\.b3: expected shape",
    ),
    "side-a3-not-tensor": (
        lambda: side_with(a3="a3"),
        TypeError,
        r"^side\.a3: expected a torch\.Tensor",
    ),
    # ---- plan_routes
    "plan-ids-not-tensor": (
        lambda: mm.plan_routes([[0, 1]], E, 64),
        TypeError,
        r"^topk_ids: expected a torch\.Tensor",
    ),
    "plan-ids-3d": (
        lambda: mm.plan_routes(torch.zeros(2, 2, 1, dtype=torch.int32), E, 64),
        ValueError,
        r"^topk_ids: expected 2 dimensions",
    ),
    "plan-experts-float": (
        lambda: mm.plan_routes(routing()[0], 4.0, 64),
        TypeError,
        r"^num_local_experts: expected an int",
    ),
    "plan-block-m-bool": (
        lambda: mm.plan_routes(routing()[0], E, True),
        TypeError,
        r"^block_m: expected an int",
    ),
    "plan-expert-begin-str": (
        lambda: mm.plan_routes(routing()[0], E, 64, expert_begin="0"),
        TypeError,
        r"^expert_begin: expected an int",
    ),
    # ---- scratch layout and heuristics
    "workspace-side-rank-negative": (
        lambda: mm.workspace_layout(T, H, I, E, K, -16),
        ValueError,
        r"^side_rank: expected an int >= 0",
    ),
    "workspace-ep-size-zero": (
        lambda: mm.workspace_layout(T, H, I, E, K, ep_size=0),
        ValueError,
        r"^ep_size: expected an int >= 1",
    ),
    "workspace-tokens-float": (
        lambda: mm.workspace_layout(12.0, H, I, E, K),
        TypeError,
        r"^num_tokens: expected an int",
    ),
    "block-m-ep-size-bool": (
        lambda: mm.get_block_m(T, K, E, ep_size=True),
        TypeError,
        r"^ep_size: expected an int",
    ),
    # ---- pool wrappers (validation runs before the CPU reference or the kernel)
    "pool-plan-int64-map": (
        lambda: pool.gather_pool(bf16(T, H), None, plan_with(pool_row_to_route=torch.zeros(8))),
        TypeError,
        r"^plan\.pool_row_to_route: expected dtype int32",
    ),
    "pool-plan-map-other-device": (
        lambda: pool.gather_pool(
            bf16(T, H),
            None,
            plan_with(route_to_pool_row=torch.empty(T, K, dtype=torch.int32, device=META)),
        ),
        ValueError,
        r"^plan\.route_to_pool_row: expected device cpu",
    ),
    "pool-plan-offsets-too-short": (
        lambda: pool.gather_pool(
            bf16(T, H), None, plan_with(expert_pool_offsets=torch.zeros(1, dtype=torch.int32))
        ),
        ValueError,
        r"^plan\.expert_pool_offsets: expected \[E_l \+ 1\] entries",
    ),
    "gather-x-other-device": (
        lambda: pool.gather_pool(
            torch.empty(T, H, dtype=torch.bfloat16, device=META), None, plan()
        ),
        ValueError,
        r"^x: expected device cpu",
    ),
    "gather-side-float32": (
        lambda: pool.gather_pool(bf16(T, H), torch.randn(T, 32), plan()),
        TypeError,
        r"^side: expected dtype bfloat16",
    ),
    "gather-side-strided": (
        lambda: pool.gather_pool(bf16(T, H), bf16(32, T).t(), plan()),
        ValueError,
        r"^side: expected a contiguous tensor",
    ),
    "combine-side-expand-float32": (
        lambda: pool.combine(pool_output(), plan(), routing()[1], torch.randn(T, H), 1.0, hidden=H),
        TypeError,
        r"^side_expand: expected dtype bfloat16",
    ),
    "combine-hidden-bool": (
        lambda: pool.combine(pool_output(), plan(), routing()[1], hidden=True),
        TypeError,
        r"^hidden: expected an int",
    ),
    "combine-pool-output-3d": (
        lambda: pool.combine(pool_output().unsqueeze(0), plan(), routing()[1], hidden=H),
        ValueError,
        r"^pool_output: expected 2 dimensions",
    ),
    "combine-out-float32": (
        lambda: pool.combine(pool_output(), plan(), routing()[1], out=torch.empty(T, H)),
        TypeError,
        r"^out: expected dtype bfloat16",
    ),
    "side-sum-weights-strided": (
        lambda: pool.side_sum(pool_output(), plan(), torch.full((K, T), 0.5).t(), H),
        ValueError,
        r"^topk_weights: expected a contiguous tensor",
    ),
    # ---- grouped GEMM wrappers (checked before the compiled module is touched)
    "gemm-a-float32": (
        lambda: gemm(a=torch.randn(plan().pool_capacity, I)),
        TypeError,
        r"^a: expected dtype bfloat16",
    ),
    "gemm-a-3d": (
        lambda: gemm(a=bf16(1, plan().pool_capacity, I)),
        ValueError,
        r"^a: expected 2 dimensions",
    ),
    "gemm-a-strided": (
        lambda: gemm(a=bf16(I, plan().pool_capacity).t()),
        ValueError,
        r"^a: expected a contiguous tensor",
    ),
    "gemm-b-2d": (lambda: gemm(b=bf16(H, I)), ValueError, r"^b: expected 3 dimensions"),
    "gemm-b-other-device": (
        lambda: gemm(b=torch.empty(E, H, I, dtype=torch.bfloat16, device=META)),
        ValueError,
        r"^b: expected device cpu",
    ),
    "gated-activation": (
        lambda: gated(activation="relu"),
        ValueError,
        r"^activation: expected one of",
    ),
    "gated-w13-float16": (
        lambda: gated(w13=torch.randn(E, 2 * I, H, dtype=torch.float16)),
        TypeError,
        r"^w13: expected dtype bfloat16",
    ),
    # ---- MXFP4 quantizer and pre-quantized weights (megamoe.validation.mxfp4)
    "quantize-axis-bool": (
        lambda: mm.quantize_mxfp4(torch.randn(4, 64), axis=True),
        TypeError,
        r"^axis: expected an int",
    ),
    "dequantize-scales-other-device": (
        lambda: mm.dequantize_mxfp4(
            quantized()[0], torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=META)
        ),
        ValueError,
        r"^scales: expected device cpu",
    ),
    "mxfp4-nan-scale": (
        lambda: check_mxfp4_weights(
            "w13", quantized()[0], with_nan_scale((2, 5, 1)), (E, 2 * I, H)
        ),
        ValueError,
        r"^w13_scales: 1 UE8M0 scale byte\(s\) are 0xFF.*first at index \[2, 5, 1\]",
    ),
    "mxfp4-nan-scales-w2": (
        lambda: check_mxfp4_scales(
            "w2_scales", torch.full((E, H, I // 32), 0xFF, dtype=torch.uint8)
        ),
        ValueError,
        rf"^w2_scales: {E * H * I // 32} UE8M0 scale byte\(s\) are 0xFF",
    ),
    "mxfp4-scale-past-finite": (
        lambda: check_mxfp4_scales(
            "w2_scales",
            torch.full((E, H, I // 32), 127, dtype=torch.uint8).index_fill_(
                1, torch.tensor([3]), 253
            ),
        ),
        ValueError,
        rf"^w2_scales: {E * I // 32} UE8M0 scale byte\(s\) are 253 or 254 \(2\^126, 2\^127\), "
        r"first at index \[0, 3, 0\]",
    ),
    "mxfp4-scales-float": (
        lambda: check_mxfp4_weights("w13", quantized()[0], quantized()[1].float(), (E, 2 * I, H)),
        TypeError,
        r"^w13_scales: expected dtype uint8",
    ),
    "mxfp4-packed-int8": (
        lambda: check_mxfp4_weights(
            "w13", quantized()[0].to(torch.int8), quantized()[1], (E, 2 * I, H)
        ),
        TypeError,
        r"^w13: expected dtype uint8",
    ),
    "mxfp4-packed-unpacked-width": (
        lambda: check_mxfp4_weights(
            "w13", torch.zeros(E, 2 * I, H, dtype=torch.uint8), quantized()[1], (E, 2 * I, H)
        ),
        ValueError,
        r"^w13: expected shape \[4, 128, 32\]",
    ),
    "mxfp4-scales-shape": (
        lambda: check_mxfp4_weights(
            "w13", quantized()[0], torch.zeros(E, 2 * I, H // 16, dtype=torch.uint8), (E, 2 * I, H)
        ),
        ValueError,
        r"^w13_scales: expected shape \[4, 128, 2\]",
    ),
    "mxfp4-scales-other-device": (
        lambda: check_mxfp4_weights(
            "w13",
            quantized()[0],
            torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=META),
            (E, 2 * I, H),
        ),
        ValueError,
        r"^w13_scales: expected device cpu",
    ),
    "mxfp4-packed-strided": (
        lambda: check_mxfp4_weights(
            "w2",
            torch.zeros(E, I // 2, H, dtype=torch.uint8).transpose(1, 2),
            torch.zeros(E, H, I // 32, dtype=torch.uint8),
            (E, H, I),
        ),
        ValueError,
        r"^w2: expected a contiguous tensor",
    ),
    "mxfp4-logical-not-blocked": (
        lambda: check_mxfp4_weights(
            "w2",
            torch.zeros(E, H, 24, dtype=torch.uint8),
            torch.zeros(E, H, 1, dtype=torch.uint8),
            (E, H, 48),
        ),
        ValueError,
        r"^w2 \(logical size along axis 2\): expected a multiple of 32",
    ),
    "mxfp4-device-mismatch-with-base": (
        lambda: check_mxfp4_weights(
            "w2", *quantized((E, H, I)), (E, H, I), device=torch.device("meta")
        ),
        ValueError,
        r"^w2: expected device meta",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_the_argument(case: str) -> None:
    call, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call()


def test_valid_mxfp4_weights_pass_the_checks() -> None:
    packed, scales = quantized()
    assert check_mxfp4_weights("w13", packed, scales, (E, 2 * I, H)) == (packed, scales)
    packed0, scales0 = mm.quantize_mxfp4(torch.randn(64, 8), axis=0)
    check_mxfp4_weights("w", packed0, scales0, (64, 8), axis=0)


# ------------------------------------------------------------- checks the API lacks


def test_moe_side_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"^side: expected megamoe\.SideLoRA"):
        moe(side=side_tensors())


def test_straight_through_needs_a_trainable_master() -> None:
    w13, w2 = base_tensors()
    with pytest.raises(ValueError, match=r"^base: straight_through\(\) needs an MXFP4 base"):
        mm.prepare_base_weights(w13, w2, format="mxfp4").straight_through()


def test_moe_cpu_weights_name_the_base() -> None:
    with pytest.raises(ValueError, match=r"^base: expected CUDA weights"):
        moe()


@pytest.mark.parametrize("block_m", [0, 96])
def test_workspace_block_m_is_checked(block_m: int) -> None:
    with pytest.raises(ValueError, match=r"^block_m: expected"):
        mm.workspace_layout(T, H, I, E, K, block_m=block_m)


def test_block_m_config_type_is_checked() -> None:
    with pytest.raises(TypeError, match=r"^config: expected"):
        mm.get_block_m(T, K, E, config={"min_blocks_per_expert": 1})


def test_gemm_pool_rows_name_the_argument() -> None:
    p = plan()
    with pytest.raises(ValueError, match=r"^a: expected plan.pool_capacity"):
        gemm(a=bf16(p.pool_capacity - 8, I))


def test_gemm_cpu_twins_match_the_float64_references() -> None:
    """On CPU the engine entry points run torch twins (for pipeline tests without a
    GPU); they agree with the float64 references to BF16 rounding."""
    from megamoe.wrappers.grouped_gemm import gated_grouped_gemm_reference, grouped_gemm_reference

    p = plan()
    rows = int(p.expert_pool_offsets[-1])
    a, b, extra = bf16(p.pool_capacity, I), bf16(E, H, I), bf16(E, I, 16)  # extra [E, k, N_x]
    out = gemm(a=a, b=b, b_extra=extra)
    want = grouped_gemm_reference(a, b, p, b_extra=extra)
    assert torch.allclose(out[:rows].double(), want, rtol=2e-2, atol=2e-2)
    a1 = bf16(p.pool_capacity, H)
    w13 = bf16(E, 2 * I, H)
    preact = torch.empty(p.pool_capacity, 2 * I, dtype=torch.bfloat16)
    h = gated(a=a1, w13=w13, preact_out=preact)
    want_h = gated_grouped_gemm_reference(a1, w13, p, k=H)
    assert torch.allclose(h[:rows].double(), want_h, rtol=3e-2, atol=3e-2)
    # The side segment: b1, b3 as given [E, r, I] over a's columns H .. H + 2r.
    a1 = bf16(p.pool_capacity, H + 2 * R)
    side = dict(side_b_gate=bf16(E, R, I), side_b_up=bf16(E, R, I), side_scale=0.5)
    h = gated(a=a1, w13=w13, **side)
    want_h = gated_grouped_gemm_reference(a1, w13, p, k=H, **side)
    assert torch.allclose(h[:rows].double(), want_h, rtol=3e-2, atol=3e-2)


def test_dgrad2_side_rank_and_output_overlap_name_the_argument() -> None:
    """dgrad2 + activation backward: a side rank TMA cannot stride, and a dg | du buffer
    partly overlapping the pre-activations, are refused before anything runs; the buffer
    may be the pre-activations themselves (the layer's in-place use)."""
    from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward

    p = plan()
    dout_pool = bf16(p.pool_capacity, H + 16)
    w2, weights = bf16(E, H, I), routing()[1]
    preact = bf16(p.pool_capacity, 2 * I)
    with pytest.raises(ValueError, match=r"^side_a2: expected r a multiple of 8, got r=12"):
        fused_dgrad2_activation_backward(dout_pool, w2, preact, weights, p, side_a2=bf16(E, I, 12))
    buffer = bf16(p.pool_capacity + 1, 2 * I)
    overlapping = buffer[1:]
    with pytest.raises(ValueError, match=r"^dgrad_out: expected preact itself or memory apart"):
        fused_dgrad2_activation_backward(
            dout_pool, w2, buffer[:-1], weights, p, dgrad_out=overlapping
        )
    fresh = fused_dgrad2_activation_backward(dout_pool, w2, preact.clone(), weights, p)
    in_place = preact.clone()
    got = fused_dgrad2_activation_backward(dout_pool, w2, in_place, weights, p, dgrad_out=in_place)
    assert got[0].data_ptr() == in_place.data_ptr()
    assert torch.equal(got[0], fresh[0]) and torch.equal(got[2], fresh[2])


# --------------------------------------------- found missing by a review (2026-12-05)


def fake_cuda_call(**changes: object) -> None:
    """``mm.moe`` on fake CUDA tensors (FakeTensorMode: the GPU path's Python, whose full
    checks run inside the custom op), with ``changes`` to its arguments."""
    cuda = torch.device("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        w13, w2 = (torch.empty(t.shape, dtype=t.dtype, device=cuda) for t in base_tensors())
        args = dict(
            x=torch.empty(T, H, dtype=torch.bfloat16, device=cuda),
            topk_ids=torch.empty(T, K, dtype=torch.int32, device=cuda),
            topk_weights=torch.empty(T, K, device=cuda),
            base=mm.BaseWeights("bf16", w13, w2, None, None, E, H, I),
        )
        args.update({k: v(cuda) if callable(v) else v for k, v in changes.items()})
        mm.moe(**args)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({}, None, None),
        ({"side": {"a1": None}}, TypeError, r"^side: expected megamoe\.SideLoRA"),
        (
            {
                "topk_ids": lambda d: torch.empty(T, 0, dtype=torch.int32, device=d),
                "topk_weights": lambda d: torch.empty(T, 0, device=d),
            },
            ValueError,
            r"^topk_ids: expected at least one route per token",
        ),
    ],
)
def test_the_gpu_path_checks_what_it_reads_before_the_op(changes, error, match) -> None:
    if error is None:
        fake_cuda_call(**changes)  # the valid call goes through
        return
    with pytest.raises(error, match=match):
        fake_cuda_call(**changes)


@pytest.mark.parametrize("tokens", [T, 8000])  # 6 and 4,000 routes per expert
def test_a_trainable_mxfp4_base_is_checked_before_its_decode(monkeypatch, tokens) -> None:
    """Ordinary mode on an MXFP4 base: with many rows per expert it is decoded (a
    launch) before the op, with few the op takes it packed; on the GPU path (fake CUDA
    tensors) the call's checks come first either way."""

    def decode_first(self):
        raise AssertionError("decoded before the checks")

    monkeypatch.setattr(mm.BaseWeights, "straight_through", decode_first)
    packed = mm.prepare_base_weights(*base_tensors(), format="mxfp4")
    # Trainable masters (their values are never read), real CPU tensors: a fake CUDA
    # tensor that requires grad aborts autograd on a machine without CUDA.
    masters = {
        name: torch.zeros(shape, requires_grad=True)
        for name, shape in (("w13_master", (E, 2 * I, H)), ("w2_master", (E, H, I)))
    }
    cuda = torch.device("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = {
            name: torch.empty(t.shape, dtype=t.dtype, device=cuda)
            for name in ("w13", "w2", "w13_scales", "w2_scales")
            if (t := getattr(packed, name)) is not None
        }
        base = dataclasses.replace(packed, **on_gpu, **masters)
        assert base.decodes_for_call
        x = torch.empty(tokens, H, device=cuda)  # float32: not the layer's dtype
        ids = torch.empty(tokens, K, dtype=torch.int32, device=cuda)
        with pytest.raises(TypeError, match=r"^x: expected dtype bfloat16"):
            mm.moe(x, ids, torch.empty(tokens, K, device=cuda), base)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: mm.BaseWeights("bf16", bf16(E, 64, H), bf16(E, H, 32), None, None, E, H, 32),
            r"^base: expected H a multiple of 64 .* I a multiple of 64",
        ),
        (
            lambda: mm.BaseWeights(
                "bf16", bf16(E, H, 2 * I).transpose(1, 2), bf16(E, H, I), None, None, E, H, I
            ),
            r"^base\.w13: expected a contiguous tensor",
        ),
    ],
)
def test_hand_built_bases_are_held_to_the_kernels_layout(make, match) -> None:
    ids, weights = routing()
    with pytest.raises(ValueError, match=match):
        mm.moe(bf16(T, H), ids, weights, make())


@pytest.mark.parametrize("shape", [(E, 0, H), (E, 2 * I, 0)])
def test_empty_base_dims_are_refused_when_prepared(shape) -> None:
    w13 = torch.zeros(shape, dtype=torch.bfloat16)
    w2 = torch.zeros(E, shape[2], shape[1] // 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^w13: expected H >= 1 and I >= 1"):
        mm.prepare_base_weights(w13, w2)


def test_meta_ids_are_named_not_read() -> None:
    ids, weights = routing()
    layer = mm.MegaMoE(H, I, E, K, side_rank=R, backend="reference")
    with pytest.raises(ValueError, match=r"^topk_ids: expected device cpu, got meta"):
        layer(torch.randn(T, H), ids.to(META), weights)
    base = mm.prepare_base_weights(*base_tensors())
    x = torch.randn(T, H, device=META)
    with pytest.raises(ValueError, match=r"^base: expected device meta like x"):
        mm.reference.moe(x, ids.to(META), weights.to(META), base)
    # All on meta: the reference (which plans from the ids' values) names the ids, last,
    # where a MegaMoE on meta with the reference backend met bincount's
    # NotImplementedError (a review); the fused backend's fake implementation runs there.
    on_meta = mm.MegaMoE(H, I, E, K, side_rank=R, backend="reference", device=META)
    readable = r"^topk_ids: the reference plans its pool from the ids' values, and a meta"
    with pytest.raises(ValueError, match=readable):
        on_meta(x.float(), ids.to(META), weights.to(META))


def test_floats_beyond_range_are_named() -> None:
    ids, weights = routing()
    base = mm.prepare_base_weights(*base_tensors())
    with pytest.raises(ValueError, match=r"^activation_clamp: expected a positive finite"):
        mm.moe(bf16(T, H), ids, weights, base, activation_clamp=10**400)
    with pytest.raises(ValueError, match=r"^activation_clamp: expected a positive finite"):
        mm.MegaMoE(H, I, E, K, activation_clamp=10**400)
    # Finite as a Python float but not as the kernels' float32: refused before any work
    # (the CPU twins stopped midway on it, after the route plan and the gather).
    with pytest.raises(ValueError, match=r"^activation_clamp: expected a positive finite"):
        mm.moe(bf16(T, H), ids, weights, base, activation_clamp=3.5e38)
    with pytest.raises(ValueError, match=r"^activation_clamp: expected a positive finite"):
        mm.MegaMoE(H, I, E, K, activation_clamp=1e300)
    with pytest.raises(ValueError, match=r"^side\.scale: expected a finite float"):
        mm.SideLoRA(**side_tensors(), scale=10**400)


def test_activation_of_the_wrong_kind_is_a_type_error_everywhere() -> None:
    ids, weights = routing()
    base = mm.prepare_base_weights(*base_tensors())
    x = bf16(T, H)
    for call in (
        lambda: mm.moe(x, ids, weights, base, activation=None),
        lambda: mm.MegaMoE(H, I, E, K, activation=None),
        lambda: mm.reference.moe(x, ids, weights, base, activation=None),
    ):
        with pytest.raises(TypeError, match=r"^activation: expected a str, got NoneType"):
            call()


def test_a_gpu_other_than_hopper_is_named_before_any_launch(monkeypatch) -> None:
    """The kernels are sm_90a only: an A100 (or a Blackwell) gets a ValueError naming
    the base and the GPU, not the first launch's CUDA error. (The device is simulated:
    the check reads torch's answers for it.)"""
    from megamoe.validation import layer

    monkeypatch.setattr(layer, "_HOPPER_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    for capability in ((8, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        with pytest.raises(ValueError, match=r"^base: the fused kernels need an NVIDIA Hopper"):
            layer.check_hopper(torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    layer.check_hopper(torch.device("cuda", 1))
    assert 1 in layer._HOPPER_DEVICES  # asked once per device


def test_the_backward_op_refuses_a_block_m_its_plan_was_not_made_with():
    """The kernels find an expert's tiles as offset / BLOCK_M: a backward under another
    BLOCK_M than the forward planned with would multiply rows by the wrong expert's
    weights on the GPU (the CPU twins read the offsets and hid it). Named instead."""
    import megamoe as mm
    from megamoe.pipeline.fused_forward import moe_forward
    from megamoe.testing import make_layer

    layer = make_layer(64, 128, 4, 2, 16, num_tokens=42, seed=3)
    block_m = mm.get_block_m(42, 2, 4)
    _, state = moe_forward(
        layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side,
        block_m=block_m, save="preact",
    )  # fmt: skip
    plan, other = state.plan, 128 if block_m == 64 else 64
    with pytest.raises(ValueError, match=r"^block_m: expected the BLOCK_M the forward planned"):
        torch.ops.megamoe.moe_backward(
            torch.ones_like(layer.x), layer.x, layer.topk_weights, layer.base.w13,
            layer.base.w2, None, None, *layer.side.tensors(), layer.side.scale, "swiglu",
            None, plan.expert_counts, plan.expert_pool_offsets, plan.route_to_pool_row,
            plan.pool_row_to_route, state.preact, state.q13, state.p_sum, False, True, other,
        )  # fmt: skip


@pytest.mark.parametrize("scale", [1e39, -3.5e38])
def test_an_adapter_scale_must_be_finite_in_float32(scale):
    """The kernels take the scale as float32: 1e39 passed as a finite float, made the
    forward inf and was refused only in the backward's K-grouped GEMM."""
    import megamoe as mm
    from megamoe.testing import make_layer

    side = make_layer(64, 128, 4, 2, 16, num_tokens=5, seed=1).side
    with pytest.raises(ValueError, match=r"^side.scale: expected a float finite in float32"):
        mm.SideLoRA(*side.tensors(), scale=scale)
    with pytest.raises(ValueError, match=r"^side_scale: expected a float finite in float32"):
        mm.MegaMoE(64, 128, 4, 2, side_rank=16, side_scale=scale)
    # The transformers adapters too (attached, they failed only in the first forward).
    from megamoe.integrations.transformers import SideLoRAAdapter, attach_side_lora

    with pytest.raises(ValueError, match=r"^scale: expected a float finite in float32"):
        attach_side_lora(torch.nn.Module(), rank=16, scale=scale)
    with pytest.raises(ValueError, match=r"^scale \(alpha / rank\): expected a float finite"):
        attach_side_lora(torch.nn.Module(), rank=1, alpha=scale)
    with pytest.raises(ValueError, match=r"^scale: expected a float finite in float32"):
        SideLoRAAdapter(64, 128, 4, 16, scale=scale)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda mm: mm.prepare_base_weights(*_bf16_base(), format=None), TypeError, "format"),
        (lambda mm: mm.MegaMoE(64, 128, 4, 2, base_format=None), TypeError, "base_format"),
        (lambda mm: mm.MegaMoE(64, 128, 4, 2, backend=None), TypeError, "backend"),
        (lambda mm: mm.MegaMoE(64, 128, 4, 2, backend="Fused"), ValueError, "backend"),
    ],
)
def test_a_string_option_of_another_kind_is_a_type_error(call, error, message):
    """DESIGN §5: a wrong kind is a TypeError, a string outside the choices a ValueError
    (``format=None`` was a ValueError while ``activation=None`` was a TypeError)."""
    import megamoe as mm

    with pytest.raises(error, match=rf"^{message}: expected"):
        call(mm)


def _bf16_base() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(4, 256, 64, dtype=torch.bfloat16), torch.zeros(
        4, 64, 128, dtype=torch.bfloat16
    )


def test_a_clamp_that_is_zero_in_float32_is_refused() -> None:
    """1e-50 is positive in float64 and 0 in the kernels' float32, where it would zero
    every output (a review): refused by mm.moe and by MegaMoE; the smallest float32
    subnormal still passes."""
    ids, weights = routing()
    base = mm.prepare_base_weights(*base_tensors())
    expected = r"^activation_clamp: expected a value that stays positive in float32"
    with pytest.raises(ValueError, match=expected):
        mm.moe(bf16(T, H), ids, weights, base, activation_clamp=1e-50)
    with pytest.raises(ValueError, match=expected):
        mm.MegaMoE(H, I, E, K, activation_clamp=1e-50)
    assert mm.MegaMoE(H, I, E, K, activation_clamp=1.5e-45).activation_clamp == 1.5e-45
