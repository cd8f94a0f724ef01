"""Base expert weights in the layout the kernels read (DESIGN §1, §3).

``prepare_base_weights`` is done once for a frozen base and reused every step. In
ordinary mode (trainable base) it is differentiable: the prepared tensors keep the
autograd link to the caller's ``w13``/``w2``. For an MXFP4 base that link goes
straight through the quantizer (DESIGN §1): the forward and the dgrads use the MXFP4
values, and the gradient with respect to those values is the master's gradient.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_choice, check_tensor
from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from .mxfp4_decode import decode_mxfp4_bf16
from .pool import gather_rows
from .registry import registry

BASE_FORMATS = ("bf16", "mxfp4")

#: ``MEGAMOE_MXFP4_DECODE``: where the GEMMs decode an MXFP4 base.
#: ``transient`` (default): a BF16 decode of the whole weight right before each GEMM,
#: dropped after it (measured faster at ep4rank: docs/PERFORMANCE.md); ``engine``: inside
#: the grouped GEMM, one K block at a time into shared memory, no BF16 copy of the
#: weights (the forward GEMMs, and the engine dgrads under MEGAMOE_DGRAD_ENGINE=1). The
#: values are the same bits either way (tested).
MXFP4_DECODE_VAR = "MEGAMOE_MXFP4_DECODE"
MXFP4_DECODE_MODES = ("engine", "transient")


def mxfp4_decode_mode() -> str:
    """``MEGAMOE_MXFP4_DECODE``: ``"transient"`` (unset) or ``"engine"``."""
    mode = os.environ.get(MXFP4_DECODE_VAR, "transient")
    if mode not in MXFP4_DECODE_MODES:
        raise ValueError(
            f"{MXFP4_DECODE_VAR}: expected one of {', '.join(MXFP4_DECODE_MODES)}, got {mode!r}"
        )
    return mode


def gate_up_interleave_index(intermediate: int, interleave: int, device=None) -> torch.Tensor:
    """Row permutation ``perm`` with ``w13_kernel = w13[:, perm]`` (nn.Linear rows -> kernel rows).

    Kernel rows come in blocks of ``interleave`` gate rows followed by the matching
    ``interleave`` up rows. (The layer applies it with :func:`to_kernel_rows`.)
    """
    blocks = intermediate // interleave
    gate = torch.arange(intermediate, device=device).view(blocks, 1, interleave)
    up = gate + intermediate
    return torch.cat([gate, up], dim=1).reshape(-1)


class _PermuteRows(torch.autograd.Function):
    """``out = src[rows]`` for ``[R, C]`` BF16 on CUDA (:func:`~megamoe.pool.gather_rows`);
    the backward gathers the gradient with the ``inverse`` permutation: a gather both
    ways, never ``index_select``'s backward (a zero fill plus ``index_add``, 19 ms for
    ``w13`` at ep4rank on an H200)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return gather_rows(src, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return gather_rows(grad.contiguous(), inverse), None, None


def _gather_rows_apply(w13: torch.Tensor, hidden: int) -> bool:
    """Whether the row-gather kernel can permute ``w13``: BF16 on CUDA in eager mode
    (under torch.compile the block transpose is traced instead), 16-byte vectors (a
    contiguous view at an odd offset takes the block transpose; a non-contiguous one is
    copied to fresh memory first)."""
    if torch.compiler.is_compiling() or not w13.is_cuda or w13.dtype != torch.bfloat16:
        return False
    return hidden % 8 == 0 and (not w13.is_contiguous() or w13.data_ptr() % 16 == 0)


def _permute_w13_rows(w13: torch.Tensor, interleave: int, to_kernel: bool) -> torch.Tensor:
    *lead, two_i, hidden = w13.shape
    blocks = two_i // (2 * interleave)
    if _gather_rows_apply(w13, hidden):
        perm = gate_up_interleave_index(two_i // 2, interleave, w13.device)
        inverse = torch.argsort(perm)
        rows, back = (perm, inverse) if to_kernel else (inverse, perm)
        # Row indices into the flattened [.. * 2I, H] view, per leading index.
        matrices = w13.numel() // (two_i * hidden)
        first = torch.arange(matrices, device=w13.device).view(-1, 1) * two_i
        rows = (first + rows).reshape(-1).to(torch.int32)
        back = (first + back).reshape(-1).to(torch.int32)
        flat = w13.contiguous().view(-1, hidden)
        return _PermuteRows.apply(flat, rows, back).view(w13.shape)
    # Elsewhere a block transpose (a strided copy both ways).
    order = (2, blocks) if to_kernel else (blocks, 2)
    return (
        w13.reshape(*lead, *order, interleave, hidden)
        .transpose(-4, -3)
        .reshape(*lead, two_i, hidden)
    )


def to_kernel_rows(w13: torch.Tensor, interleave: int) -> torch.Tensor:
    """``[.., 2I, H]`` nn.Linear rows (gate then up) -> the kernels' interleaved rows.

    The permutation of :func:`gate_up_interleave_index`, differentiable. A BF16 CUDA
    tensor moves as a row gather both ways (forward and backward), elsewhere as a block
    transpose.
    """
    return _permute_w13_rows(w13, interleave, to_kernel=True)


def to_linear_rows(w13_kernel: torch.Tensor, interleave: int) -> torch.Tensor:
    """The inverse of :func:`to_kernel_rows` (kernel rows -> nn.Linear rows)."""
    return _permute_w13_rows(w13_kernel, interleave, to_kernel=False)


@dataclass(frozen=True, eq=False)
class BaseWeights:
    """Prepared base weights (see :func:`prepare_base_weights`).

    ``format == "bf16"``: ``w13`` is ``[E_l, 2I, H]`` bfloat16 with gate/up rows
    interleaved; ``w2`` is ``[E_l, H, I]`` bfloat16.
    ``format == "mxfp4"``: ``w13``/``w2`` are the packed E2M1 bytes (``[E_l, 2I, H/2]``,
    ``[E_l, H, I/2]`` uint8, same row order) and ``w13_scales``/``w2_scales`` their
    UE8M0 scales (``[E_l, 2I, H/32]``, ``[E_l, H, I/32]`` uint8).
    """

    format: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: torch.Tensor | None
    w2_scales: torch.Tensor | None
    num_experts: int
    hidden: int
    intermediate: int
    gate_up_interleave: int
    # MXFP4 in ordinary mode: the caller's own w13/w2 (nn.Linear layout, no copy), the
    # straight-through gradient sink (None for a frozen base).
    w13_master: torch.Tensor | None = None
    w2_master: torch.Tensor | None = None

    @property
    def trains_master(self) -> bool:
        """An MXFP4 base whose master weights take a straight-through gradient."""
        masters = [t for t in (self.w13_master, self.w2_master) if t is not None]
        return any(t.requires_grad for t in masters)

    def for_call(self) -> BaseWeights:
        """What a layer call runs on: :meth:`straight_through` for an MXFP4 base with a
        trainable master while gradients are on (ordinary mode), else this base."""
        return self.straight_through() if self.trains_master and torch.is_grad_enabled() else self

    def straight_through(self) -> BaseWeights:
        """The BF16 base this MXFP4 base stands for in ordinary mode.

        Its ``w13``/``w2`` hold the exact BF16 decode of the packed values and require
        grad; their gradient passes to ``w13_master``/``w2_master`` unchanged (back in
        nn.Linear row order, in the master's dtype). The decode is transient: it lives
        for one forward/backward, next to the master that ordinary training holds anyway.
        """
        if not self.trains_master:
            raise ValueError("base: straight_through() needs an MXFP4 base with a trainable master")
        return BaseWeights(
            "bf16",
            _StraightThrough.apply(self.w13_for_gemm(), self.w13_master, self.gate_up_interleave),
            _StraightThrough.apply(self.w2_for_gemm(), self.w2_master, None),
            None,
            None,
            self.num_experts,
            self.hidden,
            self.intermediate,
            self.gate_up_interleave,
        )

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def nbytes(self) -> int:
        """Bytes held by the prepared tensors (values and scales; a trainable MXFP4
        base's masters are the caller's own tensors and not counted)."""
        tensors = [self.w13, self.w2, self.w13_scales, self.w2_scales]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def w13_for_gemm(self) -> torch.Tensor:
        """``[E_l, 2I, H]`` BF16 in the kernels' interleaved row order, for one GEMM.

        The stored tensor for ``"bf16"``; for ``"mxfp4"`` a transient decode
        (:func:`~megamoe.mxfp4_decode.decode_mxfp4_bf16`), to be dropped after the GEMM.
        """
        if self.format == "mxfp4":
            return decode_mxfp4_bf16(self.w13, self.w13_scales)
        return self.w13

    def w13_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GEMM1's B operand ``(w13, scales)``: the BF16 ``w13`` and None, or for an
        MXFP4 base decoded in the engine (:func:`mxfp4_decode_mode`) the codes and
        scales (``w13_scales=`` of :func:`~megamoe.grouped_gemm.gated_grouped_gemm`)."""
        if self.format == "mxfp4" and mxfp4_decode_mode() == "engine":
            return self.w13, self.w13_scales
        return self.w13_for_gemm(), None

    def w2_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GEMM2's B operand ``(w2, scales)`` (see :meth:`w13_operand`)."""
        if self.format == "mxfp4" and mxfp4_decode_mode() == "engine":
            return self.w2, self.w2_scales
        return self.w2_for_gemm(), None

    def w2_for_gemm(self) -> torch.Tensor:
        """``[E_l, H, I]`` BF16 for one GEMM (see :meth:`w13_for_gemm`)."""
        if self.format == "mxfp4":
            return decode_mxfp4_bf16(self.w2, self.w2_scales)
        return self.w2

    def w13_linear(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[E_l, 2I, H]`` in nn.Linear row order (gate rows then up rows), dequantized.

        Differentiable for the bf16 format (ordinary mode reference/baseline use it).
        """
        w13 = self._values(self.w13, self.w13_scales, dtype)
        return to_linear_rows(w13, self.gate_up_interleave)

    def w2_linear(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[E_l, H, I]``, dequantized."""
        return self._values(self.w2, self.w2_scales, dtype)

    def _values(self, values, scales, dtype):
        if self.format == "mxfp4":
            return dequantize_mxfp4(values, scales, axis=-1, dtype=dtype)
        return values.to(dtype)


class _StraightThrough(torch.autograd.Function):
    """``forward(decoded, master, interleave) = decoded``; the gradient goes to
    ``master`` as is, its rows put back in nn.Linear order (:func:`to_linear_rows` with
    the gate/up ``interleave``; None for ``w2``) and cast to the master's dtype."""

    @staticmethod
    def forward(
        ctx, decoded: torch.Tensor, master: torch.Tensor, interleave: int | None
    ) -> torch.Tensor:
        if decoded.shape != master.shape:
            raise ValueError(
                f"base: master shape {list(master.shape)} != decoded {list(decoded.shape)}"
            )
        ctx.master_dtype = master.dtype
        ctx.interleave = interleave
        return decoded.view_as(decoded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        if ctx.interleave is not None:
            grad = to_linear_rows(grad, ctx.interleave)
        return None, grad.to(ctx.master_dtype), None


def prepare_base_weights(w13: torch.Tensor, w2: torch.Tensor, format: str = "bf16") -> BaseWeights:
    """Convert nn.Linear-layout expert weights to the kernels' layout.

    Args:
        w13: ``[E_l, 2I, H]`` bfloat16 (fp32 accepted and rounded), rows ``0..I-1``
            gate, ``I..2I-1`` up.
        w2: ``[E_l, H, I]``, same dtype as ``w13``.
        format: ``"bf16"`` or ``"mxfp4"`` (OCP MX E2M1 with a UE8M0 scale per 32
            elements along ``H`` for ``w13`` and along ``I`` for ``w2``).

    Returns:
        A reusable :class:`BaseWeights`. MXFP4 takes about 0.27x the bytes of BF16.
        When ``w13``/``w2`` require grad (ordinary mode) the result is part of the
        autograd graph: prepare it again after every optimizer step. For MXFP4 it then
        also keeps references to ``w13``/``w2`` as the straight-through gradient sink
        (``w13_master``/``w2_master``, no copy); ``mm.moe`` trains them with the
        gradient taken at the MXFP4 values.
    """
    check_choice("format", format, BASE_FORMATS)
    reg = registry()
    w13 = check_tensor("w13", w13, ndim=3, dtypes=(torch.bfloat16, torch.float32))
    experts, two_i, hidden = w13.shape
    if two_i % 2 != 0:
        raise ValueError(f"w13: expected an even second dimension 2*I, got {two_i}")
    intermediate = two_i // 2
    check_tensor(
        "w2", w2, shape=(experts, hidden, intermediate), dtypes=(w13.dtype,), device=w13.device
    )
    if experts < 1:
        raise ValueError(f"w13: expected at least one expert, got shape {list(w13.shape)}")
    if hidden % reg.hidden_multiple != 0:
        raise ValueError(
            f"w13: hidden size H={hidden} is not a multiple of {reg.hidden_multiple} "
            "(the kernels' K tile); pad the model or use supported dims"
        )
    if intermediate % reg.intermediate_multiple != 0:
        raise ValueError(
            f"w13: intermediate size I={intermediate} is not a multiple of "
            f"{reg.intermediate_multiple} (the kernels' gate/up tile)"
        )
    w13_kernel = to_kernel_rows(w13.to(torch.bfloat16), reg.gate_up_interleave)
    w2_kernel = w2.to(torch.bfloat16)
    if format == "bf16":
        if not w13_kernel.requires_grad:
            w13_kernel = w13_kernel.contiguous()
            w2_kernel = w2_kernel.contiguous()
        return BaseWeights(
            "bf16",
            w13_kernel,
            w2_kernel,
            None,
            None,
            experts,
            hidden,
            intermediate,
            reg.gate_up_interleave,
        )
    # Ordinary mode: the caller's w13/w2 are the straight-through gradient sink (kept by
    # reference, no copy); the packed values are quantized from their BF16 rounding.
    trains = torch.is_grad_enabled() and (w13.requires_grad or w2.requires_grad)
    for name, value in (("w13", w13), ("w2", w2)):
        if not torch.isfinite(value).all():
            raise ValueError(f"{name}: MXFP4 quantization needs finite weights, found NaN or Inf")
    assert hidden % MXFP4_BLOCK == 0 and intermediate % MXFP4_BLOCK == 0
    with torch.no_grad():
        w13_packed, w13_scales = quantize_mxfp4(w13_kernel.detach(), axis=-1)
        w2_packed, w2_scales = quantize_mxfp4(w2_kernel.detach(), axis=-1)
    return BaseWeights(
        "mxfp4",
        w13_packed,
        w2_packed,
        w13_scales,
        w2_scales,
        experts,
        hidden,
        intermediate,
        reg.gate_up_interleave,
        w13_master=w13 if trains else None,
        w2_master=w2 if trains else None,
    )
