"""Shared test configuration: GPU tests skip cleanly where no GPU or module is found."""

from __future__ import annotations

import os

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
    # Without the caching allocator (the sanitizer runs set this, so that memcheck sees
    # each tensor's own bounds) every allocation is a cudaMalloc, which a capturing
    # stream refuses: graph captures cannot run there.
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        no_graphs = pytest.mark.skip(reason="PYTORCH_NO_CUDA_MEMORY_CACHING is set")
        for item in items:
            if "cuda_graph" in item.keywords:
                item.add_marker(no_graphs)
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
