"""``megamoe::moe_ep_forward`` and ``megamoe::moe_ep_backward``: the fused expert-parallel
layer (:mod:`megamoe.ep.fused_layer`'s stages) as torch custom ops, what
``mm.moe(group=pg)`` and :func:`megamoe.ep.fused_moe` run.

They keep the EP1 ops' conventions (:mod:`megamoe.custom_ops.layer`): named inputs, the adapters as
the six optional tensors ``a1, b1, a3, b3, a2, b2`` (all None: no adapters) plus
``scale``, the forward's plan handed to the backward in its state outputs (nothing is
planned again), real and fake implementations running the same argument checks on the
call's inputs (the backward's fake does not check the saved state against the plan,
which needs the plan's host values), and a FLOP formula per op
(:mod:`megamoe.custom_ops.flop_formulas`). What EP adds (docs/DESIGN-NOTES.md, "The op
layer"):

- the process group by name (``group.group_name``, resolved through torch.distributed's
  registry, as torch's functional collectives do; ``""``: one process);
- the forward plans the dispatch inside the op (:func:`~megamoe.ep.plan.plan_dispatch`:
  the collectives and the step's one host read, the gathered agreement and route
  counts), and its state carries the plan:
  the send routes, the received rows' experts, the receiver's pool plan, and the host
  split sizes as a CPU int64 tensor ``host_plan`` (so the backward reads no device
  value to size its exchanges);
- the state's sizes depend on every rank's routing, so the fake implementation gives
  them unbacked sizes (``torch.library.get_ctx().new_dynamic_size()``): a
  ``torch.compile(fullgraph=True)`` EP step traces both ops, with static or symbolic
  input sizes (tests/cpu/test_ep_ops.py, on gloo); a
  fake call without a shape environment (meta tensors, a bare ``FakeTensorMode``) can
  only be an inference call (``save="none"``, every state output empty).

Eagerly, on plain tensors (CUDA, or CPU on gloo) outside torch.compile, functorch
transforms and dispatch or torch-function modes, :func:`moe` calls the two
implementations through an autograd Function (``_EagerMoeEpForward``) instead of the
registered ops, as EP1's eager route does: the same functions and collectives in the same
order, the same bits, 0.24-0.35 ms less host time per call (docs/PERFORMANCE.md,
fifty-first session).
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from ..custom_ops.autocast import autocast_off
from ..custom_ops.eager_route import eager_forward, takes_eager_route
from ..custom_ops.inputs import (
    GRAD_NAMES,
    MASTER_GRADS,
    SIDE_NAMES,
    base_weights,
    empty,
    grads_for_inputs,
    input_names,
    mark_preact_written,
    master_dtypes,
    needs_by_input,
    requires_grad,
    save_inputs_and_state,
    saved_inputs_and_state,
    with_master_grads,
)
from ..custom_ops.inputs import side_lora as side_lora_of
from ..heuristics import mxfp4_master_decodes_once
from ..pipeline.fused_forward import SAVE_MODES, stage
from ..side_lora import SideLoRA
from ..validation import check_block_m, check_devices, check_moe_inputs
from ..validation.arguments import check_str_choice, check_tensor
from ..validation.layer import check_plan_block_m
from ..weights import BaseWeights
from ..wrappers.grouped_gemm import ACTIVATIONS
from ..wrappers.routing import RoutePlan
from .fused_layer import ep_backward_stages, ep_forward_stages, float_bits
from .plan import (
    DispatchPlan,
    ExpertPartition,
    check_max_tokens,
    group_rank,
    group_size,
    plan_dispatch,
    refuse_on_every_rank,
)

__all__ = ["moe"]

#: The forward's state outputs, in order, after ``out``.
_STATE_NAMES = (
    "send_routes",  # [N_send] int64
    "recv_expert",  # [N_recv] int64
    "pool_expert_counts",  # [E_l] int32: the receiver's pool plan
    "pool_expert_pool_offsets",  # [E_l + 1] int32
    "pool_route_to_pool_row",  # [pool routes, 1] int32
    "pool_row_to_route",  # [pool capacity] int32
    "host_plan",  # CPU int64 [6 + 2P]: T, K, T_max, BLOCK_M, recv capacity, P, splits
    "preact",  # [pool capacity, 2I] bfloat16, or empty (activation checkpointing)
    "recv_x",  # [pool routes, H] bfloat16 (a trainable base), else empty
    "recv_q13",  # [pool routes, 2r] bfloat16 (the side path), else empty
    "p_sum",  # [T, r] bfloat16 (the side path), else empty
    # An MXFP4 base given with its masters (ordinary mode) and decoded once for this
    # call: its BF16 decode, which the backward reads in place of the codes, else
    # [0, 2I, H] / [0, H, I] (1-D empty without masters: see _decoded_state).
    "w13_decoded",  # [E_l, 2I, H] bfloat16
    "w2_decoded",  # [E_l, H, I] bfloat16
)
#: The state outputs that the backward stages take as their ``saved`` tensors.
_SAVED_STAGE_STATE = ("preact", "recv_x", "recv_q13", "p_sum")
_HOST_FIELDS = 6

#: What every rank's forward must hold alike, checked in plan_dispatch's one all-gather
#: (its ``uniform``, in this order). A rank that refuses its inputs before that joins it
#: with as many placeholders (refuse_on_every_rank).
_UNIFORM_NAMES = (
    "hidden",
    "intermediate",
    "side_rank",
    "base format (0 bf16, 1 mxfp4)",
    "activation",
    "side.scale (float64 bits)",
    "activation_clamp (float64 bits, -1: None)",
    "reduce_shared_grads",
    # Every rank runs the backward (its collectives) if any does, and a checkpointed
    # call's backward exchanges the token rows once more: the ranks agree on both.
    "save (0: no backward, 1: pre-activations kept, 2: activation_checkpoint)",
)


def raise_with_the_group(
    error: Exception, group: dist.ProcessGroup | None, x: object = None
) -> NoReturn:
    """Raise ``error``, this rank's refusal of its own EP call, after the peers learn of it:
    they wait in the forward's agreement all-gather, which this rank joins with its
    refusal flagged, so that every rank raises (:func:`~megamoe.ep.plan.refuse_on_every_rank`;
    on ``x``'s device where it is a tensor, the device the peers' ids are on).
    Under torch.compile's tracing no collective runs: it just raises (a refusal while
    tracing stays this rank's: see docs/EXPERT-PARALLEL.md)."""
    if torch.compiler.is_compiling():
        raise error
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise error  # an EP step cannot be captured: no collective (fused_moe says so)
    refuse_on_every_rank(error, group, len(_UNIFORM_NAMES), x)


def _group(name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``name`` (``""``: None, one process)."""
    if not isinstance(name, str):
        raise TypeError(f"group_name: expected a str, got {type(name).__name__}")
    if name == "":
        return None
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception as error:  # torch raises a bare ValueError/KeyError/RuntimeError
        raise ValueError(f"group_name: no process group named {name!r}") from error


def _layer_inputs(
    x, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales, side, scale, activation,
    activation_clamp, masters=(None, None),
) -> tuple[BaseWeights, SideLoRA | None]:  # fmt: skip
    """The checked ``(base, side)`` of one call (real and fake alike, any device)."""
    base = base_weights(w13, w2, w13_scales, w2_scales)
    side_lora = side_lora_of(side, scale)
    check_moe_inputs(
        x,
        topk_ids,
        topk_weights,
        base,
        side_lora,
        activation,
        activation_clamp,
        require_cuda=False,
        allow_no_tokens=True,
        masters=masters,
    )
    return base, side_lora


def _decodes_once(base: BaseWeights, has_masters: bool, plan: DispatchPlan, save: str) -> bool:
    """Whether a training forward on an MXFP4 base given with its masters decodes the
    base once for the call (its GEMMs and the backward's on that BF16 decode, which the
    state keeps) instead of running every GEMM on the codes: above the in-pipeline
    limit (:func:`~megamoe.heuristics.mxfp4_master_decodes_once`, on the receiver's
    pool, whose capacity is the same on every rank), where each MXFP4 GEMM would make a
    transient decode of its own, in the forward and again in the backward. The same
    bits either way."""
    if not has_masters or save == "none" or not plan.pool_capacity:
        return False
    return mxfp4_master_decodes_once(plan.pool_capacity, base.num_experts)


def _decoded_state(x: torch.Tensor, base: BaseWeights, has_masters: bool) -> tuple:
    """The absent ``(w13_decoded, w2_decoded)``: with masters 3-D of no experts (the
    fake implementation sizes them by a dynamic size, 0 or ``E_l``), else 1-D empties."""
    if not has_masters:
        return empty(x), empty(x)
    hidden, inter = base.hidden, base.intermediate
    return x.new_empty(0, 2 * inter, hidden), x.new_empty(0, hidden, inter)


def _moe_ep_forward_impl(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scales: torch.Tensor | None,  # MXFP4 base: the UE8M0 scales; None for BF16
    w2_scales: torch.Tensor | None,
    a1: torch.Tensor | None,  # the six adapter tensors, or six Nones: no adapters
    b1: torch.Tensor | None,
    a3: torch.Tensor | None,
    b3: torch.Tensor | None,
    a2: torch.Tensor | None,
    b2: torch.Tensor | None,
    scale: float,
    activation: str,
    activation_clamp: float | None,
    group_name: str,
    max_tokens: int | None,
    check_ids: bool,
    reduce_shared_grads: bool,
    keep_x: bool,
    save: str,
    # MXFP4 in ordinary mode: the trainable masters (never read; the backward's weight
    # gradients go to them, in their dtype), else None. Last, with defaults.
    w13_master: torch.Tensor | None = None,
    w2_master: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """``(out, *state)`` (``_STATE_NAMES``); ``save="none"`` (inference): every state
    output empty; ``"recompute"`` (activation checkpointing): ``preact``, ``recv_x`` and
    ``recv_q13`` empty, the backward exchanges the token rows again and recomputes
    GEMM1's pre-activations. A collective over the group: every rank calls it."""
    group = _group(group_name)
    has_masters = w13_master is not None or w2_master is not None
    try:
        base, side = _layer_inputs(
            x, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales,
            (a1, b1, a3, b3, a2, b2), scale, activation, activation_clamp,
            (w13_master, w2_master),
        )  # fmt: skip
        check_str_choice("save", save, SAVE_MODES)
    except Exception as error:  # the peers wait in the agreement
        raise_with_the_group(error, group, x)
    # Everything that must match across ranks is checked in plan_dispatch's one
    # all-gather, so a mismatch raises on every rank instead of hanging a collective:
    # shapes, the activation, the adapter scale and clamp (their float bits; a zero
    # scale drops the adapter columns from every exchange).
    uniform_values = (
        base.hidden,
        base.intermediate,
        0 if side is None else side.rank,
        int(base.format == "mxfp4"),
        tuple(ACTIVATIONS).index(activation),
        float_bits(scale if side is not None else 0.0),
        -1 if activation_clamp is None else float_bits(float(activation_clamp)),
        int(reduce_shared_grads),
        SAVE_MODES.index(save),
    )
    uniform = dict(zip(_UNIFORM_NAMES, uniform_values, strict=True))
    plan = plan_dispatch(
        topk_ids,
        base.num_experts * group_size(group),
        group=group,
        max_tokens=max_tokens,
        check_ids=check_ids,
        uniform=uniform,
    )
    decoded = _decoded_state(x, base, has_masters)
    with autocast_off(x.device):  # the layer keeps its own precision
        if _decodes_once(base, has_masters, plan, save):
            with stage("mxfp4_decode_once"):
                base = BaseWeights(
                    "bf16", base.w13_for_gemm(), base.w2_for_gemm(), None, None,
                    base.num_experts, base.hidden, base.intermediate,
                )  # fmt: skip
            decoded = (base.w13, base.w2)
        out, saved = ep_forward_stages(
            plan, x, topk_weights, base, side, activation=activation,
            activation_clamp=activation_clamp, keep_x=keep_x and save == "preact",
            keep_preact=save == "preact",
        )  # fmt: skip
    if save == "none":
        return (out, *(empty(x) for _ in _STATE_NAMES))
    host_plan = torch.tensor(
        [
            plan.num_tokens,
            plan.top_k,
            plan.max_tokens,
            plan.block_m,
            plan.recv_capacity,
            plan.partition.world_size,
            *plan.send_splits,
            *plan.recv_splits,
        ],
        dtype=torch.int64,
    )
    routes = plan.pool
    return (
        out,
        plan.send_routes,
        plan.recv_expert,
        routes.expert_counts,
        routes.expert_pool_offsets,
        routes.route_to_pool_row,
        routes.pool_row_to_route,
        host_plan,
        *(empty(x) if saved[name] is None else saved[name] for name in _SAVED_STAGE_STATE),
        *decoded,
    )


_moe_ep_forward_op = torch.library.custom_op("megamoe::moe_ep_forward", mutates_args=())(
    _moe_ep_forward_impl
)


@_moe_ep_forward_op.register_fake
def _(
    x,
    topk_ids,
    topk_weights,
    w13,
    w2,
    w13_scales,
    w2_scales,
    a1,
    b1,
    a3,
    b3,
    a2,
    b2,
    scale,
    activation,
    activation_clamp,
    group_name,
    max_tokens,
    check_ids,
    reduce_shared_grads,
    keep_x,
    save,
    w13_master=None,
    w2_master=None,
):
    base, side = _layer_inputs(
        x, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales, (a1, b1, a3, b3, a2, b2),
        scale, activation, activation_clamp, (w13_master, w2_master),
    )  # fmt: skip
    check_str_choice("save", save, SAVE_MODES)
    world = group_size(_group(group_name))
    out = x.new_empty(x.shape)
    if save == "none":
        return (out, *(x.new_empty(0) for _ in _STATE_NAMES))
    # Sized by every rank's routing: unbacked sizes (see the module docstring).
    ctx = torch.library.get_ctx()
    num_send, num_recv = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    pool_routes, capacity = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    experts = base.num_experts
    index = dict(dtype=torch.int32, device=x.device)
    use_side = side is not None and side.scale != 0.0
    rank = side.rank if use_side else 0
    kept = save == "preact"  # "recompute": the backward recomputes these
    decoded = _decoded_state(x, base, w13_master is not None or w2_master is not None)
    if decoded[0].dim() == 3:  # with masters: decoded once or not, as the pool decides
        decoded_experts = ctx.new_dynamic_size()
        hidden, inter = base.hidden, base.intermediate
        decoded = (
            x.new_empty(decoded_experts, 2 * inter, hidden),
            x.new_empty(decoded_experts, hidden, inter),
        )
    return (
        out,
        torch.empty(num_send, dtype=torch.int64, device=x.device),
        torch.empty(num_recv, dtype=torch.int64, device=x.device),
        torch.empty(experts, **index),
        torch.empty(experts + 1, **index),
        torch.empty(pool_routes, 1, **index),
        torch.empty(capacity, **index),
        torch.empty(_HOST_FIELDS + 2 * world, dtype=torch.int64),
        x.new_empty(capacity, 2 * base.intermediate) if kept else x.new_empty(0),
        x.new_empty(pool_routes, base.hidden) if keep_x and kept else x.new_empty(0),
        x.new_empty(pool_routes, 2 * rank) if use_side and kept else x.new_empty(0),
        x.new_empty(x.shape[0], rank) if use_side else x.new_empty(0),
        *decoded,
    )


def _check_state(
    state: dict, x: torch.Tensor, base: BaseWeights, side: SideLoRA | None, splits: list[int]
) -> None:
    """The forward's state outputs as the backward reads them: dtypes, shapes that agree
    with each other and with the plan's splits, every tensor on ``x``'s device."""
    world = len(splits) // 2
    sent, received = sum(splits[:world]), sum(splits[world:])
    i32, i64 = (torch.int32,), (torch.int64,)
    experts = base.num_experts
    check_tensor("send_routes", state["send_routes"], shape=(sent,), dtypes=i64)
    check_tensor("recv_expert", state["recv_expert"], shape=(received,), dtypes=i64)
    check_tensor("pool_expert_counts", state["pool_expert_counts"], shape=(experts,), dtypes=i32)
    check_tensor(
        "pool_expert_pool_offsets",
        state["pool_expert_pool_offsets"],
        shape=(experts + 1,),
        dtypes=i32,
    )
    routes = check_tensor(
        "pool_route_to_pool_row", state["pool_route_to_pool_row"], shape=(None, 1), dtypes=i32
    ).shape[0]
    if routes < received:
        raise ValueError(
            f"pool_route_to_pool_row: {routes} rows for the {received} received routes of the plan"
        )
    capacity = check_tensor(
        "pool_row_to_route", state["pool_row_to_route"], ndim=1, dtypes=i32
    ).shape[0]
    rank = 0 if side is None else side.rank
    rows = {
        "preact": (capacity, 2 * base.intermediate),
        "recv_x": (routes, base.hidden),
        "recv_q13": (routes, 2 * rank),
        "p_sum": (x.shape[0], rank),
    }
    present = {}
    for name, shape in rows.items():  # absent: a 1-D empty
        present[name] = state[name].dim() != 1 or state[name].numel() != 0
        if present[name]:
            check_tensor(name, state[name], shape=shape, dtypes=(torch.bfloat16,))
    if side is not None and side.scale != 0.0:
        # The side path reads p_sum (db2) and, unless it recomputes them (no saved
        # preact), the received q13 rows (db1, db3): refused here, before the exchanges
        # and dgrad2 overwrite preact, not as an unnamed error midway.
        for name in ("p_sum", "recv_q13") if present["preact"] else ("p_sum",):
            if not present[name]:
                raise ValueError(
                    f"{name}: the adapters' backward needs the forward's {name}, saved empty "
                    "(a forward without the side path, or another call's state)"
                )
    _check_decoded_state(state, base)
    check_devices([("x", x), *((n, t) for n, t in state.items() if n != "host_plan")], "x")


def _check_decoded_state(state: dict, base: BaseWeights) -> None:
    """``w13_decoded``/``w2_decoded`` as the forward leaves them: 1-D empties, or 3-D
    BF16 of the decode's shapes with no experts or all of them (the decode of an MXFP4
    base), the two alike."""
    w13_decoded, w2_decoded = state["w13_decoded"], state["w2_decoded"]
    if w13_decoded.dim() == 1 and w2_decoded.dim() == 1:
        check_tensor("w13_decoded", w13_decoded, shape=(0,))
        check_tensor("w2_decoded", w2_decoded, shape=(0,))
        return
    experts = check_tensor("w13_decoded", w13_decoded, ndim=3).shape[0]
    if base.format != "mxfp4" or experts not in (0, base.num_experts):
        raise ValueError(
            f"w13_decoded: expected the decode of the call's MXFP4 base or no experts, got "
            f"shape {list(w13_decoded.shape)} beside a {base.format} base of "
            f"{base.num_experts} experts"
        )
    hidden, inter = base.hidden, base.intermediate
    bf16 = (torch.bfloat16,)
    check_tensor("w13_decoded", w13_decoded, shape=(experts, 2 * inter, hidden), dtypes=bf16)
    check_tensor("w2_decoded", w2_decoded, shape=(experts, hidden, inter), dtypes=bf16)


def _plan(
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    state: dict,
) -> DispatchPlan:
    """The forward's :class:`DispatchPlan` from its state outputs (no collective), after
    checking that they are the forward's of this call."""
    host = check_tensor("host_plan", state["host_plan"], ndim=1, dtypes=(torch.int64,))
    if host.device.type != "cpu" or host.numel() < _HOST_FIELDS:
        raise ValueError("host_plan: expected the forward's CPU int64 plan")
    values = host.tolist()
    tokens, top_k, max_tokens, block_m, capacity, world = values[:_HOST_FIELDS]
    if world != group_size(group) or len(values) != _HOST_FIELDS + 2 * world:
        raise ValueError(f"host_plan: made for {world} ranks, the group has {group_size(group)}")
    if (tokens, top_k) != tuple(topk_weights.shape):
        raise ValueError(
            f"host_plan: made for (T, K) = {(tokens, top_k)}, got topk_weights of shape "
            f"{list(topk_weights.shape)}"
        )
    try:
        check_block_m(block_m)
    except ValueError as error:
        raise ValueError(f"host_plan: the forward's plan is corrupt ({error})") from None
    splits = values[_HOST_FIELDS:]
    _check_state(state, x, base, side, splits)
    if state["pool_route_to_pool_row"].shape[0]:  # (an empty pool holds no rows at all)
        # The kernels find each expert's tiles as offset / BLOCK_M: a BLOCK_M the pool was
        # not planned with pairs rows with the wrong expert's weights.
        check_plan_block_m(
            block_m, state["pool_route_to_pool_row"], state["pool_row_to_route"],
            base.num_experts,
        )  # fmt: skip
    pool = RoutePlan(
        state["pool_expert_counts"],
        state["pool_expert_pool_offsets"],
        state["pool_route_to_pool_row"],
        state["pool_row_to_route"],
        block_m,
    )
    return DispatchPlan(
        partition=ExpertPartition(base.num_experts * world, world, group_rank(group)),
        num_tokens=tokens,
        top_k=top_k,
        max_tokens=max_tokens,
        block_m=block_m,
        send_routes=state["send_routes"],
        send_splits=tuple(splits[:world]),
        recv_splits=tuple(splits[world:]),
        recv_expert=state["recv_expert"],
        recv_capacity=capacity,
        pool=pool,
        group=group,
    )


# ``preact`` is written over: dgrad2's epilogue leaves dg | du in the saved pre-activations
# (their last reader), so the schema declares it mutated.
def _moe_ep_backward_impl(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2_scales: torch.Tensor | None,
    a1: torch.Tensor | None,
    b1: torch.Tensor | None,
    a3: torch.Tensor | None,
    b3: torch.Tensor | None,
    a2: torch.Tensor | None,
    b2: torch.Tensor | None,
    scale: float,
    activation: str,
    activation_clamp: float | None,
    group_name: str,
    reduce_shared_grads: bool,
    send_routes: torch.Tensor,
    recv_expert: torch.Tensor,
    pool_expert_counts: torch.Tensor,
    pool_expert_pool_offsets: torch.Tensor,
    pool_route_to_pool_row: torch.Tensor,
    pool_row_to_route: torch.Tensor,
    host_plan: torch.Tensor,
    preact: torch.Tensor,
    recv_x: torch.Tensor,
    recv_q13: torch.Tensor,
    p_sum: torch.Tensor,
    w13_decoded: torch.Tensor,
    w2_decoded: torch.Tensor,
    base_grads: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """``(dx, dtopk_weights, dw13, dw2, da1, db1, da3, db3, da2, db2)``; gradients not
    computed are empty (the base's without ``base_grads``, the adapters' without an
    active adapter). ``dtopk_weights`` is float32; the base's gradients are BF16
    ``[E_l, 2I, H]`` / ``[E_l, H, I]`` whatever its format (an MXFP4 base's: with respect
    to its exact decode). A collective over the group."""
    base, side = _backward_inputs(
        dout, x, topk_weights, w13, w2, w13_scales, w2_scales, (a1, b1, a3, b3, a2, b2), scale,
        activation, activation_clamp, base_grads, recv_x, preact,
    )  # fmt: skip
    state = dict(zip(_STATE_NAMES, (
        send_routes, recv_expert, pool_expert_counts, pool_expert_pool_offsets,
        pool_route_to_pool_row, pool_row_to_route, host_plan, preact, recv_x, recv_q13, p_sum,
        w13_decoded, w2_decoded,
    ), strict=True))  # fmt: skip
    group = _group(group_name)
    plan = _plan(group, x, topk_weights, base, side, state)
    if w13_decoded.dim() == 3 and w13_decoded.shape[0]:  # the forward's decode of the codes
        base = BaseWeights(
            "bf16", w13_decoded, w2_decoded, None, None, base.num_experts, base.hidden,
            base.intermediate,
        )  # fmt: skip
    # Absent saved tensors are 1-D empties; present ones are 2-D (maybe of zero rows).
    saved = {name: (state[name] if state[name].dim() == 2 else None) for name in _SAVED_STAGE_STATE}
    with autocast_off(x.device):
        grads = ep_backward_stages(
            plan, dout, x, topk_weights, base, side, saved, activation=activation,
            activation_clamp=activation_clamp, base_grads=base_grads,
            reduce_shared=reduce_shared_grads,
        )  # fmt: skip
    return tuple(empty(x) if grads[name] is None else grads[name] for name in GRAD_NAMES)


def _backward_inputs(
    dout, x, topk_weights, w13, w2, w13_scales, w2_scales, side, scale, activation,
    activation_clamp, base_grads, recv_x, preact,
) -> tuple[BaseWeights, SideLoRA | None]:  # fmt: skip
    """The checked ``(base, side)`` of one backward call: the forward's checks on its
    inputs (the ids stand in by the weights' shape), plus ``dout``."""
    placeholder_ids = torch.empty(topk_weights.shape, dtype=torch.int64, device=x.device)
    base, side_lora = _layer_inputs(
        x, placeholder_ids, topk_weights, w13, w2, w13_scales, w2_scales, side, scale,
        activation, activation_clamp,
    )  # fmt: skip
    check_tensor("dout", dout, shape=tuple(x.shape), dtypes=(torch.bfloat16,), device=x.device)
    if base_grads and recv_x.dim() != 2 and preact.dim() == 2:
        # The forward kept no received x (keep_x=False): dw13 cannot be formed.
        raise ValueError("base_grads: the forward kept no received x rows (keep_x=False)")
    return base, side_lora


_moe_ep_backward_op = torch.library.custom_op("megamoe::moe_ep_backward", mutates_args=("preact",))(
    _moe_ep_backward_impl
)


@_moe_ep_backward_op.register_fake
def _(
    dout,
    x,
    topk_weights,
    w13,
    w2,
    w13_scales,
    w2_scales,
    a1,
    b1,
    a3,
    b3,
    a2,
    b2,
    scale,
    activation,
    activation_clamp,
    group_name,
    reduce_shared_grads,
    send_routes,
    recv_expert,
    pool_expert_counts,
    pool_expert_pool_offsets,
    pool_route_to_pool_row,
    pool_row_to_route,
    host_plan,
    preact,
    recv_x,
    recv_q13,
    p_sum,
    w13_decoded,
    w2_decoded,
    base_grads,
):
    base, _ = _backward_inputs(
        dout, x, topk_weights, w13, w2, w13_scales, w2_scales, (a1, b1, a3, b3, a2, b2), scale,
        activation, activation_clamp, base_grads, recv_x, preact,
    )  # fmt: skip
    use_side = a1 is not None and scale != 0.0
    side = (a1, b1, a3, b3, a2, b2)
    experts, hidden, inter = base.num_experts, base.hidden, base.intermediate
    return (
        x.new_empty(x.shape),
        topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
        x.new_empty(experts, 2 * inter, hidden) if base_grads else x.new_empty(0),
        x.new_empty(experts, hidden, inter) if base_grads else x.new_empty(0),
        *(t.new_empty(t.shape) if use_side else x.new_empty(0) for t in side),
    )


_FORWARD_INPUTS = input_names(_moe_ep_forward_op)


def _forward_setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_FORWARD_INPUTS, inputs, strict=True))
    ctx.eager = False  # the eager route sets it (_EagerMoeEpForward)
    ctx.save = args["save"]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    if ctx.save == "none":
        return
    ctx.options = {
        name: args[name]
        for name in ("scale", "activation", "activation_clamp", "group_name", "reduce_shared_grads")
    }
    ctx.master_dtypes = master_dtypes(args)  # only their dtypes: values never read
    save_inputs_and_state(ctx, args, output[1:])


def _forward_backward(ctx, dout, *_state_grads):
    if dout is None:  # no gradient reached the output (grads are not materialized)
        return (None,) * len(_FORWARD_INPUTS)
    if ctx.save == "none":
        raise RuntimeError(
            "megamoe::moe_ep_forward: called with save='none', which keeps no state for a "
            "backward; call it with save='preact' or 'recompute' (mm.moe does)"
        )
    inputs, state = saved_inputs_and_state(ctx, _STATE_NAMES)
    needs = needs_by_input(_FORWARD_INPUTS, ctx.needs_input_grad)
    args = dict(
        dout=dout.to(torch.bfloat16).contiguous(),
        **inputs,
        **ctx.options,
        **state,
        base_grads=any(needs[name] for name in ("w13", "w2", *MASTER_GRADS)),
    )
    if ctx.eager:  # the backward op's implementation, in a profiler range of its name
        with stage("moe_ep_backward"):
            grads = _moe_ep_backward_impl(**args)
        # What the op's declared mutation of preact does on every call: a second backward
        # through this graph (retain_graph=True) then fails autograd's saved-tensor check
        # on every rank, as on the op route, also where no rank had a route to compute
        # (the stages then never write preact).
        torch.autograd.graph.increment_version(args["preact"])
    else:
        grads = _moe_ep_backward_op(**args)
    mark_preact_written(ctx, state)
    result = grads_for_inputs(
        _FORWARD_INPUTS, grads, needs, inputs, has_side=ctx.has_side, scale=ctx.options["scale"]
    )
    return with_master_grads(_FORWARD_INPUTS, result, grads, needs, ctx.master_dtypes)


_moe_ep_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup_context)


#: fused_moe's eager route (megamoe.custom_ops.eager_route), as EP1's: on plain tensors
#: (CUDA, or CPU on gloo) outside torch.compile, functorch transforms and any dispatch or
#: torch-function mode; the same functions and collectives in the same order, the same
#: bits as the ops.
_EagerMoeEpForward = eager_forward(
    "moe_ep_forward", _moe_ep_forward_impl, _forward_setup_context, _forward_backward
)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None = None,
    *,
    group: dist.ProcessGroup | None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    reduce_shared_grads: bool = True,
    max_tokens: int | None = None,
    check_ids: bool = True,
    activation_checkpoint: bool = False,
) -> torch.Tensor:
    """The MoE layer with experts sharded over ``group``, on the fused pipeline.

    What ``mm.moe(..., group=pg)`` runs (a collective: every rank of ``group`` calls it,
    and every rank runs the backward if any does), through ``megamoe::moe_ep_forward``
    and ``megamoe::moe_ep_backward``. On CPU tensors (gloo) the stages run their torch
    twins, which is how the EP logic is tested without GPUs.

    Args:
        x: ``[T, H]`` BF16 tokens of this rank (``T`` may differ between ranks, or be 0).
        topk_ids: ``[T, K]`` int32/int64 *global* expert ids in ``[-1, E)``.
        topk_weights: ``[T, K]`` float32, differentiable.
        base: this rank's experts (:func:`~megamoe.prepare_base_weights` of ``[E_l, ...]``,
            global ids ``rank * E_l ..``), format ``"bf16"`` or ``"mxfp4"``. An MXFP4
            base with trainable masters (ordinary mode) stays packed: the op takes the
            masters and gives them the gradient at the MXFP4 values, and decodes the
            base once for the call where the received pool is above the in-pipeline
            limit (:func:`~megamoe.heuristics.mxfp4_master_decodes_once`).
        side: optional BF16 :class:`~megamoe.SideLoRA`: shared ``a1, a3, b2`` (the same on
            every rank) and this rank's ``b1, b3, a2``.
        group: the EP process group (NCCL on GPUs, gloo on CPU), or None (one process).
        activation, activation_clamp: as in ``mm.moe``.
        reduce_shared_grads: all-reduce (SUM) the ``a1, a3, b2`` gradients over the group
            so they do not depend on the EP degree (turn off if the trainer reduces them).
        max_tokens: a static ``T_max`` of the group: the pool sized for it (not for the
            largest received count); agreed and checked with the rest.
        check_ids: reject ids outside ``[-1, E)`` (every rank raises together).
        activation_checkpoint: keep no pre-activations and no received rows for the
            backward; it exchanges the token rows again and recomputes GEMM1 (bitwise
            the same gradients; the same on every rank, which the dispatch plan checks).

    Returns:
        ``[T, H]`` BF16.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # Named here, before the plan's first host read would break the capture.
        raise RuntimeError(
            "group: an expert-parallel step cannot be captured in a CUDA graph (the "
            "exchange's split sizes are host values); capture the EP1 layer (group=None)"
        )
    # The op checks again (real and fake); here first, so that a wrong type is named
    # before the tensors are asked whether they need gradients. A refusal here is this
    # rank's alone:
    # it joins the peers' agreement first, so that they raise too (not under
    # torch.compile's tracing, where no collective runs).
    try:
        if not isinstance(base, BaseWeights):
            raise TypeError(f"base: expected megamoe.BaseWeights, got {type(base).__name__}")
        check_moe_inputs(
            x, topk_ids, topk_weights, base, side, activation, activation_clamp,
            require_cuda=False, allow_no_tokens=True,
        )  # fmt: skip
        # Ordinary mode on an MXFP4 base: kept packed, the op given the masters, whose
        # gradients its backward gives; the op decodes the base once itself where the
        # received pool is large (_decodes_once). The same bits as the straight-through
        # decode of EP1's larger pools.
        masters = (None, None)
        if base.decodes_for_call:
            masters = (base.w13_master, base.w2_master)
        base = base.for_call(decode_master=False)
        flags = (
            ("reduce_shared_grads", reduce_shared_grads),
            ("check_ids", check_ids),
            ("activation_checkpoint", activation_checkpoint),
        )
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if max_tokens is not None:
            check_max_tokens(max_tokens)  # the op's schema holds int64 only
    except Exception as error:  # the peers wait in the agreement
        raise_with_the_group(error, group, x)
    group_name = ""
    if group is not None:
        try:
            group_name = group.group_name
        except RuntimeError as error:  # a ProcessGroup made by hand carries no name
            raise ValueError(
                "group: not registered with torch.distributed (make it with "
                "torch.distributed.new_group or init_process_group)"
            ) from error
    side_tensors = [None] * len(SIDE_NAMES) if side is None else list(side.tensors())
    # Under vmap a batched wrapper reads requires_grad False although autograd records
    # the op on what it wraps (an inference save mode then failed the backward).
    base_trainable = any(t is not None and requires_grad(t) for t in [base.w13, base.w2, *masters])
    needs_grad = torch.is_grad_enabled() and (
        base_trainable
        or any(t is not None and requires_grad(t) for t in [x, topk_weights, *side_tensors])
    )
    args = dict(
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        w13=base.w13,
        w2=base.w2,
        w13_scales=base.w13_scales,
        w2_scales=base.w2_scales,
        **dict(zip(SIDE_NAMES, side_tensors, strict=True)),
        scale=0.0 if side is None else side.scale,
        activation=activation,
        activation_clamp=activation_clamp,
        group_name=group_name,
        max_tokens=max_tokens,
        check_ids=check_ids,
        reduce_shared_grads=reduce_shared_grads,
        keep_x=needs_grad and base_trainable,
        save=("recompute" if activation_checkpoint else "preact") if needs_grad else "none",
        w13_master=masters[0],
        w2_master=masters[1],
    )
    tensors = [x, topk_ids, topk_weights, base.w13, base.w2, base.w13_scales, base.w2_scales]
    if takes_eager_route([*tensors, *masters, *side_tensors], require_cuda=False):
        return _EagerMoeEpForward.apply(*(args[name] for name in _FORWARD_INPUTS))[0]
    return _moe_ep_forward_op(**args)[0]
