"""The torchtitan model converter (``megamoe.integrations.torchtitan``), on the CPU.

torchtitan's own ``RoutedExperts`` (its EP=1 token dispatcher + inner experts) is built
from a config, converted, and run with the converter's ``backend="reference"``
(megamoe's float32 reference behind the same module code as the fused backend). The
oracle is the routed-expert MLP written out in float64 from the module's parameters;
torchtitan's original ``GroupedExperts`` (BF16 ``torch._grouped_mm``) is checked
against the same oracle at BF16 accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

moe = pytest.importorskip("torchtitan.models.common.moe")
token_dispatcher = pytest.importorskip("torchtitan.models.common.token_dispatcher")
from megamoe.integrations import torchtitan as mtt  # noqa: E402

D, FF, E, K, T = 64, 64, 4, 2, 24


def routed_config():
    return moe.RoutedExperts.Config(
        inner_experts=moe.GroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E),
        token_dispatcher=token_dispatcher.LocalTokenDispatcher.Config(num_experts=E, top_k=K),
    )


def fill(module, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(torch.bfloat16))


def routing(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, T, D, generator=gen)).to(torch.bfloat16).float()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).view(1, T, K)
    scores = torch.rand(1, T, K, generator=gen)
    counts = torch.bincount(ids.view(-1), minlength=E)
    return x, scores, ids, counts


def oracle(experts, x, scores, ids):
    """sum_k score * MLP_e(x) (+ shared-outer side-LoRA) in float64."""
    p = {n: t.detach().double() for n, t in experts.named_parameters()}
    x, out = x.view(T, D).double(), torch.zeros(T, D, dtype=torch.float64)
    s = experts.scale
    for t in range(T):
        for k in range(K):
            e = int(ids.view(T, K)[t, k])
            g = x[t] @ p["w1_EFD"][e].T
            u = x[t] @ p["w3_EFD"][e].T
            if "a1" in p:
                g = g + s * (x[t] @ p["a1"]) @ p["b1"][e]
                u = u + s * (x[t] @ p["a3"]) @ p["b3"][e]
            h = F.silu(g) * u
            y = h @ p["w2_EDF"][e].T
            if "a2" in p:
                y = y + s * (h @ p["a2"][e]) @ p["b2"]
            out[t] += scores.view(T, K)[t, k].double() * y
    return out.view(1, T, D)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_converter_swaps_the_experts_and_keeps_their_parameters():
    config = mtt.MegaMoEConverter.Config(rank=16, alpha=32.0, backend="reference")
    converted = config.build().convert(routed_config())
    inner = converted.inner_experts
    assert isinstance(inner, mtt.MegaMoEGroupedExperts.Config)
    assert (inner.dim, inner.hidden_dim, inner.num_experts, inner.rank) == (D, FF, E, 16)
    module = converted.build()
    names = {n for n, _ in module.named_parameters()}
    assert {"inner_experts.w1_EFD", "inner_experts.w2_EDF", "inner_experts.w3_EFD"} <= names
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == {f"inner_experts.{n}" for n in ("a1", "b1", "a3", "b3", "a2", "b2")}
    assert module.inner_experts.scale == 2.0
    with pytest.raises(ValueError, match="no GroupedExperts"):
        config.build().convert(token_dispatcher.LocalTokenDispatcher.Config(num_experts=E, top_k=K))


@pytest.mark.parametrize("rank", [0, 16])
def test_converted_experts_match_the_float64_oracle(rank):
    original = routed_config().build()
    converter = mtt.MegaMoEConverter.Config(rank=rank, alpha=8.0, backend="reference").build()
    ours = converter.convert(routed_config()).build()
    fill(original)
    fill(ours)
    state = {k: v for k, v in original.state_dict().items()}
    ours.load_state_dict(state, strict=False)  # the base: same names, same values
    x, scores, ids, counts = routing()
    want = oracle(ours.inner_experts, x, scores, ids)
    x_ours = x.clone().requires_grad_(True)
    got = ours(x_ours, scores, ids, counts)
    assert rel(got, want) <= 1e-5
    # torchtitan's own experts (BF16 grouped_mm) agree at BF16 accuracy (no adapters).
    if rank == 0:
        assert rel(original(x, scores, ids, counts), want) <= 2e-2
    got.sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert x_ours.grad is not None
    if rank == 0:
        assert set(grads) == {f"inner_experts.{n}" for n in ("w1_EFD", "w2_EDF", "w3_EFD")}
        # The base gradient against autograd of the float64 oracle.
        params = [ours.inner_experts.w1_EFD, ours.inner_experts.w2_EDF, ours.inner_experts.w3_EFD]
        leaves = [p.detach().double().requires_grad_(True) for p in params]

        oracle_out = _differentiable_oracle(leaves, x, scores, ids)
        oracle_out.sum().backward()
        for p, leaf in zip(params, leaves, strict=True):
            assert rel(p.grad, leaf.grad) <= 4e-3  # BF16-rounded base gradient


def _differentiable_oracle(leaves, x, scores, ids):
    w1, w2, w3 = leaves
    x = x.view(T, D).double()
    out = torch.zeros(T, D, dtype=torch.float64)
    for k in range(K):
        e = ids.view(T, K)[:, k]
        h = F.silu(torch.einsum("td,tfd->tf", x, w1[e])) * torch.einsum("td,tfd->tf", x, w3[e])
        out = out + scores.view(T, K)[:, k, None].double() * torch.einsum("tf,tdf->td", h, w2[e])
    return out


def test_rows_past_the_counts_are_masked():
    experts = mtt.MegaMoEGroupedExperts.Config(
        dim=D, hidden_dim=FF, num_experts=E, backend="reference"
    ).build()
    fill(experts)
    x = torch.randn(10, D)
    counts = torch.tensor([3, 0, 4, 1])  # 8 rows; rows 8, 9 are padding
    out = experts(x, counts)
    assert torch.equal(out[8:], torch.zeros(2, D))
    single = experts(x[3:7], torch.tensor([0, 0, 4, 0]))
    assert torch.allclose(out[3:7], single, rtol=1e-6, atol=1e-6)


def test_bad_options():
    with pytest.raises(ValueError, match="rank"):
        mtt.MegaMoEGroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E, rank=8).build()
    with pytest.raises(ValueError, match="backend"):
        mtt.MegaMoEConverter.Config(backend="cuda").build()
