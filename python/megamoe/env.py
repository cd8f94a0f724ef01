"""The SM budget policy for persistent launches (docs/DESIGN.md §3).

``MEGAMOE_NUM_SMS``: an absolute SM count; it wins over the headroom.
``MEGAMOE_SM_HEADROOM``: SMs left free (for NCCL kernels running beside ours),
rounded up to an even number: Hopper SMs come in pairs (two per TPC), and an even
budget would keep room for 2-CTA clusters. Every launch is a 1x1 cluster (2x1 clusters
measured slower: docs/PERFORMANCE.md, sixteenth session), so the rounding costs at most
one SM.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

NUM_SMS_VAR = "MEGAMOE_NUM_SMS"
SM_HEADROOM_VAR = "MEGAMOE_SM_HEADROOM"


@functools.lru_cache(maxsize=64)  # read at every persistent launch
def _parse_int(var: str, text: str) -> int:
    # ASCII digits only: int() also takes "1_00" and other scripts' digits.
    digits = text.strip()
    if re.fullmatch(r"[+-]?[0-9]+", digits) is None:
        raise ValueError(f"{var}: expected an integer, got {text!r}")
    return int(digits, 10)


def resolve_num_sms(device_sm_count: int, environ: Mapping[str, str] | None = None) -> int:
    """SMs our persistent kernels may use on a device with ``device_sm_count`` SMs.

    Raises ``ValueError`` naming the variable for values that are not integers, are
    negative, or leave no SM.
    """
    environ = os.environ if environ is None else environ
    if isinstance(device_sm_count, bool) or not isinstance(device_sm_count, int):
        raise TypeError(f"device_sm_count: expected an int, got {type(device_sm_count).__name__}")
    if device_sm_count < 1:
        raise ValueError(f"device_sm_count: expected >= 1, got {device_sm_count}")
    absolute = environ.get(NUM_SMS_VAR, "").strip()
    if absolute:
        count = _parse_int(NUM_SMS_VAR, absolute)
        if not 1 <= count <= device_sm_count:
            raise ValueError(
                f"{NUM_SMS_VAR}: expected 1..{device_sm_count} (the device's SMs), got {count}"
            )
        return count
    headroom_text = environ.get(SM_HEADROOM_VAR, "").strip()
    if not headroom_text:
        return device_sm_count
    headroom = _parse_int(SM_HEADROOM_VAR, headroom_text)
    if headroom < 0:
        raise ValueError(f"{SM_HEADROOM_VAR}: expected >= 0, got {headroom}")
    headroom += headroom % 2
    if headroom >= device_sm_count:
        raise ValueError(
            f"{SM_HEADROOM_VAR}: headroom {headroom} (rounded up to even) leaves no SM of "
            f"{device_sm_count}"
        )
    return device_sm_count - headroom


def num_sms(device_index: int | None = None) -> int:
    """:func:`resolve_num_sms` for a CUDA device (current device when ``None``); the
    environment is read on every call, the device's SM count once."""
    import torch

    index = torch.cuda.current_device() if device_index is None else device_index
    return resolve_num_sms(_device_sm_count(index))


@functools.cache
def _device_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
