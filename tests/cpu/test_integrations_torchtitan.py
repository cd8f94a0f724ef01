"""The torchtitan model converter (``megamoe.integrations.torchtitan``), on the CPU.

torchtitan's own ``RoutedExperts`` (its EP=1 token dispatcher + inner experts) is built
from a config, converted, and run with the converter's ``backend="reference"``
(megamoe's float32 reference behind the same module code as the fused backend). The
oracle is the routed-expert MLP written out in float64 from the module's parameters;
torchtitan's original ``GroupedExperts`` (BF16 ``torch._grouped_mm``) is checked
against the same oracle at BF16 accuracy.
"""

from __future__ import annotations

from functools import partial

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
    p = {n: t.detach().double() for n, t in experts.state_dict().items()}  # w1/w3 views
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
    assert {"inner_experts.w13_E2FD", "inner_experts.w2_EDF"} <= names
    assert module.inner_experts.w13_E2FD.shape == (E, 2, FF, D)
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
    result = ours.load_state_dict(state, strict=False)  # the base: stock names, merged
    assert not result.unexpected_keys
    adapters = mtt._ADAPTER_NAMES if rank else ()
    assert set(result.missing_keys) == {f"inner_experts.{n}" for n in adapters}
    w1, w3 = ours.inner_experts.gate_up_views()
    assert torch.equal(w1, original.inner_experts.w1_EFD)
    assert torch.equal(w3, original.inner_experts.w3_EFD)
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
        assert set(grads) == {f"inner_experts.{n}" for n in ("w13_E2FD", "w2_EDF")}
        # The base gradient against autograd of the float64 oracle.
        params = [ours.inner_experts.w13_E2FD, ours.inner_experts.w2_EDF]
        leaves = [p.detach().double().requires_grad_(True) for p in params]

        oracle_out = _differentiable_oracle(leaves, x, scores, ids)
        oracle_out.sum().backward()
        for p, leaf in zip(params, leaves, strict=True):
            assert rel(p.grad, leaf.grad) <= 4e-3  # BF16-rounded base gradient


def _differentiable_oracle(leaves, x, scores, ids):
    w13, w2 = leaves
    w1, w3 = w13[:, 0], w13[:, 1]
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


# --- One gate+up parameter: checkpoint names, init, sharding, no copy -------------------

_INIT = {  # trunc_normal_ draws differently on a strided view than on a contiguous tensor
    "w1_EFD": partial(torch.nn.init.trunc_normal_, std=0.02),
    "w2_EDF": partial(torch.nn.init.trunc_normal_, std=0.03),
    "w3_EFD": partial(torch.nn.init.trunc_normal_, std=0.05),
}


def experts_pair(rank: int = 0, param_init=None, **kwargs):
    """A stock ``GroupedExperts`` and a ``MegaMoEGroupedExperts`` with the same dims."""
    dims = dict(dim=D, hidden_dim=FF, num_experts=E, param_init=param_init, **kwargs)
    stock = moe.GroupedExperts.Config(**dims).build()
    ours = mtt.MegaMoEGroupedExperts.Config(**dims, rank=rank, backend="reference").build()
    return stock, ours


def test_state_dict_has_the_stock_names_as_views_of_the_one_parameter():
    stock, ours = experts_pair()
    fill(ours)
    assert [n for n, _ in ours.named_parameters()] == ["w2_EDF", "w13_E2FD"]
    state = ours.state_dict()
    assert list(state) == list(stock.state_dict())  # w1_EFD, w2_EDF, w3_EFD, same order
    w13 = ours.w13_E2FD
    for name, half in (("w1_EFD", 0), ("w3_EFD", 1)):
        assert torch.equal(state[name], w13[:, half])
        assert state[name].untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
    with torch.no_grad():  # writes through, as a DCP load into the cached dict does
        state["w3_EFD"].fill_(7.0)
    assert bool((w13[:, 1] == 7.0).all()) and not bool((w13[:, 0] == 7.0).any())
    _, adapted = experts_pair(rank=16)
    assert list(adapted.state_dict()) == [*stock.state_dict(), *mtt._ADAPTER_NAMES]


def test_strict_round_trips_with_the_stock_experts():
    stock, ours = experts_pair()
    fill(stock, seed=3)
    ours.load_state_dict(stock.state_dict(), strict=True)
    w1, w3 = ours.gate_up_views()
    assert torch.equal(w1, stock.w1_EFD) and torch.equal(w3, stock.w3_EFD)
    assert torch.equal(ours.w2_EDF, stock.w2_EDF)
    fill(ours, seed=4)
    back = moe.GroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E).build()
    back.load_state_dict(ours.state_dict(), strict=True)
    for name, t in ours.state_dict().items():
        assert torch.equal(getattr(back, name), t)
    # A native w13_E2FD key loads too; a half alone is an error.
    again = experts_pair()[1]
    again.load_state_dict({"w13_E2FD": ours.w13_E2FD, "w2_EDF": ours.w2_EDF}, strict=True)
    assert torch.equal(again.w13_E2FD, ours.w13_E2FD)
    with pytest.raises(RuntimeError, match="must be loaded together"):
        again.load_state_dict({"w1_EFD": stock.w1_EFD, "w2_EDF": stock.w2_EDF}, strict=False)


def test_model_wrapper_cache_aliases_the_parameter_and_loads_without_a_stack(monkeypatch):
    base = pytest.importorskip("torchtitan.components.checkpointer.base")
    module = routed_config()
    module = mtt.MegaMoEConverter.Config(backend="reference").build().convert(module).build()
    fill(module)
    wrapper = base.ModelWrapper(module)
    first = wrapper.state_dict()
    w13 = module.inner_experts.w13_E2FD
    for key in ("inner_experts.w1_EFD", "inner_experts.w3_EFD"):
        assert first[key].untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
    # A second state_dict() refreshes by copy only what no longer shares storage: the
    # gate/up views must share it (no refresh copies).
    shared = []
    real = base._shares_storage
    monkeypatch.setattr(
        base, "_shares_storage", lambda a, b: shared.append(real(a, b)) or shared[-1]
    )
    assert wrapper.state_dict() is first
    assert shared and all(shared)
    monkeypatch.setattr(base, "_shares_storage", real)
    with torch.no_grad():
        first["inner_experts.w1_EFD"].fill_(0.5)  # what dcp.load does in place

    def no_stack(*args, **kwargs):
        raise AssertionError("torch.stack called on an aliasing load")

    monkeypatch.setattr(mtt.torch, "stack", no_stack)
    wrapper.load_state_dict(first)
    assert bool((w13[:, 0] == 0.5).all())


def test_dcp_save_and_load_across_stock_and_megamoe(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    base = pytest.importorskip("torchtitan.components.checkpointer.base")
    stock, ours = experts_pair()
    fill(ours, seed=5)
    dcp.save(base.ModelWrapper(ours).state_dict(), checkpoint_id=str(tmp_path / "ours"))
    target = base.ModelWrapper(stock)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ours"))
    target.load_state_dict(state)
    for name, t in ours.state_dict().items():
        assert torch.equal(getattr(stock, name), t)
    fill(stock, seed=6)
    dcp.save(base.ModelWrapper(stock).state_dict(), checkpoint_id=str(tmp_path / "stock"))
    fresh = experts_pair()[1]
    target = base.ModelWrapper(fresh)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "stock"))
    target.load_state_dict(state)
    assert torch.equal(fresh.w13_E2FD, torch.stack([stock.w1_EFD, stock.w3_EFD], dim=1))


def _qwen3_experts_config(*, enable_ep: bool | None, rank: int = 0):
    """qwen3 ``debugmodel_moe``'s converted inner-experts config (optionally with the
    sharding ``update_from_config`` sets)."""
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    converter = mtt.MegaMoEConverter.Config(rank=rank, backend="reference")
    config = qwen3.model_registry("debugmodel_moe", converters=[converter]).model
    if enable_ep is not None:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=True, enable_ep=enable_ep)
    found = [cfg for _, cfg, _, _ in config.traverse(moe.GroupedExperts.Config)]
    assert found and all(isinstance(c, mtt.MegaMoEGroupedExperts.Config) for c in found)
    return found[0]


def test_seeded_init_matches_the_stock_experts():
    qwen3_init = _qwen3_experts_config(enable_ep=None).param_init
    assert set(qwen3_init) == {"w1_EFD", "w2_EDF", "w3_EFD"}
    for param_init in (qwen3_init, _INIT):
        stock, ours = experts_pair(param_init=param_init)
        torch.manual_seed(0)
        stock.init_states()
        torch.manual_seed(0)
        ours.init_states()
        w1, w3 = ours.gate_up_views()
        assert torch.equal(w1, stock.w1_EFD)
        assert torch.equal(ours.w2_EDF, stock.w2_EDF)
        assert torch.equal(w3, stock.w3_EFD)
    _, adapted = experts_pair(rank=16, param_init=_INIT)
    adapted.init_states()  # the adapters: shrink factors uniform, expand factors zero
    assert adapted.a2.abs().max() <= 1.0 / FF**0.5 and not adapted.b2.any()


def test_forward_passes_the_parameter_itself(monkeypatch):
    _, ours = experts_pair()
    fill(ours)
    seen = {}
    real = mtt.prepare_base_weights

    def capture(w13, w2, *args, **kwargs):
        seen["w13"] = w13
        return real(w13, w2, *args, **kwargs)

    monkeypatch.setattr(mtt, "prepare_base_weights", capture)
    ours(torch.randn(8, D), torch.tensor([2, 2, 2, 2]))
    w13 = seen["w13"]
    assert w13.data_ptr() == ours.w13_E2FD.data_ptr()
    assert tuple(w13.shape) == (E, 2 * FF, D)


@pytest.mark.parametrize("enable_ep", [True, False])
def test_sharding_entry_is_derived_from_w1s_layout(enable_ep):
    moe_sharding = pytest.importorskip("torchtitan.models.common.moe_sharding")
    spmd = pytest.importorskip("spmd_types")
    from types import SimpleNamespace

    config = _qwen3_experts_config(enable_ep=enable_ep)
    stock_shardings = config.sharding_config.state_shardings
    assert set(stock_shardings) == {"w1_EFD", "w2_EDF", "w3_EFD"}  # as update_from_config sets
    with torch.device("meta"):
        module = config.build()
    shardings = module._sharding_config.state_shardings
    assert set(shardings) == {"w13_E2FD", "w2_EDF"}
    assert shardings["w2_EDF"] == stock_shardings["w2_EDF"]
    if enable_ep:  # EP: S(0) on the experts, unchanged
        stock_w1 = want = moe_sharding.expert_param_placement_sparse()
    else:  # TP colwise: the F dim, S(1) on [E, F, D] -> S(2) on [E, 2, F, D]
        stock_w1 = moe_sharding.expert_param_placement_dense(tp_placement=spmd.S(1))
        want = moe_sharding.expert_param_placement_dense(tp_placement=spmd.S(2))
    assert stock_shardings["w1_EFD"] == stock_w1 == stock_shardings["w3_EFD"]
    assert shardings["w13_E2FD"] == want
    # Every own parameter has an entry (parallelize's check), with no mesh to distribute on.
    module._distribute_states(
        SimpleNamespace(spmd_backend="partial_dtensor", resolve_mesh=lambda axes: None)
    )


def test_side_lora_under_parallelize_is_refused():
    from types import SimpleNamespace

    config = _qwen3_experts_config(enable_ep=True, rank=16)
    with torch.device("meta"):
        module = config.build()
    dims = SimpleNamespace(spmd_backend="partial_dtensor", resolve_mesh=lambda axes: None)
    with pytest.raises(ValueError, match="side-LoRA adapters are not supported under torchtitan"):
        module.parallelize(dims)
    # Without a sharding_config (a module that is not parallelized) rank > 0 works.
    plain = experts_pair(rank=16)[1]
    plain.parallelize(dims)


@pytest.fixture
def one_rank_mesh(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def test_dtensor_views_init_loads_and_the_gate_up_shard_guard(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = one_rank_mesh

    def distributed(module, placements):
        for name, p in list(module.named_parameters()):
            dt = distribute_tensor(p.detach(), mesh, [placements[name]])
            module.register_parameter(name, torch.nn.Parameter(dt))
        return module

    # EP (Shard 0) and TP (Shard 2 on [E, 2, F, D] = the stock w1's Shard 1).
    for w13_shard, w1_shard in ((0, 0), (2, 1)):
        stock, ours = experts_pair(param_init=_INIT)
        fill(stock, seed=7)
        w2_shard = 0 if w13_shard == 0 else 2
        ours = distributed(ours, {"w13_E2FD": Shard(w13_shard), "w2_EDF": Shard(w2_shard)})
        dstock = distributed(
            stock, {"w1_EFD": Shard(w1_shard), "w3_EFD": Shard(w1_shard), "w2_EDF": Shard(w2_shard)}
        )
        torch.manual_seed(0)
        ours.init_states()  # writes through the DTensor halves
        assert bool((ours.w13_E2FD.to_local()[:, 1] != 0).all())
        state = ours.state_dict()
        assert isinstance(state["w1_EFD"], DTensor)
        assert tuple(state["w1_EFD"].placements) == (Shard(w1_shard),)
        assert mtt._aliases(state["w1_EFD"], ours.w13_E2FD, 0)
        assert mtt._aliases(state["w3_EFD"], ours.w13_E2FD, 1)
        ours.load_state_dict(state, strict=True)  # the aliasing path
        ours.load_state_dict(dstock.state_dict(), strict=True)  # the stack path
        w1, w3 = ours.gate_up_views()
        assert torch.equal(w1.full_tensor(), dstock.w1_EFD.full_tensor())
        assert torch.equal(w3.full_tensor(), dstock.w3_EFD.full_tensor())
        out = ours(torch.randn(8, D), torch.tensor([2, 2, 2, 2]))
        assert torch.isfinite(out).all()
    # FSDP's Shard(1) fallback would shard the size-2 gate/up axis: refused.
    _, ours = experts_pair(param_init=_INIT)
    ours = distributed(ours, {"w13_E2FD": Shard(1), "w2_EDF": Shard(0)})
    with pytest.raises(ValueError, match="sharded on dim 1"):
        ours.init_states()
