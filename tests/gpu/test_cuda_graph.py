"""The whole fused layer, forward and backward, in ONE CUDA graph (issue 17 item 2).

Each case captures ``mm.moe`` and ``torch.autograd.grad`` of its output with respect to
``x``, the router weights and the trainable weights (the side-LoRA adapters on a frozen
base, or the base itself in ordinary mode), for a BF16 and an MXFP4 base, at a
weight-bound token count and a medium one (MXFP4: in-pipeline decode and the transient
decode). The graph is replayed on new values copied into its static inputs, and its
outputs and gradients must be bitwise the eager call's on the same values: the layer has
no host synchronisation and no data-dependent host decision.
"""

from __future__ import annotations

import pytest
import torch

import megamoe as mm
from megamoe.testing import LayerInputs, make_layer

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_graph]

HIDDEN, INTER, EXPERTS, TOP_K, RANK = 512, 256, 8, 6, 64


def _layer(mode: str, format: str, tokens: int, seed: int) -> LayerInputs:
    ordinary = mode == "ordinary"
    return make_layer(
        HIDDEN,
        INTER,
        EXPERTS,
        TOP_K,
        None if ordinary else RANK,
        num_tokens=tokens,
        device="cuda",
        seed=seed,
        routing="masked",  # masked routes and uneven experts, in both values
        format=format,
        activation_clamp=1.5,  # active: |g|, |u| reach 3-5 here (7.0 never clamped)
        requires_grad=True,
        trainable_base=ordinary,
    )


def _dout(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)


class _Static:
    """The graph's inputs: fresh leaves whose values are replaced between replays."""

    def __init__(self, layer: LayerInputs, dout: torch.Tensor) -> None:
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone().requires_grad_(t.requires_grad)

        self.format = layer.base.format
        self.x, self.topk_weights = leaf(layer.x), leaf(layer.topk_weights)
        self.topk_ids = layer.topk_ids.clone()
        self.dout = dout.clone()
        self.w13, self.w2 = leaf(layer.w13), leaf(layer.w2)
        self.trains_base = self.w13.requires_grad
        # Ordinary mode: the base links to the leaves (BF16: they are the base; MXFP4:
        # they are the straight-through masters of the packed values).
        self.base = mm.prepare_base_weights(self.w13, self.w2, format=self.format)
        if not self.trains_base:
            self.base = layer.base
        self.side = None
        if layer.side is not None:
            self.side = mm.SideLoRA(*map(leaf, layer.side.tensors()), scale=layer.side.scale)
        self.activation_clamp = layer.activation_clamp

    def leaves(self) -> list[torch.Tensor]:
        leaves = [self.x, self.topk_weights]
        if self.trains_base:
            leaves += [self.w13, self.w2]
        if self.side is not None:
            leaves += list(self.side.tensors())
        return leaves

    def step(self, **kwargs: object) -> tuple[torch.Tensor, ...]:
        out = mm.moe(
            self.x,
            self.topk_ids,
            self.topk_weights,
            self.base,
            self.side,
            activation_clamp=self.activation_clamp,
            **kwargs,
        )
        return (out, *torch.autograd.grad(out, self.leaves(), self.dout))

    @torch.no_grad()
    def load(self, layer: LayerInputs, dout: torch.Tensor) -> None:
        """Copy ``layer``'s values into the static tensors (the base re-prepared from new
        masters, as an optimizer step would, into the same buffers)."""
        for static, new in ((self.x, layer.x), (self.topk_weights, layer.topk_weights)):
            static.copy_(new)
        self.topk_ids.copy_(layer.topk_ids)
        self.dout.copy_(dout)
        if self.side is not None:
            for static, new in zip(self.side.tensors(), layer.side.tensors(), strict=True):
                static.copy_(new)
        new_base = layer.base
        if self.trains_base:
            self.w13.copy_(layer.w13)
            self.w2.copy_(layer.w2)
            new_base = mm.prepare_base_weights(self.w13, self.w2, format=self.format)
        for name in ("w13", "w2", "w13_scales", "w2_scales"):
            static = getattr(self.base, name)
            if static is not None and static is not getattr(new_base, name):
                static.copy_(getattr(new_base, name))


@pytest.mark.parametrize("tokens", [128, 2048])
@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_forward_and_backward_replay_bitwise_like_eager(mode: str, format: str, tokens: int):
    static = _Static(_layer(mode, format, tokens, seed=1), _dout(tokens, seed=2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            static.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = static.step()

    for seed in (3, 5):  # new values in the same buffers, twice
        static.load(_layer(mode, format, tokens, seed=seed), _dout(tokens, seed=seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        eager = static.step()
        names = ["out", "x", "topk_weights"] + (["w13", "w2"] if static.trains_base else [])
        names += ["a1", "b1", "a3", "b3", "a2", "b2"] if static.side is not None else []
        for name, got, want in zip(names, captured, eager, strict=True):
            assert torch.isfinite(want).all(), name
            assert torch.equal(got, want), f"{name} (replay with seed {seed})"
    mm.wrappers.routing.check_errors()  # the eager calls' ids were in range


@pytest.mark.parametrize("tokens", [128, 2048])
@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("mode", ["side-lora", "ordinary"])
def test_checkpointed_forward_and_backward_in_one_graph(mode: str, format: str, tokens: int):
    """Activation checkpointing recomputes GEMM1 in the backward (MXFP4: through the
    streaming kernels or the transient decode; ordinary mode: the straight-through
    base): the same in a graph."""
    static = _Static(_layer(mode, format, tokens, seed=11), _dout(tokens, seed=12))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            static.step(activation_checkpoint=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = static.step(activation_checkpoint=True)
    static.load(_layer(mode, format, tokens, seed=13), _dout(tokens, seed=14))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, static.step(activation_checkpoint=True), strict=True):
        assert torch.equal(got, want)
