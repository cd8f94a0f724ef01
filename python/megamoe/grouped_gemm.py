"""The grouped GEMM engine over the expert pool (kernels/grouped_gemm.cuh).

Two entry points, both on torch's current stream with no host synchronisation:

- :func:`grouped_gemm` (Store epilogue): ``out[rows of e] = a[rows of e, :k] @ b[e]^T``
  plus optional extra output columns from ``b_extra`` (the N segment GEMM2 uses for
  the ``a2`` shrink).
- :func:`gated_grouped_gemm` (GatedActivation epilogue): GEMM1 with the gate/up
  interleave of :func:`~megamoe.weights.prepare_base_weights`, the optional side K
  segment (``s * (q1 b1 | q3 b3)``), and ``h = act(g) * u`` written as BF16.

The torch references (:func:`grouped_gemm_reference`, :func:`gated_grouped_gemm_reference`)
compute the same math per expert in float64 for tests. On CPU tensors both entry
points run a torch twin (float32 per expert, the kernel's rounding points, host reads
of the offsets) so that the layer pipelines built on them (EP included) can be tested
without a GPU; ``mm.moe`` itself requires CUDA.
"""

from __future__ import annotations

import math

import torch

from . import _native
from ._checks import check_choice, check_tensor
from .env import num_sms as resolve_device_sms
from .registry import registry
from .routing import RoutePlan

ACTIVATIONS = {"swiglu": 0, "geglu": 1}
# The callers' default; the fused layer picks per GEMM with heuristics.get_block_n.
DEFAULT_BLOCK_N = 128


def _check_pool_operand(a: torch.Tensor, plan: RoutePlan) -> None:
    """The pool operand must hold exactly the plan's pool rows: the kernel walks the
    rows the plan says are in use."""
    if a.shape[0] != plan.pool_capacity:
        raise ValueError(
            f"a: expected plan.pool_capacity = {plan.pool_capacity} rows, got {a.shape[0]}"
        )


def _device_sms(device: torch.device) -> int:
    return resolve_device_sms(device.index if device.index is not None else None)


def _mxfp4_operand(
    name: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    b_major: str = "k",
) -> tuple[int, torch.Tensor]:
    """Check an MXFP4 B and return its ``K`` and its scales in the engine's layout.

    K-major (``b_major="k"``): ``codes`` ``[E, N, K/2]``, ``scales`` ``[E, N, K/32]``
    (uint8, quantized along K, K a multiple of 64); engine scales ``[E, K/64, N]`` int16:
    the two scale bytes of a 64-column K block side by side, a block's rows contiguous.
    MN-major (``"mn"``, the dgrads reading the weights as stored): ``codes``
    ``[E, K, N/2]``, ``scales`` ``[E, K, N/32]`` (quantized along N); engine scales
    ``[E, N/32, K]`` uint8. Either way one TMA box per K step loads them; the transposed
    copy (1/16 of the codes' bytes) is made per call.
    """
    check_tensor(name, codes, ndim=3, dtypes=(torch.uint8,), device=device, contiguous=True)
    experts, rows, half_cols = codes.shape
    k, n = (rows, 2 * half_cols) if b_major == "mn" else (2 * half_cols, rows)
    if k % 64 != 0:
        raise ValueError(f"{name}: an MXFP4 B needs K a multiple of 64, got K={k}")
    if b_major == "mn" and n % 32 != 0:
        raise ValueError(f"{name}: an MN-major MXFP4 B needs N a multiple of 32, got N={n}")
    check_tensor(
        f"{name}_scales",
        scales,
        shape=(experts, rows, 2 * half_cols // 32),
        dtypes=(torch.uint8,),
        device=device,
        contiguous=True,
    )
    if b_major == "mn":
        return k, scales.transpose(1, 2).contiguous()
    return k, scales.view(torch.int16).transpose(1, 2).contiguous()


def block_diagonal_side_weights(
    side_b_gate: torch.Tensor, side_b_up: torch.Tensor, interleave: int
) -> torch.Tensor:
    """``[E, 2I, 2r]`` BF16: the side weights as one K segment over the pool's
    ``[q1 | q3]`` columns, in ``w13``'s gate/up row interleave: a gate row ``i`` holds
    ``[b1^T[i] | 0]``, an up row ``[0 | b3^T[i]]``.

    GEMM1 then runs the side segment as ordinary full-width K steps (the kernel has a
    single MMA path; the zero halves cost 2r/H more MMA work, 6% at r=128, H=4096).
    Built per call from ``side_b_gate``/``side_b_up`` (``[E, I, r]``; trainable adapters
    change every step): 4r bytes per row of ``w13``. The backward's ``b1``/``b3`` shrinks
    ``(dg | du) @ this`` use the same matrix. With finite ``q1``/``q3`` the zero
    halves add exact zeros; a non-finite ``q3`` (``q1``) also makes the gate (up) sums
    NaN (0 x Inf), where the CPU twin's separate sums would not.
    """
    experts, intermediate, rank = side_b_gate.shape
    blocks = intermediate // interleave
    side = side_b_gate.new_zeros(experts, blocks, 2, interleave, 2 * rank)
    side[:, :, 0, :, :rank] = side_b_gate.reshape(experts, blocks, interleave, rank)
    side[:, :, 1, :, rank:] = side_b_up.reshape(experts, blocks, interleave, rank)
    return side.view(experts, 2 * intermediate, 2 * rank)


def _dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The CPU twins' BF16 view of an MXFP4 B (the engine decodes to the same values)."""
    from .mxfp4 import dequantize_mxfp4

    return dequantize_mxfp4(codes, scales, axis=-1, dtype=torch.bfloat16)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int | None = None,
    b_extra: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    b_major: str = "k",
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool GEMM with the Store epilogue.

    Args:
        a: ``[pool rows, >= k]`` BF16 pool (rows grouped as ``plan`` says).
        b: ``[E, N, k]`` BF16 expert weights, K-major (nn.Linear layout).
        plan: the route plan (only ``expert_pool_offsets`` and ``block_m`` are read).
        k: reduction length (defaults to ``b.shape[2]``); columns of ``a`` past it are
            ignored.
        b_extra: optional ``[E, N_x, k]`` BF16: ``N_x`` more output columns.
        out: optional ``[pool rows, N + N_x]`` BF16 output.
        block_n: output tile width, a registry choice (128, or 256 for BLOCK_M 128).
        b_major: ``"k"`` (``b`` is ``[E, N, k]``, nn.Linear layout) or ``"mn"``: ``b`` is
            ``[E, k, N]`` and read as stored (``out = a @ b[e]``: the dgrads' ``dg w13_e``
            and ``dout w2_e``), and ``b_extra`` likewise ``[E, k, N_x]`` (dgrad1's
            ``b1``/``b3`` shrink columns); BLOCK_M 128 only.
        b_scales: MXFP4 B: ``b`` is then ``[E, N, k/2]`` uint8 E2M1 codes and this is
            ``[E, N, k/32]`` uint8 UE8M0 scales (:func:`~megamoe.mxfp4.quantize_mxfp4`
            along K); with ``b_major="mn"`` ``b`` is ``[E, k, N/2]`` and this
            ``[E, k, N/32]`` (quantized along N, the weights as stored). The engine
            decodes each K block to BF16 in shared memory, with the values of
            :func:`~megamoe.mxfp4.dequantize_mxfp4`; ``b_extra`` stays BF16.

    Returns:
        ``out`` ``[pool rows, N + N_x]`` BF16. Rows at or past the rows in use are not
        written.
    """
    check_choice("b_major", b_major, ("k", "mn"))
    check_tensor("a", a, ndim=2, dtypes=(torch.bfloat16,), contiguous=True)
    engine_scales = None
    if b_scales is not None:
        b_k, engine_scales = _mxfp4_operand("b", b, b_scales, a.device, b_major)
        if k is not None and k != b_k:
            raise ValueError(f"k: an MXFP4 B reduces over all its K={b_k} columns, got k={k}")
        k = b_k
        if not a.is_cuda:
            b, engine_scales = _dequantized(b, b_scales), None
    else:
        check_tensor("b", b, ndim=3, dtypes=(torch.bfloat16,), device=a.device, contiguous=True)
    _check_pool_operand(a, plan)
    major_mn = b_major == "mn"
    if major_mn:
        if k is not None and k != b.shape[1]:
            raise ValueError(f"k: expected b.shape[1] = {b.shape[1]} for b_major='mn', got {k}")
        k = b.shape[1]
        n_total = b.shape[2] * (2 if engine_scales is not None else 1)
        if b_extra is not None:
            check_tensor(
                "b_extra",
                b_extra,
                shape=(b.shape[0], k, None),
                dtypes=(torch.bfloat16,),
                device=a.device,
                contiguous=True,
            )
            n_total += b_extra.shape[2]
    else:
        k = b.shape[2] if k is None else k
        n_total = b.shape[1] + (0 if b_extra is None else b_extra.shape[1])
    if out is None:
        out = torch.empty(a.shape[0], n_total, dtype=torch.bfloat16, device=a.device)
    if not a.is_cuda:
        weights = b if b_extra is None else torch.cat([b, b_extra], dim=2 if major_mn else 1)
        for e, start, end in _expert_rows(plan):
            if end > start:
                w = weights[e].float() if major_mn else weights[e].float().T
                out[start:end] = (a[start:end, :k].float() @ w).bfloat16()
        return out
    dl = _native.dlpack
    with torch.cuda.device(a.device):
        _native.native().grouped_gemm(
            dl(a),
            k,
            dl(b),
            dl(plan.expert_pool_offsets),
            dl(out),
            plan.block_m,
            block_n,
            False,
            0,
            math.inf,
            None if b_extra is None else dl(b_extra),
            None,
            0.0,
            None,
            major_mn,
            None if engine_scales is None else dl(engine_scales),
            _device_sms(a.device),
            _native.current_stream(a.device),
        )
    return out


def gated_grouped_gemm(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    side_b_gate: torch.Tensor | None = None,
    side_b_up: torch.Tensor | None = None,
    side_scale: float = 0.0,
    out: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    w13_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM1 + gated activation over the pool.

    Args:
        a: ``[pool rows, k + 2r]`` BF16: ``[x | q1 | q3]`` per row (``r = 0``: ``[x]``).
        w13: ``[E, 2I, k]`` BF16 in the kernel's gate/up interleave.
        plan: the route plan.
        k: hidden size ``H`` (the base reduction).
        activation: ``"swiglu"`` or ``"geglu"``; ``activation_clamp``: ``c`` or None.
        side_b_gate, side_b_up: ``[E, I, r]`` BF16 (``b1``, ``b3`` transposed), or None.
        side_scale: the adapter scale ``s``.
        out: optional ``[pool rows, I]`` BF16.
        preact_out: optional ``[pool rows, 2I]`` BF16: also store the pre-activations
            ``g``, ``u`` (before the clamp, BF16-rounded, in ``w13``'s interleaved
            order) for the backward.
        block_n: output tile width (256 needs ``2I`` to be a multiple of 256).
        w13_scales: MXFP4 base: ``w13`` is then ``[E, 2I, k/2]`` uint8 codes and this is
            ``[E, 2I, k/32]`` uint8 scales, decoded in the engine (see
            :func:`grouped_gemm`'s ``b_scales``); the side segment stays BF16.

    Returns:
        ``h`` ``[pool rows, I]`` BF16.
    """
    check_choice("activation", activation, tuple(ACTIVATIONS))
    check_tensor("a", a, ndim=2, dtypes=(torch.bfloat16,), contiguous=True)
    engine_scales = None
    if w13_scales is not None:
        w13_k, engine_scales = _mxfp4_operand("w13", w13, w13_scales, a.device)
        if w13_k != k:
            raise ValueError(f"k: expected the MXFP4 w13's K={w13_k}, got {k}")
        if not a.is_cuda:
            w13, engine_scales = _dequantized(w13, w13_scales), None
    else:
        check_tensor("w13", w13, ndim=3, dtypes=(torch.bfloat16,), device=a.device, contiguous=True)
    if w13.shape[1] % block_n != 0:
        raise ValueError(f"w13: expected 2I a multiple of block_n={block_n}, got {w13.shape[1]}")
    _check_pool_operand(a, plan)
    if preact_out is not None:
        check_tensor(
            "preact_out",
            preact_out,
            shape=(a.shape[0], w13.shape[1]),
            dtypes=(torch.bfloat16,),
            device=a.device,
            contiguous=True,
        )
    if out is None:
        out = torch.empty(a.shape[0], w13.shape[1] // 2, dtype=torch.bfloat16, device=a.device)
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    if not a.is_cuda:
        _gated_cpu(
            a, w13, plan, k, activation, clamp, side_b_gate, side_b_up, side_scale, out, preact_out
        )
        return out
    dl = _native.dlpack
    with torch.cuda.device(a.device):
        side_b = None
        if side_b_gate is not None or side_b_up is not None:
            side_b = _side_operand(side_b_gate, side_b_up, w13.shape, k, a)
        _native.native().grouped_gemm(
            dl(a),
            k,
            dl(w13),
            dl(plan.expert_pool_offsets),
            dl(out),
            plan.block_m,
            block_n,
            True,
            ACTIVATIONS[activation],
            clamp,
            None,
            None if side_b is None else dl(side_b),
            float(side_scale),
            None if preact_out is None else dl(preact_out),
            False,
            None if engine_scales is None else dl(engine_scales),
            _device_sms(a.device),
            _native.current_stream(a.device),
        )
    return out


def _side_operand(side_b_gate, side_b_up, w13_shape, k, a) -> torch.Tensor:
    """Check ``side_b_gate``/``side_b_up`` (``[E, I, r]`` BF16 each, ``a`` holding
    ``[x | q1 | q3]``) and return the block-diagonal side operand."""
    if side_b_gate is None or side_b_up is None:
        raise ValueError("side_b_gate/side_b_up: give both or neither")
    experts, two_i = w13_shape[0], w13_shape[1]
    check_tensor(
        "side_b_gate",
        side_b_gate,
        ndim=3,
        dtypes=(torch.bfloat16,),
        device=a.device,
        contiguous=True,
    )
    rank = side_b_gate.shape[2]
    expected = (experts, two_i // 2, rank)
    if tuple(side_b_gate.shape) != expected:
        raise ValueError(
            f"side_b_gate: expected shape {list(expected)}, got {list(side_b_gate.shape)}"
        )
    check_tensor("side_b_up", side_b_up, shape=expected, dtypes=(torch.bfloat16,), device=a.device)
    if rank % 8 != 0 or k + 2 * rank > a.shape[1]:
        raise ValueError(
            f"side_b_gate: rank {rank} must be a multiple of 8 with k_base + 2*rank <= a's "
            f"columns {a.shape[1]}"
        )
    return block_diagonal_side_weights(
        side_b_gate, side_b_up.contiguous(), registry().gate_up_interleave
    )


def _gated_cpu(a, w13, plan, k, activation, clamp, side_b_gate, side_b_up, side_scale, out, preact):
    """The CPU twin of the gated launch (module docstring): per expert in float32."""
    interleave = registry().gate_up_interleave
    intermediate = w13.shape[1] // 2
    rank = 0 if side_b_gate is None else side_b_gate.shape[2]
    for e, start, end in _expert_rows(plan):
        rows = end - start
        if rows == 0:
            continue
        gu = a[start:end, :k].float() @ w13[e].float().T  # [rows, 2I], interleaved
        if rank:
            q1 = a[start:end, k : k + rank].float()
            q3 = a[start:end, k + rank : k + 2 * rank].float()
            blocks = gu.view(rows, -1, 2, interleave)
            blocks[:, :, 0] += side_scale * (q1 @ side_b_gate[e].float().T).view(
                rows, -1, interleave
            )
            blocks[:, :, 1] += side_scale * (q3 @ side_b_up[e].float().T).view(rows, -1, interleave)
        gu = gu.bfloat16()
        if preact is not None:
            preact[start:end] = gu
        g, u = gu.float().view(rows, -1, 2, interleave).unbind(2)
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        act = (
            g / (1.0 + torch.exp(-g))
            if activation == "swiglu"
            else torch.nn.functional.gelu(g, approximate="tanh")
        )
        out[start:end] = (act * u).reshape(rows, intermediate).bfloat16()


def _expert_rows(plan: RoutePlan) -> list[tuple[int, int, int]]:
    offsets = plan.expert_pool_offsets.tolist()
    return [(e, offsets[e], offsets[e + 1]) for e in range(len(offsets) - 1)]


def grouped_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int | None = None,
    b_extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 ``[rows in use, N + N_x]`` of :func:`grouped_gemm` (not rounded)."""
    k = b.shape[2] if k is None else k
    rows = int(plan.expert_pool_offsets[-1])
    cols = b.shape[1] + (0 if b_extra is None else b_extra.shape[1])
    out = torch.zeros(rows, cols, dtype=torch.float64, device=a.device)
    for e, start, end in _expert_rows(plan):
        if end == start:
            continue
        x = a[start:end, :k].double()
        weights = b[e] if b_extra is None else torch.cat([b[e], b_extra[e]], 0)
        out[start:end] = x @ weights.double().T
    return out


def gated_grouped_gemm_reference(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    side_b_gate: torch.Tensor | None = None,
    side_b_up: torch.Tensor | None = None,
    side_scale: float = 0.0,
    interleave: int = 64,
) -> torch.Tensor:
    """Float64 ``h`` ``[rows in use, I]`` of :func:`gated_grouped_gemm` with the kernel's
    rounding points (``g``, ``u`` rounded to BF16 before the clamp; ``h`` not rounded)."""
    rows = int(plan.expert_pool_offsets[-1])
    intermediate = w13.shape[1] // 2
    blocks = intermediate // interleave
    h = torch.zeros(rows, intermediate, dtype=torch.float64, device=a.device)
    rank = 0 if side_b_gate is None else side_b_gate.shape[2]
    for e, start, end in _expert_rows(plan):
        if end == start:
            continue
        w = w13[e].double().view(blocks, 2, interleave, k)
        gate_w, up_w = w[:, 0].reshape(intermediate, k), w[:, 1].reshape(intermediate, k)
        x = a[start:end, :k].double()
        g, u = x @ gate_w.T, x @ up_w.T
        if rank:
            q1 = a[start:end, k : k + rank].double()
            q3 = a[start:end, k + rank : k + 2 * rank].double()
            g = g + side_scale * (q1 @ side_b_gate[e].double().T)
            u = u + side_scale * (q3 @ side_b_up[e].double().T)
        g = g.to(torch.bfloat16).double()
        u = u.to(torch.bfloat16).double()
        if activation_clamp is not None:
            g = g.clamp(max=activation_clamp)
            u = u.clamp(-activation_clamp, activation_clamp)
        act = (
            torch.nn.functional.silu(g)
            if activation == "swiglu"
            else (torch.nn.functional.gelu(g, approximate="tanh"))
        )
        h[start:end] = act * u
    return h
