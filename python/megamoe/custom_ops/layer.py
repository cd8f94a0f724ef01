"""The EP1 layer's torch custom ops, what ``mm.moe`` (:func:`megamoe.moe`) runs.

One custom op per pass (EP1; BF16 or MXFP4 base), both with named inputs and the same
adapter encoding (:mod:`megamoe.custom_ops.inputs`), six optional tensors
``a1, b1, a3, b3, a2, b2`` (all None: no adapters) and a ``scale``:

- ``megamoe::moe_forward``: the forward (:func:`megamoe.pipeline.fused_forward.moe_forward`).
  ``save="none"`` (inference) keeps nothing; ``"preact"`` (training) and
  ``"recompute"`` (activation checkpointing) also return what the backward needs: the
  route plan, GEMM1's pre-activations (not with ``"recompute"``), ``q13``, ``p_sum``.
  These state outputs belong to the autograd formula: ``moe_backward`` writes ``dg |
  du`` over ``preact`` in place (a declared mutation), so a direct caller must not keep
  them, or return them from a compiled function, past the backward (only the first
  output, ``out``, is the caller's; ``mm.moe`` returns only it).
  An MXFP4 base in ordinary mode, kept packed, comes with its trainable masters
  (``w13_master``, ``w2_master``, last, default None: never read, given the base
  gradients). Its autograd formula calls
- ``megamoe::moe_backward``: :func:`megamoe.pipeline.fused_backward.moe_backward`, given the
  forward's plan (its saved index maps) and its BLOCK_M, nothing planned again.

Eagerly, on plain CUDA tensors, ``mm.moe`` calls the two ops' implementations through
an autograd Function with the forward op's autograd rules (``_EagerMoeForward``): the
same code and kernels without the custom-op dispatch, whose host time bounded
small-token calls. torch.compile, functorch transforms, dispatch and torch-function
modes (FlopCounterMode, FakeTensorMode, DTensor) and direct ``torch.ops.megamoe`` calls
get the ops. Of the transforms, vmap runs; ``torch.func.grad`` (and vjp, jacrev) does
not: torch's autograd for a custom op is an autograd.Function without the
``setup_context`` those transforms need, and it raises saying so.

The expert-parallel pair ``megamoe::moe_ep_forward`` / ``megamoe::moe_ep_backward``
(:mod:`megamoe.ep.ops`) keeps these ops' conventions: docs/DESIGN-NOTES.md ("The op
layer") says why it is a pair of its own. Both pairs' FLOP formulas:
:mod:`megamoe.custom_ops.flop_formulas`.

All have fake implementations (shapes known without a sync), so ``torch.compile``
traces them, and none synchronises with the host: the id range check runs on the device
and a later call (or :func:`megamoe.check_errors`) reports it. The real and the
fake implementations run the same argument checks (:mod:`megamoe.validation`): a call
with one tensor on ``meta`` (which dispatches to the fake) is rejected like any other
mixed-device call, and an all-fake call (tracing, ``FakeTensorMode``, a meta module)
gets outputs of the right shapes.
"""

from __future__ import annotations

import torch

from ..pipeline.fused_backward import moe_backward
from ..pipeline.fused_forward import SAVE_MODES, ForwardState, moe_forward, stage
from ..side_lora import SideLoRA
from ..validation import (
    check_backward_inputs,
    check_block_m,
    check_devices,
    check_moe_inputs,
)
from ..validation.arguments import check_str_choice, check_tensor, has_data
from ..validation.layer import check_plan_block_m
from ..weights import BaseWeights
from ..wrappers.routing import RoutePlan, pool_capacity
from .autocast import autocast_off
from .eager_route import eager_forward
from .inputs import (
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
    save_inputs_and_state,
    saved_inputs_and_state,
    with_master_grads,
)
from .inputs import side_lora as side_lora_of

_STATE_NAMES = (
    "expert_counts",
    "expert_pool_offsets",
    "route_to_pool_row",
    "pool_row_to_route",
    "preact",
    "q13",
    "p_sum",
)


def _op_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2_scales: torch.Tensor | None,
    masters: tuple[torch.Tensor | None, torch.Tensor | None],
    side: tuple[torch.Tensor | None, ...],
    scale: float,
    activation: str,
    activation_clamp: float | None,
    block_m: int,
    save: str,
    *,
    fake: bool,
) -> tuple[BaseWeights, SideLoRA | None]:
    """The checked ``(base, side)`` of one forward op call (``block_m``: a registry
    BLOCK_M, :func:`~megamoe.get_block_m` of the call; ``save``: one of
    :data:`~megamoe.pipeline.fused_forward.SAVE_MODES`).

    The real implementation (``fake=False``) requires CUDA weights and checks the id
    range of CPU ids (CUDA ids: the forward's device-side check); the fake
    one checks everything that needs no data, on any device.
    """
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
        require_cuda=not fake,
        expert_id_limit=base.num_experts,
        masters=masters,
    )
    check_block_m(block_m)
    check_str_choice("save", save, SAVE_MODES)
    return base, side_lora


def _moe_forward_impl(
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
    block_m: int,
    save: str,
    # MXFP4 in ordinary mode: the trainable masters (never read; the backward's weight
    # gradients go to them, in their dtype), else None. Last, with defaults: positional
    # calls of the op from before they existed keep working.
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
]:
    """``(out, expert_counts, expert_pool_offsets, route_to_pool_row, pool_row_to_route,
    preact, q13, p_sum)``. ``save`` (:data:`~megamoe.pipeline.fused_forward.SAVE_MODES`):
    ``"none"`` (inference: every state output empty), ``"preact"`` (training) or
    ``"recompute"`` (activation checkpointing: ``preact`` empty); absent state tensors
    are empty."""
    base, side = _op_inputs(
        x, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales, (w13_master, w2_master),
        (a1, b1, a3, b3, a2, b2), scale, activation, activation_clamp, block_m, save,
        fake=False,
    )  # fmt: skip
    with autocast_off(x.device):  # the layer keeps its own precision
        result = moe_forward(
            x,
            topk_ids,
            topk_weights,
            base,
            side,
            activation=activation,
            activation_clamp=activation_clamp,
            block_m=block_m,
            save=save,
        )
    if save == "none":
        return (result, *(empty(x) for _ in _STATE_NAMES))
    out, state = result
    plan = state.plan
    return (
        out,
        plan.expert_counts,
        plan.expert_pool_offsets,
        plan.route_to_pool_row,
        plan.pool_row_to_route,
        empty(x) if state.preact is None else state.preact,
        empty(x) if state.q13 is None else state.q13,
        empty(x) if state.p_sum is None else state.p_sum,
    )


_moe_forward_op = torch.library.custom_op("megamoe::moe_forward", mutates_args=())(
    _moe_forward_impl
)


@_moe_forward_op.register_fake
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
    block_m,
    save,
    w13_master=None,
    w2_master=None,
):
    base, side = _op_inputs(
        x, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales, (w13_master, w2_master),
        (a1, b1, a3, b3, a2, b2), scale, activation, activation_clamp, block_m, save,
        fake=True,
    )  # fmt: skip
    out = x.new_empty(x.shape)
    if save == "none":
        return (out, *(x.new_empty(0) for _ in _STATE_NAMES))
    tokens, top_k = topk_ids.shape
    experts, two_i = base.num_experts, 2 * base.intermediate
    capacity = pool_capacity(tokens * top_k, experts, block_m)  # moe_forward's route plan
    index = dict(dtype=torch.int32, device=x.device)
    use_side = side is not None and side.scale != 0.0
    rank = side.rank if side is not None else 0
    return (
        out,
        torch.empty(experts, **index),
        torch.empty(experts + 1, **index),
        torch.empty(tokens, top_k, **index),
        torch.empty(capacity, **index),
        x.new_empty(capacity, two_i) if save == "preact" else x.new_empty(0),
        x.new_empty(tokens, 2 * rank) if use_side else x.new_empty(0),
        x.new_empty(tokens, rank) if use_side else x.new_empty(0),
    )


# ``preact`` is written over: dgrad2's epilogue leaves dg | du in the saved pre-activations
# (their last reader), so the schema declares it mutated.
def _moe_backward_impl(
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
    expert_counts: torch.Tensor,
    expert_pool_offsets: torch.Tensor,
    route_to_pool_row: torch.Tensor,
    pool_row_to_route: torch.Tensor,
    preact: torch.Tensor,
    q13: torch.Tensor,
    p_sum: torch.Tensor,
    base_grads: bool,
    side_grads: bool,
    block_m: int,
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
    computed are empty tensors. A tuple, not a list: torch.compile functionalizes an op
    that mutates an input (``preact``) only when it returns plain tensors. The plan
    (``expert_counts`` .. ``pool_row_to_route``) and ``block_m`` are the forward's.
    ``preact`` (the forward's saved ``g | u``, or empty under activation checkpointing)
    is overwritten with ``dg | du``."""
    # The autograd hook aligns dout too, but under torch.compile it is traced without
    # data (no address to test): a misaligned view would reach the kernels' TMA.
    dout = _contiguous_aligned(dout)
    base, side = _backward_inputs(
        dout, x, topk_weights, w13, w2, w13_scales, w2_scales, (a1, b1, a3, b3, a2, b2), scale,
        activation, activation_clamp, expert_counts, expert_pool_offsets, route_to_pool_row,
        pool_row_to_route, preact, q13, p_sum,
    )  # fmt: skip
    check_block_m(block_m)
    check_plan_block_m(block_m, route_to_pool_row, pool_row_to_route, base.num_experts)
    saved = (expert_counts, expert_pool_offsets, route_to_pool_row, pool_row_to_route)
    state = dict(zip(_STATE_NAMES, (*saved, preact, q13, p_sum), strict=True))
    return _run_backward(
        dout,
        x,
        topk_weights,
        base,
        side,
        state,
        activation=activation,
        activation_clamp=activation_clamp,
        base_grads=base_grads,
        side_grads=side_grads,
        block_m=block_m,
    )


def _run_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    state: dict[str, torch.Tensor],
    *,
    activation: str,
    activation_clamp: float | None,
    base_grads: bool,
    side_grads: bool,
    block_m: int,
) -> tuple[torch.Tensor, ...]:
    """The backward op's result (see :func:`_moe_backward_impl`) from checked inputs:
    ``state`` by :data:`_STATE_NAMES`, the forward's plan and saved tensors."""
    plan = RoutePlan(
        state["expert_counts"],
        state["expert_pool_offsets"],
        state["route_to_pool_row"],
        state["pool_row_to_route"],
        block_m,
    )
    preact, q13, p_sum = state["preact"], state["q13"], state["p_sum"]
    forward_state = ForwardState(
        plan=plan,
        preact=preact if preact.numel() else None,
        q13=q13 if q13.numel() else None,
        p_sum=p_sum if p_sum.numel() else None,
    )
    with autocast_off(x.device):
        grads = moe_backward(
            dout,
            x,
            topk_weights,
            base,
            side,
            forward_state,
            activation=activation,
            activation_clamp=activation_clamp,
            base_grads=base_grads,
            side_grads=side_grads,
        )
    return tuple(empty(x) if grads[name] is None else grads[name] for name in GRAD_NAMES)


def _eager_backward(
    dout: torch.Tensor,
    inputs: dict[str, torch.Tensor | None],
    options: dict[str, object],
    state: dict[str, torch.Tensor],
    *,
    base_grads: bool,
    side_grads: bool,
    block_m: int,
) -> tuple[torch.Tensor, ...]:
    """mm.moe's eager route into the backward: the forward's implementation checked
    every input and made the state itself (autograd's saved-tensor check stops a backward
    after either was changed in place), so only ``dout`` is checked again here, not the
    whole of :func:`_backward_inputs`, host time a small-token step pays
    (docs/DESIGN-NOTES.md, "The op layer"). Same result as the op."""
    x = inputs["x"]
    check_tensor("dout", dout, shape=tuple(x.shape), dtypes=(torch.bfloat16,))
    check_devices([("x", x), ("dout", dout)], "x")
    base = base_weights(inputs["w13"], inputs["w2"], inputs["w13_scales"], inputs["w2_scales"])
    side = side_lora_of(tuple(inputs[name] for name in SIDE_NAMES), options["scale"])
    return _run_backward(
        dout,
        x,
        inputs["topk_weights"],
        base,
        side,
        state,
        activation=options["activation"],
        activation_clamp=options["activation_clamp"],
        base_grads=base_grads,
        side_grads=side_grads,
        block_m=block_m,
    )


_moe_backward_op = torch.library.custom_op("megamoe::moe_backward", mutates_args=("preact",))(
    _moe_backward_impl
)


@_moe_backward_op.register_fake
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
    expert_counts,
    expert_pool_offsets,
    route_to_pool_row,
    pool_row_to_route,
    preact,
    q13,
    p_sum,
    base_grads,
    side_grads,
    block_m,
):
    base, _ = _backward_inputs(
        dout, x, topk_weights, w13, w2, w13_scales, w2_scales, (a1, b1, a3, b3, a2, b2), scale,
        activation, activation_clamp, expert_counts, expert_pool_offsets, route_to_pool_row,
        pool_row_to_route, preact, q13, p_sum,
    )  # fmt: skip
    check_block_m(block_m)
    check_plan_block_m(block_m, route_to_pool_row, pool_row_to_route, base.num_experts)
    use_side = q13.numel() > 0 and side_grads
    side = (a1, b1, a3, b3, a2, b2)
    # The base gradients are BF16 [E, 2I, H] / [E, H, I] whatever the base's format (an
    # MXFP4 base's: with respect to its exact decode).
    experts, hidden, inter = base.num_experts, base.hidden, base.intermediate
    return (
        x.new_empty(x.shape),
        topk_weights.new_empty(topk_weights.shape),
        x.new_empty(experts, 2 * inter, hidden) if base_grads else x.new_empty(0),
        x.new_empty(experts, hidden, inter) if base_grads else x.new_empty(0),
        *(t.new_empty(t.shape) if use_side else x.new_empty(0) for t in side),
    )


def _backward_inputs(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2_scales: torch.Tensor | None,
    side: tuple[torch.Tensor | None, ...],
    scale: float,
    activation: str,
    activation_clamp: float | None,
    *state: torch.Tensor,
) -> tuple[BaseWeights, SideLoRA | None]:
    """The checked ``(base, side)`` of one backward op call (real and fake alike: the
    inputs are the forward's, already checked on their device, plus ``dout`` and the
    saved state)."""
    base = base_weights(w13, w2, w13_scales, w2_scales)
    side_lora = side_lora_of(side, scale)
    # The forward's checks on its inputs; the route_to_pool_row map stands in for the
    # ids (same [T, K]; the ids themselves are not saved).
    check_moe_inputs(
        x,
        state[_STATE_NAMES.index("route_to_pool_row")],
        topk_weights,
        base,
        side_lora,
        activation,
        activation_clamp,
        require_cuda=False,
        ids_name="route_to_pool_row",
    )
    check_backward_inputs(dout, x, base, side_lora, dict(zip(_STATE_NAMES, state, strict=True)))
    return base, side_lora


_FORWARD_INPUTS = input_names(_moe_forward_op)


def _forward_setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_FORWARD_INPUTS, inputs, strict=True))
    ctx.eager = False  # mm.moe's eager route sets it (_EagerMoeForward)
    ctx.save = args["save"]
    # The state outputs are not differentiable: without this autograd would hand the
    # backward a materialized zero gradient for each ([T*K, 2I] for the pre-activations).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    if ctx.save == "none":  # inference: nothing to keep (mm.moe calls it without grad)
        return
    ctx.options = {name: args[name] for name in ("scale", "activation", "activation_clamp")}
    ctx.block_m = args["block_m"]  # the forward's plan is padded to it
    # Only their dtypes: the masters' values are never read.
    ctx.master_dtypes = master_dtypes(args)
    save_inputs_and_state(ctx, args, output[1:])


def _contiguous_aligned(dout: torch.Tensor) -> torch.Tensor:
    """``dout`` contiguous and, on CUDA, at a 16-byte aligned address: autograd may hand
    the backward a view at any offset (a split of a flat buffer), and the kernels read it
    by TMA. A copy where needed: the same values, not an error the caller cannot fix."""
    dout = dout.contiguous()
    if dout.is_cuda and has_data(dout) and dout.data_ptr() % 16:
        dout = dout.clone()
    return dout


def _forward_backward(ctx, dout, *_state_grads):
    if dout is None:  # no gradient reached the output (grads are not materialized)
        return (None,) * len(_FORWARD_INPUTS)
    if ctx.save == "none":
        raise RuntimeError(
            "megamoe::moe_forward: called with save='none', which keeps no state for a "
            "backward; call it with save='preact' or 'recompute' (mm.moe does)"
        )
    inputs, state = saved_inputs_and_state(ctx, _STATE_NAMES)
    needs = needs_by_input(_FORWARD_INPUTS, ctx.needs_input_grad)
    # The forward's plan (its saved index maps) and BLOCK_M: nothing is planned again.
    # On mm.moe's eager route the backward op's implementation is called directly, in
    # a profiler range of the op's name (see _EagerMoeForward).
    which = dict(
        base_grads=any(needs[name] for name in ("w13", "w2", *MASTER_GRADS)),
        side_grads=ctx.has_side and any(needs[name] for name in SIDE_NAMES),
        block_m=ctx.block_m,
    )
    dout = _contiguous_aligned(dout)
    if ctx.eager:
        with stage("moe_backward"):
            grads = _eager_backward(dout, inputs, ctx.options, state, **which)
    else:
        grads = _moe_backward_op(dout=dout, **inputs, **ctx.options, **state, **which)
    mark_preact_written(ctx, state)
    result = grads_for_inputs(
        _FORWARD_INPUTS, grads, needs, inputs, has_side=ctx.has_side, scale=ctx.options["scale"]
    )
    return with_master_grads(_FORWARD_INPUTS, result, grads, needs, ctx.master_dtypes)


_moe_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup_context)


#: mm.moe's eager route (megamoe.custom_ops.eager_route): the forward op's implementation
#: under the op's own autograd rules, without the custom-op dispatch's host time; taken
#: only for plain CUDA tensors outside torch.compile, functorch transforms and any
#: dispatch or torch-function mode (FlopCounterMode, FakeTensorMode, DTensor, ...),
#: which get the registered ops.
_EagerMoeForward = eager_forward(
    "moe_forward", _moe_forward_impl, _forward_setup_context, _forward_backward
)
