"""dgrad2 with the activation backward as its epilogue (the engine's ActivationBackward
kind, :func:`~megamoe.wrappers.activation_backward.fused_dgrad2_activation_backward`) and
GEMM1's pre-activation store, each against an independent oracle (the fused backward
tests cover them end to end):

- GEMM1's ``preact`` is ``g | u``: per expert ``x @ w13[e].T`` (+ the side segment) in
  float64.
- The fused dgrad2 against a float64 oracle: ``z`` per expert in float64, rounded to
  BF16 as the kernel does, then the activation backward in float64; DESIGN §6 gates and
  an element-wise bound derived from the rounding points.
- The epilogue on the kernel's own ``z``: the Store MN-major kind over the same K steps
  gives that ``z`` bit for bit; the float32 reference on it bounds every element to the
  last ulps of the fast exp/reciprocal and one BF16 rounding.

The MXFP4 ``w2`` (decoded in the pipeline) is held bitwise to the BF16 kind in
tests/gpu/test_grouped_gemm_mxfp4.py.
"""

import math

import pytest
import torch

import megamoe as mm
from megamoe.testing import assert_close_to_oracle
from megamoe.testing.inputs import make_routing
from megamoe.wrappers.activation_backward import (
    activation_backward_reference,
    fused_dgrad2_activation_backward,
)
from megamoe.wrappers.grouped_gemm import gated_grouped_gemm, grouped_gemm, grouped_gemm_reference

pytestmark = pytest.mark.gpu

# BLOCK_M of the pool variants: every engine kind exists at both.
BLOCK_MS = [64, 128]
# One FP32 ulp relative to the magnitude of a term.
FP32_ULP = 2**-24
# The engine's K step: the side segment of dgrad2 is padded to whole steps.
K_STEP = 64


def make_case(tokens, top_k, experts, hidden, inter, rank, block_m, *, seed, kind="masked"):
    """Pool operands of dgrad2: ``(plan, weights, dout_pool [P, H + r], w2 [E, H, I],
    side_a2 [E, I, r] (a2 as given) or None, preact [P, 2I])``, all on the GPU. Every
    pool row holds values (padding rows too: the kernel must give them zeros whatever
    they hold)."""
    ids, weights = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    rows = plan.pool_capacity
    dout_pool = randn(rows, hidden + rank)
    w2 = randn(experts, hidden, inter, scale=hidden**-0.5)
    side_a2 = randn(experts, inter, rank, scale=0.5 * rank**-0.5) if rank else None
    preact = randn(rows, 2 * inter, scale=2.0)
    return plan, weights.cuda(), dout_pool, w2, side_a2, preact


def rows_used(plan):
    return int(plan.expert_pool_offsets[-1])


def stacked_b(w2, side_a2):
    """``[w2_e ; a2_e^T]`` ``[E, H + r, I]``: dgrad2's whole B, MN-major (``side_a2`` is
    ``a2`` as given ``[E, I, r]``)."""
    return w2 if side_a2 is None else torch.cat([w2, side_a2.transpose(1, 2)], dim=1)


def z_float64(dout_pool, w2, side_a2, plan):
    """``z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T]`` per expert in float64, and the
    same product of absolute values (the scale of the FP32 summation error)."""
    b = stacked_b(w2, side_a2).transpose(1, 2)  # [E, I, H + r], the reference's K-major b
    k = b.shape[2]
    z = grouped_gemm_reference(dout_pool, b, plan, k=k)
    z_abs = grouped_gemm_reference(dout_pool.abs(), b.abs(), plan, k=k)
    return z, z_abs


def engine_z(dout_pool, w2, side_a2, plan):
    """The fused kernel's ``z`` bit for bit, from the Store MN-major kind.

    Both kinds share the pool schedule, the A operand and the MN-major B operand; only
    the epilogue differs, and the side segment's major: the fused kernel reads ``a2`` as
    given, K-major, this GEMM a copy ``a2^T`` MN-major (the same wgmma products over the
    same K steps, only the shared-memory layout differs). The fused kernel runs the side
    K steps first (the ``a2`` segment, zero-filled past ``r`` to a whole 64-column step),
    scales that sum by 1 (exact), then the base steps: so does this GEMM over
    ``[side | 0 | dout]`` against ``[a2^T ; 0 ; w2]``, with the zeros in the places TMA
    zero-fills.
    """
    hidden = w2.shape[1]
    if side_a2 is None:
        return grouped_gemm(dout_pool, w2, plan, b_major="mn")
    rank = side_a2.shape[2]
    pad = -rank % K_STEP
    rows, experts, inter = dout_pool.shape[0], w2.shape[0], w2.shape[2]
    a = torch.cat(
        [
            dout_pool[:, hidden : hidden + rank],
            dout_pool.new_zeros(rows, pad),
            dout_pool[:, :hidden],
        ],
        dim=1,
    )
    b = torch.cat([side_a2.transpose(1, 2), w2.new_zeros(experts, pad, inter), w2], dim=1)
    return grouped_gemm(a, b, plan, b_major="mn")


def activation_float64(preact, z, weights, plan, activation, clamp):
    """The activation backward in float64 from BF16 ``z`` (DESIGN §1), with ``h`` rounded
    to BF16 where the contract rounds it, and the magnitudes of every result's terms.

    ``preact`` and ``z`` hold the first ``P`` pool rows. Returns dicts ``want`` and
    ``terms`` over ``dgu`` ``[P, 2I]`` (``dg | du``), ``weighted`` ``[P, I]`` and
    ``drouter`` ``[P]``, ``sens`` ``[P, 2I]`` (how much ``dg | du`` moves per unit of
    ``z``) and ``h`` ``[P, I]``. GeGLU's ``act = g (1 + t) / 2`` and
    ``act' = (1 + t) / 2 + tail`` cancel (large negative ``g``; ``act'`` near its zero at
    ``g ~ -0.75``), so an FP32 ulp of the kernel's tanh moves the result by ulps of the
    *terms*, not of the result: the bounds scale with these.
    """
    rows, inter = preact.shape[0], preact.shape[1] // 2
    g, u = preact.double().split(inter, dim=1)
    limit = math.inf if clamp is None else clamp
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    route = plan.pool_row_to_route[:rows].long()
    in_use = torch.arange(rows, device=route.device) < rows_used(plan)
    routed = (route >= 0) & in_use
    w = torch.where(routed, weights.reshape(-1).double()[route.clamp(min=0)], 0.0)[:, None]
    if activation == "swiglu":
        sig = torch.sigmoid(gc)
        act, derivative = gc * sig, sig * (1 + gc * (1 - sig))
        act_terms = (gc * sig).abs()
        derivative_terms = sig * (1 + gc.abs() * (1 - sig))
    else:
        k0, k1 = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(k0 * (gc + k1 * gc**3))
        tail = 0.5 * gc * (1 - t * t) * k0 * (1 + 3 * k1 * gc * gc)
        act, derivative = 0.5 * gc * (1 + t), 0.5 * (1 + t) + tail
        act_terms = 0.5 * gc.abs() * (1 + t.abs())
        derivative_terms = 0.5 * (1 + t.abs()) + tail.abs()
    h = (act * uc).to(torch.bfloat16).double()
    z = z.double()
    dh = w * z
    keep = routed[:, None]
    dg = torch.where(keep & (g <= limit), dh * uc * derivative, 0.0)
    du = torch.where(keep & (u >= -limit) & (u <= limit), dh * act, 0.0)
    want = dict(
        dgu=torch.cat([dg, du], dim=1),
        weighted=torch.where(keep, w * h, 0.0),
        drouter=torch.where(routed, (z * h).sum(dim=1), 0.0),
    )
    sens = torch.cat([w.abs() * uc.abs() * derivative_terms, w.abs() * act_terms], dim=1)
    terms = dict(
        dgu=sens * z.abs().repeat(1, 2),
        weighted=w.abs() * act_terms * uc.abs(),
        drouter=(z.abs() * h.abs()).sum(dim=1),
    )
    return want, terms, sens, h


def assert_within(name, got, want, bound):
    error = (got.double() - want.double()).abs()
    ok = error <= bound
    if not bool(ok.all()):
        worst = float((error / bound.clamp(min=1e-300)).max())
        where = torch.nonzero(~ok)[0].tolist()
        raise AssertionError(
            f"{name}: {int((~ok).sum())} elements past the bound, up to {worst:.2f}x "
            f"(first at {where}: got {float(got.double()[tuple(where)])}, "
            f"want {float(want.double()[tuple(where)])})"
        )


def assert_padding_is_zero(plan, dgu, weighted, drouter):
    """Padding rows (no route) below the rows in use: exact zeros whatever the inputs."""
    rows = rows_used(plan)
    padding = plan.pool_row_to_route[:rows] < 0
    assert torch.count_nonzero(dgu[:rows][padding]) == 0
    assert torch.count_nonzero(drouter[:rows][padding]) == 0
    if weighted is not None:
        assert torch.count_nonzero(weighted[:rows][padding]) == 0


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", None), ("swiglu", 1.0)])
@pytest.mark.parametrize("tokens,top_k,inter", [(1, 1, 64), (333, 6, 320), (2048, 2, 512)])
def test_fused_dgrad2_matches_the_float64_oracle(
    activation, clamp, tokens, top_k, inter, rank, block_m
):
    """I = 64: one partial 256-wide tile; 320: a whole tile and a tail; 512: two tiles
    (the router dot's partials summed over column blocks). r = 16: the side K step reads
    16 of its 64 columns."""
    hidden, experts = 256, 8
    kind = "masked" if tokens > 1 else "balanced"  # one masked route would leave no rows
    plan, weights, dout_pool, w2, side_a2, preact = make_case(
        tokens, top_k, experts, hidden, inter, rank, block_m, seed=tokens + rank, kind=kind
    )
    args = dict(activation=activation, activation_clamp=clamp)
    dgu, weighted, drouter = fused_dgrad2_activation_backward(
        dout_pool, w2, preact, weights, plan, side_a2=side_a2, **args
    )
    assert dgu.shape == preact.shape and weighted.shape == (plan.pool_capacity, inter)
    assert drouter.shape == (plan.pool_capacity,) and drouter.dtype == torch.float32
    z64, z_abs = z_float64(dout_pool, w2, side_a2, plan)
    rows = rows_used(plan)
    assert rows > 0
    want, terms, sens, h = activation_float64(
        preact[:rows], z64.to(torch.bfloat16), weights, plan, activation, clamp
    )
    # The kernel's z is its FP32 sum rounded to BF16: one BF16 ulp (<= 2^-7 relative)
    # from bf16(z64) where the two sums straddle a rounding boundary, plus the FP32
    # summation error (generously K * 2^-22 of the sum of |products|, which matters
    # where z cancels). dg, du and w h round once more (2^-8); h may flip one ulp.
    z_err = (hidden + rank) * 2**-22 * z_abs
    bounds = dict(
        dgu=2**-6 * want["dgu"].abs() + 64 * FP32_ULP * terms["dgu"] + sens * z_err.repeat(1, 2),
        weighted=2**-6 * want["weighted"].abs() + 64 * FP32_ULP * terms["weighted"],
        drouter=2**-6 * terms["drouter"] + (h.abs() * z_err).sum(dim=1) + 1e-6,
    )
    got = dict(dgu=dgu[:rows], weighted=weighted[:rows], drouter=drouter[:rows])
    for name in ("dgu", "weighted", "drouter"):
        assert_within(name, got[name], want[name], bounds[name])
        assert_close_to_oracle(name, got[name], want[name])
    assert_padding_is_zero(plan, dgu, weighted, drouter)


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("weighted_h", [True, False])
@pytest.mark.parametrize("act_case", ["swiglu", "geglu-clamp"])
@pytest.mark.parametrize("hidden,rank,inter", [(256, 16, 256), (512, 0, 384), (512, 64, 320)])
def test_epilogue_on_the_kernels_z_is_the_float32_reference(
    act_case, hidden, rank, inter, weighted_h, block_m
):
    """Given the kernel's own z (:func:`engine_z`), the epilogue is the float32
    reference up to one BF16 rounding of each result (2^-7 where a sum lands on a tie;
    2^-6 for w h, whose h may flip first) and 64 FP32 ulps of the terms (the fast
    exp/reciprocal against torch's); the router dot up to one ulp of each h and the
    FP32 summation order."""
    activation, clamp = ("swiglu", None) if act_case == "swiglu" else ("geglu", 1.0)
    plan, weights, dout_pool, w2, side_a2, preact = make_case(
        2048, 2, 8, hidden, inter, rank, block_m, seed=hidden + inter + rank
    )
    args = dict(activation=activation, activation_clamp=clamp, weighted_h=weighted_h)
    dgu, weighted, drouter = fused_dgrad2_activation_backward(
        dout_pool, w2, preact, weights, plan, side_a2=side_a2, **args
    )
    assert (weighted is None) == (not weighted_h)
    z = engine_z(dout_pool, w2, side_a2, plan)
    rows = rows_used(plan)
    z[rows:] = 0  # never written: give the reference defined values there
    want_dgu, want_weighted, want_router = activation_backward_reference(
        preact, z, weights, plan, activation=activation, activation_clamp=clamp
    )
    _, terms, _, _ = activation_float64(preact[:rows], z[:rows], weights, plan, activation, clamp)
    assert_within(
        "dgu",
        dgu[:rows],
        want_dgu[:rows],
        2**-7 * want_dgu[:rows].double().abs() + 64 * FP32_ULP * terms["dgu"],
    )
    if weighted_h:
        assert_within(
            "weighted",
            weighted[:rows],
            want_weighted[:rows],
            2**-6 * want_weighted[:rows].double().abs() + 64 * FP32_ULP * terms["weighted"],
        )
    assert_within(
        "drouter",
        drouter[:rows],
        want_router[:rows],
        (2**-7 + inter * 2**-22) * terms["drouter"] + 1e-6,
    )
    assert_close_to_oracle("drouter", drouter[:rows], want_router[:rows].double())
    assert_padding_is_zero(plan, dgu, weighted, drouter)


def test_fused_dgrad2_is_deterministic():
    plan, weights, dout_pool, w2, side_a2, preact = make_case(
        3000, 6, 16, 512, 512, 16, 128, seed=5, kind="skewed"
    )
    rows = rows_used(plan)  # rows past it are not written
    first = fused_dgrad2_activation_backward(dout_pool, w2, preact, weights, plan, side_a2=side_a2)
    for _ in range(3):
        again = fused_dgrad2_activation_backward(
            dout_pool, w2, preact, weights, plan, side_a2=side_a2
        )
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a[:rows], b[:rows])


@pytest.mark.parametrize("w2_format", ["bf16", "mxfp4"])
def test_dg_du_written_over_the_pre_activations_are_bitwise_the_fresh_buffer(w2_format):
    """dgrad_out=preact (the layer's backward reuses the saved buffer): each element is
    read before it is written, so the in-place result is the out-of-place one."""
    plan, weights, dout_pool, w2, side_a2, preact = make_case(
        3000, 6, 16, 512, 512, 16, 128, seed=7, kind="skewed"
    )
    args = {}
    if w2_format == "mxfp4":
        w2, scales = mm.quantize_mxfp4(w2, axis=-1)  # [E, H, I]: quantized along I
        args["w2_scales"] = scales
    rows = rows_used(plan)
    fresh = fused_dgrad2_activation_backward(
        dout_pool, w2, preact, weights, plan, side_a2=side_a2, **args
    )
    buffer = preact.clone()
    in_place = fused_dgrad2_activation_backward(
        dout_pool, w2, buffer, weights, plan, side_a2=side_a2, dgrad_out=buffer, **args
    )
    assert in_place[0].data_ptr() == buffer.data_ptr()
    for a, b in zip(fresh, in_place, strict=True):
        assert torch.equal(a[:rows], b[:rows])


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("inter", [256, 320])
def test_gemm1_stores_the_pre_activations(block_m, rank, inter):
    """``preact`` is ``g | u``: columns ``0..I-1`` from ``w13``'s gate rows, ``I..2I-1``
    from its up rows (+ ``s q1 b1`` / ``s q3 b3``, ``b1``/``b3`` as given ``[E, r, I]``),
    each the BF16 rounding of the float64 value. I = 320: a gated tile (128 gate + 128 up
    rows) with a tail."""
    tokens, top_k, experts, hidden = 600, 2, 8, 256
    ids, _ = make_routing(tokens, experts, top_k, seed=1)
    plan = mm.plan_routes(ids.cuda(), experts, block_m)
    gen = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(plan.pool_capacity, hidden + 2 * rank, device="cuda", generator=gen)
    a = a.bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 16).bfloat16()
    side = {}
    if rank:
        b_gate = (torch.randn(experts, rank, inter, device="cuda", generator=gen) / 4).bfloat16()
        b_up = (torch.randn(experts, rank, inter, device="cuda", generator=gen) / 4).bfloat16()
        side = dict(side_b_gate=b_gate, side_b_up=b_up, side_scale=0.5)
    preact = torch.empty(plan.pool_capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
    gated_grouped_gemm(a, w13, plan, k=hidden, preact_out=preact, **side)
    offsets = plan.expert_pool_offsets.tolist()
    checked = 0
    for e in range(experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        x = a[lo:hi, :hidden].double()
        gate = x @ w13[e, :inter].double().T
        up = x @ w13[e, inter:].double().T
        if rank:
            q1, q3 = a[lo:hi, hidden : hidden + rank], a[lo:hi, hidden + rank :]
            gate += 0.5 * (q1.double() @ b_gate[e].double())
            up += 0.5 * (q3.double() @ b_up[e].double())
        want = torch.cat([gate, up], dim=1)
        got = preact[lo:hi].double()
        # One BF16 rounding of the FP32 sum (2^-8, doubled where it lands on the other
        # side of a tie than the float64 value's) plus that sum's error.
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3), e
        # Almost all are the float64 value rounded to nearest (truncation would match
        # about half): the FP32 sum straddles a rounding boundary only rarely.
        exact = (got == want.to(torch.bfloat16).double()).double().mean()
        assert exact > 0.95, (e, float(exact))
        checked += 1
    assert checked > 0
