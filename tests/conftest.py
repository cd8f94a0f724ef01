"""Shared test configuration: GPU tests skip cleanly where no GPU or module is found."""

from __future__ import annotations

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        from megamoe import _C  # noqa: F401
    except ImportError:
        return "megamoe._C is not built"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return "needs a Hopper (sm_90a) GPU"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
