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
from megamoe.side_lora import SIDE_NAMES  # noqa: E402

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
    adapters = SIDE_NAMES if rank else ()
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


@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_an_ep_rank_with_no_rows(backend, rank):
    """torchtitan's all-to-all dispatcher can send a rank no rows. The fused backend
    raised there ("x: expected at least one token": the layer call refuses T = 0 outside
    megamoe's EP path), leaving the other ranks in the combine (a review). Now both
    backends give [0, D] and zero gradients to every weight, adapter and x, so the
    gradient reductions match the ranks with rows (no GPU needed: nothing launches)."""
    experts = mtt.MegaMoEGroupedExperts.Config(
        dim=D, hidden_dim=FF, num_experts=E, rank=rank, alpha=32.0, backend=backend
    ).build()
    fill(experts)
    x = torch.randn(0, D, requires_grad=True)
    out = experts(x, torch.zeros(E, dtype=torch.int32))
    assert out.shape == (0, D) and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, D)
    trained = {n: p for n, p in experts.named_parameters() if p.requires_grad}
    assert len(trained) == (2 if rank == 0 else 6)  # the base, or the six adapters
    for name, p in trained.items():
        assert p.grad is not None and not p.grad.any(), name


def test_the_fused_backend_on_cpu_names_the_reference_backend():
    """On CPU weights the fused backend failed in mm.moe with a pointer to
    megamoe.reference.moe, which a torchtitan user does not call (a review): the
    converter's own option is named."""
    experts = mtt.MegaMoEGroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E).build()
    fill(experts)
    counts = torch.full((E,), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^backend: .* backend='reference'"):
        experts(torch.randn(2 * E, D), counts)


def test_bad_options():
    with pytest.raises(ValueError, match="rank"):
        mtt.MegaMoEGroupedExperts.Config(dim=D, hidden_dim=FF, num_experts=E, rank=8).build()
    # Sizes the kernels cannot take fail at build, not at the first forward (after
    # sharding and the checkpoint load; a review).
    with pytest.raises(ValueError, match=r"^hidden_dim: expected a multiple of 64 .* got 96"):
        mtt.MegaMoEGroupedExperts.Config(dim=D, hidden_dim=96, num_experts=E).build()
    with pytest.raises(ValueError, match=r"^dim: expected a multiple of 64 .* got 80"):
        mtt.MegaMoEGroupedExperts.Config(dim=80, hidden_dim=FF, num_experts=E).build()
    with pytest.raises(ValueError, match="backend"):
        mtt.MegaMoEConverter.Config(backend="cuda").build()
    # An alpha the adapters cannot take, named at build as attach_side_lora names it
    # (it reached the first forward as side.scale, or as an unnamed TypeError; a review).
    bad_alphas = (
        (float("nan"), ValueError, r"^alpha: expected a finite float, got nan"),
        (float("inf"), ValueError, r"^alpha: expected a finite float, got inf"),
        (1e40, ValueError, r"^scale \(alpha / rank\): expected a float finite in float32"),
        ("2", TypeError, r"^alpha: expected a float, got str"),
    )
    for alpha, kind, message in bad_alphas:
        with pytest.raises(kind, match=message):
            mtt.MegaMoEGroupedExperts.Config(
                dim=D, hidden_dim=FF, num_experts=E, rank=16, alpha=alpha
            ).build()


def test_subclassed_experts_are_refused_not_converted():
    """gpt-oss's experts config subclasses GroupedExperts.Config (biases, interleaved
    gate/up, its own clamped gate): the converter refuses it instead of swapping in
    plain SwiGLU experts."""
    gpt_oss = pytest.importorskip("torchtitan.models.gpt_oss")
    converter = mtt.MegaMoEConverter.Config(backend="reference")
    with pytest.raises(ValueError, match=r"GptOssGroupedExperts\.Config, not GroupedExperts"):
        gpt_oss.model_registry("debugmodel", converters=[converter])


@pytest.mark.parametrize("module,factory", [
    ("float8", "_get_float8_grouped_experts_cls"),
    ("mx", "_get_mxfp8_grouped_experts_cls"),
])  # fmt: skip
def test_a_quantization_converter_after_megamoe_is_refused(module, factory):
    """torchtitan's Float8 / MXFP8 grouped-experts converters subclass the experts they
    find (megamoe's too: a GroupedExperts) to quantize their grouped_mm, which megamoe
    never calls: the quantization would silently not apply. The subclass is refused as it
    is made; in the other order megamoe refuses the quantized experts config."""
    quantization = pytest.importorskip(f"torchtitan.components.quantization.{module}")
    from torchtitan.models.common import moe as titan_moe

    make_subclass = getattr(quantization, factory)
    expected = rf"^converters: a quantization converter of {quantization.__name__} after Mega"
    with pytest.raises(ValueError, match=expected):
        make_subclass(mtt.MegaMoEGroupedExperts)
    quantized = make_subclass(titan_moe.GroupedExperts).Config(dim=D, hidden_dim=FF, num_experts=E)
    refused = rf"^model_config: the root was quantized by a converter of {quantization.__name__}"
    with pytest.raises(ValueError, match=refused):
        mtt.MegaMoEConverter(mtt.MegaMoEConverter.Config(backend="reference")).convert(quantized)


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
    assert list(adapted.state_dict()) == [*stock.state_dict(), *SIDE_NAMES]


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


@pytest.mark.parametrize("rank", [0, 16])
@pytest.mark.parametrize("enable_ep", [True, False])
def test_sharding_entry_is_derived_from_w1s_layout(enable_ep, rank):
    moe_sharding = pytest.importorskip("torchtitan.models.common.moe_sharding")
    spmd = pytest.importorskip("spmd_types")
    from types import SimpleNamespace

    config = _qwen3_experts_config(enable_ep=enable_ep, rank=rank)
    stock_shardings = config.sharding_config.state_shardings
    assert set(stock_shardings) == {"w1_EFD", "w2_EDF", "w3_EFD"}  # as update_from_config sets
    with torch.device("meta"):
        module = config.build()
    shardings = module._sharding_config.state_shardings
    assert set(shardings) == {"w13_E2FD", "w2_EDF", *(SIDE_NAMES if rank else ())}
    assert shardings["w2_EDF"] == stock_shardings["w2_EDF"]
    if enable_ep:  # EP: S(0) on the experts, unchanged
        stock_w1 = want = moe_sharding.expert_param_placement_sparse()
    else:  # TP colwise: the F dim, S(1) on [E, F, D] -> S(2) on [E, 2, F, D]
        stock_w1 = moe_sharding.expert_param_placement_dense(tp_placement=spmd.S(1))
        want = moe_sharding.expert_param_placement_dense(tp_placement=spmd.S(2))
    assert stock_shardings["w1_EFD"] == stock_w1 == stock_shardings["w3_EFD"]
    assert shardings["w13_E2FD"] == want
    if rank:  # per-expert factors sharded as the base (b1/b3 [E, r, F], a2 [E, F, r]),
        # shared factors replicated, on every axis of the base's layout
        if enable_ep:
            per_expert = {
                n: moe_sharding.expert_param_placement_sparse() for n in ("b1", "b3", "a2")
            }
            sparse = moe_sharding.expert_param_placement_sparse()
            shared = type(sparse)({axis: spmd.R for axis in sparse.axis_types})
        else:
            dense = moe_sharding.expert_param_placement_dense
            per_expert = {
                "b1": dense(tp_placement=spmd.S(2)),
                "b3": dense(tp_placement=spmd.S(2)),
                "a2": dense(tp_placement=spmd.S(1)),
            }
            shared = dense(tp_placement=spmd.R)
        for name in SIDE_NAMES:
            assert shardings[name] == per_expert.get(name, shared), name
    # Every own parameter has an entry (parallelize's check), with no mesh to distribute on.
    dims = SimpleNamespace(spmd_backend="partial_dtensor", resolve_mesh=lambda axes: None)
    module._distribute_states(dims)
    module.parallelize(dims)


@pytest.mark.parametrize("backend", ["spmd_types", "full_dtensor"])
def test_side_lora_under_parallelize_needs_the_partial_dtensor_backend(backend):
    from types import SimpleNamespace

    config = _qwen3_experts_config(enable_ep=True, rank=16)
    with torch.device("meta"):
        module = config.build()
    dims = SimpleNamespace(spmd_backend=backend, resolve_mesh=lambda axes: None)
    with pytest.raises(ValueError, match="spmd_backend='partial_dtensor'"):
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


# --- Two gloo processes: TP / EP layouts, stock interchange, FSDP2 ----------------------
#
# Every rank builds the full gate/up/down tensors from the same seed; the assertions
# compare the sharded module against slices of those and against a float64 autograd
# oracle written out here (not against the module's own views or loaders).

WORLD = 2
FF2 = 128  # the hidden dim here: a TP rank's F/2 = 64 is still a multiple of 64


def _bf16_values(t: torch.Tensor) -> torch.Tensor:
    """FP32 holding BF16 values: megamoe computes from BF16 weights and rows."""
    return t.to(torch.bfloat16).float()


def _full_weights(seed: int):
    """``(w1 [E, F, D], w3 [E, F, D], w2 [E, D, F])``, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((E, FF2, D), (E, FF2, D), (E, D, FF2))
    return tuple(_bf16_values(torch.randn(s, generator=gen) * 0.2) for s in shapes)


def _oracle_grads(w1, w3, w2, batches):
    """``sum over (x, ids) in batches`` of the SwiGLU experts in float64: the outputs
    and the gradients of the sum of all outputs wrt ``(w1, w3, w2)``."""
    leaves = [w.double().requires_grad_(True) for w in (w1, w3, w2)]
    outs = []
    for x, ids in batches:
        x = x.double()
        g = torch.einsum("nd,nfd->nf", x, leaves[0][ids])
        u = torch.einsum("nd,nfd->nf", x, leaves[1][ids])
        outs.append(torch.einsum("nf,ndf->nd", F.silu(g) * u, leaves[2][ids]))
    sum(o.sum() for o in outs).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _rows(seed: int, counts: list[int], first_expert: int = 0):
    """Rows sorted by expert (as torchtitan's dispatchers hand them) and their global ids."""
    gen = torch.Generator().manual_seed(seed)
    x = _bf16_values(torch.randn(sum(counts), D, generator=gen))
    ids = torch.repeat_interleave(torch.arange(len(counts)) + first_expert, torch.tensor(counts))
    return x, ids, torch.tensor(counts)


def _assert_rel(actual, expected, tol=1e-5, what=""):
    err = rel(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol:g}"


def _qwen3_inner(*, enable_ep: bool, converted: bool, rank: int = 0):
    """qwen3 ``debugmodel_moe``'s inner-experts config with the sharding torchtitan's
    ``update_from_config`` sets (stock, or converted to megamoe with side-LoRA of
    ``rank``), resized to D/FF/E."""
    import dataclasses

    from torchtitan.models import qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    converter = mtt.MegaMoEConverter.Config(backend="reference", rank=rank, alpha=2.0 * rank)
    converters = [converter] if converted else []
    config = qwen3.model_registry("debugmodel_moe", converters=converters).model
    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=enable_ep)
    inner = next(cfg for _, cfg, _, _ in config.traverse(moe.GroupedExperts.Config))
    assert isinstance(inner, mtt.MegaMoEGroupedExperts.Config) == converted
    return dataclasses.replace(inner, dim=D, hidden_dim=FF2, num_experts=E, param_init=_INIT)


def _built(config, mesh, weights=None, side=None):
    """Build, fill with the full ``weights`` (or zeros) and side-LoRA factors ``side``
    (a dict by name), distribute per sharding_config."""
    from types import SimpleNamespace

    module = config.build()
    with torch.no_grad():
        if weights is None:
            for p in module.parameters():
                p.zero_()
        elif isinstance(module, mtt.MegaMoEGroupedExperts):
            module.w13_E2FD.copy_(torch.stack([weights[0], weights[1]], dim=1))
            module.w2_EDF.copy_(weights[2])
        else:
            module.w1_EFD.copy_(weights[0])
            module.w3_EFD.copy_(weights[1])
            module.w2_EDF.copy_(weights[2])
        for name, value in (side or {}).items():
            getattr(module, name).copy_(value)
    # torchtitan's Module.parallelize distributes the parameters with this call.
    module._distribute_states(
        SimpleNamespace(spmd_backend="partial_dtensor", resolve_mesh=lambda axes: mesh)
    )
    return module


def _layout_worker(rank: int, world: int, axis: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    ep = axis == "ep"
    w1, w3, w2 = weights = _full_weights(seed=11)
    ours = _built(_qwen3_inner(enable_ep=ep, converted=True), mesh, weights)
    stock = _built(_qwen3_inner(enable_ep=ep, converted=False), mesh, weights)

    # The placements torchtitan's stock layout gives, and the shifted one for w13.
    want13, want1, want2 = (Shard(0),) * 3 if ep else (Shard(2), Shard(1), Shard(2))
    assert tuple(ours.w13_E2FD.placements) == (want13,)
    assert tuple(ours.w2_EDF.placements) == (want2,)
    assert tuple(stock.w1_EFD.placements) == (want1,) == tuple(stock.w3_EFD.placements)
    assert tuple(stock.w2_EDF.placements) == (want2,)

    # This rank's local [E_l, 2F_l, D]: its gate rows, then the same slice's up rows.
    e_l, f_l = (E // world, FF2) if ep else (E, FF2 // world)
    es = slice(rank * e_l, (rank + 1) * e_l) if ep else slice(None)
    fs = slice(None) if ep else slice(rank * f_l, (rank + 1) * f_l)
    local13 = ours.w13_E2FD.to_local()
    assert tuple(local13.shape) == (e_l, 2, f_l, D)
    want_local13 = torch.cat([w1[es, fs], w3[es, fs]], dim=1)
    assert torch.equal(local13.view(e_l, 2 * f_l, D), want_local13)
    want_local2 = w2[es] if ep else w2[:, :, fs]
    assert torch.equal(ours.w2_EDF.to_local(), want_local2)

    # The state dict: stock keys, DTensor views with the stock module's placements.
    state, stock_state = ours.state_dict(), stock.state_dict()
    assert list(state) == list(stock_state) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    for name, full in (("w1_EFD", w1), ("w3_EFD", w3), ("w2_EDF", w2)):
        got, ref = state[name], stock_state[name]
        assert isinstance(got, DTensor), name
        assert tuple(got.placements) == tuple(ref.placements), name
        assert tuple(got.shape) == tuple(ref.shape) == tuple(full.shape), name
        assert torch.equal(got.to_local(), ref.to_local()), name
        assert torch.equal(got.full_tensor(), full), name
    for name in ("w1_EFD", "w3_EFD"):  # views of the parameter's local storage
        ptr = state[name].to_local().untyped_storage().data_ptr()
        assert ptr == local13.untyped_storage().data_ptr(), name

    # Stock sharded -> megamoe sharded, strict: exact, still sharded alike.
    v1, v3, v2 = other = _full_weights(seed=12)
    stock_other = _built(_qwen3_inner(enable_ep=ep, converted=False), mesh, other)
    fresh = _built(_qwen3_inner(enable_ep=ep, converted=True), mesh)
    fresh.load_state_dict(stock_other.state_dict(), strict=True)
    assert isinstance(fresh.w13_E2FD, DTensor)
    assert tuple(fresh.w13_E2FD.placements) == (want13,)
    local = fresh.w13_E2FD.to_local().view(e_l, 2 * f_l, D)
    assert torch.equal(local, torch.cat([v1[es, fs], v3[es, fs]], dim=1))
    assert torch.equal(fresh.w13_E2FD.full_tensor(), torch.stack([v1, v3], dim=1))
    assert torch.equal(fresh.w2_EDF.full_tensor(), v2)
    # megamoe sharded -> stock sharded, strict: exact.
    back = _built(_qwen3_inner(enable_ep=ep, converted=False), mesh)
    back.load_state_dict(ours.state_dict(), strict=True)
    for name, full in (("w1_EFD", w1), ("w3_EFD", w3), ("w2_EDF", w2)):
        assert tuple(getattr(back, name).placements) == tuple(stock_state[name].placements)
        assert torch.equal(getattr(back, name).full_tensor(), full), name

    # Forward + backward on the local shards vs the float64 oracle on the full weights.
    if ep:  # each rank: rows of its own experts; the oracle sums every rank's loss
        batches = [_rows(20 + r, [3, 2], first_expert=r * e_l) for r in range(world)]
        x, _, counts = batches[rank]
        outs, grads = _oracle_grads(w1, w3, w2, [(b[0], b[1]) for b in batches])
        out = ours(x, counts)
        _assert_rel(out, outs[rank], what="EP out")
    else:  # the same rows on every rank; each output is a partial sum over F
        x, ids, counts = _rows(20, [3, 1, 2, 2])
        outs, grads = _oracle_grads(w1, w3, w2, [(x, ids)])
        out = ours(x, counts)
        total = out.detach().clone()
        torch.distributed.all_reduce(total)
        _assert_rel(total, outs[0], what="TP out (summed partials)")
    out.sum().backward()
    g13, g2 = ours.w13_E2FD.grad, ours.w2_EDF.grad
    assert isinstance(g13, DTensor) and tuple(g13.placements) == (want13,)
    assert tuple(g2.placements) == (want2,)
    _assert_rel(
        g13.full_tensor(), torch.stack(grads[:2], dim=1), tol=4e-3, what="grad w13"
    )  # BF16-rounded base gradient
    _assert_rel(g2.full_tensor(), grads[2], tol=4e-3, what="grad w2")
    return {"ok": True}


R = 16  # the adapters' rank in the sharded side-LoRA tests
SHARED = ("a1", "a3", "b2")


def _full_side(seed: int) -> dict[str, torch.Tensor]:
    """Every side-LoRA factor nonzero (the expand factors too: with LoRA's zero ``b`` the
    shrink factors' gradients would be zero, and a missing reduction would pass)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "a1": (D, R),
        "b1": (E, R, FF2),
        "a3": (D, R),
        "b3": (E, R, FF2),
        "a2": (E, FF2, R),
        "b2": (R, D),
    }
    return {n: _bf16_values(torch.randn(s, generator=gen) * 0.2) for n, s in shapes.items()}


def _side_oracle(weights, side, scale, batches):
    """The side-LoRA experts in float64 over every ``(x, ids)`` in ``batches``: the
    outputs and the gradients of the sum of all outputs wrt each factor."""
    w1, w3, w2 = (w.double() for w in weights)
    leaves = {n: v.double().requires_grad_(True) for n, v in side.items()}
    outs = []
    for x, ids in batches:
        x = x.double()
        g = torch.einsum("nd,nfd->nf", x, w1[ids])
        g = g + scale * torch.einsum("nr,nrf->nf", x @ leaves["a1"], leaves["b1"][ids])
        u = torch.einsum("nd,nfd->nf", x, w3[ids])
        u = u + scale * torch.einsum("nr,nrf->nf", x @ leaves["a3"], leaves["b3"][ids])
        h = F.silu(g) * u
        y = torch.einsum("nf,ndf->nd", h, w2[ids])
        y = y + scale * torch.einsum("nf,nfr->nr", h, leaves["a2"][ids]) @ leaves["b2"]
        outs.append(y)
    sum(o.sum() for o in outs).backward()
    return [o.detach() for o in outs], {n: leaf.grad for n, leaf in leaves.items()}


def _side_layout_worker(rank: int, world: int, axis: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    ep = axis == "ep"
    config = _qwen3_inner(enable_ep=ep, converted=True, rank=R)

    # init_states on every rank from one seed: the replicated factors agree.
    fresh = _built(config, mesh)
    torch.manual_seed(0)
    fresh.init_states()
    gathered = [torch.empty(D, R) for _ in range(world)]
    torch.distributed.all_gather(gathered, fresh.a1.to_local().contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered) and gathered[0].any()
    assert not fresh.b1.to_local().any() and not fresh.b2.to_local().any()

    weights, side = _full_weights(seed=11), _full_side(seed=14)
    ours = _built(config, mesh, weights, side)
    shard = {"b1": 0, "b3": 0, "a2": 0} if ep else {"b1": 2, "b3": 2, "a2": 1}
    for name in SIDE_NAMES:
        want = (Shard(shard[name]),) if name in shard else (Replicate(),)
        assert tuple(getattr(ours, name).placements) == want, name
    assert not ours.w13_E2FD.requires_grad and not ours.w2_EDF.requires_grad

    e_l = E // world if ep else E
    if ep:  # each rank: rows of its own experts; the oracle sums every rank's loss
        batches = [_rows(20 + r, [3, 2], first_expert=r * e_l) for r in range(world)]
        x, _, counts = batches[rank]
        outs, grads = _side_oracle(weights, side, ours.scale, [b[:2] for b in batches])
        out = ours(x, counts)
        _assert_rel(out, outs[rank], what="EP out")
    else:  # the same rows on every rank; each output is a partial sum over F (s p b2 too)
        x, ids, counts = _rows(20, [3, 1, 2, 2])
        outs, grads = _side_oracle(weights, side, ours.scale, [(x, ids)])
        out = ours(x, counts)
        total = out.detach().clone()
        torch.distributed.all_reduce(total)
        _assert_rel(total, outs[0], what="TP out (summed partials)")
    out.sum().backward()
    for name in SIDE_NAMES:
        grad = getattr(ours, name).grad
        assert isinstance(grad, DTensor), name
        # The shared factors' gradients: this rank's part, declared Partial.
        want = (Partial(),) if name in SHARED else (Shard(shard[name]),)
        assert tuple(grad.placements) == want, (name, grad.placements)
        _assert_rel(grad.full_tensor(), grads[name], what=f"grad {name}")
    # A rank's part of a shared factor's gradient is not the whole (so a missing
    # reduction would fail above).
    for name in SHARED:
        assert rel(getattr(ours, name).grad.to_local(), grads[name]) > 0.05, name
    # Without FSDP the Partial gradient is summed where it is read: an SGD step.
    with torch.no_grad():
        ours.a1.sub_(0.1 * ours.a1.grad)
    a1 = ours.a1.to_local()
    _assert_rel(a1, side["a1"] - 0.1 * grads["a1"].float(), what="a1 after a step")
    gathered = [torch.empty_like(a1) for _ in range(world)]
    torch.distributed.all_gather(gathered, a1.contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    # The state dict: the adapters as DTensors with their placements; a strict load into
    # a fresh sharded module restores them.
    state = ours.state_dict()
    assert list(state) == ["w1_EFD", "w2_EDF", "w3_EFD", *SIDE_NAMES]
    fresh = _built(config, mesh)
    fresh.load_state_dict(state, strict=True)
    for name in SIDE_NAMES:
        assert tuple(state[name].placements) == tuple(getattr(ours, name).placements), name
        assert torch.equal(getattr(fresh, name).full_tensor(), getattr(ours, name).full_tensor())
    return {"ok": True}


def _fsdp_side_worker(rank: int, world: int, axis: str) -> dict:
    """torchtitan's FSDP2 over a 2 x 2 mesh, with EP (``efsdp`` x ``ep``) or TP (``fsdp``
    x ``tp``) on the inner axis: FSDP sums each shared factor's Partial gradient over the
    EP/TP ranks while it reduces over the data-parallel ones."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torchtitan.distributed import fsdp
    except ImportError as exc:
        return {"skip": f"FSDP2 / torchtitan's apply_fsdp_to_decoder not importable: {exc}"}
    from torch.distributed.device_mesh import init_device_mesh

    fsdp.disable_fsdp_gradient_division = lambda model: None  # gloo: see _fsdp_worker
    ep = axis == "ep"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp" if ep else "fsdp", axis))
    inner = mesh[axis]
    weights, side = _full_weights(seed=15), _full_side(seed=16)
    experts = _built(_qwen3_inner(enable_ep=ep, converted=True, rank=R), inner, weights, side)
    model = _Decoder(experts)
    if ep:
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        fsdp.apply_fsdp_to_decoder(
            model,
            dense,
            torch.float32,
            torch.float32,
            pp_enabled=False,
            ep_degree=2,
            edp_mesh=mesh["efsdp"],
        )
    else:
        fsdp.apply_fsdp_to_decoder(
            model, mesh["fsdp"], torch.float32, torch.float32, pp_enabled=False
        )
    assert tuple(experts.a1.placements) == (Shard(0), Replicate()), experts.a1.placements
    # Rank r: data-parallel index r // 2, inner (EP/TP) index r % 2. EP: rows of the
    # rank's own experts, distinct on every rank; TP: the data-parallel group's rows.
    e_l = E // 2 if ep else E
    if ep:
        batches = [_rows(40 + r, [3, 2], first_expert=(r % 2) * e_l) for r in range(world)]
        unique = batches
    else:
        batches = [_rows(40 + r // 2, [3, 1, 2, 2]) for r in range(world)]
        unique = batches[::2]
    _, grads = _side_oracle(weights, side, experts.scale, [b[:2] for b in unique])
    x, _, counts = batches[rank]
    model(x, counts).sum().backward()
    for name in SIDE_NAMES:  # FSDP averages over its 2 data-parallel ranks
        grad = getattr(experts, name).grad
        assert isinstance(grad, DTensor), name
        _assert_rel(grad.full_tensor(), grads[name] / 2, what=f"FSDP x {axis} grad {name}")
    # One SGD step keeps the replicated factors equal on the EP/TP ranks.
    with torch.no_grad():
        for name in SIDE_NAMES:
            param = getattr(experts, name)
            param.sub_(0.1 * param.grad)
    a1 = experts.a1.full_tensor()
    gathered = [torch.empty_like(a1) for _ in range(world)]
    torch.distributed.all_gather(gathered, a1)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    _assert_rel(a1, side["a1"] - 0.1 * grads["a1"].float() / 2, what="a1 after a step")
    return {"ok": True}


def _parallelized_moe_worker(rank: int, world: int, axis: str) -> dict:
    """qwen3 ``debugmodel_moe``'s MoE block (router, token dispatcher, megamoe experts
    with side-LoRA) parallelized by torchtitan itself (``ParallelDims.build_mesh``,
    ``Module.parallelize`` on the ``partial_dtensor`` backend: TP with sequence
    parallelism, or EP with the all-to-all dispatcher) against the same block whole."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models import qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    parallel_dims_module.device_type = "cpu"  # torchtitan assumes an accelerator
    dist_utils.set_spmd_backend("partial_dtensor")  # as its trainer does from the config
    ep = axis == "ep"

    def block():
        converter = mtt.MegaMoEConverter.Config(rank=16, alpha=32.0, backend="reference")
        config = qwen3.model_registry("debugmodel_moe", converters=[converter]).model
        set_qwen3_sharding_config(config, enable_sp=True, enable_ep=ep)
        moe_config = next(cfg for _, cfg, _, _ in config.traverse(moe.MoE.Config))
        torch.manual_seed(0)
        module = moe_config.build()
        module.init_states()
        with torch.no_grad():  # nonzero expand factors: every factor's gradient is nonzero
            for name, param in module.named_parameters():
                if name.endswith((".b1", ".b3", ".b2")):
                    param.normal_(0.0, 0.05)
        return module

    whole = block()
    x = torch.randn(
        2, 16, whole.router.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)
    )
    out_whole = whole(x)
    ((out_whole.float() ** 2).sum() / out_whole.numel()).backward()
    want = {n: p.grad for n, p in whole.named_parameters() if n.split(".")[-1] in SIDE_NAMES}

    sharded = block()
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=2 if ep else 1,
        cp=1,
        tp=1 if ep else 2,
        pp=1,
        ep=2 if ep else 1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    sharded.parallelize(dims)
    # EP: data parallel, a batch row per rank. TP with SP: the sequence split over TP.
    rows = slice(rank, rank + 1) if ep else (slice(None), slice(8 * rank, 8 * (rank + 1)))
    out = sharded(x[rows])
    out = out.to_local() if isinstance(out, DTensor) else out
    _assert_rel(out, out_whole[rows], what=f"{axis} out")
    ((out.float() ** 2).sum() / out_whole.numel()).backward()  # the ranks' losses sum
    for name, grad in want.items():
        got = dict(sharded.named_parameters())[name].grad
        got = got.full_tensor() if isinstance(got, DTensor) else got
        _assert_rel(got, grad, what=f"{axis} grad {name}")
    return {"ok": True}


class _Block(torch.nn.Module):
    """What torchtitan's ``apply_fsdp_to_decoder`` reads of an MoE transformer block."""

    moe_enabled = True

    def __init__(self, experts):
        super().__init__()
        self.moe = torch.nn.Module()
        self.moe.routed_experts = torch.nn.Module()
        self.moe.routed_experts.inner_experts = experts

    def forward(self, x, counts):
        return self.moe.routed_experts.inner_experts(x, counts)


class _Decoder(torch.nn.Module):
    """A one-block decoder as ``apply_fsdp_to_decoder`` sees one (no embeddings/head)."""

    enable_weight_tying = False
    tok_embeddings = norm = lm_head = None

    def __init__(self, experts):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _Block(experts)})

    def forward(self, x, counts):
        return self.layers["0"](x, counts)


def _fsdp_worker(rank: int, world: int) -> dict:
    try:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
        from torchtitan.distributed import fsdp
    except ImportError as exc:
        return {"skip": f"FSDP2 / torchtitan's apply_fsdp_to_decoder not importable: {exc}"}
    # torchtitan turns FSDP's gradient division off (a PREMUL_SUM reduce-scatter, which
    # gloo lacks); this process keeps FSDP's default: the gradients are averaged.
    fsdp.disable_fsdp_gradient_division = lambda model: None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

    def sharded(num_experts: int):
        experts = mtt.MegaMoEGroupedExperts.Config(
            dim=D, hidden_dim=FF2, num_experts=num_experts, param_init=_INIT, backend="reference"
        ).build()
        model = _Decoder(experts)
        # torchtitan's own FSDP rule: Shard(0) for the experts, Shard(1) when the FSDP
        # ranks exceed them. FP32 parameters and reductions: the oracle's precision.
        fsdp.apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
        return model, experts

    # E >= FSDP ranks: Shard(0); a forward + backward with this rank's rows.
    model, experts = sharded(E)
    assert tuple(experts.w13_E2FD.placements) == (Shard(0),)
    assert tuple(experts.w2_EDF.placements) == (Shard(0),)
    experts.init_states()  # as torchtitan does after fully_shard: the guard passes
    w1, w3, w2 = _full_weights(seed=13)
    with torch.no_grad():  # known values, distributed independently of the module
        experts.w13_E2FD.copy_(distribute_tensor(torch.stack([w1, w3], 1), mesh, [Shard(0)]))
        experts.w2_EDF.copy_(distribute_tensor(w2, mesh, [Shard(0)]))
    batches = [_rows(30 + r, [2, 1, 3, 2]) for r in range(world)]
    outs, grads = _oracle_grads(w1, w3, w2, [(b[0], b[1]) for b in batches])
    x, _, counts = batches[rank]
    out = model(x, counts)
    _assert_rel(out, outs[rank], what="FSDP out")
    out.sum().backward()  # FSDP averages the ranks' gradients
    grads = [g / world for g in grads]
    g13, g2 = experts.w13_E2FD.grad, experts.w2_EDF.grad
    assert isinstance(g13, DTensor) and tuple(g13.placements) == (Shard(0),)
    assert tuple(g13.to_local().shape) == (E // world, 2, FF2, D)
    assert tuple(g2.placements) == (Shard(0),)
    _assert_rel(g13.full_tensor(), torch.stack(grads[:2], dim=1), tol=4e-3, what="FSDP grad w13")
    _assert_rel(g2.full_tensor(), grads[2], tol=4e-3, what="FSDP grad w2")
    state = experts.state_dict()
    assert all(tuple(state[n].placements) == (Shard(0),) for n in ("w1_EFD", "w3_EFD"))
    assert torch.equal(state["w1_EFD"].full_tensor(), w1)

    # Fewer experts than FSDP ranks: torchtitan's rule picks Shard(1), the gate/up axis.
    _, few = sharded(1)
    assert tuple(few.w13_E2FD.placements) == (Shard(1),)
    try:
        few.init_states()
    except ValueError as exc:
        assert "sharded on dim 1" in str(exc), str(exc)
    else:
        raise AssertionError("init_states did not refuse a Shard(1) w13_E2FD")
    return {"ok": True}


def _run_gloo_ranks(fn, *args, world: int = WORLD):
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    pytest.importorskip("torchtitan.models.qwen3")
    from megamoe.ep import run_gloo

    return run_gloo(fn, world, *args)


def _run_two_gloo_ranks(fn, *args):
    return _run_gloo_ranks(fn, *args)


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_two_rank_layouts_match_the_stock_experts_and_the_oracle(axis):
    assert _run_two_gloo_ranks(_layout_worker, axis) == [{"ok": True}] * WORLD


def test_two_rank_fsdp2_shard0_trains_and_the_shard1_fallback_is_refused():
    results = _run_two_gloo_ranks(_fsdp_worker)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    assert results == [{"ok": True}] * WORLD


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_two_rank_side_lora_gradients_are_summed_over_the_model_parallel_ranks(axis):
    assert _run_two_gloo_ranks(_side_layout_worker, axis) == [{"ok": True}] * WORLD


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_four_rank_fsdp2_side_lora_matches_the_oracle(axis):
    results = _run_gloo_ranks(_fsdp_side_worker, axis, world=4)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    assert results == [{"ok": True}] * 4


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_moe_block_under_torchtitans_parallelize_matches_the_whole_block(axis):
    assert _run_two_gloo_ranks(_parallelized_moe_worker, axis) == [{"ok": True}] * WORLD


def test_with_torchtitans_lora_converter_the_side_lora_trains():
    """torchtitan's LoRAConverter freezes every module it does not target through a config
    subclass whose build freezes the direct parameters. Listed after MegaMoEConverter it
    froze the side-LoRA factors (they silently never trained): refused by name. Listed
    before, its frozen experts config was refused as a subclass; now megamoe converts it
    (the base frozen, the side-LoRA trainable, as LoRA asks), and rank 0 is refused."""
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models import qwen3

    megamoe = mtt.MegaMoEConverter.Config(rank=16, alpha=32.0, backend="reference")
    lora = LoRAConverter.Config(rank=8)
    with pytest.raises(ValueError, match=r"^converters: torchtitan's LoRAConverter after"):
        qwen3.model_registry("debugmodel_moe", converters=[megamoe, lora])
    config = qwen3.model_registry("debugmodel_moe", converters=[lora, megamoe]).model
    with torch.device("meta"):
        model = config.build()
    experts = [m for m in model.modules() if isinstance(m, mtt.MegaMoEGroupedExperts)]
    assert experts
    for module in experts:
        assert all(getattr(module, name).requires_grad for name in SIDE_NAMES)
        assert not module.w13_E2FD.requires_grad and not module.w2_EDF.requires_grad
    no_adapters = mtt.MegaMoEConverter.Config(rank=0, backend="reference")
    with pytest.raises(ValueError, match=r"was frozen by torchtitan's LoRAConverter"):
        qwen3.model_registry("debugmodel_moe", converters=[lora, no_adapters])
