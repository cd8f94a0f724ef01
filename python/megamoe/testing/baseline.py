"""The unfused baseline (DESIGN §7): the MoE + side-LoRA math of DESIGN §1 written the
way a trainer would write it without megamoe, with ``torch._grouped_mm`` for every
per-expert product, plain torch ops, and torch autograd for the backward.

It is the yardstick of the performance targets and a second, independent
implementation for tests. It does what a careful trainer does: stable-sort routes by
expert, gather token rows, grouped GEMMs, router weight applied to ``h`` before the
down projection, gather back to route order and sum over k. Row movement uses two
tiny autograd Functions whose forward and backward are both gathers (no atomic
index_add in the backward), so the baseline is a fair, not a strawman, competitor.
No host synchronisation on the CUDA path.

Masked and non-local routes are not removed (that needs a host sync to learn how
many remain); they are sorted into the last local expert's group, computed like any
other row and multiplied by a zero router weight, so they add exact zeros to the
output and to every gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..side_lora import SideLoRA
from ..validation.arguments import check_finite_float, check_int, check_str_choice, check_tensor
from ..weights import BaseWeights

ACTIVATIONS = ("swiglu", "geglu")
_FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def _grouped_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (CUDA, BF16, 16-byte rows)."""
    if not hasattr(torch, "_grouped_mm") or not a.is_cuda or a.shape[0] == 0:
        return False
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    align = 16 // a.element_size()
    a_ok = a.stride(1) == 1 and a.stride(0) % align == 0
    # B may be row-major or column-major in its last two dims (a transposed
    # nn.Linear weight is column-major), with 16-byte aligned leading strides.
    b_ok = (b.stride(2) == 1 and b.stride(1) % align == 0) or (
        b.stride(1) == 1 and b.stride(2) % align == 0
    )
    ptr_ok = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    return a_ok and b_ok and ptr_ok


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """Per-expert products over expert-sorted rows: ``out[rows of e] = a[rows of e] @ b[e]``.

    Args:
        a: ``[M, k]`` rows sorted by group.
        b: ``[G, k, n]``, same dtype as ``a``.
        offsets: ``[G]`` int32 on ``a``'s device, cumulative row counts (group ``e``
            is rows ``offsets[e-1] .. offsets[e]-1``; ``offsets[-1] == M``).
        use_grouped_mm: ``None`` picks ``torch._grouped_mm`` when it takes the operands
            (CUDA, BF16, 16-byte aligned rows), else a per-group loop of matmuls;
            ``True``/``False`` force one (the loop reads ``offsets`` on the host).

    Returns:
        ``[M, n]`` in ``a``'s dtype, differentiable in ``a`` and ``b``.
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(a, b)
    if use_grouped_mm:
        # offs stays on the device: no host sync on this path.
        return torch._grouped_mm(a, b, offs=offsets)
    pieces = []
    start = 0
    for e, end in enumerate(offsets.tolist()):
        pieces.append(a[start:end] @ b[e])
        start = end
    return torch.cat(pieces)


# Row movement. Each direction is a gather (vectorized, deterministic) forward and
# backward; plain index_select would back-propagate through an atomic index_add
# (~7 ms per [T*K, 4096] BF16 tensor on an H200, and order-dependent).
def _gather_rows(src: torch.Tensor, token_of_row: torch.Tensor) -> torch.Tensor:
    """``[T, C]`` -> ``[M, C]``: row ``i`` is token ``token_of_row[i]``'s row."""
    return src.index_select(0, token_of_row)


def _combine_rows(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[M, C]`` -> ``[T, C]``: sum of each token's ``top_k`` routes, k = 0..K-1.

    ``inverse[t*K + k]`` is the sorted row of route ``(t, k)``; the sum over k runs in
    fp32 (torch's reduction accumulator) in a fixed order.
    """
    return rows.index_select(0, inverse).view(-1, top_k, rows.shape[1]).sum(dim=1)


class _GatherRows(torch.autograd.Function):
    """Gather token rows into expert-sorted route rows; the adjoint is the combine."""

    @staticmethod
    def forward(ctx, src, token_of_row, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return _gather_rows(src, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _combine_rows(grad.contiguous(), inverse, ctx.top_k), None, None, None


class _CombineRows(torch.autograd.Function):
    """Sum expert-sorted route rows back to tokens; the adjoint is the gather."""

    @staticmethod
    def forward(ctx, rows, token_of_row, inverse, top_k):
        ctx.save_for_backward(token_of_row)
        return _combine_rows(rows, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return _gather_rows(grad.contiguous(), token_of_row), None, None, None


def _activation(
    g: torch.Tensor, u: torch.Tensor, activation: str, clamp: float | None
) -> torch.Tensor:
    if clamp is not None:
        # The gradient passes at the boundary (|value| == clamp), as DESIGN §1 asks:
        # where() sends it to the input wherever the input is kept. (torch.clamp's own
        # gradient at the boundary changed between torch 2.13 and 2.14.)
        g = torch.where(g > clamp, clamp, g)
        u = torch.where(u > clamp, clamp, torch.where(u < -clamp, -clamp, u))
    if activation == "swiglu":
        return F.silu(g) * u
    return F.gelu(g, approximate="tanh") * u


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights | tuple[torch.Tensor, torch.Tensor],
    side: SideLoRA | None = None,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    expert_begin: int = 0,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Unfused MoE layer with optional shared-outer side-LoRA (DESIGN §1, §7).

    Args:
        x: ``[T, H]`` bfloat16 (float32/float64 accepted; all math runs in ``x``'s dtype).
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked.
        topk_weights: ``[T, K]`` float32 router weights (differentiable).
        base: :class:`~megamoe.weights.BaseWeights` (read through ``w13_linear`` /
            ``w2_linear``, so MXFP4 is dequantized: the baseline is BF16 math), or a
            ``(w13 [E_l, 2I, H], w2 [E_l, H, I])`` pair in nn.Linear layout, which
            is what a trainer holds (no layout copy per call).
        side: adapters or ``None``.
        activation: ``"swiglu"`` or ``"geglu"`` (tanh GELU).
        activation_clamp: optional ``c > 0``: ``g = min(g, c)``, ``u = clamp(u, -c, c)``.
        expert_begin: global id of local expert 0; other ids are non-local.
        use_grouped_mm: see :func:`grouped_mm` (``None`` = automatic).

    Returns:
        ``[T, H]`` in ``x``'s dtype, differentiable by torch autograd in ``x``,
        ``topk_weights``, the adapter tensors and (ordinary mode) the base weights.
    """
    x = check_tensor("x", x, ndim=2, dtypes=_FLOAT_DTYPES)
    tokens, hidden = x.shape
    topk_ids = check_tensor(
        "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=x.device
    )
    top_k = topk_ids.shape[1]
    check_tensor("topk_ids", topk_ids, shape=(tokens, None))
    check_tensor("topk_weights", topk_weights, shape=(tokens, top_k), device=x.device)
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
    check_str_choice("activation", activation, ACTIVATIONS)
    if activation_clamp is not None:
        activation_clamp = check_finite_float("activation_clamp", activation_clamp)
        if activation_clamp <= 0.0:
            raise ValueError(f"activation_clamp: expected a value > 0, got {activation_clamp}")
    expert_begin = check_int("expert_begin", expert_begin, minimum=0)

    dtype = x.dtype
    if isinstance(base, BaseWeights):
        base = base.for_call()  # MXFP4 ordinary mode: straight through, as mm.moe
        # The MXFP4 decoder stops at float32, which holds every decoded value exactly.
        narrow = torch.float32 if dtype == torch.float64 else dtype
        w13, w2 = base.w13_linear(narrow).to(dtype), base.w2_linear(narrow).to(dtype)
    else:
        w13, w2 = base
        w13, w2 = w13.to(dtype), w2.to(dtype)
    experts = w13.shape[0]
    inter = w13.shape[1] // 2
    check_tensor("base.w13", w13, shape=(experts, 2 * inter, hidden), device=x.device)
    check_tensor("base.w2", w2, shape=(experts, hidden, inter), device=x.device)
    if side is not None:
        if side.hidden != hidden or side.intermediate != inter or side.num_experts != experts:
            raise ValueError(
                f"side: expected H={hidden}, I={inter}, E_l={experts} like the base, got "
                f"H={side.hidden}, I={side.intermediate}, E_l={side.num_experts}"
            )
        if side.device != x.device:
            raise ValueError(f"side: expected device {x.device} like x, got {side.device}")

    # Route plan: flatten (t, k) routes, stable sort by local expert.
    local = topk_ids.reshape(-1).long() - expert_begin
    valid = (topk_ids.reshape(-1) >= 0) & (local >= 0) & (local < experts)
    key = torch.where(valid, local, experts - 1)  # dropped routes ride in the last group
    sorted_key, order = torch.sort(key, stable=True)  # order: sorted row -> route t*K + k
    # Group ends by binary search on the sorted keys (torch.bincount would sync the
    # host on CUDA to size its output).
    group_ids = torch.arange(experts, device=key.device)
    offsets = torch.searchsorted(sorted_key, group_ids, right=True).to(torch.int32)
    rows = order.numel()
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows, device=order.device)  # flat route -> sorted row
    token_of_row = order // top_k

    def to_sorted(per_token: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(per_token, token_of_row, inverse, top_k)

    def to_tokens(sorted_rows: torch.Tensor) -> torch.Tensor:
        return _CombineRows.apply(sorted_rows, token_of_row, inverse, top_k)

    def gmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return grouped_mm(a, b, offsets, use_grouped_mm=use_grouped_mm)

    # Zero weight for dropped routes: their rows then add exact zeros everywhere.
    weights = torch.where(valid, topk_weights.reshape(-1), 0.0)
    row_weights = weights.index_select(0, order).to(dtype).unsqueeze(1)  # [M, 1]

    # GEMM1 (gate and up in one product) on the gathered rows.
    gu = gmm(to_sorted(x), w13.transpose(1, 2))  # [M, 2I]
    # split, not two slices: autograd joins split's gradients with one cat, where each
    # slice's backward zero-fills a whole [M, 2I] buffer before an add.
    g, u = gu.split(inter, dim=1)
    if side is not None:
        a1, b1, a3, b3, a2, b2 = (t.to(dtype) for t in side.tensors())
        rank = side.rank
        # Shared shrink once per token (not per route), already scaled by s.
        q_rows = to_sorted(torch.mm(x, torch.cat([a1, a3], dim=1)) * side.scale)  # [M, 2r]
        g = g + gmm(q_rows[:, :rank], b1)
        u = u + gmm(q_rows[:, rank:], b3)
    # The router weight is applied to h (GEMM2 is linear in it): half the elements
    # of weighting y, and it weights the side shrink p = h a2 at the same time.
    h = _activation(g, u, activation, activation_clamp) * row_weights  # [M, I]

    out = to_tokens(gmm(h, w2.transpose(1, 2)))  # [T, H] = sum_k w y
    if side is not None:
        p_comb = to_tokens(gmm(h, a2))  # [T, r] = sum_k w p
        # Shared expand once per token: out += s * (sum_k w p) b2.
        out = torch.addmm(out, p_comb, b2, alpha=side.scale)
    return out
