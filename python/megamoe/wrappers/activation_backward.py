"""dgrad2 with the gated-activation backward as its epilogue (the engine's
ActivationBackward kind, kernels/engine/epilogue_activation_backward.cuh; with an MXFP4
``w2`` and few rows per expert the weight-streaming kernel's, which gives the same bits).

``z = [dout | s dout b2^T]_pool @ [w2_e ; a2_e^T]`` (the unweighted ``dL/dh``, adapter
term included: ``a2^T`` is a K side segment over the pool's ``s dout b2^T`` columns) is
consumed where it is computed; per pool row (weight ``w`` of its route) and column
``i < I`` the epilogue forms (DESIGN §1):

- ``h = bf16(act(gc) * uc)`` from the saved pre-activations (bitwise the forward's);
- ``dg = bf16(w z uc act'(gc))``, ``du = bf16(w z act(gc))``, zero where the clamp cut;
- the router gradient ``<z, h>`` (FP32 per tile; the tiles' partials summed by one
  deterministic reduction);
- ``weighted_h = bf16(w h)``, which the ``a2`` and ``w2`` weight gradients contract over.

``preact`` and ``dgrad_preact`` are ``g | u`` (``w13``'s gate rows, then up rows), so
``dgrad_preact`` feeds dgrad1 against ``w13`` as stored. Padding rows below the rows in
use get zeros; rows at or past them are not written. ``z`` never reaches memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..validation.arguments import check_str_choice, check_tensor
from . import _native
from .grouped_gemm import (
    ACTIVATIONS,
    GROUP_M,
    StreamsPredicate,
    _check_mxfp4,
    _check_pool_operand,
    _check_tma_aligned,
    _device_sms,
    _mxfp4_operand,
    _stream_chunk,
    grouped_gemm,
    mxfp4_b_unchecked,
)
from .routing import RoutePlan

__all__ = [
    "activation_backward_reference",
    "fused_dgrad2_activation_backward",
    "fused_dgrad2_activation_backward_unchecked",
]

#: The engine's tile width: the router dot's partials come one per 256 columns of I.
BLOCK_N = 256


def _dgrad2_streams(plan: RoutePlan) -> StreamsPredicate:
    """``StreamsPredicate`` of dgrad2 over ``plan`` (``w2`` codes as stored, ``[E, H,
    I/2]``). The launch also asks 8-byte aligned epilogue operands, not known here: with
    unaligned ones the engine's in-pipeline decode runs up to the streaming limit."""
    return lambda codes, scales: (
        _stream_chunk("ActivationBackward", 2 * codes.shape[2], scales, plan, codes.shape[0])
        is not None
    )


def _check(
    preact: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    activation: str,
) -> tuple[int, int]:
    check_str_choice("activation", activation, tuple(ACTIVATIONS))
    capacity = plan.pool_capacity
    check_tensor(
        "preact", preact, shape=(capacity, None), dtypes=(torch.bfloat16,), contiguous=True
    )
    two_i = preact.shape[1]
    if two_i == 0 or two_i % 128 != 0:
        raise ValueError(f"preact: expected 2I columns with I a multiple of 64, got {two_i}")
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


def _check_same_or_apart(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``t`` is ``other``'s memory exactly or shares none of it (a partial overlap would
    let one thread's write land on another's unread input)."""
    if t.data_ptr() == other.data_ptr() or t.numel() == 0 or other.numel() == 0:
        return
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    other_begin = other.data_ptr()
    other_end = other_begin + other.numel() * other.element_size()
    if begin < other_end and other_begin < end:
        raise ValueError(
            f"{name}: expected {other_name} itself or memory apart from it, got a partial overlap"
        )


def fused_dgrad2_activation_backward(
    dout_pool: torch.Tensor,
    w2: torch.Tensor,
    preact: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    *,
    side_a2: torch.Tensor | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    weighted_h: bool = True,
    w2_scales: torch.Tensor | None = None,
    dgrad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """dgrad2 + activation backward + router-gradient dot over the pool (module docstring).

    Args:
        dout_pool: ``[pool_capacity, >= H (+ r)]`` BF16 ``[dout | s dout b2^T]`` pool.
        w2: ``[E, H, I]`` BF16 as stored, read MN-major; or with ``w2_scales`` the MXFP4
            codes ``[E, H, I/2]``, scales ``[E, H, I/32]``, decoded in the pipeline.
        preact: ``[pool_capacity, 2I]`` BF16 ``g | u`` from the forward's GEMM1.
        topk_weights: ``[T, K]`` float32 router weights (the weights of the plan's routes).
        plan: the forward's route plan.
        side_a2: ``[E, I, r]`` BF16 ``a2`` as given (read K-major): the adapter term
            over the pool's columns ``H .. H + r`` (None: no adapter).
        activation, activation_clamp: as in the forward.
        weighted_h: also return ``bf16(w h)``.
        dgrad_out: optional ``[pool_capacity, 2I]`` BF16 buffer for ``dg | du``; it may be
            ``preact`` itself (each element is read, then written, by one thread and
            never read again), which saves a pool-sized buffer when ``preact`` has no
            other reader.

    Returns:
        ``(dgrad_preact [pool_capacity, 2I] BF16 dg | du, weighted_h [pool_capacity, I]
        BF16 or None, drouter [pool_capacity] float32)``. On CPU: the store GEMM's twin
        followed by :func:`activation_backward_reference`.
    """
    from ..validation.layer import check_activation  # (validation imports the wrappers)

    check_activation(activation, activation_clamp)
    if not isinstance(weighted_h, bool):
        raise TypeError(f"weighted_h: expected a bool, got {type(weighted_h).__name__}")
    check_tensor("preact", preact, ndim=2, dtypes=(torch.bfloat16,))
    device = preact.device
    mxfp4 = w2_scales is not None
    if mxfp4:  # decoded (where it is: a launch) only once every check has passed
        _check_mxfp4("w2", w2, w2_scales, device, "mn")
    else:
        check_tensor("w2", w2, ndim=3, dtypes=(torch.bfloat16,), device=device, contiguous=True)
    experts, hidden = w2.shape[0], w2.shape[1]
    intermediate = w2.shape[2] * (2 if mxfp4 else 1)
    if hidden % 64 or intermediate % 64:  # the kernels' K step and column tiles
        raise ValueError(f"w2: expected H and I multiples of 64, got H={hidden}, I={intermediate}")
    check_tensor(
        "dout_pool", dout_pool, ndim=2, dtypes=(torch.bfloat16,), device=device, contiguous=True
    )
    _check_pool_operand(dout_pool, plan, "dout_pool", weights=("w2", w2))
    capacity = plan.pool_capacity
    rank = 0
    if side_a2 is not None:
        check_tensor(
            "side_a2", side_a2, shape=(experts, intermediate, None), dtypes=(torch.bfloat16,),
            device=device, contiguous=True,
        )  # fmt: skip
        rank = side_a2.shape[2]
        if rank < 8 or rank % 8 != 0:  # 16-byte rows for TMA
            raise ValueError(f"side_a2: expected r a multiple of 8, got r={rank}")
    if dout_pool.shape[1] < hidden + rank:
        raise ValueError(
            f"dout_pool: expected at least H + r = {hidden + rank} columns, "
            f"got {dout_pool.shape[1]}"
        )
    _check_tma_aligned(("w2", w2), ("side_a2", side_a2))
    check_tensor(
        "preact", preact, shape=(capacity, 2 * intermediate), dtypes=(torch.bfloat16,),
        contiguous=True, alignment=16,  # the epilogue's 16-byte vectors
    )  # fmt: skip
    check_tensor(
        "topk_weights", topk_weights, shape=tuple(plan.route_to_pool_row.shape),
        dtypes=(torch.float32,), device=device, contiguous=True,
    )  # fmt: skip
    if dgrad_out is not None:
        check_tensor(
            "dgrad_out", dgrad_out, shape=tuple(preact.shape), dtypes=(torch.bfloat16,),
            device=device, contiguous=True, alignment=16,
        )  # fmt: skip
        _check_same_or_apart("dgrad_out", dgrad_out, "preact", preact)
    decode_scales = None
    if mxfp4:
        w2, decode_scales = _mxfp4_operand(w2, w2_scales, plan, "mn", _dgrad2_streams(plan))
    if not preact.is_cuda:
        b = w2 if side_a2 is None else torch.cat([w2, side_a2.transpose(1, 2)], dim=1)
        z = grouped_gemm(dout_pool, b, plan, b_major="mn")
        dgrad, weighted, drouter = activation_backward_reference(
            preact,
            z,
            topk_weights,
            plan,
            activation=activation,
            activation_clamp=activation_clamp,
            weighted_h=weighted_h,
        )
        if dgrad_out is not None:
            dgrad = dgrad_out.copy_(dgrad)
        return dgrad, weighted, drouter
    return _launch(
        dout_pool, w2, decode_scales, preact, topk_weights, plan, side_a2, activation,
        activation_clamp, weighted_h, dgrad_out, hidden, intermediate, experts,
    )  # fmt: skip


def fused_dgrad2_activation_backward_unchecked(
    dout_pool: torch.Tensor,
    w2: torch.Tensor,
    preact: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    *,
    side_a2: torch.Tensor | None,
    activation: str,
    activation_clamp: float | None,
    weighted_h: bool,
    w2_scales: torch.Tensor | None,
    dgrad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`fused_dgrad2_activation_backward` for the fused backward, whose operands are
    made from inputs already checked: no argument checks in Python (host time a
    small-token step pays per check); the native launchers still check dtypes, shapes,
    strides, alignment and devices."""
    if not preact.is_cuda:
        return fused_dgrad2_activation_backward(
            dout_pool, w2, preact, topk_weights, plan, side_a2=side_a2, activation=activation,
            activation_clamp=activation_clamp, weighted_h=weighted_h, w2_scales=w2_scales,
            dgrad_out=dgrad_out,
        )  # fmt: skip
    decode_scales = None
    if w2_scales is not None:
        _, w2, decode_scales = mxfp4_b_unchecked(
            w2, w2_scales, plan, "mn", streams=_dgrad2_streams(plan)
        )
    experts, hidden = w2.shape[0], w2.shape[1]
    intermediate = w2.shape[2] * (2 if decode_scales is not None else 1)
    return _launch(
        dout_pool, w2, decode_scales, preact, topk_weights, plan, side_a2, activation,
        activation_clamp, weighted_h, dgrad_out, hidden, intermediate, experts,
    )  # fmt: skip


def streaming_a2_fits(experts: int, intermediate: int, side_a2: torch.Tensor | None) -> bool:
    """Whether the streaming dgrad2 may take an adapter's ``a2``: it forms the TMA row of
    ``a2`` viewed as ``[E * I, r]`` in int32, which past ``E * I = 2^31`` goes negative and
    reads zeros (the adapter term lost for the high experts). Larger shapes run the
    engine, whose ``a2`` map keeps the expert as its own dimension (the same bits)."""
    return side_a2 is None or experts * intermediate <= 2**31 - 1


def _launch(
    dout_pool: torch.Tensor,
    w2: torch.Tensor,
    decode_scales: torch.Tensor | None,
    preact: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutePlan,
    side_a2: torch.Tensor | None,
    activation: str,
    activation_clamp: float | None,
    weighted_h: bool,
    dgrad_out: torch.Tensor | None,
    hidden: int,
    intermediate: int,
    experts: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The CUDA launch of :func:`fused_dgrad2_activation_backward`: the streaming kernel
    where it takes the shape, else the engine; then the partials' reduction."""
    device, capacity = preact.device, plan.pool_capacity
    n_blocks = -(-intermediate // BLOCK_N)
    dgrad_preact = torch.empty_like(preact) if dgrad_out is None else dgrad_out
    weighted = (
        torch.empty(capacity, intermediate, dtype=torch.bfloat16, device=device)
        if weighted_h
        else None
    )
    # Zeros, not empty: rows past the rows in use are never written, and callers index
    # row 0 for routes without a row (masked by a where), which must read initialized
    # memory even when no row is in use (compute-sanitizer initcheck).
    partials = torch.zeros(capacity, n_blocks, dtype=torch.float32, device=device)
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    # Each pool row's route weight, gathered here so that the epilogue loads it beside
    # the row's route instead of after it. Padding rows (route -1) read the last route's
    # weight, which the epilogue never uses (they give zeros); one index launch.
    flat_weights = topk_weights.reshape(-1)
    if flat_weights.numel() > 0:
        row_weights = flat_weights[plan.pool_row_to_route]
    else:  # no routes: every row is padding
        row_weights = flat_weights.new_zeros(plan.pool_capacity)
    dl = _native.dlpack
    # An MXFP4 w2 decoded in the pipeline streams (the weights as stored, decoded
    # transposed into the wgmma's A registers) wherever the kernel takes the shape.
    chunk = None
    if (
        decode_scales is not None
        and streaming_a2_fits(experts, intermediate, side_a2)
        and all(
            t.data_ptr() % 8 == 0
            for t in (preact, dgrad_preact, *(() if weighted is None else (weighted,)))
        )
    ):
        chunk = _stream_chunk("ActivationBackward", intermediate, decode_scales, plan, experts)
    # The epilogue's operands, in the order both launchers take them.
    epilogue = (
        dl(preact),
        dl(row_weights),
        flat_weights.numel(),
        dl(plan.pool_row_to_route),
        dl(dgrad_preact),
        None if weighted is None else dl(weighted),
        dl(partials),
        ACTIVATIONS[activation],
        clamp,
        plan.block_m,
    )
    side = None if side_a2 is None else dl(side_a2)
    native = _native.native()
    with _native.on_device(device):
        sms, stream = _device_sms(device), _native.current_stream(device)
        if chunk is not None:
            native.weight_stream_activation_backward(
                dl(dout_pool), dl(w2), dl(decode_scales), side, dl(plan.expert_pool_offsets),
                dl(plan.expert_counts), *epilogue, chunk, sms, stream,
            )  # fmt: skip
        else:
            native.engine_activation_backward(
                dl(dout_pool), hidden, dl(w2),
                None if decode_scales is None else dl(decode_scales), side,
                dl(plan.expert_pool_offsets), *epilogue, GROUP_M, sms, stream,
            )  # fmt: skip
    # One deterministic reduction over the tiles' partials (a fixed order for a shape).
    return dgrad_preact, weighted, partials.sum(dim=1)


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
    capacity, intermediate = _check(preact, z, topk_weights, plan, activation)
    rows_used = int(plan.expert_pool_offsets[-1])
    route = plan.pool_row_to_route.long()
    routed = (route >= 0) & (torch.arange(capacity, device=preact.device) < rows_used)
    weights = torch.where(
        routed, topk_weights.reshape(-1)[route.clamp(min=0)], torch.zeros((), device=route.device)
    )[:, None]
    g, u = preact.float().split(intermediate, dim=1)
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
    dgrad_preact = torch.cat(
        [torch.where(keep, dg, 0.0).bfloat16(), torch.where(keep, du, 0.0).bfloat16()], dim=1
    )
    drouter = torch.where(routed, (z * h).sum(dim=1), 0.0)
    weighted = torch.where(keep, weights * h, 0.0).bfloat16() if weighted_h else None
    return dgrad_preact, weighted, drouter
