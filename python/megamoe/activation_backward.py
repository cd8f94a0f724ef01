"""The gated-activation backward over the expert pool (kernels/activation_backward.cuh).

Between dgrad2 (``z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T]``) and dgrad1,
one memory-bound pass per pool row (weight ``w`` of its route) computes, for every
column ``i < I`` (DESIGN §1):

- ``z``: the unweighted ``dL/dh`` (adapter term included);
- ``h = bf16(act(gc) * uc)`` from the saved pre-activations (bitwise the forward's);
- ``dg = bf16(w z uc act'(gc))``, ``du = bf16(w z act(gc))``, zero where the clamp cut;
- ``drouter[row] = sum_i z_i h_i`` (the router gradient ``<z, h>``, FP32);
- ``weighted_h = bf16(w h)``, which the ``a2`` and ``w2`` weight gradients contract over.

``preact`` and ``dgrad_preact`` use ``w13``'s gate/up interleave (64 gate columns, then
the matching 64 up columns), so ``dgrad_preact`` feeds dgrad1 against ``w13`` as is.
Padding rows below the rows in use get zeros; rows at or past them are not written.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _native
from ._checks import check_choice, check_tensor
from .grouped_gemm import ACTIVATIONS, _dequantized, _device_sms, _mxfp4_operand, grouped_gemm
from .heuristics import get_block_n
from .registry import registry
from .routing import RoutePlan

__all__ = [
    "activation_backward",
    "activation_backward_reference",
    "fused_dgrad2_activation_backward",
]


def _check(
    preact: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    activation: str,
) -> tuple[int, int]:
    check_choice("activation", activation, tuple(ACTIVATIONS))
    capacity = plan.pool_capacity
    check_tensor(
        "preact", preact, shape=(capacity, None), dtypes=(torch.bfloat16,), contiguous=True
    )
    two_i = preact.shape[1]
    interleave = registry().gate_up_interleave
    if two_i == 0 or two_i % (2 * interleave) != 0:
        raise ValueError(
            f"preact: expected 2I columns with I a multiple of {interleave}, got {two_i}"
        )
    intermediate = two_i // 2
    device = preact.device
    check_tensor(
        "z",
        z,
        shape=(capacity, intermediate),
        dtypes=(torch.bfloat16,),
        device=device,
        contiguous=True,
    )
    check_tensor(
        "topk_weights",
        topk_weights,
        shape=tuple(plan.route_to_pool_row.shape),
        dtypes=(torch.float32,),
        device=device,
        contiguous=True,
    )
    return capacity, intermediate


def activation_backward(
    preact: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    weighted_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Activation backward + router-gradient dot over the pool (module docstring).

    Args:
        preact: ``[pool_capacity, 2I]`` BF16 pre-activations from the forward's GEMM1.
        z: ``[pool_capacity, I]`` BF16 dgrad2 output ``[dout | s dout b2^T]_pool @
            [w2_e ; a2_e^T]``.
        topk_weights: ``[T, K]`` float32 router weights.
        plan: the forward's route plan.
        activation, activation_clamp: as in the forward.
        weighted_h: also return ``bf16(w h)``.

    Returns:
        ``(dgrad_preact [pool_capacity, 2I] BF16, weighted_h [pool_capacity, I] BF16 or
        None, drouter [pool_capacity] float32)``.
    """
    capacity, intermediate = _check(preact, z, topk_weights, plan, activation)
    if not preact.is_cuda:
        return activation_backward_reference(
            preact,
            z,
            topk_weights,
            plan,
            activation=activation,
            activation_clamp=activation_clamp,
            weighted_h=weighted_h,
        )
    device = preact.device
    dgrad_preact = torch.empty_like(preact)
    weighted = (
        torch.empty(capacity, intermediate, dtype=torch.bfloat16, device=device)
        if weighted_h
        else None
    )
    # Zeros, not empty: rows past the rows in use are never written, and callers index
    # row 0 for routes without a row (masked by a where), which must read initialized
    # memory even when no row is in use (compute-sanitizer initcheck).
    drouter = torch.zeros(capacity, dtype=torch.float32, device=device)
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    dl = _native.dlpack
    with torch.cuda.device(device):
        _native.native().activation_backward(
            dl(preact),
            dl(z),
            dl(topk_weights.view(-1)),
            dl(plan.pool_row_to_route),
            dl(plan.expert_pool_offsets),
            ACTIVATIONS[activation],
            clamp,
            dl(dgrad_preact),
            None if weighted is None else dl(weighted),
            dl(drouter),
            _native.current_stream(device),
        )
    return dgrad_preact, weighted, drouter


def _split_interleave(t: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, two_i = t.shape
    blocks = t.view(rows, two_i // (2 * interleave), 2, interleave)
    return blocks[:, :, 0].reshape(rows, two_i // 2), blocks[:, :, 1].reshape(rows, two_i // 2)


def _join_interleave(gate: torch.Tensor, up: torch.Tensor, interleave: int) -> torch.Tensor:
    rows, intermediate = gate.shape
    blocks = intermediate // interleave
    return torch.stack(
        [gate.view(rows, blocks, interleave), up.view(rows, blocks, interleave)], dim=2
    ).reshape(rows, 2 * intermediate)


def activation_backward_reference(
    preact: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    weighted_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The same math in torch float32 (rows past the rows in use are zero here).

    The dot product's summation order differs from the kernel's, so ``drouter`` agrees
    to float32 rounding, the BF16 outputs to one BF16 ulp where a sum lands on a tie.
    """
    capacity, _ = _check(preact, z, topk_weights, plan, activation)
    interleave = registry().gate_up_interleave
    rows_used = int(plan.expert_pool_offsets[-1])
    route = plan.pool_row_to_route.long()
    routed = (route >= 0) & (torch.arange(capacity, device=preact.device) < rows_used)
    weights = torch.where(
        routed, topk_weights.reshape(-1)[route.clamp(min=0)], torch.zeros((), device=route.device)
    )[:, None]
    g, u = (t.float() for t in _split_interleave(preact, interleave))
    z = z.float()
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    gc, uc = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    if activation == "swiglu":
        sig = torch.sigmoid(gc)
        act = F.silu(gc)
        derivative = sig * (1.0 + gc * (1.0 - sig))
    else:
        k0, k1 = math.sqrt(2.0 / math.pi), 0.044715
        t = torch.tanh(k0 * (gc + k1 * gc**3))
        act = 0.5 * gc * (1.0 + t)
        sech2 = 1.0 - t * t
        tail = torch.where(sech2 == 0, 0.0, 0.5 * gc * sech2 * k0 * (1.0 + 3.0 * k1 * gc * gc))
        derivative = 0.5 * (1.0 + t) + tail
    h = (act * uc).bfloat16().float()
    dh = weights * z
    dg = torch.where(g <= clamp, dh * uc * derivative, 0.0)
    du = torch.where((u >= -clamp) & (u <= clamp), dh * act, 0.0)
    keep = routed[:, None]
    dgrad_preact = _join_interleave(
        torch.where(keep, dg, 0.0).bfloat16(), torch.where(keep, du, 0.0).bfloat16(), interleave
    )
    drouter = torch.where(routed, (z * h).sum(dim=1), 0.0)
    weighted = torch.where(keep, weights * h, 0.0).bfloat16() if weighted_h else None
    return dgrad_preact, weighted, drouter


def fused_dgrad2_activation_backward(
    dout_pool: torch.Tensor,
    w2: torch.Tensor,
    preact: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    weighted_h: bool = True,
    w2_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """dgrad2 with the activation backward as its epilogue (the engine's
    ActivationBackward variants): ``z = dout_pool @ w2[e]`` is consumed in registers.

    Args:
        dout_pool: ``[pool_capacity, >= K]`` BF16 ``[dout | s dout b2^T]`` pool.
        w2: ``[E, K, I]`` BF16 as stored (``w2``, or ``[w2 ; a2^T]``), read MN-major;
            or with ``w2_scales`` the MXFP4 codes ``[E, K, I/2]`` of ``w2``, scales
            ``[E, K, I/32]``, decoded in the engine.
        preact, topk_weights, plan, activation, activation_clamp, weighted_h: as in
            :func:`activation_backward` (BLOCK_M 128 pools: the variants that exist).

    Returns:
        ``(dgrad_preact, weighted_h or None, drouter)`` like :func:`activation_backward`;
        ``drouter`` is the in-order sum of the per-tile partials. On CPU: the store GEMM's
        twin followed by :func:`activation_backward_reference`.
    """
    check_choice("activation", activation, tuple(ACTIVATIONS))
    engine_scales = None
    if w2_scales is not None:
        _, engine_scales = _mxfp4_operand("w2", w2, w2_scales, preact.device, "mn")
        if not preact.is_cuda:
            w2 = _dequantized(w2, w2_scales)
    else:
        check_tensor("w2", w2, ndim=3, dtypes=(torch.bfloat16,), device=preact.device)
    capacity = plan.pool_capacity
    intermediate = w2.shape[2] * (2 if w2.dtype == torch.uint8 else 1)
    check_tensor(
        "dout_pool",
        dout_pool,
        shape=(capacity, None),
        dtypes=(torch.bfloat16,),
        device=preact.device,
        contiguous=True,
    )
    check_tensor(
        "preact",
        preact,
        shape=(capacity, 2 * intermediate),
        dtypes=(torch.bfloat16,),
        contiguous=True,
    )
    check_tensor(
        "topk_weights",
        topk_weights,
        shape=tuple(plan.route_to_pool_row.shape),
        dtypes=(torch.float32,),
        device=preact.device,
        contiguous=True,
    )
    if not preact.is_cuda:
        z = grouped_gemm(dout_pool, w2, plan, b_major="mn")
        return activation_backward_reference(
            preact,
            z,
            topk_weights,
            plan,
            activation=activation,
            activation_clamp=activation_clamp,
            weighted_h=weighted_h,
        )
    if plan.block_m != 128:
        raise ValueError(f"plan.block_m: the fused dgrad2 needs BLOCK_M 128, got {plan.block_m}")
    block_n = get_block_n(plan.block_m, intermediate)
    n_blocks = -(-intermediate // block_n)
    device = preact.device
    dgrad_preact = torch.empty_like(preact)
    weighted = (
        torch.empty(capacity, intermediate, dtype=torch.bfloat16, device=device)
        if weighted_h
        else None
    )
    partials = torch.zeros(capacity, n_blocks, dtype=torch.float32, device=device)
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    dl = _native.dlpack
    with torch.cuda.device(device):
        _native.native().grouped_gemm_activation_backward(
            dl(dout_pool),
            dl(w2.contiguous()),
            dl(plan.expert_pool_offsets),
            dl(preact),
            dl(topk_weights.reshape(-1)),
            dl(plan.pool_row_to_route),
            dl(dgrad_preact),
            None if weighted is None else dl(weighted),
            dl(partials),
            plan.block_m,
            block_n,
            ACTIVATIONS[activation],
            clamp,
            None if engine_scales is None else dl(engine_scales),
            _device_sms(device),
            _native.current_stream(device),
        )
    drouter = partials[:, 0].clone()
    for n_block in range(1, n_blocks):  # the tiles' partials, in order
        drouter += partials[:, n_block]
    return dgrad_preact, weighted, drouter
