"""The eager route of the layer's custom-op pairs (EP1's, :mod:`megamoe.custom_ops.layer`;
expert parallelism's, :mod:`megamoe.ep.ops`).

Eagerly, on plain tensors, the layer calls a pair's two implementations through an
autograd Function with the forward op's own autograd rules instead of the registered
ops: the same functions and kernels, the same bits, without the custom-op dispatch's
host time (default filling, its autograd wrapper, the redispatch, the dynamo-disable
wrapper), which bounds small-token calls (docs/DESIGN-NOTES.md, "The op layer").
torch.compile, functorch transforms, dispatch and torch-function modes (FlopCounterMode,
FakeTensorMode, DTensor) and tensor subclasses get the ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from ..pipeline.fused_forward import stage

__all__ = ["eager_forward", "takes_eager_route"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def takes_eager_route(tensors: list[torch.Tensor | None], *, require_cuda: bool = True) -> bool:
    """Whether the layer may call a pair's implementations directly: outside
    torch.compile, functorch transforms (vmap runs on the ops; grad transforms need the
    ops' ``setup_context``) and dispatch or torch-function modes, with every tensor a
    plain ``Tensor`` or ``Parameter`` (None allowed) on CUDA, or also on the CPU where
    ``require_cuda`` is False (the EP pair's torch twins run there, over gloo). Other
    devices (meta) get the ops, whose fake implementations they run."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(
        t is None
        or (
            type(t) in _PLAIN_TENSORS
            and (t.is_cuda or (not require_cuda and t.device.type == "cpu"))
        )
        for t in tensors
    )


def eager_forward(
    name: str,
    forward_impl: Callable[..., tuple[torch.Tensor, ...]],
    setup_context: Callable[..., None],
    op_backward: Callable[..., tuple[torch.Tensor | None, ...]],
) -> type[torch.autograd.Function]:
    """The autograd Function of a pair's eager route: ``apply(*inputs)`` (the forward
    op's inputs in schema order) runs ``forward_impl`` in a profiler range ``name`` (the
    op's), then the op's ``setup_context`` with ``ctx.eager`` set after it, so that the
    op's autograd backward ``op_backward`` calls the backward implementation directly.
    Once differentiable, like the op: no second-order graph through the native kernels.
    ``op_backward`` is looked up as the class's ``run_backward`` at each call (tests
    replace it there)."""

    class EagerForward(torch.autograd.Function):
        # A forward that takes ctx, not a separate setup_context: with one,
        # Function.apply binds the arguments through inspect.signature on every call,
        # host time on the path to the first kernel of a small-token call.
        @staticmethod
        def forward(ctx, *inputs):
            with stage(name):
                output = forward_impl(*inputs)
            setup_context(ctx, inputs, output)
            ctx.eager = True
            return output

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            return EagerForward.run_backward(ctx, *grads)

        run_backward = staticmethod(op_backward)

    EagerForward.__name__ = EagerForward.__qualname__ = f"Eager_{name}"
    return EagerForward
