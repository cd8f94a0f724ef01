"""Base expert weights as the kernels read them (DESIGN §1, §3).

The kernels read the user's nn.Linear layout directly: ``w13 [E, 2I, H]`` (gate rows,
then up rows) and ``w2 [E, H, I]``; GEMM1 loads a tile's gate rows and up rows as two
TMA boxes. A BF16 base is the caller's tensors themselves (no copy); an MXFP4 base is
their packed E2M1 codes and UE8M0 scales (0.27x the BF16 bytes), decoded inside the
GEMM pipeline. ``prepare_base_weights`` is done once for a frozen base and reused every
step. In ordinary mode (trainable base) it is differentiable: the gradient of a BF16
base lands in the caller's ``w13``/``w2`` in their own layout; for an MXFP4 base it goes
straight through the quantizer (DESIGN §1) to the caller's master weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from .validation.arguments import check_str_choice, check_tensor, has_data
from .wrappers.mxfp4_decode import decode_mxfp4_bf16
from .wrappers.registry import registry

BASE_FORMATS = ("bf16", "mxfp4")


@dataclass(frozen=True, eq=False)
class BaseWeights:
    """Prepared base weights (see :func:`prepare_base_weights`).

    ``format == "bf16"``: ``w13`` is ``[E_l, 2I, H]`` bfloat16 (rows ``0..I-1`` gate,
    ``I..2I-1`` up: nn.Linear layout); ``w2`` is ``[E_l, H, I]`` bfloat16.
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
    # MXFP4 in ordinary mode: the caller's own w13/w2 (nn.Linear layout, no copy), the
    # straight-through gradient sink (None for a frozen base).
    w13_master: torch.Tensor | None = None
    w2_master: torch.Tensor | None = None
    # Where w13/w2 are a copy (BF16 from FP32 masters) or a quantization of sources
    # that require grad (in any grad mode): [name, source, its version, the copy, its
    # version] at prepare time. The copy does not follow an optimizer step, so a later
    # call checks that a changed source had its copy rewritten too (re-prepared into
    # the same buffers, as a CUDA-graph step does).
    sources: tuple[list, ...] = ()
    # Sources that require grad but that this base holds without an autograd link (a
    # copy or quantization made under no_grad): a call with gradients on would give
    # them none, silently, so for_call refuses it.
    unlinked: tuple[str, ...] = ()

    @property
    def trains_master(self) -> bool:
        """An MXFP4 base whose master weights take a straight-through gradient."""
        masters = [t for t in (self.w13_master, self.w2_master) if t is not None]
        return any(t.requires_grad for t in masters)

    @property
    def decodes_for_call(self) -> bool:
        """Whether this is an MXFP4 base with a trainable master while gradients are on
        (ordinary mode), which :meth:`for_call` decodes (a launch on a CUDA base) unless
        called with ``decode_master=False``."""
        return self.trains_master and torch.is_grad_enabled()

    def for_call(self, *, oracle: bool = False, decode_master: bool = True) -> BaseWeights:
        """What a layer call runs on: :meth:`straight_through` where
        :attr:`decodes_for_call` and ``decode_master``, else this base. Raises
        ``ValueError`` when this base is a copy of trainable weights that changed in place
        since it was prepared, or a copy of weights that require grad made under
        ``no_grad`` and called with gradients on (it has no autograd link to them).
        ``oracle``: decode with :func:`~megamoe.dequantize_mxfp4` (torch ops) instead of
        the native decode the fused path uses, so the reference shares no decode with
        the code it checks. ``decode_master=False``: a trainable MXFP4 base stays packed;
        the caller hands ``w13_master``/``w2_master`` to the op, whose backward gives
        them the gradient (:func:`~megamoe.heuristics.mxfp4_master_decodes_once`)."""
        if not isinstance(decode_master, bool):
            raise TypeError(f"decode_master: expected a bool, got {type(decode_master).__name__}")
        self.check_sources_unchanged()
        # Also while torch.compile traces: `unlinked` and the grad mode are static.
        if self.unlinked and torch.is_grad_enabled():
            names = " and ".join(self.unlinked)
            raise ValueError(
                f"base: prepared under torch.no_grad() from {names}, which require grad: "
                "it holds a copy without the autograd link, so this call would give them "
                "no gradient. Prepare the base with gradients on (each step, as "
                "megamoe.MegaMoE does), or call under torch.no_grad(), or prepare it "
                "from detached weights to keep them frozen"
            )
        if self.decodes_for_call and decode_master:
            return self.straight_through(oracle=oracle)
        return self

    def check_sources_unchanged(self) -> None:
        """``ValueError`` if a trainable source this base copied or quantized changed in
        place since (an optimizer step): the copy would silently run on the old values
        while the gradients land in the new ones. Not checked while torch.compile traces
        (version counters are not traceable)."""
        if torch.compiler.is_compiling():
            return
        for record in self.sources:
            name, source, version, copy, copy_version = record
            if source._version == version:
                # Unchanged: a rewrite of the copy since then is not a refresh of a
                # later change (an earlier re-prepare into the same buffers).
                record[4] = copy._version
                continue
            if copy._version != copy_version:  # rewritten since: current again
                record[2], record[4] = source._version, copy._version
                continue
            raise ValueError(
                f"base: {name} changed in place after prepare_base_weights copied it "
                f"(an optimizer step?): this base still holds the old values. A "
                f"trainable base is prepared again each step (megamoe.MegaMoE does)"
            )

    def straight_through(self, *, oracle: bool = False) -> BaseWeights:
        """The BF16 base this MXFP4 base stands for in ordinary mode.

        Its ``w13``/``w2`` hold the exact BF16 decode of the packed values and require
        grad; their gradient passes to ``w13_master``/``w2_master`` unchanged (in the
        master's dtype). The decode is transient: it lives for one forward/backward, next
        to the master that ordinary training holds anyway.
        """
        if not self.trains_master:
            raise ValueError("base: straight_through() needs an MXFP4 base with a trainable master")
        if oracle:  # the same values (both decodes are exact), by torch ops
            w13, w2 = self.w13_linear(), self.w2_linear()
        else:
            w13, w2 = self.w13_for_gemm(), self.w2_for_gemm()
        return BaseWeights(
            "bf16",
            _StraightThrough.apply(w13, self.w13_master),
            _StraightThrough.apply(w2, self.w2_master),
            None,
            None,
            self.num_experts,
            self.hidden,
            self.intermediate,
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
        """``[E_l, 2I, H]`` BF16: the stored tensor for ``"bf16"``; for ``"mxfp4"`` an
        exact decode (:func:`~megamoe.wrappers.mxfp4_decode.decode_mxfp4_bf16`), for the BF16
        view ordinary mode trains straight through and for tests."""
        if self.format == "mxfp4":
            return decode_mxfp4_bf16(self.w13, self.w13_scales)
        return self.w13

    def w2_for_gemm(self) -> torch.Tensor:
        """``[E_l, H, I]`` BF16 (see :meth:`w13_for_gemm`)."""
        if self.format == "mxfp4":
            return decode_mxfp4_bf16(self.w2, self.w2_scales)
        return self.w2

    def w13_linear(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[E_l, 2I, H]`` in nn.Linear row order (gate rows then up rows), dequantized.

        Differentiable for the bf16 format (ordinary mode reference/baseline use it).
        """
        return self._values(self.w13, self.w13_scales, dtype)

    def w2_linear(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[E_l, H, I]``, dequantized."""
        return self._values(self.w2, self.w2_scales, dtype)

    def _values(self, values, scales, dtype):
        if self.format == "mxfp4":
            return dequantize_mxfp4(values, scales, axis=-1, dtype=dtype)
        return values.to(dtype)


class _StraightThrough(torch.autograd.Function):
    """``forward(decoded, master) = decoded``; the gradient goes to ``master`` as is,
    cast to the master's dtype (same layout: the kernels read the user's)."""

    @staticmethod
    def forward(ctx, decoded: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        if decoded.shape != master.shape:
            raise ValueError(
                f"base: master shape {list(master.shape)} != decoded {list(decoded.shape)}"
            )
        ctx.master_dtype = master.dtype
        return decoded.view_as(decoded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.to(ctx.master_dtype)


def prepare_base_weights(
    w13: torch.Tensor, w2: torch.Tensor, format: str = "bf16", *, check_finite: bool = True
) -> BaseWeights:
    """The base expert weights as the kernels read them (no copy for BF16).

    Args:
        w13: ``[E_l, 2I, H]`` bfloat16 (fp32 accepted and rounded), rows ``0..I-1``
            gate, ``I..2I-1`` up.
        w2: ``[E_l, H, I]``, same dtype as ``w13``.
        format: ``"bf16"`` or ``"mxfp4"`` (OCP MX E2M1 with a UE8M0 scale per 32
            elements along ``H`` for ``w13`` and along ``I`` for ``w2``).
        check_finite: MXFP4: refuse NaN or Inf weights before quantizing. The check reads
            one flag per weight back to the host (a device synchronisation on a GPU); a
            per-step re-preparation of trained masters (``MegaMoE`` in ordinary mode)
            passes False, and a NaN master then gives NaN blocks, as any NaN parameter
            gives NaN outputs.

    Returns:
        A :class:`BaseWeights`, reusable while its sources are unchanged (a copy or
        quantization of trainable weights is refused by the next call after they change
        in place, unless it was rewritten too:
        :meth:`BaseWeights.check_sources_unchanged`; a copy made under ``no_grad`` from
        weights that require grad is refused by a call with gradients on). BF16:
        ``w13``/``w2`` themselves when they are contiguous bfloat16 (else one contiguous
        bfloat16 copy); their gradients (ordinary mode) land in them directly. MXFP4
        takes about 0.27x the bytes of BF16; when ``w13``/``w2`` require grad it keeps
        references to them as the straight-through gradient sink
        (``w13_master``/``w2_master``, no copy) and ``mm.moe`` trains them with the
        gradient taken at the MXFP4 values.
    """
    check_str_choice("format", format, BASE_FORMATS)
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite: expected a bool, got {type(check_finite).__name__}")
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
    if hidden < 1 or intermediate < 1:
        raise ValueError(
            f"w13: expected H >= 1 and I >= 1 ([E, 2I, H]), got shape {list(w13.shape)}"
        )
    if hidden % reg.hidden_multiple != 0:
        raise ValueError(
            f"w13: hidden size H={hidden} is not a multiple of {reg.hidden_multiple} "
            "(the kernels' K tile); pad the model or use supported dims"
        )
    if intermediate % reg.intermediate_multiple != 0:
        raise ValueError(
            f"w13: intermediate size I={intermediate} is not a multiple of "
            f"{reg.intermediate_multiple} (the kernels' epilogue vectors)"
        )
    # .to() and .contiguous() return the tensor itself when it is already contiguous
    # bfloat16 (and stay differentiable otherwise).
    w13_bf16 = w13.to(torch.bfloat16).contiguous()
    w2_bf16 = w2.to(torch.bfloat16).contiguous()
    if format == "bf16":
        given = (("w13", w13, w13_bf16), ("w2", w2, w2_bf16))
        unlinked = tuple(
            name
            for name, source, copy in given
            if source.requires_grad and copy is not source and not copy.requires_grad
        )
        return BaseWeights(
            "bf16",
            w13_bf16,
            w2_bf16,
            None,
            None,
            experts,
            hidden,
            intermediate,
            sources=_trainable_sources(*given),
            unlinked=unlinked,
        )
    # Ordinary mode: the caller's w13/w2 are the straight-through gradient sink (kept by
    # reference, no copy); the packed values are quantized from their BF16 rounding.
    trains = torch.is_grad_enabled() and (w13.requires_grad or w2.requires_grad)
    assert hidden % MXFP4_BLOCK == 0 and intermediate % MXFP4_BLOCK == 0
    # Traced by torch.compile the quantization is part of the graph (its ops are plain
    # torch ops); only the host-side finite check, a data-dependent branch, is left out.
    traced = torch.compiler.is_compiling()
    if not traced and not (has_data(w13) and has_data(w2)):
        # Meta or fake tensors (a module built on meta, FakeTensorMode): the packed
        # layout's shapes, no values to check or quantize.
        def packed(w: torch.Tensor, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
            lead = tuple(w.shape[:-1])
            return (
                w.new_empty(*lead, inner // 2, dtype=torch.uint8),
                w.new_empty(*lead, inner // MXFP4_BLOCK, dtype=torch.uint8),
            )

        (w13_packed, w13_scales), (w2_packed, w2_scales) = (
            packed(w13, hidden),
            packed(w2, intermediate),
        )
    else:
        # The BF16 rounding is what is quantized: FP32 values beyond BF16's range are
        # finite but round to Inf.
        for name, value in (("w13", w13_bf16), ("w2", w2_bf16)):
            if check_finite and not traced and not torch.isfinite(value).all():
                raise ValueError(
                    f"{name}: MXFP4 quantization needs finite weights, found NaN or Inf "
                    "(after rounding to BF16)"
                )
        with torch.no_grad():
            w13_packed, w13_scales = quantize_mxfp4(w13_bf16.detach(), axis=-1)
            w2_packed, w2_scales = quantize_mxfp4(w2_bf16.detach(), axis=-1)
    return BaseWeights(
        "mxfp4",
        w13_packed,
        w2_packed,
        w13_scales,
        w2_scales,
        experts,
        hidden,
        intermediate,
        w13_master=w13 if trains else None,
        w2_master=w2 if trains else None,
        sources=_trainable_sources(("w13", w13, w13_packed), ("w2", w2, w2_packed)),
        unlinked=()
        if trains
        else tuple(n for n, w in (("w13", w13), ("w2", w2)) if w.requires_grad),
    )


def _trainable_sources(*given: tuple[str, torch.Tensor, torch.Tensor]) -> tuple[list, ...]:
    """``[name, source, version, copy, version]`` of each source that requires grad and
    that the base holds a copy or quantization of (``copy``), not the tensor itself
    (whatever the grad mode: a copy made under ``no_grad`` goes stale the same way)."""
    if torch.compiler.is_compiling():
        return ()
    sources = []
    for name, source, copy in given:
        if source.requires_grad and copy is not source:
            try:
                sources.append([name, source, source._version, copy, copy._version])
            except RuntimeError:  # inference tensors keep no version counter
                continue
    return tuple(sources)
