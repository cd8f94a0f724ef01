"""Seeded input factories for tests and benchmarks.

Every random draw comes from a CPU ``torch.Generator`` seeded by the caller and is
moved to the target device afterwards, so one seed gives the same tensors on any
device (a CUDA run can be replayed on the CPU oracle and vice versa).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..heuristics import get_block_m, mxfp4_decodes_in_pipeline, weight_stream_chunk
from ..side_lora import SIDE_NAMES, SideLoRA
from ..validation.arguments import check_choice, check_finite_float, check_int, check_str_choice
from ..weights import BaseWeights, prepare_base_weights
from ..wrappers.grouped_gemm import stream_widest_chunks
from ..wrappers.routing import pool_capacity

ROUTING_KINDS = ("balanced", "skewed", "masked", "empty")
DEFAULT_SKEW = 1.2


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(check_int("seed", seed, minimum=0))
    return gen


def _balanced_ids(num_tokens: int, top_k: int, num_allowed: int, gen: torch.Generator) -> list:
    """Indices into the allowed experts, ``num_tokens * top_k`` long, token-major.

    The route slots are filled from a stream of fresh random permutations of the
    allowed experts ("rounds"), so every expert gets one route per round and the
    loads differ by at most one. A token whose ``top_k`` slots straddle two rounds
    could see an expert twice; the head of the later round is repaired by swapping
    the clashing entries with later ones of the same round, which keeps each round a
    permutation (and so keeps the balance).
    """
    total = num_tokens * top_k
    rounds = -(-total // num_allowed)
    perms = torch.argsort(torch.rand(rounds, num_allowed, generator=gen), dim=1).tolist()
    stream: list[int] = []
    for j, perm in enumerate(perms):
        start = j * num_allowed
        before = start % top_k  # slots of the straddling token already in the stream
        if before:
            head = top_k - before  # its slots in this round (< num_allowed since K <= n)
            earlier = set(stream[start - before : start])
            for i in range(head):
                if perm[i] in earlier:
                    # A later non-clashing entry always exists: the round holds
                    # n - K + (clashes) >= clashes of them past the head.
                    p = next(p for p in range(head, num_allowed) if perm[p] not in earlier)
                    perm[i], perm[p] = perm[p], perm[i]
        stream.extend(perm)
    return stream[:total]


def make_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    kind: str = "balanced",
    seed: int = 0,
    device: torch.device | str = "cpu",
    masked_fraction: float = 0.2,
    empty_experts: Sequence[int] | None = None,
    skew: float = DEFAULT_SKEW,
    id_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded router output ``(topk_ids, topk_weights)``.

    Args:
        num_tokens: ``T >= 0``.
        num_experts: ``E``; ids are ``0 .. E-1`` (EP1 global ids).
        top_k: ``K``; every token gets ``K`` distinct experts (``-1`` for masked routes).
        kind: ``"balanced"``: uniformly random distinct experts with expert loads as
            even as possible (max - min <= 1 over the allowed experts).
            ``"skewed"``: Zipf-like expert popularity ``p ~ 1/rank**skew`` over a
            random ranking, still ``K`` distinct experts per token.
            ``"masked"``: balanced, then ``round(masked_fraction * T * K)`` random
            routes set to ``-1``, at least one where ``masked_fraction > 0`` and
            ``T * K >= 2`` (a single route stays unmasked).
            ``"empty"``: balanced over all experts except ``empty_experts``.
        seed: seed of the CPU generator every draw comes from.
        device: where the returned tensors live.
        masked_fraction: fraction of routes masked by ``kind="masked"`` (in [0, 1]).
        empty_experts: experts that receive no route. Honoured by every kind;
            ``None`` means none, except for ``kind="empty"`` where it means the first,
            middle and last expert. Needs ``K <= E - len(empty_experts)``.
        skew: Zipf exponent of ``kind="skewed"`` (>= 0; 0 is uniform).
        id_dtype: ``torch.int32`` or ``torch.int64``.

    Returns:
        ``topk_ids [T, K]`` of ``id_dtype`` and ``topk_weights [T, K]`` float32: a
        softmax of random logits over the token's ``K`` routes (positive, summing to
        1); masked routes get weight 0 and the others keep their softmax value, as
        with a router that drops routes after the softmax.
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    num_experts = check_int("num_experts", num_experts, minimum=1)
    top_k = check_int("top_k", top_k, minimum=1)
    check_str_choice("kind", kind, ROUTING_KINDS)
    check_choice("id_dtype", id_dtype, (torch.int32, torch.int64))
    masked_fraction = check_finite_float("masked_fraction", masked_fraction)
    if not 0.0 <= masked_fraction <= 1.0:
        raise ValueError(f"masked_fraction: expected a value in [0, 1], got {masked_fraction}")
    skew = check_finite_float("skew", skew)
    if skew < 0.0:
        raise ValueError(f"skew: expected a value >= 0, got {skew}")
    if empty_experts is None:
        empty_experts = (0, num_experts // 2, num_experts - 1) if kind == "empty" else ()
    empty = sorted(set(int(e) for e in empty_experts))
    if any(not 0 <= e < num_experts for e in empty):
        raise ValueError(
            f"empty_experts: expected ids in [0, {num_experts - 1}], got {list(empty_experts)}"
        )
    if kind == "empty" and not empty:
        raise ValueError("empty_experts: kind='empty' needs at least one empty expert, got ()")
    allowed = [e for e in range(num_experts) if e not in set(empty)]
    if top_k > len(allowed):
        raise ValueError(
            f"top_k: expected at most {len(allowed)} (num_experts={num_experts} minus "
            f"{len(empty)} empty experts) so every token gets distinct experts, got {top_k}"
        )

    gen = _generator(seed)
    allowed_t = torch.tensor(allowed, dtype=torch.int64)
    if kind == "skewed":
        ranks = torch.randperm(len(allowed), generator=gen).to(torch.float64)
        popularity = (ranks + 1.0) ** (-skew)
        if num_tokens:
            picks = torch.multinomial(
                popularity.expand(num_tokens, -1), top_k, replacement=False, generator=gen
            )
        else:
            picks = torch.empty(0, top_k, dtype=torch.int64)
    else:
        stream = _balanced_ids(num_tokens, top_k, len(allowed), gen)
        picks = torch.tensor(stream, dtype=torch.int64).view(num_tokens, top_k)
        # Rounds fill tokens in order; shuffle tokens so position carries no pattern.
        picks = picks[torch.randperm(num_tokens, generator=gen)]
    ids = allowed_t[picks]

    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    if kind == "masked":
        total = num_tokens * top_k
        num_masked = round(masked_fraction * total)
        if masked_fraction > 0.0 and total >= 2:
            # Small T * K rounds to none: "masked" cases would then hold no masked
            # route, and their checks of masked routes would pass over nothing (a review).
            num_masked = max(num_masked, 1)
        masked = torch.randperm(total, generator=gen)[:num_masked]
        ids.view(-1)[masked] = -1
        weights.view(-1)[masked] = 0.0
    return ids.to(device=device, dtype=id_dtype), weights.to(device=device)


@dataclass(eq=False)
class LayerInputs:
    """One MoE layer call's inputs, made by :func:`make_layer`.

    - ``x``: ``[T, H]`` activations.
    - ``topk_ids`` ``[T, K]``, ``topk_weights`` ``[T, K]`` float32: routing.
    - ``base``: prepared :class:`~megamoe.weights.BaseWeights` (of ``w13``/``w2``).
    - ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``: the same weights in nn.Linear
      layout, in the layer dtype (BF16-representable values).
    - ``side``: :class:`~megamoe.side_lora.SideLoRA` or ``None``.
    - ``activation``, ``activation_clamp``: the activation to call with.
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    base: BaseWeights
    w13: torch.Tensor
    w2: torch.Tensor
    side: SideLoRA | None
    activation: str = "swiglu"
    activation_clamp: float | None = None

    def call(self, fn: Callable[..., torch.Tensor], **kwargs) -> torch.Tensor:
        """``fn(x, topk_ids, topk_weights, base, side, activation=..., activation_clamp=...)``.

        Works for ``megamoe.moe``, ``megamoe.reference.moe`` and
        ``megamoe.testing.baseline.moe``; ``kwargs`` are passed through.
        """
        return fn(
            self.x,
            self.topk_ids,
            self.topk_weights,
            self.base,
            self.side,
            activation=self.activation,
            activation_clamp=self.activation_clamp,
            **kwargs,
        )

    def reprepare_base(self) -> BaseWeights:
        """Prepare ``base`` again from ``w13``/``w2`` (same format) and return it.

        In ordinary mode (``trainable_base=True``) ``base`` is part of the autograd
        graph, so a second backward needs a freshly prepared one, as a trainer's step
        would make.
        """
        wide = torch.float32 if self.w13.dtype == torch.float64 else self.w13.dtype
        self.base = prepare_base_weights(
            self.w13.to(wide), self.w2.to(wide), format=self.base.format
        )
        return self.base

    def grad_leaves(self) -> dict[str, torch.Tensor]:
        """The tensors that require grad, by name (``x``, ``topk_weights``, ``a1`` ..)."""
        named = {"x": self.x, "topk_weights": self.topk_weights, "w13": self.w13, "w2": self.w2}
        if self.side is not None:
            named.update(zip(SIDE_NAMES, self.side.tensors(), strict=True))
        return {k: v for k, v in named.items() if v.requires_grad}


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    # Rounded to BF16 so a float32 layer and a BF16 layer of one seed hold the same
    # values: the oracle then sees exactly the kernels' inputs.
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def make_layer(
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    side_rank: int | None = None,
    *,
    num_tokens: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    scale: float = 0.25,
    routing: str = "balanced",
    format: str = "bf16",
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    requires_grad: bool = False,
    trainable_base: bool = False,
    **routing_kwargs,
) -> LayerInputs:
    """A seeded MoE layer call with realistic magnitudes.

    Scaling follows real checkpoints so every stage is O(1) and SwiGLU is not
    saturated: ``x ~ N(0, 1)``, each weight ``~ N(0, 1/fan_in)`` (std
    ``1/sqrt(fan_in)``): ``w13`` fan-in ``H``, ``w2`` fan-in ``I``, ``a1``/``a3`` fan-in
    ``H``, ``b1``/``b3`` fan-in ``r``, ``a2`` fan-in ``I``, ``b2`` fan-in ``r``. The
    adapter factors are all nonzero (unlike LoRA's zero-initialised ``b``) so every
    adapter path is exercised. All values are BF16-representable whatever ``dtype``.

    Args:
        hidden, intermediate: ``H``, ``I`` (multiples of 64, see
            :func:`~megamoe.weights.prepare_base_weights`).
        num_experts: ``E`` (EP1: all experts local).
        top_k: ``K``.
        side_rank: adapter rank ``r``, or ``None`` for no adapters.
        num_tokens: ``T``.
        seed: seeds the tensors and (through :func:`make_routing`, same seed) the routing.
        device: device of every tensor.
        dtype: dtype of ``x``, ``w13``/``w2`` and the adapter tensors (bfloat16 for the
            kernels, float32/float64 for the oracle).
        scale: the adapter scale ``s``.
        routing: ``kind`` of :func:`make_routing`; ``routing_kwargs`` go there too.
        format: ``"bf16"`` or ``"mxfp4"`` base.
        activation, activation_clamp: stored in the result for :meth:`LayerInputs.call`.
        requires_grad: make ``x``, ``topk_weights`` and the adapter tensors leaves
            that require grad.
        trainable_base: ordinary mode: ``w13``/``w2`` are leaves that require grad and
            ``base`` keeps the autograd link to them (for ``format="mxfp4"`` straight
            through the quantizer); call :meth:`LayerInputs.reprepare_base` before each
            further backward.
    """
    hidden = check_int("hidden", hidden, minimum=1)
    intermediate = check_int("intermediate", intermediate, minimum=1)
    num_experts = check_int("num_experts", num_experts, minimum=1)
    if side_rank is not None:
        side_rank = check_int("side_rank", side_rank, minimum=1)
    check_choice("dtype", dtype, (torch.bfloat16, torch.float32, torch.float64))
    topk_ids, topk_weights = make_routing(
        num_tokens, num_experts, top_k, kind=routing, seed=seed, device=device, **routing_kwargs
    )
    gen = _generator(seed)
    h, i, e = hidden, intermediate, num_experts
    x = _normal((num_tokens, h), 1.0, gen)
    w13 = _normal((e, 2 * i, h), 1.0 / math.sqrt(h), gen)
    w2 = _normal((e, h, i), 1.0 / math.sqrt(i), gen)
    side_raw = None
    if side_rank is not None:
        r = side_rank
        side_raw = [
            _normal((h, r), 1.0 / math.sqrt(h), gen),  # a1
            _normal((e, r, i), 1.0 / math.sqrt(r), gen),  # b1
            _normal((h, r), 1.0 / math.sqrt(h), gen),  # a3
            _normal((e, r, i), 1.0 / math.sqrt(r), gen),  # b3
            _normal((e, i, r), 1.0 / math.sqrt(i), gen),  # a2
            _normal((r, h), 1.0 / math.sqrt(r), gen),  # b2
        ]

    def place(t: torch.Tensor, grad: bool) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).requires_grad_(grad)

    x = place(x, requires_grad)
    topk_weights.requires_grad_(requires_grad)
    w13 = place(w13, trainable_base)
    w2 = place(w2, trainable_base)
    # prepare_base_weights takes bf16/fp32; a float64 layer goes through fp32 (exact,
    # the values are BF16-representable) and keeps the autograd link.
    wide = torch.float32 if dtype == torch.float64 else dtype
    base = prepare_base_weights(w13.to(wide), w2.to(wide), format=format)
    side = None
    if side_raw is not None:
        side = SideLoRA(*(place(t, requires_grad) for t in side_raw), scale=scale)
    return LayerInputs(
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        base=base,
        w13=w13,
        w2=w2,
        side=side,
        activation=activation,
        activation_clamp=activation_clamp,
    )


def mxfp4_schedule(tokens: int, top_k: int, num_experts: int) -> tuple:
    """What an MXFP4 layer of ``tokens`` tokens (EP1, ``top_k`` routes each, balanced
    expected loads) runs, as our heuristics choose it from host values: BLOCK_M, each
    weight-streaming kind's chunk (:func:`~megamoe.heuristics.weight_stream_chunk` up to
    the kind's widest registry variant), and whether the pool decodes in the pipeline
    (:func:`~megamoe.heuristics.mxfp4_decodes_in_pipeline`, without and with the
    streaming kernels; the chunks only where the pool may stream). It does not model the
    wrappers' per-shape refusals of a streaming kernel (tile columns, scale alignment,
    BLOCK_M against a narrow chunk): where a shape is refused, its transitions are a
    superset of the layer's."""
    block_m = get_block_m(tokens, top_k, num_experts)
    routes = tokens * top_k
    rows = pool_capacity(routes, num_experts, block_m)
    streams = mxfp4_decodes_in_pipeline(rows, num_experts, streams=True)
    # The chunks only where the pool may stream (past the limit: the transient decode).
    chunks = tuple(
        (
            kind,
            weight_stream_chunk(routes, num_experts, widest=max(64, w), kind=kind)
            if streams
            else None,
        )
        for kind, w in sorted(stream_widest_chunks().items())
    )
    return block_m, chunks, mxfp4_decodes_in_pipeline(rows, num_experts), streams


def _transitions(choice: Callable[[int], object], max_tokens: int) -> list[int]:
    """Token counts ``t - 1, t, t + 1`` around every ``t`` below ``max_tokens`` where
    ``choice(t)`` differs from ``choice(t - 1)``."""
    found, previous = [], choice(1)
    for tokens in range(2, max_tokens):
        current = choice(tokens)
        if current != previous:
            found += [tokens - 1, tokens, tokens + 1]
            previous = current
    return found


def mxfp4_schedule_transitions(top_k: int, num_experts: int, max_tokens: int = 70_000) -> list[int]:
    """Token counts ``t - 1, t, t + 1`` around every ``t`` below ``max_tokens`` where
    :func:`mxfp4_schedule` changes: the MXFP4 layer's schedule transitions (BLOCK_M's
    among them), which the DESIGN §6 sweep runs in addition to its token list."""
    return _transitions(lambda t: mxfp4_schedule(t, top_k, num_experts), max_tokens)


def block_m_transitions(top_k: int, num_experts: int, max_tokens: int = 70_000) -> list[int]:
    """Token counts ``t - 1, t, t + 1`` around every ``t`` where our own BLOCK_M heuristic
    (:func:`~megamoe.get_block_m`, EP1) changes, for ``t`` below ``max_tokens``; the edge
    matrix tests query it instead of copying the heuristic's thresholds."""
    return _transitions(lambda t: get_block_m(t, top_k, num_experts), max_tokens)
