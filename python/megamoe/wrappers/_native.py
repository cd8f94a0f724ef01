"""Access to the compiled module ``megamoe._C`` and the CUDA-side conventions."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def native() -> ModuleType:
    """The compiled module; raises ImportError saying how to build it if it is missing."""
    try:
        from .. import _C
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            "megamoe._C is not built: install megamoe from a wheel or with "
            "`pip install .` (needs nvcc for sm_90a)"
        ) from error
    return _C


def dlpack(tensor: torch.Tensor) -> object:
    """A DLPack capsule of a CUDA tensor for the C++ launchers.

    ``stream=-1`` tells torch not to order the default stream after the current one:
    our launches run on the current stream themselves, and that extra event wait
    would break CUDA-graph capture. Detached first: inside the autograd custom ops the
    inputs still carry ``requires_grad`` and the kernels never take part in autograd.
    """
    return tensor.detach().__dlpack__(stream=-1)


def current_stream(device: torch.device) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on ``device``."""
    return torch.cuda.current_stream(device).cuda_stream
