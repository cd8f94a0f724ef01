"""Float64/float32 oracle for the fused MoE layer: forward and closed-form backward.

This module implements DESIGN §1 literally, with plain torch ops, so the fused kernels
can be checked against it. It has two layers:

- :func:`forward` / :func:`backward`: a functional core on plain tensors (base weights
  in nn.Linear layout, *not* gate/up interleaved). :func:`backward` evaluates the
  closed-form gradients of §1 from a :class:`ForwardContext`; it never calls autograd.
- :func:`moe`: the public signature of ``mm.moe``, differentiable through a
  ``torch.autograd.Function`` whose backward is :func:`backward`.

Work is vectorized per local expert (a Python loop over experts, never over tokens or
routes). Each expert's routes are gathered in stable ``(t, k)`` order; per-route rows
are scattered into ``[T, K, ...]`` buffers and summed over ``k`` in the fixed order
``k = 0 .. K-1`` (never through ``index_add``, whose order is unspecified on GPU).

Rounding model (``round_bf16=True``). Inputs are used as given (the GPU tests feed the
same BF16 values to both sides). Every listed value is rounded to the nearest bfloat16
value and kept in ``compute_dtype`` (``t.to(bfloat16).to(compute_dtype)``); everything
else, including the sums over ``k``, stays in ``compute_dtype``:

forward
  - ``q1 = x a1``, ``q3 = x a3`` (per token);
  - ``g``, ``u``: the GEMM1 outputs ``x w1_e^T + s q1 b1_e`` / ``x w3_e^T + s q3 b3_e``,
    before the clamp;
  - ``h = act(g) * u``;
  - ``y = h w2_e^T`` and ``p = h a2_e`` (the GEMM2 outputs);
  - the per-token side sum ``sum_k w_tk p_tk`` and its ``b2`` expand
    ``(sum_k w_tk p_tk) b2``;
  - ``out`` (``sum_k w_tk y_tk + s (sum_k w_tk p_tk) b2``).
backward
  - ``s dout b2^T`` (per token, the scale inside the rounding, as the kernels' A
    operand of dgrad2 holds it next to ``dout``);
  - ``z`` (the dgrad2 output);
  - ``dg``, ``du`` (``act'`` applied to ``dh = w z``);
  - ``w h`` (per route, the weight gradients' operand: ``da2 = sum (w h)^T s dout b2^T``,
    ``dw2 = sum dout^T (w h)``);
  - the per-route dgrad1 output ``dg w1_e + du w3_e`` and the shrink columns
    ``dg b1_e^T``, ``du b3_e^T``;
  - the per-token sums ``sum_k dg b1_e^T`` and ``sum_k du b3_e^T``, and their ``a1`` /
    ``a3`` expand ``sg a1^T + su a3^T`` (one product);
  - ``dx`` and every gradient output (``topk_weights``, ``a1``, ``b1``, ``a3``, ``b3``,
    ``a2``, ``b2``, ``w13``, ``w2``).
With ``round_bf16=False`` nothing is rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .custom_ops.autocast import autocast_off
from .side_lora import SIDE_NAMES, SideLoRA
from .validation.arguments import (
    check_finite_float,
    check_int,
    check_str_choice,
    check_tensor,
    has_data,
)
from .weights import BaseWeights

__all__ = ["ACTIVATIONS", "ForwardContext", "backward", "forward", "moe"]

#: Gated activations: ``h = act(g) * u``.
ACTIVATIONS = ("swiglu", "geglu")

_X_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.float64)
_COMPUTE_DTYPES = (torch.float32, torch.float64)

# gelu_tanh(g) = 0.5 g (1 + tanh(_GELU_K0 (g + _GELU_K1 g^3)))
_GELU_K0 = math.sqrt(2.0 / math.pi)
_GELU_K1 = 0.044715


@dataclass
class ForwardContext:
    """What :func:`backward` needs, saved by :func:`forward` (tensors in compute dtype).

    Routes are held in *pool order*: local routes sorted by local expert, stable in the
    flat route index ``t * K + k``; expert ``e`` owns pool rows
    ``expert_offsets[e] : expert_offsets[e + 1]``.
    """

    x: torch.Tensor  # [T, H]
    route_weights: torch.Tensor  # [T, K], 0 where the route is masked or not local
    local: torch.Tensor  # [T, K] bool, route goes to a local expert
    w13: torch.Tensor  # [E_l, 2I, H] nn.Linear layout
    w2: torch.Tensor  # [E_l, H, I]
    side: tuple[torch.Tensor, ...] | None  # (a1, b1, a3, b3, a2, b2) or None
    scale: float
    q1: torch.Tensor | None  # [T, r]
    q3: torch.Tensor | None  # [T, r]
    route_index: torch.Tensor  # [N] int64 flat route index t*K+k, pool order
    expert_offsets: list[int]  # E_l + 1 offsets into the pool
    g: torch.Tensor  # [N, I] GEMM1 gate output, before the clamp
    u: torch.Tensor  # [N, I] GEMM1 up output, before the clamp
    p_sum: torch.Tensor | None  # [T, r] sum_k w_tk p_tk
    activation: str
    activation_clamp: float | None
    round_bf16: bool

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def top_k(self) -> int:
        return self.local.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.x.dtype


def _rounder(enabled: bool):
    """Return ``f(t)``: ``t`` rounded to bfloat16 values, kept in its dtype (or ``t``)."""
    if not enabled:
        return lambda t: t
    return lambda t: t.to(torch.bfloat16).to(t.dtype)


def _activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh")


def _activation_derivative(g: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(g) / dg, closed form."""
    if activation == "swiglu":
        sig = torch.sigmoid(g)
        return sig * (1.0 + g * (1.0 - sig))
    t = torch.tanh(_GELU_K0 * (g + _GELU_K1 * g * g * g))
    sech2 = 1.0 - t * t
    # Where tanh saturates, sech2 is exactly 0 but g^2 may be inf: keep 0, not NaN.
    tail = torch.where(
        sech2 == 0, torch.zeros_like(g), 0.5 * g * sech2 * _GELU_K0 * (1.0 + 3.0 * _GELU_K1 * g * g)
    )
    return 0.5 * (1.0 + t) + tail


def _clamp(g: torch.Tensor, u: torch.Tensor, clamp: float | None):
    """Clamped (g, u) and the masks where the clamp passes the gradient.

    Boundary values count as not clamped: their gradient passes (DESIGN §1).
    """
    if clamp is None:
        return g, u, None, None
    gate_pass = g <= clamp
    up_pass = (u >= -clamp) & (u <= clamp)
    return torch.clamp(g, max=clamp), torch.clamp(u, -clamp, clamp), gate_pass, up_pass


def _check_routing(x, topk_ids, topk_weights, hidden: int) -> tuple[int, int]:
    check_tensor("x", x, ndim=2, dtypes=_X_DTYPES)
    tokens = x.shape[0]
    check_tensor("x", x, shape=(tokens, hidden))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_ID_DTYPES, device=x.device)
    top_k = topk_ids.shape[1]
    check_tensor("topk_ids", topk_ids, shape=(tokens, top_k))
    if top_k < 1:
        raise ValueError(
            f"topk_ids: expected at least one route per token, got shape {list(topk_ids.shape)}"
        )
    check_tensor(
        "topk_weights",
        topk_weights,
        shape=(tokens, top_k),
        dtypes=_WEIGHT_DTYPES,
        device=x.device,
    )
    if topk_ids.numel() > 0 and has_data(topk_ids):  # (meta and fake ids hold no values)
        lowest = int(topk_ids.min())
        if lowest < -1:
            raise ValueError(
                f"topk_ids: expected expert ids >= -1 (-1 = masked route), got {lowest}"
            )
    return tokens, top_k


def _check_options(activation, activation_clamp, compute_dtype) -> float | None:
    check_str_choice("activation", activation, ACTIVATIONS)
    if activation_clamp is not None:
        activation_clamp = check_finite_float("activation_clamp", activation_clamp)
        if activation_clamp <= 0:
            raise ValueError(
                f"activation_clamp: expected a positive finite float or None, got "
                f"{activation_clamp}"
            )
    if compute_dtype not in _COMPUTE_DTYPES:
        raise TypeError(
            f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}"
        )
    return activation_clamp


def _check_side(side, hidden: int, intermediate: int, experts: int, device) -> None:
    if side is None:
        return
    if not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected a megamoe.SideLoRA or None, got {type(side).__name__}")
    got = (side.hidden, side.intermediate, side.num_experts)
    if got != (hidden, intermediate, experts):
        raise ValueError(
            f"side: expected adapters for H={hidden}, I={intermediate}, E_l={experts}, got "
            f"H={got[0]}, I={got[1]}, E_l={got[2]}"
        )
    if side.device != device:
        raise ValueError(f"side: expected device {device} like x, got {side.device}")


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    side: SideLoRA | None = None,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    expert_begin: int = 0,
    compute_dtype: torch.dtype = torch.float64,
    round_bf16: bool = False,
) -> tuple[torch.Tensor, ForwardContext]:
    """MoE layer forward (DESIGN §1) on plain tensors.

    Args:
        x: ``[T, H]`` bf16/fp32/fp64 tokens.
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked. Ids outside
            ``expert_begin .. expert_begin + E_l - 1`` are remote and contribute nothing.
        topk_weights: ``[T, K]`` fp32/fp64 routing weights.
        w13: ``[E_l, 2I, H]`` nn.Linear layout, rows ``0..I-1`` gate, ``I..2I-1`` up.
        w2: ``[E_l, H, I]`` nn.Linear layout.
        side: optional :class:`SideLoRA` with scale ``s = side.scale``.
        activation: ``"swiglu"`` or ``"geglu"`` (tanh GELU).
        activation_clamp: optional ``c > 0``: ``g = min(g, c)``, ``u = clamp(u, -c, c)``.
        expert_begin: global id of local expert 0.
        compute_dtype: float64 (default) or float32; every input is cast to it.
        round_bf16: round at the kernels' rounding points (module docstring).

    Returns:
        ``(out, ctx)``: ``out`` ``[T, H]`` in ``compute_dtype`` and the context for
        :func:`backward`. The ops are ordinary torch ops, so autograd also works through
        ``out`` when inputs require grad (the tests use that as a second oracle).
    """
    check_tensor("w13", w13, ndim=3)
    experts, two_i, hidden = w13.shape
    if two_i % 2 != 0:
        raise ValueError(f"w13: expected an even second dimension 2*I, got {two_i}")
    intermediate = two_i // 2
    check_tensor("w2", w2, shape=(experts, hidden, intermediate), device=w13.device)
    tokens, top_k = _check_routing(x, topk_ids, topk_weights, hidden)
    check_tensor("w13", w13, ndim=3, device=x.device)
    activation_clamp = _check_options(activation, activation_clamp, compute_dtype)
    _check_side(side, hidden, intermediate, experts, x.device)
    check_int("expert_begin", expert_begin, minimum=0)
    if not torch.compiler.is_compiling() and not has_data(topk_ids):
        # Last, as a device the call cannot run on. (torch.compile breaks the graph where
        # the reference reads values, and runs on.)
        raise ValueError(
            "topk_ids: the reference plans its pool from the ids' values, and a meta or fake "
            "tensor holds none (mm.moe's fake implementation runs on those)"
        )

    rnd = _rounder(round_bf16)
    cd = compute_dtype
    x_c = x.to(cd)
    w13_c = w13.to(cd)
    w2_c = w2.to(cd)

    # Pool order: a stable sort of the flat routes by local expert (remote and masked
    # routes get the key E_l and fall off the end), like the kernels' route plan.
    ids = topk_ids.to(torch.int64)
    local_expert = ids - expert_begin
    local = (ids >= 0) & (local_expert >= 0) & (local_expert < experts)
    key = torch.where(local, local_expert, torch.full_like(local_expert, experts)).reshape(-1)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=experts + 1)[:experts].tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    route_index = order[: offsets[-1]]
    route_token = torch.div(route_index, top_k, rounding_mode="floor")
    # Zero weight on non-local routes, so a junk weight there (even NaN) changes nothing.
    route_weights = torch.where(
        local, topk_weights.to(cd), torch.zeros((), dtype=cd, device=x.device)
    )

    if side is not None:
        a1, b1, a3, b3, a2, b2 = (t.to(cd) for t in side.tensors())
        s = side.scale
        q1 = rnd(x_c @ a1)
        q3 = rnd(x_c @ a3)
        rank = a1.shape[1]
    else:
        q1 = q3 = None

    flat_routes = tokens * top_k
    y_routes = torch.zeros(flat_routes, hidden, dtype=cd, device=x.device)
    p_routes = (
        torch.zeros(flat_routes, rank, dtype=cd, device=x.device) if side is not None else None
    )
    g_pool, u_pool = [], []
    for e in range(experts):
        begin, end = offsets[e], offsets[e + 1]
        if begin == end:
            continue
        idx = route_index[begin:end]
        tok = route_token[begin:end]
        gu = x_c.index_select(0, tok) @ w13_c[e].T
        g, u = gu[:, :intermediate], gu[:, intermediate:]
        if side is not None:
            g = g + s * (q1.index_select(0, tok) @ b1[e])
            u = u + s * (q3.index_select(0, tok) @ b3[e])
        g, u = rnd(g), rnd(u)
        g_pool.append(g)
        u_pool.append(u)
        gc, uc, _, _ = _clamp(g, u, activation_clamp)
        h = rnd(_activation(gc, activation) * uc)
        y_routes.index_copy_(0, idx, rnd(h @ w2_c[e].T))
        if side is not None:
            p_routes.index_copy_(0, idx, rnd(h @ a2[e]))

    empty = torch.zeros(0, intermediate, dtype=cd, device=x.device)
    g_all = torch.cat(g_pool) if g_pool else empty
    u_all = torch.cat(u_pool) if u_pool else empty

    # Combine in the fixed order k = 0..K-1.
    y_tk = y_routes.view(tokens, top_k, hidden)
    out = torch.zeros(tokens, hidden, dtype=cd, device=x.device)
    for k in range(top_k):
        out = out + route_weights[:, k, None] * y_tk[:, k]
    p_sum = None
    if side is not None:
        p_tk = p_routes.view(tokens, top_k, rank)
        p_sum = torch.zeros(tokens, rank, dtype=cd, device=x.device)
        for k in range(top_k):
            p_sum = p_sum + route_weights[:, k, None] * p_tk[:, k]
        p_sum = rnd(p_sum)
        out = out + s * rnd(p_sum @ b2)  # the shared b2 expand, once per token
    out = rnd(out)

    ctx = ForwardContext(
        x=x_c,
        route_weights=route_weights,
        local=local,
        w13=w13_c,
        w2=w2_c,
        side=(a1, b1, a3, b3, a2, b2) if side is not None else None,
        scale=side.scale if side is not None else 0.0,
        q1=q1,
        q3=q3,
        route_index=route_index,
        expert_offsets=offsets,
        g=g_all,
        u=u_all,
        p_sum=p_sum,
        activation=activation,
        activation_clamp=activation_clamp,
        round_bf16=round_bf16,
    )
    return out, ctx


def backward(
    dout: torch.Tensor, ctx: ForwardContext, *, base_grads: bool = False
) -> dict[str, torch.Tensor | None]:
    """Closed-form gradients of DESIGN §1 (no autograd).

    Args:
        dout: ``[T, H]`` gradient of the output (any float dtype; cast to the compute
            dtype and used as given).
        ctx: the context returned by :func:`forward`.
        base_grads: also return ``"w13"`` ``[E_l, 2I, H]`` and ``"w2"`` ``[E_l, H, I]``
            (ordinary mode, nn.Linear layout).

    Returns:
        A dict with ``"x"`` ``[T, H]``, ``"topk_weights"`` ``[T, K]`` (exactly 0 on masked
        and remote routes), ``"a1"``, ``"b1"``, ``"a3"``, ``"b3"``, ``"a2"``, ``"b2"``
        (``None`` without adapters), ``"w13"``, ``"w2"`` (``None`` unless
        ``base_grads``), all in the compute dtype. Experts without routes get exactly-zero
        expert-local gradients.
    """
    with torch.no_grad():
        return _backward(dout, ctx, base_grads)


def _backward(dout: torch.Tensor, ctx: ForwardContext, base_grads: bool):
    tokens, top_k = ctx.num_tokens, ctx.top_k
    check_tensor("dout", dout, shape=(tokens, ctx.x.shape[1]), device=ctx.x.device)
    rnd = _rounder(ctx.round_bf16)
    cd = ctx.compute_dtype
    dev = ctx.x.device
    x = ctx.x.detach()
    w13, w2 = ctx.w13.detach(), ctx.w2.detach()
    experts, hidden, _ = w2.shape
    dout = dout.detach().to(cd)
    has_side = ctx.side is not None
    s = ctx.scale
    flat_routes = tokens * top_k
    weights_flat = ctx.route_weights.detach().reshape(-1)
    clamp = ctx.activation_clamp
    activation = ctx.activation

    if has_side:
        a1, b1, a3, b3, a2, b2 = (t.detach() for t in ctx.side)
        rank = a1.shape[1]
        q1, q3 = ctx.q1.detach(), ctx.q3.detach()
        dout_b2 = rnd(s * (dout @ b2.T))  # [T, r], s dout b2^T once per token
        db1, db3, da2 = torch.zeros_like(b1), torch.zeros_like(b3), torch.zeros_like(a2)
        sg_routes = torch.zeros(flat_routes, rank, dtype=cd, device=dev)
        su_routes = torch.zeros(flat_routes, rank, dtype=cd, device=dev)
    if base_grads:
        dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)

    drouter = torch.zeros(flat_routes, dtype=cd, device=dev)
    dx_routes = torch.zeros(flat_routes, hidden, dtype=cd, device=dev)
    g_pool, u_pool = ctx.g.detach(), ctx.u.detach()
    offsets = ctx.expert_offsets
    for e in range(experts):
        begin, end = offsets[e], offsets[e + 1]
        if begin == end:
            continue  # empty expert: its local grads stay exactly zero
        idx = ctx.route_index[begin:end]
        tok = torch.div(idx, top_k, rounding_mode="floor")
        w = weights_flat.index_select(0, idx)[:, None]
        g, u = g_pool[begin:end], u_pool[begin:end]
        gc, uc, gate_pass, up_pass = _clamp(g, u, clamp)
        act = _activation(gc, activation)
        h = rnd(act * uc)  # recomputed exactly as in forward

        dout_e = dout.index_select(0, tok)
        z = dout_e @ w2[e]  # unweighted dL/dh
        if has_side:
            dout_b2_e = dout_b2.index_select(0, tok)
            z = z + dout_b2_e @ a2[e].T
        z = rnd(z)
        drouter.index_copy_(0, idx, (z * h).sum(dim=1))
        dh = w * z
        dg = dh * uc * _activation_derivative(gc, activation)
        du = dh * act
        if clamp is not None:
            dg = torch.where(gate_pass, dg, torch.zeros_like(dg))
            du = torch.where(up_pass, du, torch.zeros_like(du))
        dg, du = rnd(dg), rnd(du)
        dgu = torch.cat([dg, du], dim=1)  # [n, 2I], matches the w13 row order
        dx_routes.index_copy_(0, idx, rnd(dgu @ w13[e]))
        if has_side:
            sg_routes.index_copy_(0, idx, rnd(dg @ b1[e].T))
            su_routes.index_copy_(0, idx, rnd(du @ b3[e].T))
            db1[e] = rnd(s * (q1.index_select(0, tok).T @ dg))
            db3[e] = rnd(s * (q3.index_select(0, tok).T @ du))
        if has_side or base_grads:
            wh = rnd(w * h)  # the K-grouped GEMMs' operand, BF16
        if has_side:
            da2[e] = rnd(wh.T @ dout_b2_e)
        if base_grads:
            dw13[e] = rnd(dgu.T @ x.index_select(0, tok))
            dw2[e] = rnd(dout_e.T @ wh)

    # Sums over k in the fixed order k = 0..K-1.
    dx_tk = dx_routes.view(tokens, top_k, hidden)
    dx = torch.zeros(tokens, hidden, dtype=cd, device=dev)
    for k in range(top_k):
        dx = dx + dx_tk[:, k]
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("x", "topk_weights", *SIDE_NAMES, "w13", "w2")
    )
    if has_side:
        sg_tk = sg_routes.view(tokens, top_k, rank)
        su_tk = su_routes.view(tokens, top_k, rank)
        sg = torch.zeros(tokens, rank, dtype=cd, device=dev)
        su = torch.zeros(tokens, rank, dtype=cd, device=dev)
        for k in range(top_k):
            sg = sg + sg_tk[:, k]
            su = su + su_tk[:, k]
        sg, su = rnd(sg), rnd(su)
        # The shared a1/a3 expands run once per token on the k-summed shrinks, as one
        # product over [sg | su] (rounded once).
        dx = dx + s * rnd(sg @ a1.T + su @ a3.T)
        grads["a1"] = rnd(s * (x.T @ sg))
        grads["a3"] = rnd(s * (x.T @ su))
        grads["b1"], grads["b3"], grads["a2"] = db1, db3, da2
        grads["b2"] = rnd(s * (ctx.p_sum.detach().T @ dout))
    grads["x"] = rnd(dx)
    grads["topk_weights"] = rnd(drouter.view(tokens, top_k))
    if base_grads:
        grads["w13"], grads["w2"] = dw13, dw2
    return grads


def _save_context(autograd_ctx, fctx: ForwardContext) -> None:
    """Keep ``fctx``'s tensors through ``save_for_backward``: in the compute dtype ``x``,
    the weights and the adapters are the caller's own tensors, and autograd's version
    check then refuses a backward after one of them changed in place."""
    names = [f.name for f in fields(fctx) if isinstance(getattr(fctx, f.name), torch.Tensor)]
    side = list(fctx.side) if fctx.side is not None else []
    autograd_ctx.save_for_backward(*(getattr(fctx, n) for n in names), *side)
    autograd_ctx.context_names = names
    autograd_ctx.context = replace(fctx, **dict.fromkeys(names), side=None)
    autograd_ctx.context_has_side = fctx.side is not None


def _saved_context(autograd_ctx) -> ForwardContext:
    """The forward's :class:`ForwardContext` from :func:`_save_context`."""
    saved = autograd_ctx.saved_tensors
    names = autograd_ctx.context_names
    side = tuple(saved[len(names) :]) if autograd_ctx.context_has_side else None
    return replace(autograd_ctx.context, **dict(zip(names, saved, strict=False)), side=side)


class _ReferenceMoE(torch.autograd.Function):
    """Autograd wrapper: forward by :func:`forward`, backward by closed-form :func:`backward`."""

    @staticmethod
    def forward(autograd_ctx, options, x, topk_ids, topk_weights, w13, w2, *side_tensors):
        side = SideLoRA(*side_tensors, scale=options["scale"]) if side_tensors else None
        with autocast_off(x.device):  # the oracle computes in compute_dtype, always
            out, fctx = forward(
                x,
                topk_ids,
                topk_weights,
                w13,
                w2,
                side,
                activation=options["activation"],
                activation_clamp=options["activation_clamp"],
                compute_dtype=options["compute_dtype"],
                round_bf16=options["round_bf16"],
            )
        _save_context(autograd_ctx, fctx)
        autograd_ctx.input_dtypes = [t.dtype for t in (x, topk_ids, topk_weights, w13, w2)] + [
            t.dtype for t in side_tensors
        ]
        return out

    @staticmethod
    @once_differentiable
    def backward(autograd_ctx, dout):
        needs = autograd_ctx.needs_input_grad[1:]  # skip options
        fctx = _saved_context(autograd_ctx)
        with autocast_off(dout.device):
            grads = backward(dout, fctx, base_grads=bool(needs[3] or needs[4]))
        keys = ["x", None, "topk_weights", "w13", "w2"]
        if fctx.side is not None:
            keys += list(SIDE_NAMES)
        result = [None]  # options
        for key, need, dtype in zip(keys, needs, autograd_ctx.input_dtypes, strict=True):
            if key is None or not need or grads[key] is None:
                result.append(None)
            else:
                result.append(grads[key].to(dtype))
        return tuple(result)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None = None,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype = torch.float64,
    round_bf16: bool = False,
) -> torch.Tensor:
    """Reference ``mm.moe``, computed by :func:`forward`: ``mm.moe``'s arguments (``group``
    must be None; no ``activation_checkpoint``/``reduce_shared_grads``), plus
    ``compute_dtype`` and ``round_bf16``; the output is in ``compute_dtype``.

    Args:
        x: ``[T, H]`` bf16/fp32/fp64.
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked. The
            reference does not know the global expert count, so any id ``>= E_l`` is
            treated as a remote route (contributes nothing); ids ``< -1`` are rejected.
        topk_weights: ``[T, K]`` fp32/fp64, differentiable (router gradient).
        base: :class:`~megamoe.weights.BaseWeights` (bf16 or mxfp4; dequantized with
            ``w13_linear``/``w2_linear``). If ``base.w13`` requires grad (ordinary mode)
            the base weights get gradients through that path.
        side: optional :class:`SideLoRA`; every adapter tensor is differentiable.
        activation: ``"swiglu"`` or ``"geglu"``.
        activation_clamp: ``None`` or a positive finite float.
        group: must be ``None``: the reference runs on one process.
        compute_dtype: float64 (default) or float32.
        round_bf16: model the kernels' BF16 rounding points (module docstring).

    Returns:
        ``out`` ``[T, H]`` in ``compute_dtype`` (the oracle keeps its precision).
        Gradients flowing back to the inputs come in each input's own dtype.
    """
    if group is not None:
        raise ValueError("group: the reference runs on one process; pass group=None")
    if not isinstance(base, BaseWeights):
        raise TypeError(f"base: expected a megamoe.BaseWeights, got {type(base).__name__}")
    _check_routing(x, topk_ids, topk_weights, base.hidden)
    if base.device != x.device:
        raise ValueError(f"base: expected device {x.device} like x, got {base.device}")
    activation_clamp = _check_options(activation, activation_clamp, compute_dtype)
    _check_side(side, base.hidden, base.intermediate, base.num_experts, x.device)
    if not isinstance(round_bf16, bool):
        raise TypeError(f"round_bf16: expected a bool, got {type(round_bf16).__name__}")
    # MXFP4 ordinary mode: straight through, as mm.moe, on the oracle's own decode; after
    # the call's checks (a decode, and a stale base's error, come after a bad input's).
    base = base.for_call(oracle=True)

    # MXFP4 decodes exactly in float32 but dequantize_mxfp4 offers no float64; a BF16 base
    # goes straight to compute_dtype so an ordinary-mode gradient is rounded only once.
    decode_dtype = torch.float32 if base.format == "mxfp4" else compute_dtype
    w13 = base.w13_linear(decode_dtype).to(compute_dtype)
    w2 = base.w2_linear(decode_dtype).to(compute_dtype)
    options = {
        "scale": side.scale if side is not None else 0.0,
        "activation": activation,
        "activation_clamp": activation_clamp,
        "compute_dtype": compute_dtype,
        "round_bf16": round_bf16,
    }
    side_tensors = side.tensors() if side is not None else ()
    return _ReferenceMoE.apply(options, x, topk_ids, topk_weights, w13, w2, *side_tensors)
