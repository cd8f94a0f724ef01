"""``mm.moe``: the public fused MoE layer call (DESIGN §5), a torch custom op.

Forward only in this version (EP1, BF16 base): a call that would need gradients is
rejected with a clear error rather than silently falling back to other numerics.
"""

from __future__ import annotations

import torch

from .fused_forward import moe_forward
from .registry import registry
from .side_lora import SideLoRA
from .weights import BaseWeights


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def _moe_forward_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    side: list[torch.Tensor],  # (a1, b1, a3, b3, a2, b2), or empty: no adapters
    scale: float,
    activation: str,
    activation_clamp: float | None,
    check_ids: bool,
) -> torch.Tensor:
    experts, two_i, hidden = w13.shape
    base = BaseWeights(
        "bf16", w13, w2, None, None, experts, hidden, two_i // 2, registry().gate_up_interleave
    )
    side_lora = SideLoRA(*side, scale=scale) if side else None
    return moe_forward(
        x,
        topk_ids,
        topk_weights,
        base,
        side_lora,
        activation=activation,
        activation_clamp=activation_clamp,
        check_ids=check_ids,
    )


@_moe_forward_op.register_fake
def _(x, topk_ids, topk_weights, w13, w2, side, scale, activation, activation_clamp, check_ids):
    return x.new_empty(x.shape)


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None = None,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    group: object = None,
    workspace: object = None,
) -> torch.Tensor:
    """The MoE layer forward on the fused kernels.

    Args:
        x: ``[T, H]`` bfloat16, CUDA, contiguous.
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked.
        topk_weights: ``[T, K]`` float32 router weights.
        base: :func:`~megamoe.prepare_base_weights` output (``format="bf16"``).
        side: optional :class:`~megamoe.SideLoRA` (bfloat16); scale 0 gives output
            bitwise equal to ``side=None``.
        activation: ``"swiglu"`` or ``"geglu"``; activation_clamp: ``c`` or None.
        group: expert parallelism (not in this version: must be None).
        workspace: must be None in this version (scratch comes from torch's caching
            allocator).

    Returns:
        ``[T, H]`` bfloat16.
    """
    if group is not None:
        raise ValueError(
            "group: the fused kernels run EP1 only in this version (the NCCL path is issue "
            "6); pass None, or use megamoe.ep.reference_moe(..., group=pg) for the "
            "expert-parallel reference"
        )
    if workspace is not None:
        raise ValueError(
            "workspace: this version allocates scratch through torch's caching allocator; pass None"
        )
    if not isinstance(base, BaseWeights):
        raise TypeError(f"base: expected megamoe.BaseWeights, got {type(base).__name__}")
    if base.format != "bf16":
        raise ValueError(
            f"base: format {base.format!r} has no fused kernels yet (MXFP4 decode lands "
            "with issue 5); use format='bf16'"
        )
    if side is not None and not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected megamoe.SideLoRA or None, got {type(side).__name__}")
    side_tensors = [] if side is None else list(side.tensors())
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in [x, topk_weights, base.w13, base.w2, *side_tensors]
    )
    if needs_grad:
        raise NotImplementedError(
            "mm.moe: the fused backward is not available yet (issue 4); call under "
            "torch.no_grad() / inference_mode, or train with megamoe.reference.moe"
        )
    scale = 0.0 if side is None else side.scale
    # The id check reads back to the host, which graph capture forbids.
    check_ids = not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    return _moe_forward_op(
        x,
        topk_ids,
        topk_weights,
        base.w13,
        base.w2,
        side_tensors,
        scale,
        activation,
        activation_clamp,
        check_ids,
    )
