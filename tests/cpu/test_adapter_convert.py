"""adapter_convert: PEFT / Megatron-Bridge shared-outer LoRA <-> SideLoRA.

The oracles below compute the MoE layer straight from each external layout with the
plain LoRA formula (``x W^T + scaling * x A^T B^T`` per route, float64, Python loop over
routes), reading the tensors by their external names; the converted SideLoRA goes
through megamoe.reference.moe. Agreement means the key layout, the transposes and
the alpha scaling were all mapped right.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megamoe import adapter_convert as ac
from megamoe import reference
from megamoe.module import MegaMoE
from megamoe.side_lora import SideLoRA
from megamoe.testing.inputs import make_routing
from megamoe.weights import prepare_base_weights

H, I, E, K, R, T = 64, 64, 4, 2, 16, 12
F64 = torch.float64
P = "base_model.model.model.layers.3.mlp.experts"
MP = "decoder.layers.3.mlp.experts"
GATE, UP, DOWN = ac.PEFT_PROJECTIONS


def rand(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def make_side(rank=R, scale=0.5, shared_gate_up=False, dtype=F64, seed=0):
    a1 = rand(H, rank, seed=seed, scale=H**-0.5)
    a3 = a1.clone() if shared_gate_up else rand(H, rank, seed=seed + 1, scale=H**-0.5)
    return SideLoRA(
        a1.to(dtype),
        rand(E, rank, I, seed=seed + 2, scale=rank**-0.5).to(dtype),
        a3.to(dtype),
        rand(E, rank, I, seed=seed + 3, scale=rank**-0.5).to(dtype),
        rand(E, I, rank, seed=seed + 4, scale=I**-0.5).to(dtype),
        rand(rank, H, seed=seed + 5, scale=rank**-0.5).to(dtype),
        scale=scale,
    )


def assert_side_equal(a: SideLoRA, b: SideLoRA):
    assert a.scale == b.scale
    for name, x, y in zip(("a1", "b1", "a3", "b3", "a2", "b2"), a.tensors(), b.tensors()):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def assert_dict_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


class Layer:
    """Base weights (BF16-representable, kept in float64) and routed inputs."""

    def __init__(self, seed=0):
        bf = lambda t: t.to(torch.bfloat16).to(F64)  # noqa: E731
        self.w1 = bf(rand(E, I, H, seed=seed + 10, scale=H**-0.5))
        self.w3 = bf(rand(E, I, H, seed=seed + 11, scale=H**-0.5))
        self.w2 = bf(rand(E, H, I, seed=seed + 12, scale=I**-0.5))
        self.x = rand(T, H, seed=seed + 13)
        ids, weights = make_routing(T, E, K, kind="masked", seed=seed, masked_fraction=0.2)
        self.ids, self.weights = ids, weights.to(F64)

    def megamoe(self, side: SideLoRA) -> torch.Tensor:
        w13 = torch.cat([self.w1, self.w3], dim=1).float()  # exact: BF16 values
        base = prepare_base_weights(w13, self.w2.float())
        return reference.moe(self.x, self.ids, self.weights, base, side, compute_dtype=F64)

    def oracle(self, lora_gate, lora_up, lora_down) -> torch.Tensor:
        """``lora_*(e)`` -> ``(A [r, in], B [out, r], scaling)`` of expert ``e``."""
        out = torch.zeros(T, H, dtype=F64)
        for t in range(T):
            x = self.x[t]
            for k in range(K):
                e = int(self.ids[t, k])
                if e < 0:
                    continue

                g = _lora_linear(self.w1[e], *lora_gate(e), x)
                u = _lora_linear(self.w3[e], *lora_up(e), x)
                y = _lora_linear(self.w2[e], *lora_down(e), F.silu(g) * u)
                out[t] += self.weights[t, k] * y
        return out


def _lora_linear(w, a, b, scaling, v):
    """nn.Linear + LoRA on one vector: ``W v + scaling * B (A v)``."""
    return w @ v + scaling * (b.to(F64) @ (a.to(F64) @ v))


# ------------------------------------------------------------------------ PEFT modules


def peft_state(rank=R, seed=0, names=ac.PEFT_PROJECTIONS, shared_gate_up=False):
    """A shared-outer PEFT per-expert state dict (each expert has its own copy)."""
    gate, up, down = names
    a_gate = rand(rank, H, seed=seed, scale=H**-0.5)
    a_up = a_gate if shared_gate_up else rand(rank, H, seed=seed + 1, scale=H**-0.5)
    b_down = rand(H, rank, seed=seed + 2, scale=rank**-0.5)
    sd = {}
    for e in range(E):
        sd[f"{P}.{e}.{gate}.lora_A.weight"] = a_gate.clone()
        sd[f"{P}.{e}.{gate}.lora_B.weight"] = rand(I, rank, seed=seed + 10 + e, scale=rank**-0.5)
        sd[f"{P}.{e}.{up}.lora_A.weight"] = a_up.clone()
        sd[f"{P}.{e}.{up}.lora_B.weight"] = rand(I, rank, seed=seed + 20 + e, scale=rank**-0.5)
        sd[f"{P}.{e}.{down}.lora_A.weight"] = rand(rank, I, seed=seed + 30 + e, scale=I**-0.5)
        sd[f"{P}.{e}.{down}.lora_B.weight"] = b_down.clone()
    return sd


def peft_lora(sd, proj, scaling):
    return lambda e: (
        sd[f"{P}.{e}.{proj}.lora_A.weight"],
        sd[f"{P}.{e}.{proj}.lora_B.weight"],
        scaling,
    )


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_matches_the_lora_oracle(use_rslora):
    alpha = 24.0
    sd = peft_state()
    side = ac.side_lora_from_peft(sd, P, lora_alpha=alpha, use_rslora=use_rslora)
    scaling = alpha / (math.sqrt(R) if use_rslora else R)
    assert side.scale == scaling and side.dtype == F64 and side.rank == R
    layer = Layer()
    want = layer.oracle(peft_lora(sd, GATE, scaling), peft_lora(sd, UP, scaling),
                        peft_lora(sd, DOWN, scaling))  # fmt: skip
    torch.testing.assert_close(layer.megamoe(side), want, rtol=1e-12, atol=1e-12)


def test_peft_per_projection_alpha_and_rank_padding():
    # rank 8 (below megamoe's 16) and one alpha per projection: padded, scalings folded.
    sd = peft_state(rank=8, names=("w1", "w3", "w2"))
    alphas = {"w1": 16.0, "w3": 4.0, "w2": 8.0}
    with pytest.raises(ValueError, match="rank=<multiple of 16>"):
        ac.side_lora_from_peft(sd, P, lora_alpha=alphas, projections=("w1", "w3", "w2"))
    side = ac.side_lora_from_peft(sd, P, lora_alpha=alphas, projections=("w1", "w3", "w2"), rank=16)
    assert side.rank == 16 and side.scale == 2.0
    layer = Layer()
    want = layer.oracle(
        peft_lora(sd, "w1", 2.0), peft_lora(sd, "w3", 0.5), peft_lora(sd, "w2", 1.0)
    )
    torch.testing.assert_close(layer.megamoe(side), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", ["per_expert", "expert_agnostic"])
@pytest.mark.parametrize("adapter_name", [None, "default"])
def test_peft_round_trip_is_exact(shared, adapter_name):
    side = make_side(dtype=torch.bfloat16)
    sd, config = ac.side_lora_to_peft(side, P, shared=shared, adapter_name=adapter_name)
    assert config == {
        "r": R,
        "lora_alpha": side.scale * R,
        "use_rslora": False,
        "target_modules": list(ac.PEFT_PROJECTIONS),
    }
    suffix = f".{adapter_name}.weight" if adapter_name else ".weight"
    if shared == "expert_agnostic":
        assert sd[f"{P}.{GATE}.lora_A{suffix}"].shape == (1, R, H)
        assert sd[f"{P}.{DOWN}.lora_B{suffix}"].shape == (1, H, R)
    else:
        assert sd[f"{P}.3.{GATE}.lora_A{suffix}"].shape == (R, H)
    assert sd[f"{P}.0.{UP}.lora_B{suffix}"].shape == (I, R)
    assert sd[f"{P}.1.{DOWN}.lora_A{suffix}"].shape == (R, I)
    back = ac.side_lora_from_peft(sd, P, lora_alpha=config["lora_alpha"], adapter_name=adapter_name)
    assert_side_equal(back, side)
    # and PEFT -> megamoe -> PEFT
    sd2, _ = ac.side_lora_to_peft(back, P, shared=shared, adapter_name=adapter_name)
    assert_dict_equal(sd2, sd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_a_default_alpha_that_rounds_off_the_scale_moves_no_low_precision_bit(dtype):
    """``0.1 * 48 / 48`` is not ``0.1`` (no float64 alpha gives 0.1 at rank 48): the
    round trip's scale is PEFT's scaling, the same float32 as ``s``, and the expand
    factors are rescaled within a rounding of 1, which FP32 and BF16 factors do not
    feel. The module docstring said bit-exact without the condition (a review)."""
    side = make_side(rank=48, scale=0.1, dtype=dtype)
    sd, config = ac.side_lora_to_peft(side, P)
    back = ac.side_lora_from_peft(sd, P, lora_alpha=config["lora_alpha"])
    assert back.scale != side.scale and abs(back.scale - side.scale) <= 2**-52 * side.scale
    f32 = torch.tensor([back.scale, side.scale], dtype=torch.float64).float()
    assert f32[0] == f32[1]
    for name, x, y in zip(("a1", "b1", "a3", "b3", "a2", "b2"), back.tensors(), side.tensors()):
        assert x.dtype == y.dtype, name
        if dtype == F64:  # within a rounding
            torch.testing.assert_close(x, y, rtol=2**-51, atol=0.0)
        else:
            assert torch.equal(x, y), name


def test_peft_export_is_safetensors_friendly():
    sd, _ = ac.side_lora_to_peft(make_side(), P)
    pointers = [t.untyped_storage().data_ptr() for t in sd.values()]
    assert len(set(pointers)) == len(pointers)  # no shared storage
    assert all(t.is_contiguous() for t in sd.values())


def test_exports_of_transposed_views_share_no_storage_with_them():
    """A side built from PEFT-style factors as views (``a1 = a3 = A.T``, ``b2 = B.T``):
    every export copies, so a later in-place update of ``A`` or ``B`` leaves the export
    alone and safetensors (which refuses shared storage) can write it."""
    side = make_side(shared_gate_up=True)
    lora_a, lora_b = side.a1.T.contiguous(), side.b2.T.contiguous()
    views = SideLoRA(lora_a.T, side.b1, lora_a.T, side.b3, side.a2, lora_b.T, scale=side.scale)
    sources = {t.untyped_storage().data_ptr() for t in (lora_a, lora_b)}
    exports = {
        "peft expert_agnostic": ac.side_lora_to_peft(views, P, shared="expert_agnostic")[0],
        "peft per_expert": ac.side_lora_to_peft(views, P)[0],
        "peft fused": ac.side_lora_to_peft_fused(views, P)[0],
        "megatron": ac.side_lora_to_megatron(views, P)[0],
    }
    for form, sd in exports.items():
        pointers = [t.untyped_storage().data_ptr() for t in sd.values()]
        assert len(set(pointers)) == len(pointers), form
        assert not sources & set(pointers), form
        assert all(t.is_contiguous() for t in sd.values()), form


def test_peft_state_dict_round_trip_with_other_alpha():
    sd = peft_state()
    side = ac.side_lora_from_peft(sd, P, lora_alpha=32.0)
    back, config = ac.side_lora_to_peft(side, P, lora_alpha=32.0)
    assert config["lora_alpha"] == 32.0
    assert_dict_equal(back, sd)


def test_peft_expert_subset_for_expert_parallelism():
    sd = peft_state()
    full = ac.side_lora_from_peft(sd, P, lora_alpha=16.0)
    part = ac.side_lora_from_peft(sd, P, lora_alpha=16.0, experts=[2, 3])
    assert torch.equal(part.b1, full.b1[2:]) and torch.equal(part.a2, full.a2[2:])
    out, _ = ac.side_lora_to_peft(part, P, experts=[2, 3])
    assert f"{P}.2.{GATE}.lora_B.weight" in out and f"{P}.0.{GATE}.lora_B.weight" not in out
    # A repeated id would write (or read) one expert's factors twice and drop another's
    # without a word (a review): refused, naming it.
    distinct = r"^experts: expected distinct global ids, got \[2\] more than once"
    with pytest.raises(ValueError, match=distinct):
        ac.side_lora_to_peft(part, P, experts=[2, 2])
    with pytest.raises(ValueError, match=distinct):
        ac.side_lora_from_peft(sd, P, lora_alpha=16.0, experts=[2, 2])


def test_peft_rejects_non_identical_shared_factors():
    sd = peft_state()
    sd[f"{P}.2.{UP}.lora_A.weight"][0, 0] += 1e-3
    with pytest.raises(ValueError, match=rf"{P}\.2\.up_proj\.lora_A\.weight: the shared-outer"):
        ac.side_lora_from_peft(sd, P, lora_alpha=16.0)
    sd = peft_state()
    sd[f"{P}.1.{DOWN}.lora_B.weight"] = sd[f"{P}.1.{DOWN}.lora_B.weight"] * 2
    with pytest.raises(ValueError, match=rf"{P}\.1\.down_proj\.lora_B\.weight"):
        ac.side_lora_from_peft(sd, P, lora_alpha=16.0)


def test_converters_name_a_prefix_or_state_dict_of_the_wrong_kind():
    """``prefix=None`` gave ``'NoneType' object has no attribute 'rstrip'`` and a list
    state dict a missing-keys error (a review): each now a TypeError naming it."""
    sd, side = peft_state(), make_side()
    prefix = r"^prefix: expected a str \(the module's key prefix\), got NoneType"
    with pytest.raises(TypeError, match=prefix):
        ac.side_lora_from_peft(sd, None, lora_alpha=16.0)
    with pytest.raises(TypeError, match=prefix):
        ac.side_lora_to_peft(side, None)
    with pytest.raises(TypeError, match=prefix):
        ac.side_lora_from_megatron({}, None, alpha=8.0)
    mapping = r"^state_dict: expected a mapping of keys to tensors, got list"
    with pytest.raises(TypeError, match=mapping):
        ac.side_lora_from_peft(list(sd.values()), P, lora_alpha=16.0)
    with pytest.raises(TypeError, match=mapping):
        ac.side_lora_from_megatron([], "m", alpha=8.0)


def test_peft_rejects_agnostic_and_per_expert_copies_that_differ():
    sd = peft_state()
    sd[f"{P}.{GATE}.lora_A.weight"] = sd[f"{P}.0.{GATE}.lora_A.weight"].unsqueeze(0) + 1
    with pytest.raises(ValueError, match=rf"{P}\.0\.gate_proj\.lora_A\.weight"):
        ac.side_lora_from_peft(sd, P, lora_alpha=16.0)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda sd: sd.pop(f"{P}.2.{UP}.lora_B.weight"), r"2\.up_proj\.lora_B\.weight: missing"),
        (
            lambda sd: sd.pop(f"{P}.1.{GATE}.lora_A.weight"),
            r"1\.gate_proj\.lora_A\.weight: missing",
        ),
        (lambda sd: sd.update({f"{P}.0.{DOWN}.lora_magnitude_vector": torch.ones(H)}), "DoRA"),
        (lambda sd: sd.update({f"{P}.0.{DOWN}.lora_B.bias": torch.ones(H)}), "bias"),
        (lambda sd: sd.update({f"{P}.5.{DOWN}.lora_A.weight": torch.ones(R, I)}), "0..E-1"),
        (lambda sd: sd.update({f"{P}.1.{GATE}.lora_B.weight": torch.ones(I, 8)}), "gate_proj"),
        # One factor elsewhere: named, not torch.stack's RuntimeError (a review).
        (
            lambda sd: sd.update({f"{P}.1.{GATE}.lora_B.weight": torch.ones(I, R, device="meta")}),
            r"^\S+\.1\.gate_proj\.lora_B\.weight: expected device cpu .* got meta",
        ),
    ],
)
def test_peft_bad_state_dicts(edit, match):
    sd = peft_state()
    edit(sd)
    with pytest.raises(ValueError, match=match):
        ac.side_lora_from_peft(sd, P, lora_alpha=16.0)


def test_converted_adapter_loads_into_the_module():
    sd = peft_state()
    side = ac.side_lora_from_peft(sd, P, lora_alpha=32.0, dtype=torch.float32)
    layer = MegaMoE(H, I, E, K, side_rank=R, backend="reference", param_dtype=torch.float32)
    layer.load_side_lora(side)
    assert layer.side_scale == 2.0 and torch.equal(layer.a1, side.a1)


# ------------------------------------------------------------------ PEFT ParamWrapper


def peft_fused_state(rank=R, seed=0, down_rank=None, swap=False):
    """ParamWrapper tensors built from per-expert A_e/B_e with PEFT's packing."""
    down_rank = down_rank or rank
    a_gu = rand(rank, H, seed=seed, scale=H**-0.5)
    b_gu = [rand(2 * I, rank, seed=seed + 1 + e, scale=rank**-0.5) for e in range(E)]
    a_dn = [rand(down_rank, I, seed=seed + 10 + e, scale=I**-0.5) for e in range(E)]
    b_dn = rand(H, down_rank, seed=seed + 20, scale=down_rank**-0.5)
    gu = (torch.cat([a_gu] * E), torch.stack(b_gu, dim=2).reshape(2 * I, rank * E))
    dn = (torch.cat(a_dn), torch.stack([b_dn] * E, dim=2).reshape(H, down_rank * E))
    inner, outer = (dn, gu) if swap else (gu, dn)
    return {
        f"{P}.base_layer.lora_A.weight": inner[0],
        f"{P}.base_layer.lora_B.weight": inner[1],
        f"{P}.lora_A.weight": outer[0],
        f"{P}.lora_B.weight": outer[1],
    }


def peft_delta(a_packed, b_packed, scaling):
    """PEFT's ParamWrapper.get_delta_weight for a non-transposed [E, out, in] parameter."""
    a = a_packed.reshape(E, -1, a_packed.shape[-1])
    b = b_packed.reshape(b_packed.shape[0], -1, E)
    return torch.einsum("ore,eri->eoi", b, a) * scaling


@pytest.mark.parametrize("swap", [False, True])
def test_peft_fused_matches_merged_weights(swap):
    # Oracle: merge PEFT's delta into the base (W_e + delta_e) and run plain SwiGLU.
    alpha = 8.0
    sd = peft_fused_state(swap=swap)
    gu_key, dn_key = (f"{P}.lora", f"{P}.base_layer.lora") if swap else (
        f"{P}.base_layer.lora", f"{P}.lora")  # fmt: skip
    side = ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=alpha)
    assert torch.equal(side.a1, side.a3)
    layer = Layer()
    d13 = peft_delta(sd[f"{gu_key}_A.weight"], sd[f"{gu_key}_B.weight"], alpha / R)
    d2 = peft_delta(sd[f"{dn_key}_A.weight"], sd[f"{dn_key}_B.weight"], alpha / R)
    merged = Layer()
    merged.w1, merged.w3 = layer.w1 + d13[:, :I], layer.w3 + d13[:, I:]
    merged.w2 = layer.w2 + d2
    none = lambda e: (torch.zeros(1, H, dtype=F64), torch.zeros(H, 1, dtype=F64), 0.0)  # noqa: E731
    down_none = lambda e: (torch.zeros(1, I, dtype=F64), torch.zeros(H, 1, dtype=F64), 0.0)  # noqa: E731
    want = merged.oracle(none, none, down_none)
    torch.testing.assert_close(layer.megamoe(side), want, rtol=1e-11, atol=1e-11)


def test_peft_fused_round_trips():
    # a1 == a3: one A, rank r, bit-exact both ways.
    side = make_side(shared_gate_up=True)
    sd, config = ac.side_lora_to_peft_fused(side, P)
    assert config["r"] == R and sd[f"{P}.base_layer.lora_A.weight"].shape == (E * R, H)
    assert sd[f"{P}.base_layer.lora_B.weight"].shape == (2 * I, R * E)
    back = ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=config["lora_alpha"])
    assert_side_equal(back, side)
    assert_dict_equal(ac.side_lora_to_peft_fused(back, P)[0], sd)
    # a1 != a3: stacked rank 2r (down zero-padded), read back split at rank r.
    side = make_side(scale=0.25)
    sd, config = ac.side_lora_to_peft_fused(side, P)
    assert config["r"] == 2 * R and config["lora_alpha"] == 0.25 * 2 * R
    back = ac.side_lora_from_peft_fused(
        sd, P, num_experts=E, lora_alpha=config["lora_alpha"], split_gate_up=True, rank=R
    )
    assert_side_equal(back, side)
    # Split without rank=: read back at r too (the down pair's zero padding trimmed).
    back = ac.side_lora_from_peft_fused(
        sd, P, num_experts=E, lora_alpha=config["lora_alpha"], split_gate_up=True
    )
    assert_side_equal(back, side)
    # Without split/trim it is a different but equivalent rank-2r adapter.
    wide = ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=config["lora_alpha"])
    assert wide.rank == 2 * R
    layer = Layer()
    torch.testing.assert_close(layer.megamoe(wide), layer.megamoe(side), rtol=1e-12, atol=1e-12)


def test_peft_fused_reads_transformers4_conversion():
    # PEFT's transformers-5 conversion of per-expert gate/up LoRA: gate_up rank 2r with
    # A = [A_gate; A_up] and block-diagonal B; down stays rank r (its own scaling).
    side = make_side()
    sd, _ = ac.side_lora_to_peft_fused(side, P, lora_alpha=32.0)  # scaling 32/2r = 1
    a, b = sd[f"{P}.lora_A.weight"], sd[f"{P}.lora_B.weight"]
    a = a.reshape(E, 2 * R, I)[:, :R].reshape(E * R, I)
    # Drop down's zero padding; at rank r its scaling is 32/r = 2, so halve B to compensate.
    b = b.reshape(H, 2 * R, E)[:, :R].reshape(H, R * E) * 0.5
    sd.update({f"{P}.lora_A.weight": a, f"{P}.lora_B.weight": b})
    back = ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=32.0, split_gate_up=True)
    assert back.rank == R and back.scale == 1.0
    for name in ("a1", "a3", "a2"):
        assert torch.equal(getattr(back, name), getattr(side, name)), name
    for name in ("b1", "b3", "b2"):
        torch.testing.assert_close(
            getattr(back, name) * back.scale, getattr(side, name) * side.scale, rtol=0, atol=0
        )
    layer = Layer()
    torch.testing.assert_close(layer.megamoe(back), layer.megamoe(side), rtol=1e-12, atol=1e-12)


def test_peft_fused_rejects_per_expert_and_bad_split():
    sd = peft_fused_state()
    sd[f"{P}.base_layer.lora_A.weight"][R + 3, 5] += 1.0  # expert 1's A differs
    with pytest.raises(ValueError, match=r"base_layer\.lora_A\.weight \(expert 1\)"):
        ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=8.0)
    sd = peft_fused_state()
    sd[f"{P}.lora_B.weight"][:, 2 * E + 3] += 1.0  # rank 2 of expert 3 in down's B
    with pytest.raises(ValueError, match=r"experts\.lora_B\.weight \(expert 3\)"):
        ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=8.0)
    with pytest.raises(ValueError, match="split_gate_up"):
        ac.side_lora_from_peft_fused(
            peft_fused_state(), P, num_experts=E, lora_alpha=8.0, split_gate_up=True
        )
    with pytest.raises(ValueError, match=r"expected \[E\*r, in\] with E=3"):
        ac.side_lora_from_peft_fused(peft_fused_state(), P, num_experts=3, lora_alpha=8.0)
    sd = peft_fused_state()
    sd[f"{P}.lora_B.weight"] = torch.zeros(H + 64, R * E, dtype=F64)
    with pytest.raises(ValueError, match="do not look like gate_up_proj"):
        ac.side_lora_from_peft_fused(sd, P, num_experts=E, lora_alpha=8.0)


def test_peft_fused_gate_up_modes():
    side = make_side()
    with pytest.raises(ValueError, match="a1 == side.a3"):
        ac.side_lora_to_peft_fused(side, P, gate_up="shared")
    with pytest.raises(ValueError, match="gate_up"):
        ac.side_lora_to_peft_fused(side, P, gate_up="split")
    shared = make_side(shared_gate_up=True)
    _, config = ac.side_lora_to_peft_fused(shared, P, gate_up="stacked")
    assert config["r"] == 2 * R


# -------------------------------------------------------------------- Megatron-Bridge


def megatron_state(rank=R, seed=0):
    return {
        f"{MP}.linear_fc1.adapter.linear_in.weight": rand(rank, H, seed=seed, scale=H**-0.5),
        f"{MP}.linear_fc1.adapter.linear_out.weight": rand(E, 2 * I, rank, seed=seed + 1),
        f"{MP}.linear_fc2.adapter.linear_in.weight": rand(E, rank, I, seed=seed + 2, scale=I**-0.5),
        f"{MP}.linear_fc2.adapter.linear_out.weight": rand(H, rank, seed=seed + 3) * 0.1,
    }


def megatron_lora(sd, which, scaling):
    a = sd[f"{MP}.linear_fc{1 if which != 'down' else 2}.adapter.linear_in.weight"]
    b = sd[f"{MP}.linear_fc{1 if which != 'down' else 2}.adapter.linear_out.weight"]
    if which == "gate":
        return lambda e: (a, b[e, :I], scaling)
    if which == "up":
        return lambda e: (a, b[e, I:], scaling)
    return lambda e: (a[e], b, scaling)


def test_megatron_matches_the_lora_oracle():
    alpha = 32.0
    sd = megatron_state()
    side = ac.side_lora_from_megatron(sd, MP, alpha=alpha)
    assert side.scale == alpha / R and torch.equal(side.a1, side.a3)
    layer = Layer()
    s = alpha / R
    want = layer.oracle(megatron_lora(sd, "gate", s), megatron_lora(sd, "up", s),
                        megatron_lora(sd, "down", s))  # fmt: skip
    torch.testing.assert_close(layer.megamoe(side), want, rtol=1e-12, atol=1e-12)


def test_megatron_round_trips():
    sd = megatron_state()
    side = ac.side_lora_from_megatron(sd, MP, alpha=16.0)
    out, config = ac.side_lora_to_megatron(side, MP, alpha=16.0)
    assert config == {"dim": R, "alpha": 16.0, "experts_shared_outer_loras": True}
    assert_dict_equal(out, sd)
    # a1 != a3: stacked dim 2r, fc2 zero-padded; split + rank=r restores it exactly.
    side = make_side(dtype=torch.bfloat16, scale=0.75)
    out, config = ac.side_lora_to_megatron(side, MP)
    assert config["dim"] == 2 * R and config["alpha"] == 0.75 * 2 * R
    assert out[f"{MP}.linear_fc2.adapter.linear_out.weight"].shape == (H, 2 * R)
    back = ac.side_lora_from_megatron(out, MP, alpha=config["alpha"], split_gate_up=True, rank=R)
    assert_side_equal(back, side)
    with pytest.raises(ValueError, match="cannot trim"):
        ac.side_lora_from_megatron(out, MP, alpha=config["alpha"], rank=R)


def test_megatron_other_grouped_layouts():
    sd = megatron_state()
    side = ac.side_lora_from_megatron(sd, MP, alpha=16.0)
    # share_expert_adapters=False: every side 3D; the shared sides must be identical.
    per_expert = dict(sd)
    key_in = f"{MP}.linear_fc1.adapter.linear_in.weight"
    key_out = f"{MP}.linear_fc2.adapter.linear_out.weight"
    per_expert[key_in] = sd[key_in].expand(E, -1, -1).clone()
    per_expert[key_out] = sd[key_out].expand(E, -1, -1).clone()
    assert_side_equal(ac.side_lora_from_megatron(per_expert, MP, alpha=16.0), side)
    per_expert[key_out][2, 0, 0] += 1.0
    with pytest.raises(ValueError, match=r"linear_fc2\.adapter\.linear_out\.weight \(expert 2\)"):
        ac.side_lora_from_megatron(per_expert, MP, alpha=16.0)
    # share_expert_adapters=True: one adapter for all experts, broadcast.
    one = {k: (v[0] if v.dim() == 3 else v) for k, v in sd.items()}
    with pytest.raises(ValueError, match="num_experts"):
        ac.side_lora_from_megatron(one, MP, alpha=16.0)
    broadcast = ac.side_lora_from_megatron(one, MP, alpha=16.0, num_experts=E)
    assert broadcast.num_experts == E and torch.equal(broadcast.b1[3], side.b1[0])


def test_megatron_bad_inputs():
    sd = megatron_state()
    sd.pop(f"{MP}.linear_fc2.adapter.linear_in.weight")
    with pytest.raises(ValueError, match=r"linear_fc2\.adapter\.linear_in\.weight: missing"):
        ac.side_lora_from_megatron(sd, MP, alpha=16.0)
    sd = megatron_state()
    sd[f"{MP}.linear_fc1.adapter.linear_out.weight"] = torch.zeros(E, 2 * I, 2 * R, dtype=F64)
    with pytest.raises(
        ValueError, match=r"linear_fc1\.adapter\.linear_out\.weight: expected shape"
    ):
        ac.side_lora_from_megatron(sd, MP, alpha=16.0)
    with pytest.raises(ValueError, match="num_experts"):
        ac.side_lora_from_megatron(megatron_state(), MP, alpha=16.0, num_experts=E + 1)


def test_megatron_and_peft_agree():
    # One shared-outer adapter, two external layouts, one SideLoRA.
    side = make_side(shared_gate_up=True)
    mg, config = ac.side_lora_to_megatron(side, MP)
    pf, pconfig = ac.side_lora_to_peft(side, P)
    a = ac.side_lora_from_megatron(mg, MP, alpha=config["alpha"])
    b = ac.side_lora_from_peft(pf, P, lora_alpha=pconfig["lora_alpha"])
    assert_side_equal(a, b)


def test_lora_scaling():
    assert ac.lora_scaling(32, 16) == 2.0
    assert ac.lora_scaling(32, 16, use_rslora=True) == 8.0
    with pytest.raises(ValueError, match="rank"):
        ac.lora_scaling(32, 0)


def test_export_from_module_parameters_is_detached():
    layer = MegaMoE(H, I, E, K, side_rank=R, backend="reference", param_dtype=torch.float32)
    side = SideLoRA(*layer.adapter_parameters(), scale=layer.side_scale)
    for out, _ in (
        ac.side_lora_to_peft(side, P),
        ac.side_lora_to_peft_fused(side, P),
        ac.side_lora_to_megatron(side, MP),
    ):
        assert not any(t.requires_grad for t in out.values())


def test_the_widest_rank_splits_back_from_a_stacked_megatron_export():
    """r = 256: the stacked export is rank 512, beyond megamoe's; split, it reads back at
    256 without rank= (before, the down pair kept its zero padding: 512, refused)."""
    side = make_side(rank=256, scale=1.0, seed=5)
    state, config = ac.side_lora_to_megatron(side, MP)
    assert config["dim"] == 512  # a1 != a3: the stacked form
    back = ac.side_lora_from_megatron(
        state, MP, alpha=config["alpha"], num_experts=E, split_gate_up=True
    )
    assert back.rank == 256
    assert_side_equal(back, side)


def test_a_trim_drops_slots_that_contribute_nothing_slot_by_slot():
    """Rank slots whose shrink or expand factor is zero contribute nothing, even when
    the zeros sit in different factors for different slots: trimming them is exact."""
    side = make_side(rank=32, scale=0.5, shared_gate_up=True, seed=6)  # one A: rank 32
    tensors = dict(zip(("a1", "b1", "a3", "b3", "a2", "b2"), side.tensors(), strict=True))
    tensors["a3"] = tensors["a1"]  # (the same tensor: zeroed once below)
    tensors["a1"][:, 16:24] = 0  # shrink zero in slots 16..23
    for b in ("b1", "b3"):
        tensors[b][:, 24:32] = 0  # expand zero in slots 24..31
    tensors["a2"][..., 16:24] = 0
    tensors["b2"][24:32] = 0
    side = SideLoRA(*tensors.values(), scale=side.scale)
    state, config = ac.side_lora_to_megatron(side, MP)
    alpha = config["alpha"]
    trimmed = ac.side_lora_from_megatron(state, MP, alpha=alpha, num_experts=E, rank=16)
    wide = ac.side_lora_from_megatron(state, MP, alpha=alpha, num_experts=E)
    assert trimmed.rank == 16 and wide.rank == 32
    layer = Layer()
    torch.testing.assert_close(layer.megamoe(trimmed), layer.megamoe(wide), rtol=1e-12, atol=1e-12)
    tensors["a2"][..., 20] = 0.1  # slot 20: nonzero in both down factors now
    tensors["b2"][20] = 1.0
    state, _ = ac.side_lora_to_megatron(SideLoRA(*tensors.values(), scale=side.scale), MP)
    with pytest.raises(ValueError, match=r"rank slot 20 is nonzero in both LoRA factors"):
        ac.side_lora_from_megatron(state, MP, alpha=alpha, num_experts=E, rank=16)


def test_float16_factors_ask_for_a_dtype_and_convert_exactly_to_float32():
    """A checkpoint saved in float16 (SideLoRA itself holds BF16/FP32/FP64)."""
    side = make_side(scale=0.5, shared_gate_up=True, seed=8)
    state, config = ac.side_lora_to_megatron(side, MP)
    state = {k: v.to(torch.float16) for k, v in state.items()}
    with pytest.raises(ValueError, match=r"^dtype: the adapter's factors are torch.float16"):
        ac.side_lora_from_megatron(state, MP, alpha=config["alpha"], num_experts=E)
    back = ac.side_lora_from_megatron(
        state, MP, alpha=config["alpha"], num_experts=E, dtype=torch.float32
    )
    rounded = ac.side_lora_from_megatron(
        {k: v.to(F64) for k, v in state.items()}, MP, alpha=config["alpha"], num_experts=E
    )  # the float16 values, widened first
    for got, want in zip(back.tensors(), rounded.tensors(), strict=True):
        assert got.dtype == torch.float32 and torch.equal(got.double(), want)
