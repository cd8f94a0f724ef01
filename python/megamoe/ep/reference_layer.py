"""The expert-parallel MoE layer on the float64/float32 reference math.

Per rank, the pipeline of DESIGN §3/§4 with torch ops in place of the kernels:

forward
  ``q1 = x a1``, ``q3 = x a3`` once per token (source rank) -> :func:`dispatch` of
  ``[x | q1 | q3]`` rows -> expert stage over the received rows in pool order
  (:class:`ReferenceExperts`: ``[y | p]`` rows) -> :func:`combine` back to the source
  -> ``out = sum_k w y + s (sum_k w p) b2`` (sums in order ``k = 0..K-1``).
backward
  ``dout b2^T`` once per token -> dispatch of ``[dout | dout b2^T | w]`` rows -> expert
  backward (``[dx_route | dg b1^T | du b3^T | dw]`` rows and the expert-local grads
  ``b1, b3, a2`` (+ ``w13, w2`` in ordinary mode)) -> combine -> per-token sums over
  ``k`` -> ``dx`` and the shared grads ``a1, a3, b2``, all-reduced (SUM) over the group.

The rounding points are those of :mod:`megamoe.reference` (``round_bf16=True``), so
EP ``P`` computes what EP1 computes on the same global batch: every expert sees the
same rows in the same order (when the global batch is the ranks' slices in rank
order); only ``q = x a`` (per-rank GEMMs) and the shared grads (a sum over ranks)
are evaluated in a different order, which is well below 1e-10 relative in float64.

:class:`ReferenceExperts` is the seam where the fused GPU backend plugs in: the same
row formats in and out, computed by the grouped GEMMs over the same pool plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..reference import (
    ACTIVATIONS,
    _activation,
    _activation_derivative,
    _check_options,
    _check_side,
    _clamp,
    _rounder,
)
from ..side_lora import SIDE_NAMES, SideLoRA
from ..validation.arguments import check_int, check_tensor
from .exchange import combine, dispatch, reduce_shared_grads, sum_over_k
from .fused_layer import float_bits
from .plan import DispatchPlan, group_size, plan_dispatch, refuse_on_every_rank

__all__ = ["ExpertState", "ReferenceExperts", "reference_moe"]

_X_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass
class ExpertState:
    """What :meth:`ReferenceExperts.backward` needs from the forward (received order).

    ``segments``: per non-empty local expert, ``(e, rows)`` with ``rows`` the receive
    indices of its routes in pool order; ``g``/``u``: the GEMM1 outputs of those rows
    (before the clamp); ``x``, ``q1``, ``q3``: the received inputs ``[N_recv, ·]``.
    """

    segments: list[tuple[int, torch.Tensor]]
    g: list[torch.Tensor]
    u: list[torch.Tensor]
    x: torch.Tensor
    q1: torch.Tensor | None
    q3: torch.Tensor | None


class ReferenceExperts:
    """The expert stage of one rank: received rows in, result rows out (reference math).

    Row formats (columns; ``H`` hidden, ``r`` adapter rank, 0 without adapters):

    - forward in ``[N_recv, H + 2r]`` = ``[x | q1 | q3]``; out ``[N_recv, H + r]`` =
      ``[y | p]`` (unweighted per-route results);
    - backward in ``[N_recv, H + r + 1]`` = ``[dout | dout b2^T | w]``; out
      ``[N_recv, H + 2r + 1]`` = ``[dx_route | dg b1^T | du b3^T | dw]``.

    Args:
        w13: ``[E_l, 2I, H]`` local experts, nn.Linear layout (compute dtype).
        w2: ``[E_l, H, I]``.
        side: ``(b1 [E_l, r, I], b3 [E_l, r, I], a2 [E_l, I, r])`` or ``None``.
        scale: adapter scale ``s``.
        activation, activation_clamp, round_bf16: as in :func:`megamoe.reference.forward`.
    """

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        side: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        *,
        scale: float,
        activation: str,
        activation_clamp: float | None,
        round_bf16: bool,
    ) -> None:
        self.w13, self.w2, self.side = w13, w2, side
        self.scale = scale
        self.activation = activation
        self.clamp = activation_clamp
        self.rnd = _rounder(round_bf16)
        self.hidden = w2.shape[1]
        self.intermediate = w2.shape[2]
        self.rank = 0 if side is None else side[0].shape[1]

    @staticmethod
    def segments(plan: DispatchPlan) -> list[tuple[int, torch.Tensor]]:
        """``(e, receive indices in pool order)`` of each non-empty local expert."""
        pool = plan.pool
        counts = pool.expert_counts.tolist()
        offsets = pool.expert_pool_offsets.tolist()
        rows = pool.pool_row_to_route.to(torch.int64)
        return [(e, rows[offsets[e] : offsets[e] + n]) for e, n in enumerate(counts) if n > 0]

    def forward(self, rows: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, ExpertState]:
        """``[x | q1 | q3]`` rows ``[N_recv, H + 2r]`` -> ``[y | p]`` rows ``[N_recv, H + r]``."""
        h_dim, r = self.hidden, self.rank
        rnd, s = self.rnd, self.scale
        x = rows[:, :h_dim]
        q1 = rows[:, h_dim : h_dim + r] if r else None
        q3 = rows[:, h_dim + r :] if r else None
        out = rows.new_zeros(rows.shape[0], h_dim + r)
        state = ExpertState(self.segments(plan), [], [], x, q1, q3)
        inter = self.intermediate
        for e, idx in state.segments:
            gu = x.index_select(0, idx) @ self.w13[e].T
            g, u = gu[:, :inter], gu[:, inter:]
            if r:
                b1, b3, _ = self.side
                g = g + s * (q1.index_select(0, idx) @ b1[e])
                u = u + s * (q3.index_select(0, idx) @ b3[e])
            g, u = rnd(g), rnd(u)
            state.g.append(g)
            state.u.append(u)
            gc, uc, _, _ = _clamp(g, u, self.clamp)
            h = rnd(_activation(gc, self.activation) * uc)
            y = rnd(h @ self.w2[e].T)
            if r:
                y = torch.cat([y, rnd(h @ self.side[2][e])], dim=1)
            out.index_copy_(0, idx, y)
        return out, state

    def backward(
        self, rows: torch.Tensor, state: ExpertState, *, base_grads: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """``[dout | dout b2^T | w]`` rows -> ``[dx_route | dg b1^T | du b3^T | dw]`` rows.

        Also returns the expert-local grads ``{"b1", "b3", "a2", "w13", "w2"}`` (``None``
        where not applicable); experts without routes get exact zeros.
        """
        h_dim, r = self.hidden, self.rank
        rnd, s = self.rnd, self.scale
        dout = rows[:, :h_dim]
        dout_b2 = rows[:, h_dim : h_dim + r] if r else None
        weights = rows[:, h_dim + r]
        out = rows.new_zeros(rows.shape[0], h_dim + 2 * r + 1)
        local: dict[str, torch.Tensor | None] = dict.fromkeys(("b1", "b3", "a2", "w13", "w2"))
        if r:
            b1, b3, a2 = self.side
            local["b1"], local["b3"], local["a2"] = (
                torch.zeros_like(b1),
                torch.zeros_like(b3),
                torch.zeros_like(a2),
            )
        if base_grads:
            local["w13"], local["w2"] = torch.zeros_like(self.w13), torch.zeros_like(self.w2)
        for (e, idx), g, u in zip(state.segments, state.g, state.u, strict=True):
            w = weights.index_select(0, idx)[:, None]
            gc, uc, gate_pass, up_pass = _clamp(g, u, self.clamp)
            act = _activation(gc, self.activation)
            h = rnd(act * uc)
            dout_e = dout.index_select(0, idx)
            z = dout_e @ self.w2[e]
            if r:
                dout_b2_e = dout_b2.index_select(0, idx)
                z = z + dout_b2_e @ a2[e].T
            z = rnd(z)
            dw = (z * h).sum(dim=1, keepdim=True)
            dh = w * z
            dg = dh * uc * _activation_derivative(gc, self.activation)
            du = dh * act
            if self.clamp is not None:
                dg = torch.where(gate_pass, dg, torch.zeros_like(dg))
                du = torch.where(up_pass, du, torch.zeros_like(du))
            dg, du = rnd(dg), rnd(du)
            dgu = torch.cat([dg, du], dim=1)
            pieces = [rnd(dgu @ self.w13[e])]
            wh = rnd(w * h)  # the K-grouped weight gradients' BF16 operand
            if r:
                pieces += [rnd(dg @ b1[e].T), rnd(du @ b3[e].T)]
                local["b1"][e] = rnd(s * (state.q1.index_select(0, idx).T @ dg))
                local["b3"][e] = rnd(s * (state.q3.index_select(0, idx).T @ du))
                local["a2"][e] = rnd(wh.T @ dout_b2_e)
            pieces.append(dw)
            out.index_copy_(0, idx, torch.cat(pieces, dim=1))
            if base_grads:
                local["w13"][e] = rnd(dgu.T @ state.x.index_select(0, idx))
                local["w2"][e] = rnd(dout_e.T @ wh)
        return out, local


class _EPReferenceMoE(torch.autograd.Function):
    """Forward and closed-form backward of the EP layer (both are collectives)."""

    @staticmethod
    def forward(autograd_ctx, options, plan, x, topk_weights, w13, w2, *side_tensors):
        cd = options["compute_dtype"]
        rnd = _rounder(options["round_bf16"])
        hidden = w2.shape[1]
        x_c = x.detach().to(cd)
        valid = options["topk_ids"] >= 0
        route_w = torch.where(
            valid, topk_weights.detach().to(cd), torch.zeros((), dtype=cd, device=x.device)
        )
        side = tuple(t.detach().to(cd) for t in side_tensors) if side_tensors else None
        s = options["scale"]
        if side is not None:
            a1, b1, a3, b3, a2, b2 = side
            q1, q3 = rnd(x_c @ a1), rnd(x_c @ a3)  # once per token, on the source rank
            rows = torch.cat([x_c, q1, q3], dim=1)
        else:
            rows = x_c
        experts = ReferenceExperts(
            w13.detach().to(cd),
            w2.detach().to(cd),
            (b1, b3, a2) if side is not None else None,
            scale=s,
            activation=options["activation"],
            activation_clamp=options["activation_clamp"],
            round_bf16=options["round_bf16"],
        )
        recv_out, state = experts.forward(dispatch(rows, plan), plan)
        back = combine(recv_out, plan)  # [T, K, H + r]
        out = sum_over_k(back[..., :hidden], route_w)
        p_sum = None
        if side is not None:
            p_sum = rnd(sum_over_k(back[..., hidden:], route_w))
            out = out + s * rnd(p_sum @ b2)  # the shared b2 expand, once per token
        autograd_ctx.saved = dict(
            options=options,
            plan=plan,
            experts=experts,
            state=state,
            x=x_c,
            route_w=route_w,
            side=side,
            p_sum=p_sum,
        )
        autograd_ctx.input_dtypes = [t.dtype for t in (x, topk_weights, w13, w2, *side_tensors)]
        return rnd(out)

    @staticmethod
    @once_differentiable
    def backward(autograd_ctx, dout):
        saved = autograd_ctx.saved
        options, plan, experts = saved["options"], saved["plan"], saved["experts"]
        cd = options["compute_dtype"]
        rnd = _rounder(options["round_bf16"])
        side, x = saved["side"], saved["x"]
        s, hidden, r = experts.scale, experts.hidden, experts.rank
        tokens, top_k = plan.num_tokens, plan.top_k
        needs = autograd_ctx.needs_input_grad
        dout = dout.detach().to(cd)
        if side is not None:
            a1, _, a3, _, _, b2 = side
            dout_b2 = rnd(s * (dout @ b2.T))  # s dout b2^T once per token
            token_rows = torch.cat([dout, dout_b2], dim=1)
        else:
            token_rows = dout
        # The backward exchange runs on every rank whatever needs grad here, so the
        # collectives match across ranks.
        route_rows = torch.cat(
            [
                token_rows[:, None, :].expand(tokens, top_k, token_rows.shape[1]),
                saved["route_w"][..., None],
            ],
            dim=2,
        )
        recv_out, local = experts.backward(
            dispatch(route_rows, plan, per_route=True),
            saved["state"],
            base_grads=bool(needs[4] or needs[5]),
        )
        back = combine(recv_out, plan)  # [T, K, H + 2r + 1]
        dx = sum_over_k(back[..., :hidden])
        grads = dict.fromkeys(("x", "topk_weights", "w13", "w2", *SIDE_NAMES))
        grads["topk_weights"] = rnd(back[..., -1])
        if side is not None:
            sg = rnd(sum_over_k(back[..., hidden : hidden + r]))
            su = rnd(sum_over_k(back[..., hidden + r : hidden + 2 * r]))
            dx = dx + s * rnd(sg @ a1.T + su @ a3.T)  # one product over [sg | su]
            shared = [s * (x.T @ sg), s * (x.T @ su), s * (saved["p_sum"].T @ dout)]
            if options["reduce_shared_grads"]:
                reduce_shared_grads(shared, plan.group)
            grads["a1"], grads["a3"], grads["b2"] = (rnd(g) for g in shared)
            grads["b1"], grads["b3"], grads["a2"] = local["b1"], local["b3"], local["a2"]
        grads["x"] = rnd(dx)
        grads["w13"], grads["w2"] = local["w13"], local["w2"]
        keys = ["x", "topk_weights", "w13", "w2"]
        if side is not None:
            keys += list(SIDE_NAMES)
        result = [None, None]  # options, plan
        for key, need, dtype in zip(keys, needs[2:], autograd_ctx.input_dtypes, strict=True):
            g = grads[key]
            result.append(g.to(dtype) if need and g is not None else None)
        return tuple(result)


#: What every rank must hold alike (plan_dispatch's ``uniform``), in order.
_UNIFORM_NAMES = (
    "hidden",
    "intermediate",
    "side_rank",
    "activation",
    "activation_clamp (float64 bits, -1: none)",
    "side scale (float64 bits)",
    "compute_dtype",
    "round_bf16",
    "reduce_shared_grads",
)


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_local: torch.Tensor,
    w2_local: torch.Tensor,
    side_local: SideLoRA | None = None,
    *,
    group: dist.ProcessGroup | None,
    num_experts: int | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    reduce_shared_grads: bool = True,
    compute_dtype: torch.dtype = torch.float64,
    round_bf16: bool = False,
    max_tokens: int | None = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """The MoE layer with experts sharded over ``group``, on the reference math.

    A collective: every rank of ``group`` calls it (in the same order as its other
    collectives), and every rank runs the backward if any does.

    Args:
        x: ``[T, H]`` bf16/fp32/fp64 tokens of this rank (``T`` may differ between ranks,
            and may be 0).
        topk_ids: ``[T, K]`` int32/int64 *global* expert ids in ``[-1, E)``, ``-1`` = masked.
        topk_weights: ``[T, K]`` fp32/fp64, differentiable (router gradient; exactly 0 on
            masked routes).
        w13_local: ``[E_l, 2I, H]`` this rank's experts (global ids
            ``rank * E_l .. (rank + 1) * E_l - 1``), nn.Linear layout, rows ``0..I-1``
            gate. Differentiable (ordinary mode: expert-local gradient, not reduced).
        w2_local: ``[E_l, H, I]``.
        side_local: optional :class:`~megamoe.SideLoRA` with the shared ``a1, a3 [H, r]``,
            ``b2 [r, H]`` (replicated on every rank) and this rank's ``b1, b3 [E_l, r, I]``,
            ``a2 [E_l, I, r]``.
        group: the EP process group (gloo or NCCL), or ``None`` for one process.
        num_experts: ``E`` over the group (default ``E_l * P``; must equal it).
        activation: ``"swiglu"`` or ``"geglu"``; activation_clamp: ``None`` or ``c > 0``.
        reduce_shared_grads: all-reduce (SUM) the gradients of ``a1``, ``a3``, ``b2`` over
            the group, so they are the EP1 gradients of the global batch on every rank.
            Turn off when the trainer reduces those parameters over these ranks itself
            (e.g. DDP over the same ranks would otherwise count them twice).
        compute_dtype: float64 (default) or float32.
        round_bf16: the kernels' BF16 rounding points (:mod:`megamoe.reference`).
        max_tokens: static ``T_max`` of the group (the pool sized for it, not for the
            largest received count; agreed with the rest: see
            :func:`~megamoe.ep.plan.plan_dispatch`).
        check_ids: reject ids outside ``[-1, E)`` on any rank (every rank raises).

    Returns:
        ``out`` ``[T, H]`` in ``compute_dtype``; gradients come back in each input's dtype.
    """
    # A refusal here is this rank's alone: it joins the peers' agreement first, so that
    # they raise too instead of waiting for it.
    try:
        check_tensor("w13_local", w13_local, ndim=3)
        experts, two_i, hidden = w13_local.shape
        if two_i % 2:
            raise ValueError(f"w13_local: expected an even second dimension 2*I, got {two_i}")
        inter = two_i // 2
        check_tensor("w2_local", w2_local, shape=(experts, hidden, inter), device=w13_local.device)
        # Shapes only: bad id values are checked in plan_dispatch on every rank at once, so
        # no rank is left waiting in a collective.
        check_tensor("x", x, shape=(None, hidden), dtypes=_X_DTYPES)
        tokens = x.shape[0]
        check_tensor("topk_ids", topk_ids, shape=(tokens, None), dtypes=_ID_DTYPES, device=x.device)
        check_tensor(
            "topk_weights",
            topk_weights,
            shape=tuple(topk_ids.shape),
            dtypes=(torch.float32, torch.float64),
            device=x.device,
        )
        check_tensor("w13_local", w13_local, ndim=3, device=x.device)
        activation_clamp = _check_options(activation, activation_clamp, compute_dtype)
        _check_side(side_local, hidden, inter, experts, x.device)
        world = group_size(group)
        if num_experts is None:
            num_experts = experts * world
        check_int("num_experts", num_experts, minimum=1)
        if num_experts != experts * world:
            raise ValueError(
                f"num_experts: expected E_l * P = {experts} * {world} = {experts * world} "
                f"(w13_local holds E_l={experts}), got {num_experts}"
            )
        flags = (("reduce_shared_grads", reduce_shared_grads), ("round_bf16", round_bf16))
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    except Exception as error:  # the peers wait in plan_dispatch's agreement
        refuse_on_every_rank(error, group, len(_UNIFORM_NAMES), x)
    uniform_values = (
        hidden,
        inter,
        0 if side_local is None else side_local.rank,
        ACTIVATIONS.index(activation),
        -1 if activation_clamp is None else float_bits(float(activation_clamp)),
        float_bits(float(side_local.scale) if side_local is not None else 0.0),
        64 if compute_dtype == torch.float64 else 32,
        int(round_bf16),
        int(reduce_shared_grads),
    )
    uniform = dict(zip(_UNIFORM_NAMES, uniform_values, strict=True))
    plan = plan_dispatch(
        topk_ids,
        num_experts,
        group=group,
        max_tokens=max_tokens,
        check_ids=check_ids,
        uniform=uniform,
    )
    options = {
        "topk_ids": topk_ids,
        "scale": side_local.scale if side_local is not None else 0.0,
        "activation": activation,
        "activation_clamp": activation_clamp,
        "compute_dtype": compute_dtype,
        "round_bf16": round_bf16,
        "reduce_shared_grads": reduce_shared_grads,
    }
    side_tensors = side_local.tensors() if side_local is not None else ()
    return _EPReferenceMoE.apply(options, plan, x, topk_weights, w13_local, w2_local, *side_tensors)
