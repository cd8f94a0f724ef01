"""mm.moe forward (fused, EP1, BF16) vs the float64 oracle: the DESIGN §6 forward matrix."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import assert_close_to_oracle, block_m_transitions, make_layer

pytestmark = pytest.mark.gpu


def run_case(hidden, inter, experts, top_k, rank, tokens, **kwargs):
    fast = make_layer(
        hidden,
        inter,
        experts,
        top_k,
        rank,
        num_tokens=tokens,
        device="cuda",
        dtype=torch.bfloat16,
        **kwargs,
    )
    exact = make_layer(
        hidden,
        inter,
        experts,
        top_k,
        rank,
        num_tokens=tokens,
        device="cuda",
        dtype=torch.float64,
        **kwargs,
    )
    with torch.no_grad():
        out = fast.call(mm.moe)
        expected = exact.call(mm.reference.moe)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    assert_close_to_oracle("out", out, expected)
    return fast, out


TOKENS = [1, 15, 16, 17, 90, 91, 176, 177, 346, 347, 688, 689, 1029, 1030, 2048]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_token_counts(tokens, top_k):
    run_case(256, 128, 16, top_k, 16, tokens, seed=tokens, routing="masked")


@pytest.mark.parametrize("tokens", block_m_transitions(6, 8))
def test_block_m_transitions(tokens):
    run_case(256, 128, 8, 6, 16, tokens, seed=3)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("routing", ["balanced", "skewed", "masked", "empty"])
def test_activation_clamp_routing(activation, clamp, routing):
    run_case(
        512,
        256,
        8,
        2,
        32,
        700,
        seed=5,
        activation=activation,
        activation_clamp=clamp,
        routing=routing,
    )


@pytest.mark.parametrize("rank", [16, 64, 128, 256])
def test_adapter_ranks(rank):
    run_case(512, 256, 8, 4, rank, 400, seed=rank)


@pytest.mark.parametrize("hidden,inter", [(1536, 768), (2880, 2880), (4096, 2048)])
def test_other_dims(hidden, inter):
    run_case(hidden, inter, 8, 2, 64, 300, seed=7)


def test_no_adapter_path():
    run_case(512, 256, 8, 2, None, 333, seed=8)


def test_zero_scale_is_bitwise_the_no_adapter_output():
    layer = make_layer(512, 256, 8, 2, 64, num_tokens=500, device="cuda", scale=0.0, seed=9)
    with torch.no_grad():
        with_side = layer.call(mm.moe)
        layer.side = None
        without = layer.call(mm.moe)
    assert torch.equal(with_side, without)


def test_repeated_calls_are_bitwise_identical():
    layer = make_layer(
        512, 256, 16, 6, 64, num_tokens=3000, device="cuda", seed=10, routing="skewed"
    )
    with torch.no_grad():
        first = layer.call(mm.moe)
        for _ in range(3):
            assert torch.equal(layer.call(mm.moe), first)


def test_bad_input_is_rejected_before_launch():
    layer = make_layer(256, 128, 8, 2, 16, num_tokens=10, device="cuda")
    with torch.no_grad():
        with pytest.raises(TypeError, match="x: expected dtype"):
            mm.moe(layer.x.float(), layer.topk_ids, layer.topk_weights, layer.base, layer.side)
        # (Out-of-range CUDA ids are reported by a later call: tests/gpu/test_id_check.py.)
        with pytest.raises(TypeError, match="group"):
            mm.moe(layer.x, layer.topk_ids, layer.topk_weights, layer.base, group=object())
    # The training path (grads needed) checks the same way before any launch.
    with pytest.raises(TypeError, match="x: expected dtype"):
        mm.moe(layer.x.float().requires_grad_(), layer.topk_ids, layer.topk_weights, layer.base)
