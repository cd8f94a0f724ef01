"""``mm.MegaMoE`` under ``torch.compile`` on the GPU, as trainers run it (torchtitan
compiles its blocks): inductor in its default mode, and ``mode="reduce-overhead"``, which
replays the forward and the backward from CUDA graphs. Each compiled step (forward, then
``backward`` of the output) must give the eager module's output and gradients bit for
bit, on new values every step (a frozen BF16 or MXFP4 base with side-LoRA adapters, and a
trainable BF16 base in ordinary mode)."""

from __future__ import annotations

import copy

import pytest
import torch

import megamoe as mm
from megamoe.testing.inputs import make_routing

pytestmark = pytest.mark.gpu

HIDDEN, INTER, EXPERTS, TOP_K, RANK, TOKENS = 512, 256, 8, 6, 64, 300


def _module(side_rank: int | None, base_format: str) -> mm.MegaMoE:
    torch.manual_seed(0)
    layer = mm.MegaMoE(
        HIDDEN,
        INTER,
        EXPERTS,
        TOP_K,
        side_rank=side_rank,
        trainable_base=side_rank is None,
        base_format=base_format,
        activation_clamp=1.5,  # active: |g|, |u| reach 3-5 here (7.0 never clamped)
        device="cuda",
    )
    with torch.no_grad():  # adapters' up factors start at zero; give them values
        for p in layer.parameters():
            if p.requires_grad and not p.any():
                p.copy_(torch.randn_like(p) * 0.05)
    return layer


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = make_routing(TOKENS, EXPERTS, TOP_K, kind="masked", seed=seed)
    dout = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    return x, ids.cuda(), weights.cuda(), dout


def _step(layer: torch.nn.Module, x, ids, weights, dout) -> list[torch.Tensor]:
    """Output and the gradients of x, the router weights and every trainable parameter,
    cloned (a CUDA-graph replay reuses its output memory)."""
    x = x.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    out = layer(x, ids, weights)
    out.backward(dout)
    grads = [x.grad, weights.grad] + [p.grad for p in layer.parameters() if p.requires_grad]
    return [t.detach().clone() for t in (out, *grads)]


@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize(
    ("side_rank", "base_format"), [(RANK, "bf16"), (RANK, "mxfp4"), (None, "bf16")]
)
def test_compiled_steps_match_eager_bitwise(compile_mode, side_rank, base_format):
    eager = _module(side_rank, base_format)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, mode=compile_mode, fullgraph=True)
    for seed in (1, 2, 3, 4):  # reduce-overhead records on the first calls, replays after
        inputs = _inputs(seed)
        want = _step(eager, *inputs)
        got = _step(compiled, *inputs)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.isfinite(w).all(), (seed, i)
            assert torch.equal(g, w), f"seed {seed}: tensor {i} of (out, dx, dweights, params)"
    mm.check_errors()
