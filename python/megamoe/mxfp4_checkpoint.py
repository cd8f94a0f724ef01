"""Pre-quantized MXFP4 checkpoints as megamoe's MXFP4 base, with no BF16 round trip.

A checkpoint that stores its experts as OCP MXFP4 (E2M1 codes packed two per byte,
one UE8M0 scale per 32 elements along the reduction dim) already holds the values
megamoe's MXFP4 base holds (:mod:`megamoe.mxfp4`): the bytes are taken as they are,
only the gate/up rows are put in the kernels' order. Nothing is dequantized, so the
result is exactly the checkpoint's values (a re-quantization of a BF16 decode would be
too, but only for canonical scales, and it costs a full BF16 copy).

Layouts read:

- megamoe / OCP, per expert nn.Linear rows: ``w13_codes [E, 2I, H/2]`` (rows ``0..I-1``
  gate, ``I..2I-1`` up), ``w13_scales [E, 2I, H/32]``, ``w2_codes [E, H, I/2]``,
  ``w2_scales [E, H, I/32]``; byte ``j`` of a row holds elements ``2j`` (low nibble)
  and ``2j+1`` (high nibble); a scale byte is ``exponent + 127``.
- DeepSeek-V4 style FP4 experts (transformers' ``FP8Experts`` with ``expert_dtype="fp4"``):
  the same layout with the codes as ``int8`` and the scales as ``float8_e8m0fnu`` (the
  same bytes); both are read as ``uint8`` views.
- gpt-oss (transformers' ``GptOssExperts`` MXFP4 checkpoints, ``*_blocks``/``*_scales``):
  ``gate_up_proj_blocks [E, 2I, H/32, 16]``, ``gate_up_proj_scales [E, 2I, H/32]``,
  ``down_proj_blocks [E, H, I/32, 16]``, ``down_proj_scales [E, H, I/32]``. The 16
  bytes of a block are its 32 elements, low nibble first (transformers'
  ``convert_moe_packed_tensors`` decodes them so), which is the layout above once the
  block dims are merged. Its gate/up rows are interleaved (row ``2j`` gate ``j``, row
  ``2j+1`` up ``j``: gpt-oss's ``gate_up[..., ::2]`` / ``[..., 1::2]``): pass
  ``gate_up="interleaved"`` (:func:`base_weights_from_gpt_oss` does). Note that gpt-oss's
  experts also have biases and a custom gated activation, which megamoe does not
  compute; the converter loads the weights, it does not make gpt-oss runnable.

One normalization: the E2M1 code 8 (``-0``) is written as code 0 (``+0``), the only zero
:func:`~megamoe.quantize_mxfp4` emits, so the result equals ``quantize_mxfp4`` of the
decoded values bit for bit whenever the checkpoint's scales are canonical (exponent
``floor(log2(amax)) - 2``, as megamoe's and the OCP reference quantizer choose).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .mxfp4 import MXFP4_BLOCK
from .validation.arguments import check_str_choice, check_tensor, has_data
from .validation.mxfp4 import check_mxfp4_scales
from .weights import BaseWeights
from .wrappers.registry import registry
from .wrappers.routing import check_local_experts

__all__ = ["GATE_UP_ORDERS", "base_weights_from_gpt_oss", "base_weights_from_mxfp4"]

#: ``"concatenated"``: rows ``[gate; up]`` (nn.Linear / HF ``gate_up_proj``);
#: ``"interleaved"``: row ``2j`` gate ``j``, row ``2j + 1`` up ``j`` (gpt-oss).
GATE_UP_ORDERS = ("concatenated", "interleaved")

_BYTES_PER_BLOCK = MXFP4_BLOCK // 2


def _as_bytes(t: object) -> object:
    """``int8`` codes and ``float8_e8m0fnu`` scales (DeepSeek-V4's FP4 experts in
    transformers) as the ``uint8`` bytes they are (a view, no copy); anything else as
    given, for the checks to name."""
    byte_dtypes = (torch.int8, getattr(torch, "float8_e8m0fnu", None))
    if isinstance(t, torch.Tensor) and t.dtype in byte_dtypes:
        return t.view(torch.uint8)
    return t


def _merge_blocks(name: str, codes: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/32, 16]`` (gpt-oss blocks) -> ``[E, N, K/2]``; 3-D passes through."""
    check_tensor(name, codes)  # a TypeError naming it for a list or None
    if codes.dim() == 4:
        if codes.shape[-1] != _BYTES_PER_BLOCK:
            raise ValueError(
                f"{name}: expected blocks of {_BYTES_PER_BLOCK} bytes [E, N, K/32, 16], got "
                f"shape {list(codes.shape)}"
            )
        return codes.reshape(*codes.shape[:2], -1)
    return codes


def _positive_zero(codes: torch.Tensor) -> torch.Tensor:
    """Code 8 (-0) -> code 0 in both nibbles (see the module docstring)."""
    low, high = codes & 0x0F, codes >> 4
    low = torch.where(low == 8, torch.zeros_like(low), low)
    high = torch.where(high == 8, torch.zeros_like(high), high)
    return low | (high << 4)


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[g0, u0, g1, u1, ..]`` -> ``[g0, g1, .., u0, u1, ..]`` along dim 1."""
    experts, rows, *rest = t.shape
    return t.view(experts, rows // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


def base_weights_from_mxfp4(
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    *,
    gate_up: str = "concatenated",
) -> BaseWeights:
    """A frozen MXFP4 :class:`~megamoe.BaseWeights` from packed E2M1 codes and scales.

    Args:
        w13_codes: ``[E, 2I, H/2]`` uint8 or int8 (or gpt-oss blocks ``[E, 2I, H/32,
            16]``).
        w13_scales: ``[E, 2I, H/32]`` uint8 or float8_e8m0fnu UE8M0.
        w2_codes: ``[E, H, I/2]`` uint8 or int8 (or ``[E, H, I/32, 16]``).
        w2_scales: ``[E, H, I/32]`` uint8 or float8_e8m0fnu.
        gate_up: the row order of ``w13``: ``"concatenated"`` or ``"interleaved"``
            (:data:`GATE_UP_ORDERS`).

    Returns:
        The base :func:`~megamoe.prepare_base_weights` would return for ``format="mxfp4"``
        on the decoded values (for canonical scales bit for bit), without decoding: the
        codes and scales are copied once into the kernels' row order (0.27x the BF16
        bytes), on their device. ``mm.moe`` and ``mm.reference.moe`` take it as is.
    """
    return _base_weights(
        w13_codes, w13_scales, w2_codes, w2_scales, gate_up, ("w13_scales", "w2_scales")
    )


def _base_weights(
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    gate_up: str,
    scale_names: tuple[str, str],
) -> BaseWeights:
    """:func:`base_weights_from_mxfp4`, naming the scales ``scale_names`` in its NaN check
    (a checkpoint loader passes its keys)."""
    check_str_choice("gate_up", gate_up, GATE_UP_ORDERS)
    w13_codes, w13_scales, w2_codes, w2_scales = map(
        _as_bytes, (w13_codes, w13_scales, w2_codes, w2_scales)
    )
    reg = registry()
    w13_codes = check_tensor("w13_codes", _merge_blocks("w13_codes", w13_codes), ndim=3,
                             dtypes=(torch.uint8,))  # fmt: skip
    experts, two_i, half_h = w13_codes.shape
    if experts < 1:
        shape = list(w13_codes.shape)
        raise ValueError(f"w13_codes: expected at least one expert, got shape {shape}")
    check_local_experts("w13_codes", experts)
    hidden, intermediate = 2 * half_h, two_i // 2
    if two_i % 2:
        raise ValueError(f"w13_codes: expected an even row count 2I, got {two_i}")
    device = w13_codes.device
    uint8 = (torch.uint8,)
    check_tensor("w13_scales", w13_scales, shape=(experts, two_i, hidden // MXFP4_BLOCK),
                 dtypes=uint8, device=device)  # fmt: skip
    w2_codes = check_tensor("w2_codes", _merge_blocks("w2_codes", w2_codes),
                            shape=(experts, hidden, intermediate // 2), dtypes=uint8,
                            device=device)  # fmt: skip
    check_tensor("w2_scales", w2_scales, shape=(experts, hidden, intermediate // MXFP4_BLOCK),
                 dtypes=uint8, device=device)  # fmt: skip
    for name, dim, multiple in (
        ("hidden size H", hidden, reg.hidden_multiple),
        ("intermediate size I", intermediate, reg.intermediate_multiple),
    ):
        if dim < 1 or dim % multiple or dim % MXFP4_BLOCK:
            raise ValueError(
                f"w13_codes: {name}={dim} is not a positive multiple of "
                f"{max(multiple, MXFP4_BLOCK)} (the kernels' tile and the MXFP4 block)"
            )
    if has_data(w13_scales):  # a NaN scale byte poisons whole blocks, silently
        check_mxfp4_scales(scale_names[0], w13_scales)
        check_mxfp4_scales(scale_names[1], w2_scales)
    if gate_up == "interleaved":
        w13_codes, w13_scales = _deinterleave_rows(w13_codes), _deinterleave_rows(w13_scales)
    # The kernels read w13 in this concatenated (nn.Linear) row order as it is. The
    # scales are copied too (the codes are new tensors already): the base must not
    # change with the checkpoint's tensors, whose bytes were checked here.
    contiguous = torch.contiguous_format
    return BaseWeights(
        "mxfp4",
        _positive_zero(w13_codes).contiguous(),
        _positive_zero(w2_codes).contiguous(),
        w13_scales.clone(memory_format=contiguous),
        w2_scales.clone(memory_format=contiguous),
        experts,
        hidden,
        intermediate,
    )


def base_weights_from_gpt_oss(
    state_dict: Mapping[str, torch.Tensor], prefix: str, *, device: torch.device | None = None
) -> BaseWeights:
    """The MXFP4 base of one gpt-oss experts module from its checkpoint tensors.

    Args:
        state_dict: the checkpoint (e.g. ``safetensors.torch.load_file`` of a shard).
        prefix: the experts module, e.g. ``model.layers.0.mlp.experts``; reads
            ``{prefix}.gate_up_proj_blocks``/``_scales`` and ``{prefix}.down_proj_blocks``
            /``_scales``.
        device: where to put the result (default: where the tensors are).

    Returns:
        The frozen MXFP4 base that ``mm.moe`` takes, as :func:`base_weights_from_mxfp4`
        returns it for gpt-oss's interleaved gate/up rows.

    Raises:
        ValueError: a tensor named above is missing from ``state_dict`` (or a shape or
            scale the reader refuses; ``TypeError`` for a dtype).
    """
    names = [
        f"{prefix}.{p}_{k}" for p in ("gate_up_proj", "down_proj") for k in ("blocks", "scales")
    ]
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise ValueError(f"state_dict: missing {missing} (gpt-oss MXFP4 experts)")
    for name in names:
        check_tensor(f"state_dict[{name!r}]", state_dict[name])
    tensors = [state_dict[n] if device is None else state_dict[n].to(device) for n in names]
    return _base_weights(*tensors, "interleaved", (names[1], names[3]))
