"""The GEMM engine's pool GEMMs (kernels/engine/), the layer's forward GEMMs and dgrad1.

Two entry points, both on torch's current stream with no host synchronisation:

- :func:`grouped_gemm` (store epilogue): ``out[rows of e] = a[rows of e, :k] @ b[e]^T``
  (``b`` K-major, nn.Linear layout) or ``@ b[e]`` (``b_major="mn"``: the weights as
  stored, the dgrads), plus optional extra output columns: ``b_extra`` (GEMM2's ``a2``
  shrink) or ``b_extra_blocks`` (dgrad1's ``b1``/``b3`` shrinks, two blocks on the
  diagonal, read as given).
- :func:`gated_grouped_gemm` (gated-activation epilogue): GEMM1 on ``w13`` in the
  user's layout (gate rows, then up rows: a tile reads both as two TMA boxes), the
  optional side K segment ``s * (q1 b1 | q3 b3)``, and ``h = act(g) * u`` as BF16 (with
  the pre-activations ``g | u`` optionally stored for the backward).

An MXFP4 ``b`` (packed E2M1 codes + UE8M0 scales, :func:`~megamoe.mxfp4.quantize_mxfp4`
layout) is decoded to BF16 inside the GEMM pipeline, one K step at a time: no BF16 copy
of the weights exists. The torch references (:func:`grouped_gemm_reference`,
:func:`gated_grouped_gemm_reference`) compute the same math per expert in float64 for
tests. On CPU tensors both entry points run a torch twin (float32 per expert, the
kernel's rounding points, host reads of the offsets) so that the layer pipelines built
on them (EP included) can be tested without a GPU; ``mm.moe`` itself requires CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..env import num_sms as resolve_device_sms
from ..heuristics import mxfp4_decodes_in_pipeline, weight_stream_chunk
from ..validation.arguments import (
    check_finite_float,
    check_int,
    check_str_choice,
    check_tensor,
)
from . import _native
from .registry import registry
from .routing import RoutePlan

ACTIVATIONS = {"swiglu": 0, "geglu": 1}
#: M blocks of one expert a wave of CTAs sweeps per weight column block (L2 reuse:
#: docs/PERFORMANCE.md, "Engine v2").
GROUP_M = 16


def _check_pool_operand(
    a: torch.Tensor,
    plan: RoutePlan,
    name: str = "a",
    *,
    weights: tuple[str, torch.Tensor] | None = None,
) -> None:
    """The pool operand of an engine GEMM against its plan, before anything launches:
    exactly the plan's pool rows (the kernel walks the rows the plan says are in use),
    16-byte rows at a 16-byte aligned address (TMA), the plan's maps on its device, and
    the plan's ``block_m`` the one its pool was planned with (the kernels find each
    expert's tiles as ``offset / BLOCK_M``: under another BLOCK_M rows would meet
    another expert's weights). ``weights`` (name, tensor): the expert weights, with one
    expert per plan segment (fewer would be read past their end, more would go unused)."""
    from ..validation.layer import check_plan_block_m  # (it imports this module)

    if not isinstance(plan, RoutePlan):
        raise TypeError(f"plan: expected a megamoe.RoutePlan, got {type(plan).__name__}")
    experts = plan.expert_counts.shape[0]
    if weights is not None and weights[1].shape[0] != experts:
        raise ValueError(
            f"{weights[0]}: expected the plan's E_l = {experts} experts, got "
            f"{weights[1].shape[0]} (shape {list(weights[1].shape)})"
        )
    if a.shape[0] != plan.pool_capacity:
        raise ValueError(
            f"{name}: expected plan.pool_capacity = {plan.pool_capacity} rows, got {a.shape[0]}"
        )
    if a.shape[1] % 8:
        raise ValueError(
            f"{name}: expected a column count that is a multiple of 8 (16-byte rows for "
            f"TMA), got {a.shape[1]}"
        )
    check_tensor(name, a, alignment=16)
    for map_name in (
        "expert_counts",
        "expert_pool_offsets",
        "route_to_pool_row",
        "pool_row_to_route",
    ):
        check_tensor(f"plan.{map_name}", getattr(plan, map_name), device=a.device)
    choices = registry().block_m_choices
    if isinstance(plan.block_m, bool) or plan.block_m not in choices:
        raise ValueError(f"plan.block_m: expected one of {list(choices)}, got {plan.block_m!r}")
    check_plan_block_m(
        plan.block_m, plan.route_to_pool_row, plan.pool_row_to_route,
        experts, name="plan.block_m", planner="its pool was",
    )  # fmt: skip


def _check_tma_aligned(*named: tuple[str, torch.Tensor | None]) -> None:
    """16-byte aligned addresses (CUDA tensors) for what the kernels move by TMA, checked
    before anything launches (an MXFP4 B's decode included), under the caller's names."""
    for name, t in named:
        if t is not None:
            check_tensor(name, t, alignment=16)


def _device_sms(device: torch.device) -> int:
    return resolve_device_sms(_native.device_index(device))


def _check_mxfp4(
    name: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device,
    b_major: str = "k",
) -> int:
    """Check an MXFP4 B and return its ``K``.

    K-major (``b_major="k"``): ``codes`` ``[E, N, K/2]``, ``scales`` ``[E, N, K/32]``
    (uint8, quantized along K, K a multiple of 64). MN-major (``"mn"``, the dgrads
    reading the weights as stored): ``codes`` ``[E, K, N/2]``, ``scales`` ``[E, K, N/32]``
    (quantized along N, N a multiple of 32).
    """
    check_tensor(name, codes, ndim=3, dtypes=(torch.uint8,), device=device, contiguous=True)
    experts, rows, half_cols = codes.shape
    k, n = (rows, 2 * half_cols) if b_major == "mn" else (2 * half_cols, rows)
    if k % 64 != 0:
        raise ValueError(f"{name}: an MXFP4 B needs K a multiple of 64, got K={k}")
    if b_major == "mn" and n % 32 != 0:
        raise ValueError(f"{name}: an MN-major MXFP4 B needs N a multiple of 32, got N={n}")
    check_tensor(
        f"{name}_scales",
        scales,
        shape=(experts, rows, 2 * half_cols // 32),
        dtypes=(torch.uint8,),
        device=device,
        contiguous=True,
    )
    return k


#: Whether the weight-streaming kernel takes a GEMM, from its (checked) MXFP4 codes and
#: scales: the GEMM's shape, for the limit of :func:`mxfp4_decodes_in_pipeline`.
StreamsPredicate = Callable[[torch.Tensor, torch.Tensor], bool]


def _mxfp4_operand(
    codes: torch.Tensor,
    scales: torch.Tensor,
    plan: RoutePlan,
    b_major: str,
    streams: StreamsPredicate | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An MXFP4 B for one GEMM, of codes and scales already checked (the caller runs every
    other check first: the transient decode is a launch): ``(values, scales)``, the codes
    and scales as given where the pipeline decodes them
    (:func:`~megamoe.heuristics.mxfp4_decodes_in_pipeline`, ``streams`` telling whether
    the weight-streaming kernel takes the GEMM; its decode reads both in the caller's
    layout, no copy), else an exact BF16 decode (the same values bit for bit) and None;
    on the CPU the decode."""
    if codes.is_cuda:
        return mxfp4_b_unchecked(codes, scales, plan, b_major, streams=streams)[1:]
    return _dequantized(codes, scales), None


def mxfp4_b_unchecked(
    codes: torch.Tensor,
    scales: torch.Tensor,
    plan: RoutePlan,
    b_major: str = "k",
    *,
    streams: StreamsPredicate | None = None,
) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """``(K, values, scales)`` of :func:`_mxfp4_operand` for CUDA codes and scales (the
    fused pipelines': the weights were checked where they entered)."""
    k = codes.shape[1] if b_major == "mn" else 2 * codes.shape[2]
    rows, experts = plan.pool_capacity, codes.shape[0]
    # The predicate only where it decides: below the engine's limit both decode in the
    # pipeline (the few-token steps, whose host time counts).
    if mxfp4_decodes_in_pipeline(rows, experts) or (
        streams is not None
        and mxfp4_decodes_in_pipeline(rows, experts, streams=True)
        and streams(codes, scales)
    ):
        return k, codes, scales
    return k, _dequantized(codes, scales), None


def _stream_tile_columns() -> dict[str, dict[int, int]]:
    """Each weight-streaming kind's tile columns by chunk rows, from the registry
    (variants.toml's ``columns``, which the generated sources check against the kernels)."""
    tiles: dict[str, dict[int, int]] = {}
    for variant in registry().family("weight_stream"):
        params = variant.params
        tiles.setdefault(params["kind"], {})[params["tokens"]] = params["columns"]
    return tiles


#: Read once at import, as the registry is.
_STREAM_TILE_COLUMNS = _stream_tile_columns()


def stream_widest_chunks() -> dict[str, int]:
    """Each weight-streaming kind's widest chunk (its widest registry variant), the widest
    :func:`~megamoe.heuristics.weight_stream_chunk` may give it, by kind name."""
    return {kind: max(tiles) for kind, tiles in _STREAM_TILE_COLUMNS.items()}


#: The scales' address alignment each streaming kind's producer reads them at (bytes), as
#: its launcher requires (bindings/weight_stream_launch.cpp): the forward kinds load the
#: aligned 8-byte chunk holding four steps' bytes of a row; the transposed kinds copy the
#: aligned 4-byte word holding a step's bytes.
_STREAM_SCALE_ALIGNMENT = {"Gated": 8, "Store": 8, "StoreMN": 4, "ActivationBackward": 4}


def _stream_chunk(
    kind: str, columns: int, scales: torch.Tensor, plan: RoutePlan, experts: int
) -> int | None:
    """The chunk of the weight-streaming kernel of ``kind`` (a StreamKind name) for an
    MXFP4 GEMM decoded in its pipeline, or None where its shape does not allow it:
    ``columns`` (GEMM1's ``I``, GEMM2's and dgrad1's ``N``, dgrad2's ``I``) in whole tiles
    of the chunk's variant, segments padded to whole chunks of 32 or 64 rows (wider chunks
    start at each segment's start), and scales at the address alignment its producer reads
    them at (:data:`_STREAM_SCALE_ALIGNMENT`; other scales take the engine's in-pipeline
    decode, the same bits). The widest chunk the heuristic may take is the kind's widest
    variant, by the kind's costs."""
    tiles = _STREAM_TILE_COLUMNS[kind]
    chunk = weight_stream_chunk(
        plan.route_to_pool_row.numel(), experts, widest=max(tiles), kind=kind
    )
    if chunk <= 64 and plan.block_m % chunk:
        return None
    if columns % tiles[chunk] or scales.data_ptr() % _STREAM_SCALE_ALIGNMENT[kind]:
        return None
    return chunk


def _gated_streams(plan: RoutePlan) -> StreamsPredicate:
    """:data:`StreamsPredicate` of GEMM1 over ``plan`` (codes ``[E, 2I, H/2]``)."""
    return lambda codes, scales: (
        _stream_chunk("Gated", codes.shape[1] // 2, scales, plan, codes.shape[0]) is not None
    )


def _store_stream_chunk(
    n_base: int,
    n_extra: int,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None,
    major_mn: bool,
    scales: torch.Tensor,
    plan: RoutePlan,
    experts: int,
) -> int | None:
    """:func:`grouped_gemm`'s streaming chunk (:func:`_stream_chunk`): K-major B (GEMM2,
    kind Store) with at most 256 extra columns; MN-major B (dgrad1, the weights as stored,
    kind StoreMN) with extra blocks of at most 128 columns each."""
    if not major_mn and n_extra <= 256:
        return _stream_chunk("Store", n_base, scales, plan, experts)
    if major_mn and _extra_blocks_fit_one_tile(b_extra_blocks):
        return _stream_chunk("StoreMN", n_base, scales, plan, experts)
    return None


def _store_streams(
    plan: RoutePlan,
    b_major: str,
    b_extra: torch.Tensor | None,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None,
) -> StreamsPredicate:
    """:data:`StreamsPredicate` of :func:`grouped_gemm` over ``plan`` (codes ``[E, N,
    K/2]``, or ``[E, K, N/2]`` MN-major). Called before the extra columns are checked:
    where they are not well formed it answers False, and their checks then name them."""
    major_mn = b_major == "mn"

    def streams(codes: torch.Tensor, scales: torch.Tensor) -> bool:
        n_extra = _extra_columns(b_extra, b_extra_blocks)
        if n_extra is None:
            return False
        n_base = 2 * codes.shape[2] if major_mn else codes.shape[1]
        chunk = _store_stream_chunk(
            n_base, n_extra, b_extra_blocks, major_mn, scales, plan, codes.shape[0]
        )
        return chunk is not None

    return streams


def _extra_columns(b_extra: object, b_extra_blocks: object) -> int | None:
    """:func:`grouped_gemm`'s extra columns ``N_x`` (0 without), or None where the
    arguments are not 3-D tensors (a tuple of two, for the blocks)."""
    if b_extra is not None:
        return b_extra.shape[2] if isinstance(b_extra, torch.Tensor) and b_extra.ndim == 3 else None
    if b_extra_blocks is None:
        return 0
    if not (
        isinstance(b_extra_blocks, tuple)
        and len(b_extra_blocks) == 2
        and all(isinstance(x, torch.Tensor) and x.ndim == 3 for x in b_extra_blocks)
    ):
        return None
    return b_extra_blocks[0].shape[1] + b_extra_blocks[1].shape[1]


def _extra_blocks_fit_one_tile(blocks: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the transposed streaming kernel takes :func:`grouped_gemm`'s extra blocks
    (checked ones): none, or each block's ``N`` a multiple of 8 up to 128 (one half of
    the extra tile; in 192- and 256-row chunks an extra tile of its own)."""
    return blocks is None or all(0 < x.shape[1] <= 128 and x.shape[1] % 8 == 0 for x in blocks)


def _dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The exact BF16 values of an MXFP4 B (one decode kernel on CUDA)."""
    from .mxfp4_decode import decode_mxfp4_bf16

    return decode_mxfp4_bf16(codes, scales)


def _check_extra_blocks(
    blocks: tuple[torch.Tensor, torch.Tensor],
    experts: int,
    k: int,
    device: torch.device,
    major_mn: bool,
) -> int:
    """Check :func:`grouped_gemm`'s ``b_extra_blocks`` and return ``N_lo + N_hi``."""
    if not major_mn:
        raise ValueError("b_extra_blocks: only with b_major='mn' (use b_extra with 'k')")
    if not isinstance(blocks, tuple) or len(blocks) != 2:
        raise TypeError(
            f"b_extra_blocks: expected a tuple (lo, hi) of two tensors, got {type(blocks).__name__}"
        )
    lo, hi = blocks
    check_tensor(
        "b_extra_blocks[0]", lo, shape=(experts, None, None), dtypes=(torch.bfloat16,),
        device=device, contiguous=True,
    )  # fmt: skip
    k_lo = lo.shape[2]
    if k_lo % 64 != 0 or not 0 < k_lo < k:
        raise ValueError(
            f"b_extra_blocks[0]: expected K_lo a multiple of 64 in (0, k={k}), got {k_lo}"
        )
    check_tensor(
        "b_extra_blocks[1]", hi, shape=(experts, None, k - k_lo), dtypes=(torch.bfloat16,),
        device=device, contiguous=True,
    )  # fmt: skip
    for index, block in enumerate(blocks):
        if block.shape[1] == 0:  # a TMA box over no rows
            raise ValueError(f"b_extra_blocks[{index}]: expected at least one row (N), got 0")
    return lo.shape[1] + hi.shape[1]


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int | None = None,
    b_extra: torch.Tensor | None = None,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    b_major: str = "k",
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool GEMM with the store epilogue.

    Args:
        a: ``[pool rows, >= k]`` BF16 pool (rows grouped as ``plan`` says).
        b: ``[E, N, k]`` BF16 expert weights, K-major (nn.Linear layout).
        plan: the route plan (``expert_pool_offsets`` and ``block_m``; the
            weight-streaming path also reads ``expert_counts`` and the route count).
        k: reduction length (defaults to ``b``'s); columns of ``a`` past it are ignored.
        b_extra: optional ``[E, k, N_x]`` BF16, ``b_major="k"`` only (read as it is,
            MN-major): ``N_x`` more output columns ``a @ b_extra[e]`` (GEMM2's ``a2``
            as given).
        b_extra_blocks: optional ``(lo, hi)``, ``b_major="mn"`` only: ``lo``
            ``[E, N_lo, K_lo]`` and ``hi`` ``[E, N_hi, k - K_lo]`` BF16 (``K_lo`` a
            multiple of 64), the blocks of ``[[lo_e^T, 0], [0, hi_e^T]]`` read as given
            (K-major): ``N_x = N_lo + N_hi`` more columns ``a[:, :K_lo] @ lo[e]^T |
            a[:, K_lo:k] @ hi[e]^T`` (dgrad1's ``(dg b1_e^T | du b3_e^T)`` from the
            adapters' ``b1``, ``b3`` ``[E, r, I]``). The zero blocks are never stored.
            Where a block's columns fit the first extra tile's low half (``N_lo <=
            128``; ``N_lo + N_hi <= 128`` for ``hi``) its K steps multiply that half
            only; elsewhere the MMAs run over zeros, so a non-finite ``a`` column there
            also makes the other block's sums NaN (0 x Inf), as a dense block-diagonal
            matrix would. The CPU twin computes the two blocks separately (no such
            NaN).
        out: optional ``[pool rows, N + N_x]`` BF16 output.
        b_major: ``"k"`` (``b`` is ``[E, N, k]``) or ``"mn"``: ``b`` is ``[E, k, N]`` and
            read as stored (``out = a @ b[e]``: the dgrads' ``(dg | du) w13_e``).
        b_scales: MXFP4 B: ``b`` is then ``[E, N, k/2]`` uint8 E2M1 codes and this is
            ``[E, N, k/32]`` uint8 UE8M0 scales (:func:`~megamoe.mxfp4.quantize_mxfp4`
            along K); with ``b_major="mn"`` ``b`` is ``[E, k, N/2]`` and this
            ``[E, k, N/32]`` (quantized along N, the weights as stored). Decoded to the
            values of :func:`~megamoe.mxfp4.dequantize_mxfp4` inside the pipeline;
            the extra columns stay BF16.

    Returns:
        ``out`` ``[pool rows, N + N_x]`` BF16. Rows at or past the rows in use are not
        written.
    """
    check_str_choice("b_major", b_major, ("k", "mn"))
    check_tensor("a", a, ndim=2, dtypes=(torch.bfloat16,), contiguous=True)
    if k is not None:
        check_int("k", k)
    mxfp4 = b_scales is not None
    if mxfp4:  # decoded (where it is: a launch) only once every check has passed
        b_k = _check_mxfp4("b", b, b_scales, a.device, b_major)
        if k is not None and k != b_k:
            raise ValueError(f"k: an MXFP4 B reduces over all its K={b_k} columns, got k={k}")
        k = b_k
    else:
        check_tensor("b", b, ndim=3, dtypes=(torch.bfloat16,), device=a.device, contiguous=True)
    _check_pool_operand(a, plan, weights=("b", b))
    major_mn = b_major == "mn"
    if major_mn:
        if k is not None and k != b.shape[1]:
            raise ValueError(f"k: expected b.shape[1] = {b.shape[1]} for b_major='mn', got {k}")
        k = b.shape[1]
        n_base = b.shape[2] * (2 if mxfp4 else 1)
    else:
        k = b.shape[2] * (2 if mxfp4 else 1) if k is None else k
        n_base = b.shape[1]
    n_extra = 0
    if b_extra is not None:
        if major_mn:
            raise ValueError(
                "b_extra: with b_major='mn' the extra columns are b_extra_blocks=(lo, hi)"
            )
        check_tensor(
            "b_extra", b_extra, shape=(b.shape[0], k, None), dtypes=(torch.bfloat16,),
            device=a.device, contiguous=True,
        )  # fmt: skip
        n_extra = b_extra.shape[2]
        if n_extra == 0:  # a TMA box over no columns
            raise ValueError("b_extra: expected at least one column (N_x), got 0")
    if b_extra_blocks is not None:
        n_extra = _check_extra_blocks(b_extra_blocks, b.shape[0], k, a.device, major_mn)
    if n_extra % 8 != 0:
        name = "b_extra" if b_extra is not None else "b_extra_blocks"
        raise ValueError(f"{name}: expected N_x a multiple of 8 (16-byte rows), got {n_extra}")
    if not 0 < k <= a.shape[1] or k % 8:  # 16-byte rows
        raise ValueError(f"k: expected a multiple of 8 in [8, a.shape[1] = {a.shape[1]}], got {k}")
    if not major_mn and not mxfp4 and k != b.shape[2]:
        raise ValueError(f"k: expected b's K = b.shape[2] = {b.shape[2]}, got {k}")
    if n_base % 8:
        raise ValueError(f"b: expected N a multiple of 8, got {n_base}")  # 16-byte rows
    if out is None:
        out = torch.empty(a.shape[0], n_base + n_extra, dtype=torch.bfloat16, device=a.device)
    else:
        check_tensor(
            "out", out, shape=(a.shape[0], n_base + n_extra), dtypes=(torch.bfloat16,),
            device=a.device, contiguous=True,
        )  # fmt: skip
    _check_tma_aligned(
        ("b", b), ("b_extra", b_extra), ("out", out),
        *zip(("b_extra_blocks[0]", "b_extra_blocks[1]"), b_extra_blocks or ()),
    )  # fmt: skip
    decode_scales = None
    if mxfp4:
        streams = _store_streams(plan, b_major, b_extra, b_extra_blocks)
        b, decode_scales = _mxfp4_operand(b, b_scales, plan, b_major, streams)
    if not a.is_cuda:
        for e, start, end in _expert_rows(plan):
            if end > start:
                w = b[e].float() if major_mn else b[e].float().T  # [k, N]
                if b_extra is not None:
                    w = torch.cat([w, b_extra[e].float()], dim=1)
                out[start:end, : w.shape[1]] = (a[start:end, :k].float() @ w).bfloat16()
                if b_extra_blocks is not None:
                    lo, hi = b_extra_blocks
                    k_lo, n_lo = lo.shape[2], lo.shape[1]
                    rows = a[start:end].float()
                    extra = out[start:end, n_base:]
                    extra[:, :n_lo] = (rows[:, :k_lo] @ lo[e].float().T).bfloat16()
                    extra[:, n_lo:] = (rows[:, k_lo:k] @ hi[e].float().T).bfloat16()
        return out
    return _launch_store(
        a, b, plan, k, n_base, n_extra, decode_scales, major_mn, b_extra, b_extra_blocks, out
    )


def grouped_gemm_unchecked(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    b_extra: torch.Tensor | None = None,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    b_major: str = "k",
    b_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm` (reducing over all of ``b``'s K) for the fused pipelines, whose
    operands are made from inputs already checked: no argument checks in Python (host
    time a small-token step pays per check); the native launchers still check dtypes,
    shapes, strides, alignment and devices."""
    if not a.is_cuda:
        return grouped_gemm(
            a, b, plan, b_extra=b_extra, b_extra_blocks=b_extra_blocks, b_major=b_major,
            b_scales=b_scales,
        )  # fmt: skip
    major_mn = b_major == "mn"
    decode_scales = None
    if b_scales is not None:
        streams = _store_streams(plan, b_major, b_extra, b_extra_blocks)
        k, b, decode_scales = mxfp4_b_unchecked(b, b_scales, plan, b_major, streams=streams)
    else:
        k = b.shape[1] if major_mn else b.shape[2]
    packed = 2 if decode_scales is not None else 1
    n_base = b.shape[2] * packed if major_mn else b.shape[1]
    n_extra = _extra_columns(b_extra, b_extra_blocks)  # checked where they entered
    out = torch.empty(a.shape[0], n_base + n_extra, dtype=torch.bfloat16, device=a.device)
    return _launch_store(
        a, b, plan, k, n_base, n_extra, decode_scales, major_mn, b_extra, b_extra_blocks, out
    )


def _launch_store(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    k: int,
    n_base: int,
    n_extra: int,
    decode_scales: torch.Tensor | None,
    major_mn: bool,
    b_extra: torch.Tensor | None,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`grouped_gemm`'s CUDA launch: the streaming kernel where it takes the shape,
    else the engine."""
    mxfp4 = decode_scales is not None
    extra_lo, extra_hi = (b_extra, None) if b_extra_blocks is None else b_extra_blocks
    dl = _native.dlpack
    chunk = None
    # An MXFP4 B decoded in the pipeline streams (as GEMM1 does) wherever the kernel
    # takes the shape: faster than the engine's in-pipeline decode at every token count
    # of that regime (docs/PERFORMANCE.md, "twenty-fourth session"; the transposed
    # dgrad1, "twenty-fifth session").
    if mxfp4:
        chunk = _store_stream_chunk(
            n_base, n_extra, b_extra_blocks, major_mn, decode_scales, plan, b.shape[0]
        )
    if major_mn and chunk is not None:
        # dgrad1: the weights as stored, decoded transposed into the A registers.
        with _native.on_device(a.device):
            _native.native().weight_stream_store_mn(
                dl(a),
                dl(b),
                dl(decode_scales),
                None if extra_lo is None else dl(extra_lo),
                None if extra_hi is None else dl(extra_hi),
                dl(plan.expert_pool_offsets),
                dl(plan.expert_counts),
                dl(out),
                plan.block_m,
                chunk,
                _device_sms(a.device),
                _native.current_stream(a.device),
            )
        return out
    if chunk is not None:
        # MXFP4 with few rows per expert: decoded into the wgmma's A registers.
        with _native.on_device(a.device):
            _native.native().weight_stream_store(
                dl(a),
                k,
                dl(b),
                dl(decode_scales),
                None if b_extra is None else dl(b_extra),
                dl(plan.expert_pool_offsets),
                dl(plan.expert_counts),
                dl(out),
                plan.block_m,
                chunk,
                _device_sms(a.device),
                _native.current_stream(a.device),
            )
        return out
    with _native.on_device(a.device):
        _native.native().engine_store(
            dl(a),
            k,
            dl(b),
            None if decode_scales is None else dl(decode_scales),
            major_mn,
            None if extra_lo is None else dl(extra_lo),
            None if extra_hi is None else dl(extra_hi),
            dl(plan.expert_pool_offsets),
            dl(out),
            plan.block_m,
            GROUP_M,
            _device_sms(a.device),
            _native.current_stream(a.device),
        )
    return out


def gated_grouped_gemm(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    side_b_gate: torch.Tensor | None = None,
    side_b_up: torch.Tensor | None = None,
    side_scale: float = 0.0,
    out: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None,
    w13_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM1 + gated activation over the pool.

    Args:
        a: ``[pool rows, k + 2r]`` BF16: ``[x | q1 | q3]`` per row (``r = 0``: ``[x]``).
        w13: ``[E, 2I, k]`` BF16 in the user's layout (rows ``0..I-1`` gate, ``I..2I-1``
            up), read as it is.
        plan: the route plan.
        k: hidden size ``H`` (the base reduction, a multiple of 64).
        activation: ``"swiglu"`` or ``"geglu"``; ``activation_clamp``: ``c`` or None.
        side_b_gate, side_b_up: ``[E, r, I]`` BF16, the adapters' ``b1``, ``b3`` as given
            (read MN-major), or None.
        side_scale: the adapter scale ``s``.
        out: optional ``[pool rows, I]`` BF16.
        preact_out: optional ``[pool rows, 2I]`` BF16: also store the pre-activations
            ``g | u`` (before the clamp, BF16-rounded) for the backward.
        w13_scales: MXFP4 base: ``w13`` is then ``[E, 2I, k/2]`` uint8 codes and this is
            ``[E, 2I, k/32]`` uint8 scales, decoded in the pipeline (see
            :func:`grouped_gemm`'s ``b_scales``); the side segment stays BF16.

    Returns:
        ``h`` ``[pool rows, I]`` BF16.
    """
    from ..validation.layer import check_activation  # (validation imports this module)

    check_activation(activation, activation_clamp)
    check_tensor("a", a, ndim=2, dtypes=(torch.bfloat16,), contiguous=True)
    check_int("k", k)
    if w13_scales is not None:  # decoded (where it is: a launch) once every check passed
        w13_k = _check_mxfp4("w13", w13, w13_scales, a.device, "k")
    else:
        check_tensor("w13", w13, ndim=3, dtypes=(torch.bfloat16,), device=a.device, contiguous=True)
        w13_k = w13.shape[2]
    if w13_k != k:
        raise ValueError(f"k: expected w13's K={w13_k}, got {k}")
    if k < 64 or k % 64:
        raise ValueError(f"k: expected a multiple of 64 (the kernels' K step), got {k}")
    if k > a.shape[1]:
        raise ValueError(f"k: expected at most a.shape[1] = {a.shape[1]} columns, got {k}")
    two_i = w13.shape[1]
    if two_i % 128 != 0:
        raise ValueError(f"w13: expected 2I rows with I a multiple of 64, got {two_i}")
    _check_pool_operand(a, plan, weights=("w13", w13))
    if preact_out is not None:
        check_tensor(
            "preact_out",
            preact_out,
            shape=(a.shape[0], two_i),
            dtypes=(torch.bfloat16,),
            device=a.device,
            contiguous=True,
        )
    if (side_b_gate is None) != (side_b_up is None):
        raise ValueError("side_b_gate/side_b_up: give both or neither")
    side_scale = check_finite_float("side_scale", side_scale, float32=True)
    if side_b_gate is not None:
        _check_side(side_b_gate, side_b_up, w13.shape[0], two_i // 2, k, a)
    if out is None:
        out = torch.empty(a.shape[0], two_i // 2, dtype=torch.bfloat16, device=a.device)
    else:
        check_tensor(
            "out", out, shape=(a.shape[0], two_i // 2), dtypes=(torch.bfloat16,),
            device=a.device, contiguous=True,
        )  # fmt: skip
    _check_tma_aligned(
        ("w13", w13), ("side_b_gate", side_b_gate), ("side_b_up", side_b_up), ("out", out),
        ("preact_out", preact_out),
    )  # fmt: skip
    decode_scales = None
    if w13_scales is not None:
        w13, decode_scales = _mxfp4_operand(w13, w13_scales, plan, "k", _gated_streams(plan))
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    if not a.is_cuda:
        _gated_cpu(
            a, w13, plan, k, activation, clamp, side_b_gate, side_b_up, side_scale, out, preact_out
        )
        return out
    return _launch_gated(
        a, w13, plan, k, decode_scales, activation, clamp, side_b_gate, side_b_up, side_scale,
        out, preact_out,
    )  # fmt: skip


def gated_grouped_gemm_unchecked(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int,
    activation: str,
    activation_clamp: float | None,
    side_b_gate: torch.Tensor | None = None,
    side_b_up: torch.Tensor | None = None,
    side_scale: float = 0.0,
    preact_out: torch.Tensor | None = None,
    w13_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gated_grouped_gemm` for the fused pipelines (unchecked in Python, as
    :func:`grouped_gemm_unchecked`)."""
    if not a.is_cuda:
        return gated_grouped_gemm(
            a, w13, plan, k=k, activation=activation, activation_clamp=activation_clamp,
            side_b_gate=side_b_gate, side_b_up=side_b_up, side_scale=side_scale,
            preact_out=preact_out, w13_scales=w13_scales,
        )  # fmt: skip
    decode_scales = None
    if w13_scales is not None:
        _, w13, decode_scales = mxfp4_b_unchecked(
            w13, w13_scales, plan, streams=_gated_streams(plan)
        )
    out = torch.empty(a.shape[0], w13.shape[1] // 2, dtype=torch.bfloat16, device=a.device)
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    return _launch_gated(
        a, w13, plan, k, decode_scales, activation, clamp, side_b_gate, side_b_up, side_scale,
        out, preact_out,
    )  # fmt: skip


def _launch_gated(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    k: int,
    decode_scales: torch.Tensor | None,
    activation: str,
    clamp: float,
    side_b_gate: torch.Tensor | None,
    side_b_up: torch.Tensor | None,
    side_scale: float,
    out: torch.Tensor,
    preact_out: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`gated_grouped_gemm`'s CUDA launch: the streaming kernel where it takes the
    shape, else the engine."""
    two_i = w13.shape[1]
    dl = _native.dlpack
    chunk = None
    if decode_scales is not None:
        chunk = _stream_chunk("Gated", two_i // 2, decode_scales, plan, w13.shape[0])
    if chunk is not None:
        # MXFP4 with few rows per expert: decoded into the wgmma's A registers.
        with _native.on_device(a.device):
            _native.native().weight_stream_gated(
                dl(a),
                k,
                dl(w13),
                dl(decode_scales),
                dl(plan.expert_pool_offsets),
                dl(plan.expert_counts),
                dl(out),
                None if preact_out is None else dl(preact_out),
                None if side_b_gate is None else dl(side_b_gate),
                None if side_b_up is None else dl(side_b_up),
                float(side_scale),
                ACTIVATIONS[activation],
                clamp,
                plan.block_m,
                chunk,
                _device_sms(a.device),
                _native.current_stream(a.device),
            )
        return out
    with _native.on_device(a.device):
        _native.native().engine_gated(
            dl(a),
            k,
            dl(w13),
            None if decode_scales is None else dl(decode_scales),
            dl(plan.expert_pool_offsets),
            dl(out),
            None if preact_out is None else dl(preact_out),
            None if side_b_gate is None else dl(side_b_gate),
            None if side_b_up is None else dl(side_b_up),
            float(side_scale),
            ACTIVATIONS[activation],
            clamp,
            plan.block_m,
            GROUP_M,
            _device_sms(a.device),
            _native.current_stream(a.device),
        )
    return out


def _check_side(side_b_gate, side_b_up, experts: int, intermediate: int, k: int, a) -> None:
    """``side_b_gate``/``side_b_up``: ``[E, r, I]`` BF16 each, ``a`` holding ``[x | q1 | q3]``."""
    check_tensor(
        "side_b_gate",
        side_b_gate,
        ndim=3,
        dtypes=(torch.bfloat16,),
        device=a.device,
        contiguous=True,
    )
    rank = side_b_gate.shape[1]
    expected = (experts, rank, intermediate)
    if tuple(side_b_gate.shape) != expected:
        raise ValueError(
            f"side_b_gate: expected shape {list(expected)}, got {list(side_b_gate.shape)}"
        )
    check_tensor(
        "side_b_up", side_b_up, shape=expected, dtypes=(torch.bfloat16,), device=a.device,
        contiguous=True,
    )  # fmt: skip
    if rank < 8 or rank % 8 != 0 or k + 2 * rank > a.shape[1]:
        raise ValueError(
            f"side_b_gate: rank {rank} must be a positive multiple of 8 with k_base + 2*rank "
            f"<= a's columns {a.shape[1]}"
        )


def _gated_cpu(a, w13, plan, k, activation, clamp, side_b_gate, side_b_up, side_scale, out, preact):
    """The CPU twin of the gated launch (module docstring): per expert in float32."""
    intermediate = w13.shape[1] // 2
    rank = 0 if side_b_gate is None else side_b_gate.shape[1]
    for e, start, end in _expert_rows(plan):
        if end == start:
            continue
        gu = a[start:end, :k].float() @ w13[e].float().T  # [rows, 2I]: g | u
        if rank:
            q1 = a[start:end, k : k + rank].float()
            q3 = a[start:end, k + rank : k + 2 * rank].float()
            gu[:, :intermediate] += side_scale * (q1 @ side_b_gate[e].float())
            gu[:, intermediate:] += side_scale * (q3 @ side_b_up[e].float())
        gu = gu.bfloat16()
        if preact is not None:
            preact[start:end] = gu
        g, u = gu.float().split(intermediate, dim=1)
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        act = (
            g / (1.0 + torch.exp(-g))
            if activation == "swiglu"
            else torch.nn.functional.gelu(g, approximate="tanh")
        )
        out[start:end] = (act * u).bfloat16()


def _expert_rows(plan: RoutePlan) -> list[tuple[int, int, int]]:
    offsets = plan.expert_pool_offsets.tolist()
    return [(e, offsets[e], offsets[e + 1]) for e in range(len(offsets) - 1)]


def grouped_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int | None = None,
    b_extra: torch.Tensor | None = None,
    b_extra_blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Float64 ``[rows in use, N + N_x]`` of :func:`grouped_gemm` with a K-major ``b``
    ``[E, N, k]`` and ``b_extra`` ``[E, k, N_x]`` or ``b_extra_blocks`` (``lo``
    ``[E, N_lo, K_lo]``, ``hi`` ``[E, N_hi, k - K_lo]``: a dense block-diagonal
    ``[k, N_lo + N_hi]`` per expert), not rounded."""
    k = b.shape[2] if k is None else k
    rows = int(plan.expert_pool_offsets[-1])
    cols = b.shape[1] + (0 if b_extra is None else b_extra.shape[2])
    if b_extra_blocks is not None:
        cols += b_extra_blocks[0].shape[1] + b_extra_blocks[1].shape[1]
    out = torch.zeros(rows, cols, dtype=torch.float64, device=a.device)
    for e, start, end in _expert_rows(plan):
        if end == start:
            continue
        x = a[start:end, :k].double()
        weights = b[e].double().T
        if b_extra is not None:
            weights = torch.cat([weights, b_extra[e].double()], dim=1)
        if b_extra_blocks is not None:
            lo, hi = (block[e].double().T for block in b_extra_blocks)
            weights = torch.cat([weights, torch.block_diag(lo, hi)], dim=1)
        out[start:end] = x @ weights
    return out


def gated_grouped_gemm_reference(
    a: torch.Tensor,
    w13: torch.Tensor,
    plan: RoutePlan,
    *,
    k: int,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    side_b_gate: torch.Tensor | None = None,
    side_b_up: torch.Tensor | None = None,
    side_scale: float = 0.0,
) -> torch.Tensor:
    """Float64 ``h`` ``[rows in use, I]`` of :func:`gated_grouped_gemm` with the kernel's
    rounding points (``g``, ``u`` rounded to BF16 before the clamp; ``h`` not rounded)."""
    rows = int(plan.expert_pool_offsets[-1])
    intermediate = w13.shape[1] // 2
    h = torch.zeros(rows, intermediate, dtype=torch.float64, device=a.device)
    rank = 0 if side_b_gate is None else side_b_gate.shape[1]
    for e, start, end in _expert_rows(plan):
        if end == start:
            continue
        gate_w, up_w = w13[e].double().split(intermediate, dim=0)
        x = a[start:end, :k].double()
        g, u = x @ gate_w.T, x @ up_w.T
        if rank:
            q1 = a[start:end, k : k + rank].double()
            q3 = a[start:end, k + rank : k + 2 * rank].double()
            g = g + side_scale * (q1 @ side_b_gate[e].double())
            u = u + side_scale * (q3 @ side_b_up[e].double())
        g = g.to(torch.bfloat16).double()
        u = u.to(torch.bfloat16).double()
        if activation_clamp is not None:
            g = g.clamp(max=activation_clamp)
            u = u.clamp(-activation_clamp, activation_clamp)
        act = (
            torch.nn.functional.silu(g)
            if activation == "swiglu"
            else (torch.nn.functional.gelu(g, approximate="tanh"))
        )
        h[start:end] = act * u
    return h
