"""The fused MoE forward on the GPU (EP1; BF16 or MXFP4 base), DESIGN §3 pipeline:

route plan -> q13 = x [a1|a3] once per token -> gather [x | q13] into the pool ->
GEMM1 + side K segment + gated activation -> GEMM2 + a2 N segment -> per-token
side sum -> b2 expand once per token -> combine (k summed in order, FP32).

Each stage runs in a ``torch.profiler.record_function`` range ``megamoe::<stage>``
(:func:`stage`), so profiles and traces show the pipeline; the ranges sit in the custom
ops' real implementations, which torch.compile does not trace.

No host synchronisation: the route plan's kernels also check the id range, reported by
a later call (:func:`megamoe.wrappers.routing.plan_routes`). A zero adapter scale takes
the no-adapter path, so its output is bitwise the no-adapter output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from ..side_lora import SideLoRA
from ..validation.arguments import check_str_choice
from ..weights import BaseWeights
from ..wrappers import pool
from ..wrappers.grouped_gemm import gated_grouped_gemm_unchecked, grouped_gemm_unchecked
from ..wrappers.routing import RoutePlan, plan_routes

#: What the forward keeps for the backward (see :func:`moe_forward`).
SAVE_MODES = ("none", "preact", "recompute")


def stage(name: str) -> contextlib.AbstractContextManager:
    """The profiler range ``megamoe::<name>`` of one pipeline stage while a profiler runs;
    otherwise no range (an idle ``record_function`` still costs ~4 us of host time)."""
    return record_function(f"megamoe::{name}") if _profiler_enabled() else contextlib.nullcontext()


@dataclass(frozen=True, eq=False)
class ForwardState:
    """What the fused backward needs beyond the call's inputs (DESIGN §3 memory policy).

    - ``plan``: the route plan (int32 index maps, ~8 bytes per route with the padding).
    - ``preact``: ``[pool_capacity, 2I]`` BF16 GEMM1 pre-activations ``g | u``, or None
      under activation checkpointing.
    - ``q13``: ``[T, 2r]`` BF16 ``[x a1 | x a3]`` (None without an active adapter).
    - ``p_sum``: ``[T, r]`` BF16 ``sum_k w p`` (None without an active adapter).
    """

    plan: RoutePlan
    preact: torch.Tensor | None
    q13: torch.Tensor | None
    p_sum: torch.Tensor | None


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None = None,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    block_m: int,
    save: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, ForwardState]:
    """``out [T, H]`` BF16 of DESIGN §1 on the fused kernels (see module docstring).

    The arguments are the ones the calling custom op checked
    (:func:`megamoe.validation.check_moe_inputs`); this function does not check them
    again, except the expert ids' range ``[-1, E_l)``, which it checks on the device
    without a host synchronisation in the route plan
    (:func:`~megamoe.wrappers.routing.plan_routes`: a ``ValueError`` from a later call or
    :func:`megamoe.check_errors`; the kernels treat such ids as masked).

    ``block_m``: the pool's segment padding, :func:`~megamoe.get_block_m` of the call's
    ``T``, ``K``, ``E_l`` (the caller decides once, and the backward reuses it with the
    plan). ``save``: ``"none"`` returns ``out``; ``"preact"`` also keeps GEMM1's pre-activations
    and returns ``(out, ForwardState)`` for :mod:`megamoe.pipeline.fused_backward`;
    ``"recompute"`` returns a state without them (the backward recomputes GEMM1:
    activation checkpointing).
    """
    check_str_choice("save", save, SAVE_MODES)
    experts = base.num_experts
    with stage("route_plan"):
        # Raises the earlier calls' finished id checks before it launches anything.
        plan = plan_routes(topk_ids, experts, block_m, id_limit=experts)

    # A zero scale contributes exact zeros: take the no-adapter path (bitwise equal).
    use_side = side is not None and side.scale != 0.0
    q13 = None
    if use_side:
        with stage("adapter_shrink"):
            # [T, 2r], once per token; one product (one cuBLAS call's host time less).
            q13 = x @ torch.cat([side.a1, side.a3], dim=1)
    preact = None
    if save == "preact":
        preact = torch.empty(
            plan.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16, device=x.device
        )
    pool_output = expert_stage(
        x,
        q13,
        plan,
        base,
        side if use_side else None,
        activation=activation,
        activation_clamp=activation_clamp,
        preact=preact,
    )
    side_expand = None
    p_sum = None
    if use_side:
        with stage("adapter_expand"):
            p_sum = pool.side_sum_unchecked(pool_output, plan, topk_weights, base.hidden)  # [T, r]
            side_expand = p_sum @ side.b2  # [T, H], once per token
    with stage("combine"):
        out = pool.combine_unchecked(
            pool_output,
            plan,
            topk_weights,
            side_expand,
            scale=side.scale if use_side else 0.0,
            hidden=base.hidden,
        )
    if save == "none":
        return out
    return out, ForwardState(plan=plan, preact=preact, q13=q13, p_sum=p_sum)


def gemm1(
    pool_input: torch.Tensor,
    plan: RoutePlan,
    base: BaseWeights,
    side: SideLoRA | None,
    *,
    activation: str,
    activation_clamp: float | None,
    preact: torch.Tensor | None,
) -> torch.Tensor:
    """GEMM1 + side K segment + gated activation over the pool: ``h`` ``[P, I]`` BF16.

    The one launch the forward, the checkpoint recompute and the EP layer share, so
    their pre-activations are bitwise equal. ``side``: None for no active adapter;
    ``preact``: optional ``[P, 2I]`` BF16 output of ``g``, ``u``.
    """
    with stage("gemm1"):
        side_args = {}
        if side is not None:
            side_args = dict(
                side_b_gate=side.b1,  # [E, r, I] as given, read MN-major
                side_b_up=side.b3,
                side_scale=side.scale,
            )
        # MXFP4: the codes and scales, decoded inside the GEMM pipeline.
        return gated_grouped_gemm_unchecked(
            pool_input,
            base.w13,
            plan,
            k=base.hidden,
            activation=activation,
            activation_clamp=activation_clamp,
            preact_out=preact,
            w13_scales=base.w13_scales,
            **side_args,
        )


def expert_stage(
    rows: torch.Tensor,
    side_rows: torch.Tensor | None,
    plan: RoutePlan,
    base: BaseWeights,
    side: SideLoRA | None,
    *,
    activation: str,
    activation_clamp: float | None,
    preact: torch.Tensor | None,
) -> torch.Tensor:
    """The experts over one pool: gather ``[rows | side_rows]``, GEMM1 (+ activation),
    GEMM2 (+ ``a2`` N segment). Returns ``[y | p]`` ``[P, H (+ r)]`` BF16.

    Shared by EP1 (``rows`` = tokens, ``side_rows`` = ``q13``) and the EP layer
    (``rows`` = received ``[x | q13]`` rows, ``side_rows`` None). The pool input, the
    largest forward buffer, is freed before GEMM2.
    """
    with stage("gather"):
        pool_input = pool.gather_pool_unchecked(rows, side_rows, plan)
    hidden_pool = gemm1(
        pool_input,
        plan,
        base,
        side,
        activation=activation,
        activation_clamp=activation_clamp,
        preact=preact,
    )
    del pool_input
    with stage("gemm2"):
        b_extra = None if side is None else side.a2  # [E, I, r] as given, read MN-major
        return grouped_gemm_unchecked(
            hidden_pool, base.w2, plan, b_extra=b_extra, b_scales=base.w2_scales
        )


def recompute_preact(
    x: torch.Tensor,
    state: ForwardState,
    base: BaseWeights,
    side: SideLoRA | None,
    *,
    activation: str,
    activation_clamp: float | None,
) -> torch.Tensor:
    """GEMM1's ``[pool_capacity, 2I]`` pre-activations again (activation checkpointing):
    the same gather and :func:`gemm1` launch as the forward, so bitwise the same values."""
    plan = state.plan
    use_side = state.q13 is not None
    with stage("gather"):
        pool_input = pool.gather_pool_unchecked(x, state.q13, plan)
    preact = torch.empty(
        plan.pool_capacity, 2 * base.intermediate, dtype=torch.bfloat16, device=x.device
    )
    gemm1(
        pool_input,
        plan,
        base,
        side if use_side else None,
        activation=activation,
        activation_clamp=activation_clamp,
        preact=preact,
    )
    return preact
