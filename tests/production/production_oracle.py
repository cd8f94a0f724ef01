"""An independent oracle for the production suite: the MoE layer of docs/DESIGN.md §1 in
plain torch, unrounded, one expert at a time, in float32 (or float64), with torch
autograd for every gradient.

It shares no code with the library's own oracle (``megamoe.reference``, closed-form
backward) or baseline (``megamoe.testing.baseline``, grouped GEMMs): the only megamoe
functions it is given are the MXFP4 quantizer's, through the caller's
``expert_weights`` (the oracle of an MXFP4 layer runs on the dequantized weights).

Memory: one expert's rows at a time (their forward, then at once their backward), so
besides the float leaves (``x``, the router weights, the adapters, the gradients of
the base in ordinary mode) only one expert's activations live at a time; at one EP4
rank of the production layer in float32 that is under 30 GB.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SIDE_NAMES = ("a1", "b1", "a3", "b3", "a2", "b2")

#: ``expert_weights(e) -> (w13_e [2I, H], w2_e [H, I])`` in nn.Linear layout (rows
#: ``0..I-1`` gate, ``I..2I-1`` up), any float dtype.
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class OracleResult:
    """``out [T, H]`` and the gradients by name (``x``, ``topk_weights``, the six
    adapters with ``side``, ``w13``/``w2`` with ``base_grads``), in the oracle dtype."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor]
    #: Entries of ``g`` and ``u`` the clamp changed, over all routed ``g`` and ``u``
    #: entries (``2 I`` per unmasked route); 0 without a clamp.
    clamped: float = 0.0


def bf16_weights(w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
    """Expert ``e``'s slices of BF16 nn.Linear-layout ``w13 [E, 2I, H]``, ``w2 [E, H, I]``."""
    return lambda e: (w13[e], w2[e])


def mxfp4_weights(w13: torch.Tensor, w2: torch.Tensor, quantize, dequantize) -> ExpertWeights:
    """Expert ``e``'s weights as an MXFP4 base holds them: ``dequantize(quantize(w, -1))``
    of its nn.Linear-layout slices (one UE8M0 scale per 32 values along the reduction
    dim: ``H`` for ``w13``, ``I`` for ``w2``). ``quantize``/``dequantize`` are
    ``megamoe.quantize_mxfp4``/``megamoe.dequantize_mxfp4``."""

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 holds the BF16-representable weights exactly (the quantizer's input).
        return tuple(
            dequantize(*quantize(w[e].float(), axis=-1), axis=-1, dtype=torch.float32)
            for w in (w13, w2)
        )

    return weights


def moe_oracle(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_weights: ExpertWeights,
    num_experts: int,
    side: tuple[torch.Tensor, ...] | None,
    scale: float,
    dout: torch.Tensor,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    base_grads: bool = False,
    dtype: torch.dtype = torch.float32,
    clamp_on_bf16: bool = True,
) -> OracleResult:
    """The layer's output and the gradients of ``<out, dout>``, in ``dtype``.

    For each expert ``e`` and each route ``(t, k)`` with ``topk_ids[t, k] == e`` (ids
    outside ``[0, E)`` are masked routes and contribute nothing)::

        g = x_t w1_e^T + s (x_t a1) b1_e      u = x_t w3_e^T + s (x_t a3) b3_e
        g = min(g, c); u = clamp(u, -c, c)    (with a clamp c; see clamp_activations)
        h = act(g) * u                        act = silu | gelu(tanh)
        out_t += w_tk (h w2_e^T + s (h a2_e) b2)

    The shared ``b2`` expand is applied per route here (the kernels apply it once per
    token, after the sum over k: the same value by linearity).
    """
    tokens, top_k = topk_ids.shape
    xf = x.detach().to(dtype).requires_grad_(True)
    wf = topk_weights.detach().to(dtype).requires_grad_(True)
    side_f = None
    if side is not None:
        side_f = [t.detach().to(dtype).requires_grad_(True) for t in side]
    dout_f = dout.detach().to(dtype)
    out = torch.zeros(tokens, x.shape[1], dtype=dtype, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=num_experts + 1)[1:].tolist()
    start = int((flat < 0).sum())
    dw13, dw2 = [], []
    clamped_entries = gu_entries = 0
    for e in range(num_experts):
        routes = order[start : start + counts[e]]
        start += counts[e]
        w13_e, w2_e = (w.detach().to(dtype).requires_grad_(base_grads) for w in expert_weights(e))
        if routes.numel() == 0:
            if base_grads:
                dw13.append(torch.zeros_like(w13_e))
                dw2.append(torch.zeros_like(w2_e))
            continue
        tok, slot = routes // top_k, routes % top_k
        xe = xf[tok]
        inter = w13_e.shape[0] // 2
        g = xe @ w13_e[:inter].T
        u = xe @ w13_e[inter:].T
        if side_f is not None:
            a1, b1, a3, b3, _, _ = side_f
            g = g + scale * ((xe @ a1) @ b1[e])
            u = u + scale * ((xe @ a3) @ b3[e])
        if activation_clamp is not None:
            g, u, clamped = clamp_activations(g, u, activation_clamp, clamp_on_bf16)
            clamped_entries += clamped
        gu_entries += g.numel() + u.numel()
        act = F.silu(g) if activation == "swiglu" else F.gelu(g, approximate="tanh")
        h = act * u
        y = h @ w2_e.T
        if side_f is not None:
            a2, b2 = side_f[4], side_f[5]
            y = y + scale * ((h @ a2[e]) @ b2)
        y = wf[tok, slot].unsqueeze(1) * y
        out.index_add_(0, tok, y.detach())
        # <out, dout> is a sum over routes: each expert's part back-propagates alone.
        (y * dout_f[tok]).sum().backward()
        if base_grads:
            dw13.append(w13_e.grad)
            dw2.append(w2_e.grad)
        del xe, g, u, act, h, y
    grads = {
        "x": _grad(xf),
        "topk_weights": _grad(wf),
    }
    if side_f is not None:
        grads.update({name: _grad(t) for name, t in zip(SIDE_NAMES, side_f, strict=True)})
    if base_grads:
        grads["w13"] = torch.stack(dw13)
        grads["w2"] = torch.stack(dw2)
    clamped = clamped_entries / gu_entries if gu_entries else 0.0
    return OracleResult(out=out, grads=grads, clamped=clamped)


def clamp_activations(g: torch.Tensor, u: torch.Tensor, c: float, on_bf16: bool = True):
    """``min(g, c)``, ``clamp(u, -c, c)`` and how many entries the clamp changed.

    With ``on_bf16`` the clamp is decided on the BF16-rounded ``g``, ``u``, as the
    kernels decide it (they store GEMM1's output in BF16 and clamp that); the values
    kept are unrounded. An unrounded decision differs on the entries within half a BF16
    ulp of ``c``, and their gradient is all or nothing. Boundary values count as not
    clamped: their gradient passes (DESIGN §1)."""
    decide_g, decide_u = g.detach(), u.detach()
    if on_bf16:
        decide_g = decide_g.to(torch.bfloat16).to(g.dtype)
        decide_u = decide_u.to(torch.bfloat16).to(u.dtype)
    g_over, u_over = decide_g > c, decide_u.abs() > c
    g = torch.where(g_over, torch.full_like(g, c), g)
    u = torch.where(u_over, c * u.detach().sign(), u)
    return g, u, int(g_over.sum()) + int(u_over.sum())


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    # A leaf no route reached (every route masked) has no .grad: its gradient is 0.
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


@dataclass(frozen=True)
class Closeness:
    """``cosine`` and ``rel_l2 = |a - e| / |e|`` of two tensors, ``worst_row`` (the largest
    row error ``|a_i - e_i|`` over the RMS row norm of ``e``; rows: the leading dimension,
    a 1-D tensor is one row) and whether ``a`` is all finite, computed in float64 in
    chunks of whole rows (no float64 copy of a whole tensor)."""

    cosine: float
    rel_l2: float
    finite: bool
    worst_row: float

    def __str__(self) -> str:
        return (
            f"cosine={self.cosine:.8f} rel_l2={self.rel_l2:.3e} worst_row={self.worst_row:.3e} "
            f"finite={self.finite}"
        )


def closeness(actual: torch.Tensor, expected: torch.Tensor, chunk: int = 1 << 26) -> Closeness:
    """Compare ``actual`` with ``expected`` (same shape, any float dtypes); ``chunk``
    bounds the elements of one float64 step (at least one row)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {list(actual.shape)} vs {list(expected.shape)}")
    rows = expected.shape[0] if expected.dim() >= 2 and expected.shape[0] else 1
    a_rows = actual.detach().reshape(rows, -1)
    e_rows = expected.detach().reshape(rows, -1).to(a_rows.device)
    step = max(1, chunk // max(1, a_rows.shape[1]))
    dot = norm_a = norm_e = norm_d = worst_d = 0.0
    finite = True
    for begin in range(0, rows, step):
        a = a_rows[begin : begin + step].double()
        e = e_rows[begin : begin + step].double()
        finite = finite and bool(torch.isfinite(a).all())
        a_flat, e_flat = a.reshape(-1), e.reshape(-1)
        dot += float(torch.dot(a_flat, e_flat))
        norm_a += float(torch.dot(a_flat, a_flat))
        norm_e += float(torch.dot(e_flat, e_flat))
        row_d = torch.linalg.vector_norm(a - e, dim=1) ** 2  # one temporary, as before
        norm_d += float(row_d.sum())
        worst_d = max(worst_d, float(row_d.max()))  # a step holds at least one row
    norm_a, norm_e, norm_d = math.sqrt(norm_a), math.sqrt(norm_e), math.sqrt(norm_d)
    if norm_a == 0.0 and norm_e == 0.0:
        return Closeness(1.0, 0.0, finite, 0.0)
    if norm_a == 0.0 or norm_e == 0.0:
        rel = math.inf if norm_e == 0.0 else norm_d / norm_e
        return Closeness(0.0, rel, finite, rel)
    worst_row = math.sqrt(worst_d) / (norm_e / math.sqrt(rows))
    return Closeness(dot / norm_a / norm_e, norm_d / norm_e, finite, worst_row)


#: The row gate: one wrong token, route or expert row is local and the global gates shrink
#: it by the number of rows (one zeroed token of 65,536 passes them); BF16 rounding
#: reads at most 0.025 on the GPU suite (docs/PERFORMANCE.md, fifty-fourth session).
MAX_WORST_ROW = 0.1


def assert_gates(name: str, actual: torch.Tensor, expected: torch.Tensor, min_cosine: float,
                 max_rel_l2: float, max_worst_row: float = MAX_WORST_ROW) -> Closeness:  # fmt: skip
    """Assert ``actual`` is finite, ``cosine >= min_cosine``, ``rel_l2 <= max_rel_l2`` and
    ``worst_row <= max_worst_row``."""
    c = closeness(actual, expected)
    # Written as "not (ok)" so a NaN metric fails instead of slipping through.
    if not (
        c.finite
        and c.cosine >= min_cosine
        and c.rel_l2 <= max_rel_l2
        and c.worst_row <= max_worst_row
    ):
        raise AssertionError(
            f"{name}: {c} (gates: finite, cosine >= {min_cosine}, rel_l2 <= {max_rel_l2}, "
            f"worst_row <= {max_worst_row})"
        )
    return c
