"""Pool gather and pool combine: moving token rows into and out of the expert pool.

The pool (see :class:`~megamoe.wrappers.routing.RoutePlan`) holds one row per local route,
sorted by expert, each expert's segment padded to ``block_m``.

- :func:`gather_pool` fills the pool input: ``pool_input[row] = [x[t] | side[t]]``
  for each routed row (``t = route // K``), zeros for padding rows below the rows in
  use (``expert_pool_offsets[-1]``); rows at or past it are not touched.
- :func:`side_sum` reduces the pool output's side columns per token:
  ``p_sum[t] = bf16(sum_k w[t, k] * pool_output[row_tk, H:H+r])``.
- :func:`combine` reduces the pool output's hidden columns per token, plus an
  optional scaled side expansion:
  ``out[t] = bf16(sum_k w[t, k] * pool_output[row_tk, :H] + scale * side_expand[t])``.
- :func:`gather_rows` is the same gather kernel as a plain row permutation
  (``out[i] = src[rows[i]]``).

Sums run over the routes ``k = 0 .. K-1`` with ``row_tk >= 0``, in float32, in that
fixed order, each product and each sum rounded separately; the CUDA kernels and the
torch references (``*_reference``, used on CPU) do exactly these float32 operations,
so they agree bit for bit. A scale of 0 drops the side term, so the output is then
bitwise the no-side output.

All BF16 row lengths must be multiples of 8 (the kernels move 16-byte vectors) and,
on CUDA, every BF16 tensor must start at a 16-byte aligned address.
"""

from __future__ import annotations

import torch

from ..validation.arguments import check_finite_float, check_int, check_tensor
from . import _native
from .routing import RoutePlan

# BF16 elements per 16-byte vector of the kernels: row lengths must be multiples.
VECTOR_ELEMS = 8
VECTOR_BYTES = 16

__all__ = [
    "combine",
    "combine_reference",
    "combine_unchecked",
    "gather_pool",
    "gather_pool_reference",
    "gather_pool_unchecked",
    "gather_rows",
    "side_sum",
    "side_sum_reference",
    "side_sum_unchecked",
]


def _check_plan(plan: object) -> RoutePlan:
    # A RoutePlan checks its index maps when it is made (RoutePlan.__post_init__).
    if not isinstance(plan, RoutePlan):
        raise TypeError(f"plan: expected a megamoe.RoutePlan, got {type(plan).__name__}")
    return plan


def _check_bf16(
    name: str, value: object, shape: list[int | None], device: torch.device
) -> torch.Tensor:
    return check_tensor(
        name,
        value,
        shape=shape,
        dtypes=(torch.bfloat16,),
        device=device,
        contiguous=True,
        alignment=VECTOR_BYTES,
    )


def _check_vector_multiple(name: str, what: str, value: int) -> None:
    if value % VECTOR_ELEMS != 0:
        raise ValueError(
            f"{name}: expected {what} to be a multiple of {VECTOR_ELEMS} "
            f"(16-byte vectors), got {value}"
        )


def _check_weights(topk_weights: object, plan: RoutePlan) -> torch.Tensor:
    return check_tensor(
        "topk_weights",
        topk_weights,
        shape=list(plan.route_to_pool_row.shape),
        dtypes=(torch.float32,),
        device=plan.route_to_pool_row.device,
        contiguous=True,
    )


# --------------------------------------------------------------------------- gather


def _check_gather(
    x: object, side: object, plan: object, out: object
) -> tuple[RoutePlan, int, int, int]:
    """Validate gather arguments; return (plan, hidden, side_cols, top_k)."""
    plan = _check_plan(plan)
    device = plan.pool_row_to_route.device
    x = _check_bf16("x", x, [None, None], device)
    num_tokens, hidden = x.shape
    if hidden < VECTOR_ELEMS:
        raise ValueError(f"x: expected at least {VECTOR_ELEMS} columns, got {hidden}")
    _check_vector_multiple("x", "the hidden size (columns)", hidden)
    side_cols = 0
    if side is not None:
        side = _check_bf16("side", side, [num_tokens, None], device)
        side_cols = side.shape[1]
        _check_vector_multiple("side", "its column count", side_cols)
    if plan.route_to_pool_row.shape[0] != num_tokens:
        raise ValueError(
            f"plan.route_to_pool_row: expected {num_tokens} rows (x's tokens), got shape "
            f"{list(plan.route_to_pool_row.shape)}"
        )
    if out is not None:
        _check_bf16("out", out, [plan.pool_capacity, hidden + side_cols], device)
    return plan, hidden, side_cols, plan.route_to_pool_row.shape[1]


def gather_pool_reference(
    x: torch.Tensor,
    side: torch.Tensor | None,
    plan: RoutePlan,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gather_pool` with torch ops (any device; reads the rows in use to the host).

    Returns ``out`` (allocated with zeros when ``None``).
    """
    plan, hidden, side_cols, top_k = _check_gather(x, side, plan, out)
    capacity = plan.pool_capacity
    if out is None:
        out = torch.zeros(capacity, hidden + side_cols, dtype=torch.bfloat16, device=x.device)
    rows_used = min(max(int(plan.expert_pool_offsets[-1]), 0), capacity)
    routes = plan.pool_row_to_route[:rows_used].to(torch.int64)
    # A row holds its route's token only where both index maps name the pair; every
    # other row in use is zero (padding, and any row of a corrupt plan), as in the kernel.
    num_routes = x.shape[0] * top_k
    routed = (routes >= 0) & (routes < num_routes)
    if num_routes > 0:
        back = plan.route_to_pool_row.reshape(-1).to(torch.int64)[routes.clamp(0, num_routes - 1)]
        routed &= back == torch.arange(rows_used, device=routes.device)
    tokens = torch.div(routes[routed], top_k, rounding_mode="floor")
    rows = torch.zeros(rows_used, hidden + side_cols, dtype=torch.bfloat16, device=x.device)
    rows[routed, :hidden] = x[tokens]
    if side_cols:
        rows[routed, hidden:] = side[tokens]
    out[:rows_used] = rows
    return out


def gather_pool(
    x: torch.Tensor,
    side: torch.Tensor | None,
    plan: RoutePlan,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather ``[x | side]`` of every local route into the expert pool.

    Args:
        x: ``[T, H]`` bfloat16, ``H`` a multiple of 8.
        side: ``[T, C]`` bfloat16 (``C`` a multiple of 8, e.g. ``[s q1 | s q3]`` with
            ``C = 2r``) or ``None`` for no side columns.
        plan: the :class:`~megamoe.wrappers.routing.RoutePlan` of this routing (``T`` tokens).
        out: ``[pool_capacity, H + C]`` bfloat16 to write into, or ``None`` to allocate.

    Returns:
        ``out``: row ``row`` holds ``[x[t] | side[t]]`` for ``t = route // K`` of its
        route; padding rows below ``plan.expert_pool_offsets[-1]`` are zero; rows at or
        past it are not written (uninitialised when allocated here on CUDA).

    On CUDA this is one kernel on the current stream with no host synchronisation:
    token-major for ``K > 1`` (each token's row read once, written to its ``K`` pool
    rows), a warp per row in use for ``K = 1``; on CPU it is :func:`gather_pool_reference`.
    """
    plan = _check_gather(x, side, plan, out)[0]
    if not x.is_cuda:
        return gather_pool_reference(x, side, plan, out)
    return _launch_gather(x, side, plan, out)


def gather_pool_unchecked(
    x: torch.Tensor, side: torch.Tensor | None, plan: RoutePlan
) -> torch.Tensor:
    """:func:`gather_pool` for the fused pipelines, whose operands are made from inputs
    already checked: no argument checks in Python (host time a small-token step pays per
    check); the native launcher still checks dtypes, shapes, devices and alignment."""
    if not x.is_cuda:
        return gather_pool(x, side, plan)
    return _launch_gather(x, side, plan, None)


def _launch_gather(
    x: torch.Tensor, side: torch.Tensor | None, plan: RoutePlan, out: torch.Tensor | None
) -> torch.Tensor:
    side_cols = 0 if side is None else side.shape[1]
    if out is None:
        out = torch.empty(
            plan.pool_capacity, x.shape[1] + side_cols, dtype=torch.bfloat16, device=x.device
        )
    dl = _native.dlpack
    stream = _native.current_stream(x.device)
    side_arg = dl(side) if side_cols else None
    with _native.on_device(x.device):
        if plan.route_to_pool_row.shape[1] > 1:  # each token's row read once for its K rows
            _native.native().pool_gather_tokens(
                dl(x), side_arg, dl(plan.route_to_pool_row), dl(plan.pool_row_to_route),
                dl(plan.expert_pool_offsets), dl(out), stream,
            )  # fmt: skip
        else:  # one row per token (EP's received rows): visit only the rows in use
            _native.native().pool_gather(
                dl(x), side_arg, dl(plan.pool_row_to_route), dl(plan.expert_pool_offsets), 1,
                dl(out), stream, dl(plan.route_to_pool_row),
            )  # fmt: skip
    return out


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[rows[i]]``: a row gather of BF16 rows on the pool-gather kernel.

    Args:
        src: ``[R, C]`` bfloat16, contiguous, ``C`` a multiple of 8.
        rows: ``[R_out]`` int32 indices into ``src``'s rows (all in ``[0, R)``; not
            checked, which would read them on the host: on CUDA a row outside gives a
            zero row, on CPU ``index_select`` raises).

    Returns:
        ``[R_out, C]`` bfloat16. On CUDA one kernel at memory speed (a warp per row,
        16-byte vectors) with no host synchronisation; elsewhere ``index_select``.
    """
    check_tensor(
        "src", src, ndim=2, dtypes=(torch.bfloat16,), contiguous=True, alignment=VECTOR_BYTES
    )
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32,), device=src.device, contiguous=True)
    _check_vector_multiple("src", "its column count", src.shape[1])
    if not src.is_cuda:
        return src.index_select(0, rows)
    out = torch.empty(rows.shape[0], src.shape[1], dtype=torch.bfloat16, device=src.device)
    # The kernel reads its row count from the last entry of a device array (no sync).
    rows_used = torch.full((2,), rows.shape[0], dtype=torch.int32, device=src.device)
    dl = _native.dlpack
    with _native.on_device(src.device):
        _native.native().pool_gather(
            dl(src), None, dl(rows), dl(rows_used), 1, dl(out), _native.current_stream(src.device)
        )
    return out


# --------------------------------------------------------------------------- combine


def _weighted_route_sum(
    pool_output: torch.Tensor,
    columns: slice,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``sum_k w[:, k] * pool_output[row_k, columns]`` in float32, k in order: [T, n]."""
    rows = plan.route_to_pool_row.to(torch.int64)
    num_tokens, top_k = rows.shape
    capacity = pool_output.shape[0]
    width = len(range(*columns.indices(pool_output.shape[1])))
    acc = torch.zeros(num_tokens, width, dtype=torch.float32, device=pool_output.device)
    # Rows outside the pool (a corrupt plan) count as masked, as in the kernel.
    live = (rows >= 0) & (rows < capacity)
    if capacity == 0:
        return acc
    safe_rows = torch.where(live, rows, 0)
    for k in range(top_k):
        values = pool_output[safe_rows[:, k], columns].to(torch.float32)
        product = topk_weights[:, k : k + 1] * values
        # Adding +0 for a masked route equals skipping it: acc starts at +0 and a
        # round-to-nearest sum is -0 only when both terms are -0, so acc is never -0.
        acc = acc + torch.where(live[:, k : k + 1], product, 0.0)
    return acc


def _check_side_sum(
    pool_output: object, plan: object, topk_weights: object, hidden: object, out: object
) -> tuple[RoutePlan, int]:
    """Validate side_sum arguments; return (plan, side_rank)."""
    plan = _check_plan(plan)
    device = plan.route_to_pool_row.device
    # Exactly the plan's rows: the kernel reads a row past the end as a masked route.
    pool_output = _check_bf16("pool_output", pool_output, [plan.pool_capacity, None], device)
    _check_weights(topk_weights, plan)
    columns = pool_output.shape[1]
    # hidden = 0 sums whole rows (the backward's b1/b3 shrinks).
    hidden = check_int("hidden", hidden, minimum=0)
    if hidden > columns:
        raise ValueError(
            f"hidden: expected at most {columns} (pool_output's columns), got {hidden}"
        )
    _check_vector_multiple("hidden", "the hidden size", hidden)
    _check_vector_multiple("pool_output", "its side columns (columns - hidden)", columns - hidden)
    num_tokens = plan.route_to_pool_row.shape[0]
    if out is not None:
        _check_bf16("out", out, [num_tokens, columns - hidden], device)
    return plan, columns - hidden


def side_sum_reference(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    hidden: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`side_sum` with torch ops (any device)."""
    plan, _ = _check_side_sum(pool_output, plan, topk_weights, hidden, out)
    total = _weighted_route_sum(pool_output, slice(hidden, None), plan, topk_weights)
    if out is None:
        return total.to(torch.bfloat16)
    out.copy_(total)
    return out


def side_sum(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    hidden: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weighted sum of the pool output's side columns (the ``p`` of DESIGN §1).

    Args:
        pool_output: ``[pool_capacity, H + r]`` bfloat16 (GEMM2's ``[y | p]``).
        plan: the :class:`~megamoe.wrappers.routing.RoutePlan` the pool was built with.
        topk_weights: ``[T, K]`` float32.
        hidden: ``H``; columns ``H .. H + r - 1`` are summed (``r`` a multiple of 8;
            ``H = 0`` sums whole rows).
        out: ``[T, r]`` bfloat16 to write into, or ``None`` to allocate.

    Returns:
        ``out[t] = bf16(sum_k w[t, k] * pool_output[row_tk, H:])`` over routes with a pool
        row, float32 in order ``k = 0 .. K-1``; tokens with no local route get zeros.
    """
    plan = _check_side_sum(pool_output, plan, topk_weights, hidden, out)[0]
    if not pool_output.is_cuda:
        return side_sum_reference(pool_output, plan, topk_weights, hidden, out)
    return _launch_side_sum(pool_output, plan, topk_weights, hidden, out)


def side_sum_unchecked(
    pool_output: torch.Tensor, plan: RoutePlan, topk_weights: torch.Tensor, hidden: int
) -> torch.Tensor:
    """:func:`side_sum` for the fused pipelines (unchecked in Python, as
    :func:`gather_pool_unchecked`)."""
    if not pool_output.is_cuda:
        return side_sum(pool_output, plan, topk_weights, hidden)
    return _launch_side_sum(pool_output, plan, topk_weights, hidden, None)


def _launch_side_sum(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    hidden: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty(
            plan.route_to_pool_row.shape[0],
            pool_output.shape[1] - hidden,
            dtype=torch.bfloat16,
            device=pool_output.device,
        )
    dl = _native.dlpack
    with _native.on_device(pool_output.device):
        _native.native().pool_side_sum(
            dl(pool_output),
            dl(plan.route_to_pool_row),
            dl(topk_weights),
            hidden,
            dl(out),
            _native.current_stream(pool_output.device),
        )
    return out


def _check_combine(
    pool_output: object,
    plan: object,
    topk_weights: object,
    side_expand: object,
    scale: object,
    out: object,
    hidden: object,
) -> tuple[RoutePlan, int, float]:
    """Validate combine arguments; return (plan, hidden, scale)."""
    plan = _check_plan(plan)
    device = plan.route_to_pool_row.device
    # Exactly the plan's rows: the kernel reads a row past the end as a masked route.
    pool_output = _check_bf16("pool_output", pool_output, [plan.pool_capacity, None], device)
    _check_weights(topk_weights, plan)
    scale = check_finite_float("scale", scale, float32=True)  # the kernel's float32
    num_tokens = plan.route_to_pool_row.shape[0]
    columns = pool_output.shape[1]
    # H: given, else the width of out / side_expand, else every column (r = 0).
    if hidden is None:
        for source in (out, side_expand):
            if isinstance(source, torch.Tensor) and source.dim() == 2:
                hidden = source.shape[1]
                break
        else:
            hidden = columns
    hidden = check_int("hidden", hidden, minimum=VECTOR_ELEMS)
    if hidden > columns:
        raise ValueError(
            f"hidden: expected at most {columns} (pool_output's columns), got {hidden}"
        )
    _check_vector_multiple("hidden", "the hidden size", hidden)
    _check_vector_multiple("pool_output", "its side columns (columns - hidden)", columns - hidden)
    if side_expand is not None:
        _check_bf16("side_expand", side_expand, [num_tokens, hidden], device)
    if out is not None:
        _check_bf16("out", out, [num_tokens, hidden], device)
    return plan, hidden, scale


def combine_reference(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    side_expand: torch.Tensor | None = None,
    scale: float = 0.0,
    out: torch.Tensor | None = None,
    *,
    hidden: int | None = None,
) -> torch.Tensor:
    """:func:`combine` with torch ops (any device)."""
    plan, hidden, scale = _check_combine(
        pool_output, plan, topk_weights, side_expand, scale, out, hidden
    )
    total = _weighted_route_sum(pool_output, slice(0, hidden), plan, topk_weights)
    if side_expand is not None and scale != 0.0:
        # float32 scale, product and sum rounded separately, as in the kernel.
        scale_f32 = torch.tensor(scale, dtype=torch.float32, device=total.device)
        total = total + side_expand.to(torch.float32) * scale_f32
    if out is None:
        return total.to(torch.bfloat16)
    out.copy_(total)
    return out


def combine(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    side_expand: torch.Tensor | None = None,
    scale: float = 0.0,
    out: torch.Tensor | None = None,
    *,
    hidden: int | None = None,
) -> torch.Tensor:
    """Per-token weighted sum of the pool output's hidden columns: the MoE output.

    Args:
        pool_output: ``[pool_capacity, H + r]`` bfloat16 (``r`` may be 0).
        plan: the :class:`~megamoe.wrappers.routing.RoutePlan` the pool was built with.
        topk_weights: ``[T, K]`` float32.
        side_expand: ``[T, H]`` bfloat16 (``(sum_k w p) b2``) or ``None``.
        scale: the adapter scale ``s`` (a finite float; rounded to float32). ``0``
            drops the side term: the output is bitwise the ``side_expand=None`` one.
        out: ``[T, H]`` bfloat16 to write into, or ``None`` to allocate.
        hidden: ``H``. Defaults to the width of ``out``, else of ``side_expand``, else
            every column of ``pool_output`` (no side columns).

    Returns:
        ``out[t] = bf16(sum_k w[t, k] * pool_output[row_tk, :H] + scale * side_expand[t])``
        with the sum over routes with a pool row in float32, order ``k = 0 .. K-1``,
        then the side term added; tokens with no local route get just the side term.
    """
    plan, hidden, scale = _check_combine(
        pool_output, plan, topk_weights, side_expand, scale, out, hidden
    )
    if not pool_output.is_cuda:
        return combine_reference(
            pool_output, plan, topk_weights, side_expand, scale, out, hidden=hidden
        )
    return _launch_combine(pool_output, plan, topk_weights, side_expand, scale, out, hidden)


def combine_unchecked(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    side_expand: torch.Tensor | None,
    *,
    scale: float,
    hidden: int,
) -> torch.Tensor:
    """:func:`combine` for the fused pipelines (unchecked in Python, as
    :func:`gather_pool_unchecked`): ``scale`` a Python float, ``hidden`` given."""
    if not pool_output.is_cuda:
        return combine(pool_output, plan, topk_weights, side_expand, scale, hidden=hidden)
    return _launch_combine(pool_output, plan, topk_weights, side_expand, scale, None, hidden)


def _launch_combine(
    pool_output: torch.Tensor,
    plan: RoutePlan,
    topk_weights: torch.Tensor,
    side_expand: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None,
    hidden: int,
) -> torch.Tensor:
    if out is None:
        out = torch.empty(
            plan.route_to_pool_row.shape[0], hidden, dtype=torch.bfloat16, device=pool_output.device
        )
    dl = _native.dlpack
    with _native.on_device(pool_output.device):
        _native.native().pool_combine(
            dl(pool_output),
            dl(plan.route_to_pool_row),
            dl(topk_weights),
            dl(side_expand) if side_expand is not None else None,
            scale,
            dl(out),
            _native.current_stream(pool_output.device),
        )
    return out
