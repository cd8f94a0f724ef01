"""FLOP formulas for megamoe's custom ops, for ``torch.utils.flop_counter``.

Registering them (importing this module, which the package does) lets
``torch.utils.flop_counter.FlopCounterMode`` count ``mm.moe`` calls, which it would otherwise
report as zero (an opaque custom op has no decomposition to count). One formula per op,
``megamoe::moe_forward`` (every save mode) and ``megamoe::moe_backward``, and the expert-
parallel ``megamoe::moe_ep_forward`` / ``megamoe::moe_ep_backward``, each reading the op's
arguments by their schema names. An EP op is counted for this rank's tokens and all of
their routes (whichever rank's experts compute them), so the counts of the group's ranks
add up to the layer's.

What is counted: the multiply-adds of DESIGN §1's math, 2 FLOPs each, for every route
``(t, k)`` as if none were masked. The formulas see shapes only (no values: they run on
fake tensors too), so masked routes and the pool's padding rows cannot be told apart;
for a router that masks nothing this is the exact model FLOP count, otherwise an upper
bound. Elementwise work (activation, scaling, the combine) is not counted, as
FlopCounterMode counts none for aten either. With ``T`` tokens, ``K`` routes per token,
hidden ``H``, intermediate ``I`` and adapter rank ``r``:

- forward: base ``6 T K H I`` (GEMM1 ``[x] w13^T`` and GEMM2 ``h w2^T``); side-LoRA
  ``6 T H r`` (``x a1``, ``x a3``, ``(sum_k w p) b2``) plus ``6 T K I r`` (``q b1``,
  ``q b3``, ``h a2``);
- backward: the data gradients ``6 T K H I`` (dgrad2 and dgrad1) plus ``2 T K I`` (the
  router gradient's dots); the base weight gradients another ``6 T K H I`` (ordinary
  mode); side-LoRA data gradients ``6 T H r + 6 T K I r`` and side weight gradients
  ``6 T H r + 6 T K I r``; with activation checkpointing the recomputed GEMM1 ``4 T K H
  I`` (+ ``4 T K I r`` for its side segment; the EP backward also ``4 T H r`` for the
  adapter shrink ``q13 = x [a1 | a3]`` of the token rows it exchanges again).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from ..ep import ops as ep_ops  # noqa: F401  (the expert-parallel ops)
from . import layer  # noqa: F401  (defines the torch.ops.megamoe.* ops registered below)

__all__ = ["backward_flops", "forward_flops"]

Shape = Sequence[int]


def _dims(x: Shape, topk_ids: Shape, w13: Shape) -> tuple[int, int, int, int]:
    """``(T, K, H, I)``; ``H`` from ``x`` (an MXFP4 ``w13`` holds ``H/2`` bytes a row)."""
    tokens, hidden = x
    top_k = topk_ids[1]
    return tokens, top_k, hidden, w13[1] // 2


def forward_flops(tokens: int, top_k: int, hidden: int, intermediate: int, rank: int) -> int:
    """FLOPs of one forward (``rank`` 0: no adapters); see the module docstring."""
    t, k, h, i, r = tokens, top_k, hidden, intermediate, rank
    return 6 * t * k * h * i + 6 * t * h * r + 6 * t * k * i * r


def backward_flops(
    tokens: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    rank: int,
    *,
    base_grads: bool,
    side_grads: bool,
    recompute: bool,
) -> int:
    """FLOPs of one backward; see the module docstring."""
    t, k, h, i, r = tokens, top_k, hidden, intermediate, rank
    flops = 6 * t * k * h * i + 2 * t * k * i
    if base_grads:
        flops += 6 * t * k * h * i
    if r:
        flops += 6 * t * h * r + 6 * t * k * i * r
        if side_grads:
            flops += 6 * t * h * r + 6 * t * k * i * r
    if recompute:
        flops += 4 * t * k * h * i + 4 * t * k * i * r
    return flops


def _rank(a1: Shape | None, scale: float) -> int:
    # A zero scale runs the no-adapter path (bitwise equal to side=None).
    return 0 if a1 is None or scale == 0.0 else a1[1]


def _bind(op: torch._ops.OpOverloadPacket, args: tuple, kwargs: dict) -> dict[str, object]:
    """The op's arguments (shapes for tensors) by their schema names, however the call
    passed them (positionally or by keyword)."""
    names = [arg.name for arg in op.default._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _forward_formula(op: torch._ops.OpOverloadPacket):
    """The formula of a forward op (EP1's or EP's: the same inputs by name). Every save
    mode runs the same forward GEMMs (the state is a by-product)."""

    def formula(*args, out_shape=None, **kwargs) -> int:
        a = _bind(op, args, kwargs)
        return forward_flops(*_dims(a["x"], a["topk_ids"], a["w13"]), _rank(a["a1"], a["scale"]))

    return formula


def _backward(a: dict, tokens: int, top_k: int, rank: int, side_grads: bool) -> int:
    """A backward op's FLOPs; no pre-activations (an empty tensor) means activation
    checkpointing: GEMM1 recomputed."""
    preact = a["preact"]
    return backward_flops(
        tokens,
        top_k,
        a["x"][1],
        a["w13"][1] // 2,
        rank,
        base_grads=bool(a["base_grads"]),
        side_grads=side_grads,
        recompute=len(preact) == 1 and preact[0] == 0,
    )


for _op in (torch.ops.megamoe.moe_forward, torch.ops.megamoe.moe_ep_forward):
    register_flop_formula(_op)(_forward_formula(_op))


@register_flop_formula(torch.ops.megamoe.moe_backward)
def _moe_backward_flops(*args, out_shape=None, **kwargs) -> int:
    a = _bind(torch.ops.megamoe.moe_backward, args, kwargs)
    tokens, top_k = a["route_to_pool_row"]
    # The forward saved q13 = [x a1 | x a3] only when the side path ran.
    q13 = a["q13"]
    rank = q13[1] // 2 if len(q13) == 2 and q13[0] > 0 else 0
    return _backward(a, tokens, top_k, rank, bool(a["side_grads"]))


@register_flop_formula(torch.ops.megamoe.moe_ep_backward)
def _moe_ep_backward_flops(*args, out_shape=None, **kwargs) -> int:
    a = _bind(torch.ops.megamoe.moe_ep_backward, args, kwargs)
    tokens, top_k = a["topk_weights"]
    # The EP backward computes the adapters' gradients whenever the side path ran.
    rank = _rank(a["a1"], a["scale"])
    flops = _backward(a, tokens, top_k, rank, rank > 0)
    preact = a["preact"]
    if rank and len(preact) == 1 and preact[0] == 0:
        # Checkpointing: the token rows are exchanged again, so q13 = x [a1 | a3] is
        # computed again too (EP1 saves q13 instead).
        flops += 4 * tokens * a["x"][1] * rank
    return flops
