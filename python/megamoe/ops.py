"""``mm.moe``: the public fused MoE layer call (docs/DESIGN.md §5).

EP1 (``group=None``) runs the torch custom ops ``megamoe::moe_forward`` /
``megamoe::moe_backward`` (:mod:`megamoe.custom_ops.layer`), eagerly on plain CUDA
tensors through their implementations without the custom-op dispatch; torch.compile,
functorch transforms, dispatch and torch-function modes and tensor subclasses get the
ops (of the transforms vmap runs; ``torch.func.grad`` raises, a limit of torch's
custom-op autograd).

``mm.moe(group=...)`` (expert parallelism) runs :func:`megamoe.ep.fused_moe` instead,
the op pair ``megamoe::moe_ep_forward`` / ``megamoe::moe_ep_backward``
(:mod:`megamoe.ep.ops`) over the same stages, with the EP1 ops' conventions and the
same eager route (on CPU tensors too, for gloo); docs/DESIGN-NOTES.md ("The op layer")
says why it is a pair of its own.

Arguments are checked before anything runs (:mod:`megamoe.validation`); nothing
synchronises with the host, except an EP call's one read in its dispatch plan (the
split sizes of NCCL's exchange are host ints).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .custom_ops.eager_route import takes_eager_route
from .custom_ops.inputs import SIDE_NAMES, requires_grad
from .custom_ops.layer import _FORWARD_INPUTS, _EagerMoeForward, _moe_forward_op
from .ep.ops import moe as fused_moe
from .ep.ops import raise_with_the_group
from .heuristics import get_block_m, mxfp4_master_decodes_once
from .side_lora import SideLoRA
from .validation import check_moe_inputs
from .validation.layer import check_call_structure
from .weights import BaseWeights
from .wrappers.routing import pool_capacity


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
    activation_checkpoint: bool = False,
    reduce_shared_grads: bool = True,
) -> torch.Tensor:
    """The MoE layer on the fused kernels, differentiable (docs/DESIGN.md §1, §5).

    Differentiable in ``x``, ``topk_weights``, every adapter tensor and, when
    ``base.w13``/``base.w2`` require grad (ordinary mode, see
    :func:`~megamoe.prepare_base_weights`), the base weights. A call with gradients
    off saves nothing for a backward.

    Args:
        x: ``[T, H]`` bfloat16, CUDA, contiguous.
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked.
        topk_weights: ``[T, K]`` float32 router weights.
        base: :func:`~megamoe.prepare_base_weights` output, ``format="bf16"`` or
            ``"mxfp4"`` (a frozen base: kept packed; each GEMM decodes the codes inside
            its pipeline up to a row count per expert, above it from a transient BF16
            decode made right before it, :func:`~megamoe.heuristics.mxfp4_decodes_in_pipeline`;
            a trainable master, ordinary mode: the same packed GEMMs where they decode
            in their pipelines, else the BF16 path on one decode per call,
            :func:`~megamoe.heuristics.mxfp4_master_decodes_once`, with ``group`` on the
            pool of rows this rank receives; either way the master
            takes the gradient at the MXFP4 values, straight through, in its dtype).
        side: optional :class:`~megamoe.SideLoRA` (bfloat16); scale 0 gives output
            bitwise equal to ``side=None``.
        activation: ``"swiglu"`` or ``"geglu"``; activation_clamp: ``c`` or None.
        group: a torch.distributed process group (NCCL) to shard the experts over:
            ``base``/``side`` then hold this rank's experts (global ids ``rank * E_l``
            ..) and the shared factors, ``topk_ids`` are global ids, and the call is a
            collective (:func:`megamoe.ep.fused_moe`). None: EP1.
        activation_checkpoint: keep only small per-token state for the backward
            (route plan, ``x a1|x a3``, ``sum_k w p``) and recompute GEMM1's
            pre-activations there, instead of saving them (``T*K*2I`` BF16). With
            ``group``, the backward also exchanges the token rows again.
        reduce_shared_grads: with ``group``, all-reduce the ``a1, a3, b2`` gradients
            over the group (results independent of the EP degree).

    Returns:
        ``[T, H]`` bfloat16 (on the inputs' device: all-``meta`` or fake inputs give an
        output of the right shape and dtype without running anything).

    Raises:
        TypeError, ValueError: bad arguments, named (:func:`megamoe.validation.
            check_moe_inputs`), checked before the device: without a GPU a wrong call
            reports what is wrong with it, and a valid one that CUDA weights are needed.
            Expert ids on the GPU are range-checked on the device (no host sync): an id
            outside ``[-1, E_l)`` raises ``ValueError`` (``topk_ids: ...``) at a later
            call or :func:`megamoe.check_errors`, and this call computes those routes as
            masked; calls captured in a CUDA graph are not checked (check a captured
            step's ids eagerly).
        RuntimeError: a second backward through the same graph (``retain_graph=True``):
            the backward writes ``dg | du`` over the saved pre-activations, and
            autograd's saved-tensor check stops the second one ("modified by an inplace
            operation"). With ``activation_checkpoint=True`` nothing is overwritten that
            a second backward needs. Under torch.compile the write is functionalized onto
            a copy and a second backward runs.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    # With group=, a refusal is this rank's alone: it joins the peers' agreement first,
    # so that they raise too instead of waiting for it (raise_with_the_group).
    try:
        if not isinstance(activation_checkpoint, bool):
            kind = type(activation_checkpoint).__name__
            raise TypeError(f"activation_checkpoint: expected a bool, got {kind}")
        if not isinstance(reduce_shared_grads, bool):
            raise TypeError(
                f"reduce_shared_grads: expected a bool, got {type(reduce_shared_grads).__name__}"
            )
        if not isinstance(base, BaseWeights):
            raise TypeError(f"base: expected megamoe.BaseWeights, got {type(base).__name__}")
        if group is None and reduce_shared_grads is not True:
            raise ValueError("reduce_shared_grads: only meaningful with group=; leave it True")
        # EP1 with CUDA tokens: the op's real implementation runs these same checks first
        # (before any launch), so they are not run twice. Under torch.compile the fake
        # implementation runs them at trace time (on fake tensors: no data pointers, no id
        # values) and the real one at run time. EP ids are global: the dispatch plan checks
        # their range. At EP1 a trainable MXFP4 base that is not kept packed decodes (a
        # launch) before the op: its call is checked here (the EP op takes it packed).
        cuda_ep1 = (
            group is None
            and isinstance(x, torch.Tensor)
            and x.is_cuda
            and isinstance(topk_ids, torch.Tensor)
            and topk_ids.dim() == 2
        )
        # Ordinary mode on an MXFP4 base, EP1: where its GEMMs decode in their pipelines,
        # the base stays packed and the op takes the masters, whose gradients its backward
        # gives (the same bits as the decode's straight-through path below).
        keep_packed, block_m = False, None
        if group is None and base.decodes_for_call:
            check_call_structure(topk_ids, side)  # what the choice reads
            tokens, top_k = topk_ids.shape
            block_m = get_block_m(tokens, top_k, base.num_experts)
            rows = pool_capacity(tokens * top_k, base.num_experts, block_m)
            keep_packed = not mxfp4_master_decodes_once(rows, base.num_experts)
        checked_by_op = cuda_ep1 and (keep_packed or not base.decodes_for_call)
        if torch.compiler.is_compiling() or checked_by_op:
            # Only what this function reads before the op's checks run.
            check_call_structure(topk_ids, side)
        else:
            check_moe_inputs(
                x,
                topk_ids,
                topk_weights,
                base,
                side,
                activation,
                activation_clamp,
                require_cuda=False,
                allow_no_tokens=group is not None,
                expert_id_limit=None if group is not None else base.num_experts,
            )
        # Ordinary mode on an MXFP4 base, unless kept packed: the BF16 path on the exact
        # decode, with the gradient passed straight through to the master (DESIGN §1).
        # With group= the EP op takes the packed base and the masters, and decodes once
        # itself where the received pool is large (megamoe.ep.fused_moe).
        masters = (base.w13_master, base.w2_master) if keep_packed else (None, None)
        base = base.for_call(decode_master=not keep_packed and group is None)
        if group is not None and base.device.type != "cuda":
            raise ValueError(
                f"base: expected CUDA weights for the fused path, got {base.device} (the "
                "CPU twin of the EP pipeline is megamoe.ep.fused_moe, for tests)"
            )
    except Exception as error:
        if group is None:
            raise
        raise_with_the_group(error, group, x)
    if group is not None:
        return fused_moe(
            x,
            topk_ids,
            topk_weights,
            base,
            side,
            group=group,
            activation=activation,
            activation_clamp=activation_clamp,
            reduce_shared_grads=reduce_shared_grads,
            activation_checkpoint=activation_checkpoint,
        )
    side_tensors = [None] * len(SIDE_NAMES) if side is None else list(side.tensors())
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and requires_grad(t)
        for t in [x, topk_weights, base.w13, base.w2, *masters, *side_tensors]
    )
    save = "none"
    if needs_grad:
        save = "recompute" if activation_checkpoint else "preact"
    # One BLOCK_M decision per call: the forward plans with it, the backward reuses it.
    if block_m is None:
        block_m = get_block_m(topk_ids.shape[0], topk_ids.shape[1], base.num_experts)
    args = dict(
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        w13=base.w13,
        w2=base.w2,
        w13_scales=base.w13_scales,
        w2_scales=base.w2_scales,
        w13_master=masters[0],
        w2_master=masters[1],
        **dict(zip(SIDE_NAMES, side_tensors, strict=True)),
        scale=0.0 if side is None else side.scale,
        activation=activation,
        activation_clamp=activation_clamp,
        block_m=block_m,
        save=save,
    )
    tensors = [x, topk_ids, topk_weights, base.w13, base.w2, base.w13_scales, base.w2_scales]
    tensors += masters
    # The decoded base takes the eager route too (the op's checks run inside it).
    if cuda_ep1 and takes_eager_route([*tensors, *side_tensors]):
        return _EagerMoeForward.apply(*(args[name] for name in _FORWARD_INPUTS))[0]
    return _moe_forward_op(**args)[0]
