"""Access to the compiled module ``megamoe._C`` and the CUDA-side conventions.

Every launch goes through these helpers, so they are kept cheap: a small-token layer
call is bound by the host's work per launch (``docs/PERFORMANCE.md``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from types import ModuleType

import torch
from torch.utils.dlpack import to_dlpack


@functools.cache
def native() -> ModuleType:
    """The compiled module; raises ImportError saying how to build it if it is missing."""
    try:
        from .. import _C
    except ImportError as error:  # pragma: no cover - depends on the install
        if importlib.util.find_spec("megamoe._C") is None:
            raise ImportError(
                "megamoe._C is not built: install megamoe from a wheel or with "
                "`pip install .` (needs nvcc for sm_90a)"
            ) from error
        # Built but not loadable (e.g. an older libstdc++ first on the library path).
        raise ImportError(f"megamoe._C is installed but failed to load: {error}") from error
    return _C


def dlpack(tensor: torch.Tensor) -> object:
    """A DLPack capsule of a CUDA tensor for the C++ launchers.

    The legacy capsule (``torch.utils.dlpack.to_dlpack``): it orders no stream (our
    launches run on the current stream themselves, and an extra event wait would break
    CUDA-graph capture), and it exports tensors that require grad, as the inputs of the
    autograd custom ops do (the kernels never take part in autograd). About a tenth of
    the host time of ``tensor.detach().__dlpack__(stream=-1)``.
    """
    return to_dlpack(tensor)


def device_index(device: torch.device) -> int:
    """The index of a CUDA device (the current device for ``cuda`` without one)."""
    return torch.cuda.current_device() if device.index is None else device.index


def current_stream(device: torch.device) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on ``device``."""
    return torch._C._cuda_getCurrentRawStream(device_index(device))


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch; no context switch when it already is."""
    index = device_index(device)
    if index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)
