"""The layer runs at its own precision under ``torch.autocast``.

Trainers wrap forwards in autocast (HF Trainer with ``bf16=True``, torchtitan's mixed
precision). Autocast reaches the torch ops our ops' implementations call, because a
custom op's implementation runs with the caller's autocast state: an FP32 product
(``mm_fp32``'s ``s dout b2^T``, the router dots) would be computed in BF16
and an FP32 reduction could change dtype, so the layer's results would depend on the
caller's context. The implementations therefore run with autocast off; their inputs are
checked as given (the layer's dtypes are its contract, not autocast's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: The device types whose autocast state torch keeps per thread and we switch off.
_AUTOCAST_DEVICES = ("cuda", "cpu")


@contextlib.contextmanager
def autocast_off(device: torch.device) -> Iterator[None]:
    """Autocast disabled for ``device``'s type inside the block (a no-op where it is
    off already, or for a device type autocast does not cover: meta)."""
    kind = device.type
    if kind in _AUTOCAST_DEVICES and torch.is_autocast_enabled(kind):
        with torch.autocast(kind, enabled=False):
            yield
    else:
        yield
