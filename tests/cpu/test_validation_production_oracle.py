"""The production suite's independent oracle (tests/production/production_oracle.py)
agrees with the library's float64 reference on the CPU, output and every gradient, so
a production failure on the GPU points at the kernels, not at the oracle."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import megamoe as mm
from megamoe.testing import make_layer

_PATH = Path(__file__).resolve().parents[1] / "production" / "production_oracle.py"
_SPEC = importlib.util.spec_from_file_location("production_oracle", _PATH)
oracle = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("production_oracle", oracle)
_SPEC.loader.exec_module(oracle)

H, I, E, K, R, T = 128, 64, 8, 3, 16, 40


def _reference(layer, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    out = layer.call(mm.reference.moe)
    leaves = layer.grad_leaves()
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return {"out": out.detach(), **dict(zip(leaves, grads, strict=True))}


@pytest.mark.parametrize(
    "mode,format,activation,clamp",
    [
        ("side-lora", "bf16", "swiglu", 1.0),
        ("side-lora", "mxfp4", "swiglu", None),
        ("side-lora", "bf16", "geglu", None),
        ("ordinary", "bf16", "swiglu", 1.0),
    ],
)
def test_oracle_matches_the_float64_reference(mode, format, activation, clamp):
    ordinary = mode == "ordinary"
    layer = make_layer(
        H, I, E, K, None if ordinary else R, num_tokens=T, dtype=torch.float64, seed=3,
        format=format, activation=activation, activation_clamp=clamp, routing="masked",
        requires_grad=True, trainable_base=ordinary, scale=0.25,
    )  # fmt: skip
    dout = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = _reference(layer, dout)
    if format == "mxfp4":
        weights = oracle.mxfp4_weights(layer.w13, layer.w2, mm.quantize_mxfp4, mm.dequantize_mxfp4)
    else:
        weights = oracle.bf16_weights(layer.w13, layer.w2)
    got = oracle.moe_oracle(
        layer.x, layer.topk_ids, layer.topk_weights, weights, E,
        None if ordinary else layer.side.tensors(), 0.25, dout, activation=activation,
        activation_clamp=clamp, base_grads=ordinary, dtype=torch.float64, clamp_on_bf16=False,
    )  # fmt: skip
    assert set(got.grads) == set(want) - {"out"}
    for name, expected in [("out", want["out"]), *((n, want[n]) for n in got.grads)]:
        actual = got.out if name == "out" else got.grads[name]
        # Both sides are float64, except the reference's router gradient, which comes in
        # the router weights' own float32 (make_layer's topk_weights), and its base
        # gradients, which pass prepare_base_weights' BF16 cast (one BF16 rounding).
        if name in ("w13", "w2"):
            oracle.assert_gates(name, actual, expected, 1 - 1e-5, 2**-8)
            continue
        rel = 1e-6 if expected.dtype == torch.float32 else 1e-9
        oracle.assert_gates(name, actual, expected, 1 - 1e-12, rel)
    if ordinary:  # the oracle's base gradients are the unrounded ones: within one
        # BF16 rounding (2^-9 relative) of the reference's, element by element
        for name in ("w13", "w2"):
            diff = (got.grads[name] - want[name]).abs()
            assert torch.all(diff <= 2**-8 * got.grads[name].abs() + 1e-12), name


def test_clamp_is_decided_on_the_bf16_values():
    c = 10.0
    # 10 + 2^-8 rounds to 10 in BF16 (ulp 2^-4 there): not clamped, gradient passes;
    # 10 + 2^-4 rounds to itself and is clamped; 10 exactly is the boundary (passes).
    values = torch.tensor([c + 2**-8, c + 2**-4, c, 3.0], dtype=torch.float64)
    g = values.clone().requires_grad_(True)
    u = torch.cat([-values[:2], values[2:]]).requires_grad_(True)
    g_out, u_out, clamped = oracle.clamp_activations(g, u, c)
    assert g_out.tolist() == [c + 2**-8, c, c, 3.0]
    assert u_out.tolist() == [-(c + 2**-8), -c, c, 3.0]
    assert clamped == 2
    (g_out.sum() + u_out.sum()).backward()
    assert g.grad.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert u.grad.tolist() == [1.0, 0.0, 1.0, 1.0]
    # Decided on the unrounded values, the first entry is clamped too.
    _, _, clamped = oracle.clamp_activations(g.detach(), u.detach(), c, on_bf16=False)
    assert clamped == 4


def test_closeness_is_chunked_and_exact():
    a = torch.randn(1000, dtype=torch.float64)
    b = a + 1e-3 * torch.randn(1000, dtype=torch.float64)
    whole = oracle.closeness(a, b, chunk=1 << 20)
    pieces = oracle.closeness(a, b, chunk=7)
    assert whole.cosine == pytest.approx(pieces.cosine, abs=1e-15)
    assert whole.rel_l2 == pytest.approx(pieces.rel_l2, rel=1e-12)
    assert whole.rel_l2 == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-12)
    assert oracle.closeness(torch.zeros(3), torch.zeros(3)).cosine == 1.0
    bad = a.clone()
    bad[5] = float("nan")
    assert not oracle.closeness(bad, b).finite
    with pytest.raises(AssertionError, match="x: .*finite=False"):
        oracle.assert_gates("x", bad, b, 0.0, 1.0)


def test_closeness_worst_row_sees_one_zeroed_row_in_any_chunking():
    """One zeroed row of 16384 passes the global gates and reads about 1.0 in worst_row,
    which its gate refuses; the row maximum does not depend on the chunking."""
    gen = torch.Generator().manual_seed(3)
    e = torch.randn(16384, 64, generator=gen, dtype=torch.float64)
    a = e + 1e-3 * torch.randn(16384, 64, generator=gen, dtype=torch.float64)
    a[777] = 0.0
    whole = oracle.closeness(a, e, chunk=1 << 26)
    pieces = oracle.closeness(a, e, chunk=100)  # one row (64 elements) per step
    expected = float(e[777].norm() / (e.norm() / 16384**0.5))
    assert whole.worst_row == pytest.approx(expected, rel=1e-3)
    assert pieces.worst_row == pytest.approx(whole.worst_row, rel=1e-12)
    assert whole.rel_l2 < 1e-2 and whole.cosine > 0.99995  # the global gates pass it
    assert oracle.closeness(a[:1], e[:1]).worst_row == pytest.approx(
        oracle.closeness(a[:1], e[:1]).rel_l2
    )
    with pytest.raises(AssertionError, match=r"worst_row <= 0\.1\)$"):
        oracle.assert_gates("dx", a, e, 0.99995, 1e-2)
    oracle.assert_gates("dx", a, e, 0.99995, 1e-2, max_worst_row=2.0)
