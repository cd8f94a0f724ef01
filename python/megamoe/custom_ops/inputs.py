"""What the layer's custom op pairs share: the EP1 ops (:mod:`megamoe.custom_ops.layer`) and the
expert-parallel ones (:mod:`megamoe.ep.ops`) take the same weight and adapter inputs,
turn them into the same :class:`BaseWeights` / :class:`SideLoRA`, and map their
backward op's gradients onto the forward's inputs by the same rules."""

from __future__ import annotations

import torch

from ..pipeline.fused_backward import GRAD_NAMES
from ..side_lora import SIDE_NAMES, SideLoRA
from ..validation.arguments import check_finite_float, check_tensor, has_data
from ..weights import BaseWeights

# SIDE_NAMES (re-exported): the adapters as op inputs, six optional tensors (all None: no
# adapters) plus ``scale``.
# GRAD_NAMES (re-exported): the gradients a backward op returns, in order, named like the
# forward's inputs; the pipeline's own names.
#: What a training forward op saves for its backward: these inputs, then its state outputs.
SAVED_INPUTS = ("x", "topk_weights", "w13", "w2", "w13_scales", "w2_scales", *SIDE_NAMES)


def requires_grad(t: torch.Tensor) -> bool:
    """``t.requires_grad`` of the tensor under any functorch batching (vmap): a batched
    wrapper reads False, while autograd still records the op on the tensor it wraps, whose
    backward then needs the saved state."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t.requires_grad


def save_inputs_and_state(
    ctx: object, args: dict[str, object], state_outputs: tuple[torch.Tensor, ...]
) -> None:
    """Save :data:`SAVED_INPUTS` of a forward op's ``args`` and its state outputs on its
    autograd ``ctx``; ``ctx.has_side``: whether adapters were given."""
    ctx.has_side = args["a1"] is not None
    ctx.save_for_backward(*(args[name] for name in SAVED_INPUTS), *state_outputs)


def saved_inputs_and_state(
    ctx: object, state_names: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """What :func:`save_inputs_and_state` saved, as ``(inputs, state)`` by name."""
    saved = ctx.saved_tensors
    inputs = dict(zip(SAVED_INPUTS, saved[: len(SAVED_INPUTS)], strict=True))
    state = dict(zip(state_names, saved[len(SAVED_INPUTS) :], strict=True))
    preact = state.get("preact")
    if preact is not None and preact.dim() == 1:
        # Activation checkpointing saved an empty 1-D placeholder (a kept preact is 2-D
        # [P, 2I]: its rank, unlike its size, is static under torch.compile). The backward
        # ops are declared to write preact, which bumps their input's version: given the
        # saved tensor, a second backward through the graph (retain_graph) would fail the
        # saved-tensor version check although nothing it needs was overwritten.
        state["preact"] = preact.new_empty(0)
    elif preact is not None:
        written = getattr(ctx, "preact_written", None)
        if written is not None and has_data(preact) and _storage_and_version(preact) == written:
            # The first backward wrote dg | du over this memory. Autograd's version
            # check refuses a second backward, except under a saved-tensor hook whose
            # unpack returns the saved tensor itself or an alias of it (an identity,
            # detach or view hook): then the memory would be read as g | u (a review).
            # A copy has a version counter of its own and passes.
            raise RuntimeError(
                "Trying to backward through the graph a second time: megamoe's first "
                "backward wrote its gradients over the saved pre-activations (with a "
                "saved-tensor hook that returns the saved tensor or an alias of it, "
                "autograd's version check does not see it); recompute the forward, or call mm.moe "
                "with activation_checkpoint=True to backward through it twice"
            )
    return inputs, state


def _storage_and_version(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s data is and its version: equal for the tensor and its aliases
    (views and detaches share the version counter), not for a copy."""
    return t.data_ptr(), t._version


def mark_preact_written(ctx: object, state: dict[str, torch.Tensor]) -> None:
    """Record that a backward wrote over the saved pre-activations ``state["preact"]``
    (a kept ``[P, 2I]`` tensor; after the write and its version bump), so that
    :func:`saved_inputs_and_state` refuses a second backward that would unpack that
    memory again."""
    preact = state.get("preact")
    if preact is not None and preact.dim() == 2 and has_data(preact):
        ctx.preact_written = _storage_and_version(preact)


def base_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
) -> BaseWeights:
    """The BaseWeights of an op's tensors: MXFP4 when scales are given (packed uint8
    values, ``H/2`` bytes per w13 row), else BF16. Only unpacks ``w13``'s dims:
    :func:`~megamoe.validation.check_base_weights` checks the rest."""
    experts, two_i, last = check_tensor("w13", w13, ndim=3).shape
    if w13_scales is not None:
        return BaseWeights("mxfp4", w13, w2, w13_scales, w2_scales, experts, 2 * last, two_i // 2)
    return BaseWeights("bf16", w13, w2, None, None, experts, last, two_i // 2)


def side_lora(side: tuple[torch.Tensor | None, ...], scale: float) -> SideLoRA | None:
    """The :class:`SideLoRA` of an op's six adapter inputs ``(a1, b1, a3, b3, a2, b2)``,
    or None for six Nones; a partial set names the adapters."""
    if all(t is None for t in side):
        return None
    if any(t is None for t in side):
        raise ValueError(
            f"side: expected all six adapter tensors {SIDE_NAMES} or none, got "
            f"{[type(t).__name__ for t in side]}"
        )
    return SideLoRA(*side, scale=check_finite_float("side.scale", scale, float32=True))


def empty(like: torch.Tensor) -> torch.Tensor:
    """An absent tensor output (state not kept, a gradient not computed): 1-D, empty."""
    return like.new_empty(0)


def input_names(op: object) -> tuple[str, ...]:
    """The names of a custom op's inputs, in its schema's order."""
    return tuple(arg.name for arg in op._opoverload._schema.arguments)


def needs_by_input(
    forward_inputs: tuple[str, ...], needs_input_grad: tuple[bool, ...]
) -> dict[str, bool]:
    """A forward op's ``ctx.needs_input_grad`` by input name. The dispatcher drops trailing
    inputs left at their defaults (the masters' None) from what autograd saw: those need
    no gradient (and get None, which autograd takes)."""
    given = tuple(needs_input_grad)
    given += (False,) * (len(forward_inputs) - len(given))
    return dict(zip(forward_inputs, given, strict=True))


#: An MXFP4 master's input name -> the backward op's gradient it takes (that of the
#: exact decode: straight through the quantizer, DESIGN §1).
MASTER_GRADS = {"w13_master": "w13", "w2_master": "w2"}


def master_dtypes(args: dict[str, object]) -> dict[str, torch.dtype]:
    """The dtypes of the masters a forward op was given (their values are never read)."""
    return {name: args[name].dtype for name in MASTER_GRADS if args.get(name) is not None}


def with_master_grads(
    forward_inputs: tuple[str, ...],
    result: tuple[torch.Tensor | None, ...],
    grads: tuple[torch.Tensor, ...],
    needs: dict[str, bool],
    dtypes: dict[str, torch.dtype],
) -> tuple[torch.Tensor | None, ...]:
    """A forward op's autograd result (:func:`grads_for_inputs`) with each master that needs
    a gradient given the base gradient of its decode (BF16), cast to the master's dtype
    (``dtypes``, :func:`master_dtypes`) as the straight-through path does
    (:class:`~megamoe.weights.BaseWeights`)."""
    result = list(result)
    for name, dtype in dtypes.items():
        if needs[name]:
            grad = grads[GRAD_NAMES.index(MASTER_GRADS[name])]
            result[forward_inputs.index(name)] = grad.to(dtype)
    return tuple(result)


def grads_for_inputs(
    forward_inputs: tuple[str, ...],
    grads: tuple[torch.Tensor, ...],
    needs: dict[str, bool],
    inputs: dict[str, torch.Tensor | None],
    *,
    has_side: bool,
    scale: float,
) -> tuple[torch.Tensor | None, ...]:
    """The forward op's autograd result: one gradient (or None) per forward input, from
    the backward op's ``grads`` (:data:`GRAD_NAMES` order). A gradient that was computed
    has its input's shape (maybe of zero rows); one that was not is :func:`empty`. With
    adapters at a zero scale (the no-adapter path ran) their gradients are exact zeros."""
    result = dict.fromkeys(forward_inputs)
    for name, grad in zip(GRAD_NAMES, grads, strict=True):
        if needs[name] and grad.shape == inputs[name].shape:
            result[name] = grad
    if has_side and scale == 0.0:
        for name in SIDE_NAMES:
            if needs[name]:
                result[name] = torch.zeros_like(inputs[name])
    return tuple(result.values())
