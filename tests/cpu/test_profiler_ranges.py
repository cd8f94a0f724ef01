"""The fused pipeline names its stages in profiles: ``megamoe::<stage>`` record_function
ranges around every stage of the forward and the backward (issue 18 item 5).

On the CPU every stage runs its torch twin, so the ranges are checked here; they sit in
the custom ops' real implementations, which torch.compile does not trace
(tests/cpu/test_ops_fake.py and tests/cpu/test_module.py keep the fullgraph tests)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.pipeline.fused_backward import moe_backward
from megamoe.pipeline.fused_forward import moe_forward
from megamoe.testing import make_layer

FORWARD = ["route_plan", "adapter_shrink", "gather", "gemm1", "gemm2", "adapter_expand"]
FORWARD += ["combine"]
BACKWARD = ["adapter_dout", "gather_dout", "dgrad2", "grad_a2", "grad_b13", "dgrad1"]
BACKWARD += ["grad_router", "combine_dx", "grad_shared"]


def _ranges(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("megamoe::")]


def _run(layer, *, checkpoint: bool, base_grads: bool) -> tuple[list[str], list[str]]:
    kwargs = dict(activation=layer.activation, activation_clamp=layer.activation_clamp)
    args = (layer.x, layer.topk_ids, layer.topk_weights, layer.base, layer.side)
    save = "recompute" if checkpoint else "preact"
    with profile(activities=[ProfilerActivity.CPU]) as forward:
        out, state = moe_forward(*args, block_m=64, save=save, **kwargs)
    dout = torch.ones_like(out)
    with profile(activities=[ProfilerActivity.CPU]) as backward:
        moe_backward(
            dout, layer.x, layer.topk_weights, layer.base, layer.side, state,
            base_grads=base_grads, side_grads=layer.side is not None, **kwargs,
        )  # fmt: skip
    return _ranges(forward), _ranges(backward)


def test_side_lora_forward_and_backward_name_every_stage():
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=24, seed=1, activation_clamp=5.0)
    forward, backward = _run(layer, checkpoint=False, base_grads=False)
    assert forward == [f"megamoe::{name}" for name in FORWARD]
    assert backward == [f"megamoe::{name}" for name in BACKWARD]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_ordinary_mode_names_the_base_gradients_and_the_recompute(checkpoint):
    layer = make_layer(64, 64, 4, 2, None, num_tokens=24, seed=2)
    forward, backward = _run(layer, checkpoint=checkpoint, base_grads=True)
    assert forward == [f"megamoe::{n}" for n in ("route_plan", "gather", "gemm1", "gemm2")] + [
        "megamoe::combine"
    ]
    expected = ["recompute_gemm1", "gather", "gemm1"] if checkpoint else []
    expected += ["gather_dout", "dgrad2", "grad_w2", "grad_w13", "dgrad1", "grad_router"]
    assert backward == [f"megamoe::{name}" for name in [*expected, "combine_dx"]]


def test_no_ranges_without_a_profiler():
    """Outside a profile the stages open no range (an idle record_function costs host
    time on every call)."""
    from megamoe.pipeline.fused_forward import stage

    assert type(stage("gemm1")).__name__ == "nullcontext"
    with profile(activities=[ProfilerActivity.CPU]):
        assert type(stage("gemm1")).__name__ == "record_function"
