"""MXFP4 -> BF16 decode of prepared base weights (kernels/mxfp4_decode.cuh).

The fused layer keeps an MXFP4 base resident as packed E2M1 codes + UE8M0 scales
(0.27x the BF16 bytes) and decodes each weight tensor into a transient BF16 buffer
right before the grouped GEMM that reads it, freeing it right after: one memory-bound
pass per use (w13 and w2 in the forward, again in the backward's dgrads), instead of
decoding each weight tile again for every M tile that reuses it (at ep4rank every
expert's tiles are reused by ~48 M tiles). No BF16 copy is kept between calls.
"""

from __future__ import annotations

import torch

from ..mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from ..validation.arguments import check_tensor
from . import _native

__all__ = ["decode_mxfp4_bf16"]


def decode_mxfp4_bf16(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4 blocked along the last dim to BF16 (bitwise :func:`dequantize_mxfp4`,
    except that a NaN block's NaNs may carry other payload bits).

    Args:
        packed: ``[..., K/2]`` uint8, contiguous (two E2M1 codes per byte, low first).
        scales: ``[..., K/32]`` uint8, contiguous, same device (0xFF decodes as NaN).

    Returns:
        ``[..., K]`` bfloat16. On CUDA one kernel on the current stream; on CPU
        :func:`dequantize_mxfp4` (the same exact values).
    """
    check_tensor("packed", packed, dtypes=(torch.uint8,), contiguous=True)
    if packed.dim() < 1 or packed.shape[-1] % (MXFP4_BLOCK // 2) != 0:
        raise ValueError(
            f"packed: expected a last dim that is a multiple of 16 bytes, got shape "
            f"{list(packed.shape)}"
        )
    want = (*packed.shape[:-1], packed.shape[-1] // (MXFP4_BLOCK // 2))
    check_tensor(
        "scales", scales, shape=want, dtypes=(torch.uint8,), device=packed.device, contiguous=True
    )
    return _decode_op(packed, scales)


# A torch custom op, so torch.compile treats the decode as one opaque node (the CUDA
# path calls the native extension directly, which dynamo cannot trace).
@torch.library.custom_op("megamoe::mxfp4_decode_bf16", mutates_args=())
def _decode_op(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if not packed.is_cuda:
        return dequantize_mxfp4(packed, scales, axis=-1, dtype=torch.bfloat16)
    out = torch.empty(
        (*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.bfloat16, device=packed.device
    )
    rows = packed.numel() // packed.shape[-1] if packed.shape[-1] else 0
    dl = _native.dlpack
    with _native.on_device(packed.device):
        _native.native().mxfp4_decode(
            dl(packed.view(rows, packed.shape[-1])),
            dl(scales.view(rows, scales.shape[-1])),
            dl(out.view(rows, out.shape[-1])),
            _native.current_stream(packed.device),
        )
    return out


@_decode_op.register_fake
def _decode_fake(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return packed.new_empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.bfloat16)
