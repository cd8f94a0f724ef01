"""A torch-function mode that changes nothing, for tests of the layer's eager route
(:mod:`megamoe.custom_ops.eager_route`): under any such mode the layer calls its
registered custom ops instead, so a test compares the two routes in one process."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

__all__ = ["OpRoute"]


class OpRoute(TorchFunctionMode):
    """Passes every torch function through unchanged; while it is active, ``mm.moe`` and
    ``megamoe.ep.fused_moe`` take the registered ops, not the eager route."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
