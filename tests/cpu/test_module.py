"""mm.MegaMoE (module.py) on the CPU through backend="reference"."""

from __future__ import annotations

import pytest
import torch

from megamoe import reference
from megamoe.module import MegaMoE
from megamoe.side_lora import SideLoRA
from megamoe.testing.inputs import make_routing
from megamoe.weights import prepare_base_weights

H, I, E, K, R, T = 64, 64, 4, 2, 16, 24
F32 = torch.float32
SIDE = ("a1", "b1", "a3", "b3", "a2", "b2")


def make_layer(**kwargs) -> MegaMoE:
    torch.manual_seed(kwargs.pop("seed", 0))
    args = dict(side_rank=R, backend="reference", param_dtype=F32, side_scale=0.5)
    args.update(kwargs)
    return MegaMoE(H, I, E, K, **args)


def randomize_adapters(layer: MegaMoE, seed: int = 1) -> None:
    """Nonzero expand factors, so every adapter path contributes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.adapter_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-2] ** 0.5)


def inputs(seed: int = 0, requires_grad: bool = False):
    ids, weights = make_routing(T, E, K, kind="masked", seed=seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(requires_grad), ids, weights.requires_grad_(requires_grad)


def reference_out(layer: MegaMoE, x, ids, weights, side="layer"):
    base = prepare_base_weights(layer.w13, layer.w2, format=layer.base_format)
    if side == "layer":
        side = SideLoRA(*layer.adapter_parameters(), scale=layer.side_scale)
    return reference.moe(
        x,
        ids,
        weights,
        base,
        side,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        compute_dtype=F32,
    )


def test_output_equals_reference_moe():
    layer = make_layer(activation="geglu", activation_clamp=3.0)
    randomize_adapters(layer)
    x, ids, weights = inputs()
    assert torch.equal(layer(x, ids, weights), reference_out(layer, x, ids, weights))


def test_parameter_layout_and_init():
    layer = make_layer()
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "w13": (E, 2 * I, H),
        "w2": (E, H, I),
        "a1": (H, R),
        "b1": (E, R, I),
        "a3": (H, R),
        "b3": (E, R, I),
        "a2": (E, I, R),
        "b2": (R, H),
    }
    # nn.Linear's default draw: |w| <= 1/sqrt(fan_in), and not degenerate.
    for p, fan_in in ((layer.w13, H), (layer.w2, I), (layer.a1, H), (layer.a2, I)):
        assert p.abs().max() <= fan_in**-0.5 and p.std() > 0.3 * fan_in**-0.5
    for name in ("b1", "b3", "b2"):
        assert not getattr(layer, name).any()


def test_initial_adapter_contribution_is_exactly_zero():
    layer = make_layer()
    x, ids, weights = inputs()
    assert torch.equal(layer(x, ids, weights), reference_out(layer, x, ids, weights, side=None))


def test_initial_gradients_reach_the_zero_expand_factors():
    # LoRA init: b = 0 gets a gradient through the random a; a gets none until b moves.
    layer = make_layer()
    x, ids, weights = inputs()
    layer(x, ids, weights).square().sum().backward()
    for name in ("b1", "b3", "b2"):
        assert getattr(layer, name).grad.abs().sum() > 0, name
    for name in ("a1", "a3", "a2"):
        assert not getattr(layer, name).grad.any(), name


def test_frozen_base_gradients_reach_only_adapters_and_inputs():
    layer = make_layer()
    randomize_adapters(layer)
    x, ids, weights = inputs(requires_grad=True)
    layer(x, ids, weights).square().sum().backward()
    assert layer.w13.grad is None and layer.w2.grad is None
    assert not layer.w13.requires_grad and not layer.trainable_base
    for name in SIDE:
        assert getattr(layer, name).grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0 and weights.grad.abs().sum() > 0


def test_ordinary_mode_gradients_reach_the_base():
    layer = make_layer(trainable_base=True)
    randomize_adapters(layer)
    x, ids, weights = inputs()
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    (layer(x, ids, weights) * dout).sum().backward()
    assert layer.trainable_base
    for name in ("w13", "w2", *SIDE):
        assert getattr(layer, name).grad.abs().sum() > 0, name

    # Same numbers as calling the oracle directly on leaves of the same values.
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    base = prepare_base_weights(leaves["w13"], leaves["w2"])
    side = SideLoRA(*(leaves[n] for n in SIDE), scale=layer.side_scale)
    out = reference.moe(x, ids, weights, base, side, compute_dtype=F32)
    (out * dout).sum().backward()
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, leaves[name].grad), name


def test_requires_grad_false_freezes_the_base():
    layer = make_layer(trainable_base=True)
    layer.requires_grad_(False)
    for p in layer.adapter_parameters():
        p.requires_grad_(True)
    x, ids, weights = inputs()
    layer(x, ids, weights).sum().backward()
    assert layer.w13.grad is None and not layer.trainable_base
    assert layer.base_weights() is layer.base_weights()  # frozen: cached


def test_helpers_list_the_parameters():
    layer = make_layer()
    assert [p for p in layer.adapter_parameters()] == [getattr(layer, n) for n in SIDE]
    assert layer.base_parameters() == [layer.w13, layer.w2]
    assert [n for n, _ in layer.named_adapter_parameters()] == list(SIDE)
    ids = {id(p) for p in layer.adapter_parameters() + layer.base_parameters()}
    assert ids == {id(p) for p in layer.parameters()}


def test_frozen_base_is_prepared_once():
    layer = make_layer()
    x, ids, weights = inputs()
    layer(x, ids, weights)
    base = layer.base_weights()
    layer(x, ids, weights)
    assert layer.base_weights() is base
    assert not base.w13.requires_grad


def test_in_place_edit_rebuilds_the_cached_base():
    layer = make_layer()
    randomize_adapters(layer)
    x, ids, weights = inputs()
    before = layer(x, ids, weights)
    base = layer.base_weights()
    with torch.no_grad():
        layer.w13.mul_(0.5)
        layer.w2[1].neg_()
    after = layer(x, ids, weights)
    assert layer.base_weights() is not base
    assert not torch.equal(before, after)
    assert torch.equal(after, reference_out(layer, x, ids, weights))


def test_load_state_dict_rebuilds_the_cached_base_and_carries_the_scale():
    src = make_layer(seed=3, side_scale=2.0)
    randomize_adapters(src, seed=4)
    dst = make_layer(seed=5)
    x, ids, weights = inputs()
    dst(x, ids, weights)  # fill the cache with the old weights
    dst.load_state_dict(src.state_dict())
    assert dst.side_scale == 2.0
    assert torch.equal(dst(x, ids, weights), src(x, ids, weights))


def test_data_writes_need_invalidate():
    # .data shares no version counter with the parameter: documented, with a remedy.
    layer = make_layer()
    x, ids, weights = inputs()
    layer(x, ids, weights)
    layer.w13.data.mul_(2.0)
    layer.invalidate_base_cache()
    assert torch.equal(layer(x, ids, weights), reference_out(layer, x, ids, weights))


def test_assigning_new_tensors_rebuilds_the_cached_base():
    layer = make_layer()
    x, ids, weights = inputs()
    layer(x, ids, weights)
    layer.w2 = torch.nn.Parameter(layer.w2.detach() * 3, requires_grad=False)
    assert torch.equal(layer(x, ids, weights), reference_out(layer, x, ids, weights))


def test_mxfp4_frozen_base():
    layer = make_layer(base_format="mxfp4")
    randomize_adapters(layer)
    x, ids, weights = inputs()
    out = layer(x, ids, weights)
    assert layer.base_weights().format == "mxfp4"
    assert torch.equal(out, reference_out(layer, x, ids, weights))


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, F32])
def test_mxfp4_ordinary_mode_trains_the_master_straight_through(param_dtype):
    """The forward runs on the MXFP4 values; w13/w2 get the gradient taken at those
    values, bit for bit the BF16 layer's gradient on the dequantized weights. I = 128
    spans two gate/up interleave blocks, so a row-order slip would show."""

    def layer_of(base_format: str) -> MegaMoE:
        torch.manual_seed(0)
        return MegaMoE(
            H, 128, E, K, side_rank=R, backend="reference", param_dtype=param_dtype,
            side_scale=0.5, base_format=base_format, trainable_base=True,
        )  # fmt: skip

    layer = layer_of("mxfp4")
    randomize_adapters(layer)
    x, ids, weights = inputs()
    out = layer(x, ids, weights)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    out.backward(dout)
    packed = layer.base_weights()
    assert packed.format == "mxfp4" and packed.trains_master
    assert packed.w13_master is layer.w13 and packed.w2_master is layer.w2  # no copies

    twin = layer_of("bf16")
    twin.load_state_dict(layer.state_dict())
    with torch.no_grad():
        twin.w13.copy_(packed.w13_linear())
        twin.w2.copy_(packed.w2_linear())
    twin_out = twin(x, ids, weights)
    twin_out.backward(dout)
    assert torch.equal(out, twin_out)
    for name in ("w13", "w2", *SIDE):
        got, want = getattr(layer, name).grad, getattr(twin, name).grad
        assert got is not None and got.dtype == param_dtype, name
        assert torch.equal(got, want), name
    # The packed base is not the master: the forward differs from the BF16 master's.
    assert not torch.equal(packed.w13_linear().to(param_dtype), layer.w13.detach())


def test_no_adapters():
    layer = make_layer(side_rank=0, side_scale=None)
    assert layer.adapter_parameters() == [] and layer.a1 is None and layer.side_lora() is None
    x, ids, weights = inputs()
    assert torch.equal(layer(x, ids, weights), reference_out(layer, x, ids, weights, side=None))


def test_scale_options():
    assert make_layer(side_scale=None).side_scale == 1.0
    assert make_layer(side_scale=None, side_alpha=32.0).side_scale == 32.0 / R


def test_bf16_params_and_output_dtype():
    layer = make_layer(param_dtype=torch.bfloat16)
    assert layer.w13.dtype == torch.bfloat16 and layer.a1.dtype == torch.bfloat16
    x, ids, weights = inputs()
    assert layer(x.to(torch.bfloat16), ids, weights).dtype == torch.bfloat16


def test_fused_backend_casts_master_weights_to_bf16_differentiably():
    layer = make_layer(backend="fused")
    side = layer.side_lora()
    assert all(t.dtype == torch.bfloat16 and t.requires_grad for t in side.tensors())
    for name, t in zip(SIDE, side.tensors(), strict=True):
        assert torch.equal(t, getattr(layer, name).to(torch.bfloat16)), name  # the cast
    side.b2.float().sum().backward()
    assert layer.b2.grad.dtype == F32  # d sum(bf16(b2)) / d b2 = 1 through the cast
    assert torch.equal(layer.b2.grad, torch.ones_like(layer.b2))


def test_load_side_lora():
    layer = make_layer()
    gen = torch.Generator().manual_seed(7)
    side = SideLoRA(*(torch.randn(p.shape, generator=gen) for p in layer.adapter_parameters()), 3.0)
    layer.load_side_lora(side)
    assert layer.side_scale == 3.0 and torch.equal(layer.b3, side.b3)
    with pytest.raises(ValueError, match="r=32"):
        make_layer(side_rank=32).load_side_lora(side)
    with pytest.raises(TypeError, match="side"):
        layer.load_side_lora(side.tensors())


def test_extra_repr():
    text = repr(make_layer(activation_clamp=7.0))
    for part in ("hidden=64", "top_k=2", "side_rank=16", "side_scale=0.5", "frozen bf16",
                 "activation_clamp=7", "backend='reference'"):  # fmt: skip
        assert part in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(hidden=48), "hidden"),
        (dict(intermediate=96), "intermediate"),
        (dict(side_rank=8), "side_rank"),
        (dict(side_rank=272), "side_rank"),
        (dict(top_k=0), "top_k"),  # top_k > num_experts is allowed (masked routes)
        (dict(base_format="fp8"), "base_format"),
        (dict(backend="triton"), "backend"),
        (dict(activation="relu"), "activation"),
        (dict(activation_clamp=-1.0), "activation_clamp"),
        (dict(side_scale=0.5, side_alpha=16.0), "side_scale"),
        (dict(side_rank=0, side_scale=None, side_alpha=16.0), "side_alpha"),
        (dict(side_rank=0), "^side_scale: needs adapters"),  # (side_scale=0.5 below)
        (dict(side_rank=None), "^side_scale: needs adapters"),
        (dict(param_dtype=torch.float16), "^param_dtype"),
        (dict(dtype=torch.float16), "^dtype: expected torch.bfloat16 or torch.float32"),
        (dict(param_dtype=F32, dtype=torch.bfloat16), "dtype"),
        (dict(trainable_base=1), "trainable_base"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    args = dict(hidden=H, intermediate=I, num_experts=E, top_k=K, side_rank=R)
    args.update(backend="reference", side_scale=0.5)
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        MegaMoE(**args)


@pytest.mark.parametrize("convert", ["half", "double"])
def test_a_module_converted_to_another_dtype_says_so(convert):
    """A review: after ``.half()`` every forward failed naming ``w13`` (an argument the
    caller never gave); the module names its own dtype and the way back."""
    layer = getattr(make_layer(), convert)()
    x, ids, weights = inputs()
    with pytest.raises(TypeError, match=r"^MegaMoE: its parameters are torch.float(16|64)"):
        layer(x, ids, weights)
    layer.to(torch.float32)
    assert torch.isfinite(layer(x, ids, weights)).all()


def test_bad_forward_arguments():
    layer = make_layer()
    x, ids, weights = inputs()
    with pytest.raises(ValueError, match=r"topk_ids: expected shape \[T, 2\]"):
        layer(x, torch.cat([ids, ids], dim=1), torch.cat([weights, weights], dim=1))
    with pytest.raises(ValueError, match="x: expected shape"):
        layer(x[:, :32], ids, weights)
    with pytest.raises(TypeError, match=r"^x: expected a torch\.Tensor"):
        layer(x.numpy(), ids, weights)


def test_activation_checkpoint_option_is_checked_and_shown():
    layer = MegaMoE(64, 64, 4, 2, side_rank=16, backend="reference", activation_checkpoint=True)
    assert "activation_checkpoint=True" in repr(layer)
    with pytest.raises(TypeError, match="^activation_checkpoint"):
        MegaMoE(64, 64, 4, 2, activation_checkpoint="yes")


def test_bf16_router_weights_give_the_fp32_result_and_a_bf16_gradient():
    layer = make_layer()
    randomize_adapters(layer)
    x, ids, weights = inputs()
    w16 = weights.to(torch.bfloat16).requires_grad_(True)
    w32 = w16.detach().float().requires_grad_(True)
    out16, out32 = layer(x, ids, w16), layer(x, ids, w32)
    assert torch.equal(out16, out32)
    out16.sum().backward()
    out32.sum().backward()
    assert w16.grad.dtype == torch.bfloat16
    assert torch.equal(w16.grad, w32.grad.to(torch.bfloat16))


@pytest.mark.parametrize("bad", [E, E + 7, -2])
def test_reference_backend_rejects_out_of_range_expert_ids(bad):
    # issue 19: the fused op rejects ids outside [-1, E); the reference backend alone
    # would take ids >= E as remote routes. The module applies the fused rule to both.
    layer = make_layer()
    x, ids, weights = inputs()
    ids = ids.clone()
    ids[3, 1] = bad
    with pytest.raises(
        ValueError, match=rf"topk_ids: expected expert ids in \[0, {E}\).*got {bad}"
    ):
        layer(x, ids, weights)
    ids[3, 1] = -1  # a masked route is fine
    layer(x, ids, weights)


def test_extra_state_is_a_tensor_and_reads_old_dict_checkpoints():
    layer = make_layer(side_scale=0.75)
    state = layer.state_dict()["_extra_state"]
    assert isinstance(state, torch.Tensor) and state.dtype == torch.float64
    assert state.item() == 0.75
    other = make_layer(side_scale=1.0)
    other.set_extra_state({"side_scale": 0.25})  # a checkpoint from before the change
    assert other.side_scale == 0.25
    other.load_state_dict(layer.state_dict())
    assert other.side_scale == 0.75
    with pytest.raises(ValueError, match="one value"):
        other.set_extra_state(torch.zeros(2))


def test_state_dict_saves_with_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    layer = make_layer(side_scale=0.5)
    path = tmp_path / "layer.safetensors"
    safetensors.save_file(layer.state_dict(), str(path))  # what save_pretrained does
    other = make_layer(seed=9, side_scale=1.0)
    other.load_state_dict(safetensors.load_file(str(path)))
    assert other.side_scale == 0.5 and torch.equal(other.w13, layer.w13)


def test_frozen_base_is_prepared_in_the_graph_under_compile():
    # The cache key reads data_ptr/_version, which a traced graph cannot: under
    # torch.compile the base is prepared directly (no cache entry is made).
    layer = make_layer()
    calls = []

    def fake_compiling() -> bool:
        calls.append(True)
        return True

    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = fake_compiling
    try:
        base = layer.base_weights()
    finally:
        torch.compiler.is_compiling = original
    assert calls and layer._base_cache is None
    assert torch.equal(base.w13, prepare_base_weights(layer.w13, layer.w2).w13)


class _Traced(Exception):
    """Raised by the trace-only backend below instead of running the graph."""


def _trace_only(gm, example_inputs):
    # The fused op has no CPU kernel: check that the whole forward traces into one
    # graph (fullgraph=True raises on any break before calling the backend), not that
    # it runs.
    def run(*args):
        raise _Traced(gm)

    return run


@pytest.mark.parametrize("base_format", ["bf16", "mxfp4"])
def test_fullgraph_compile_with_the_base_prepared_inside(base_format):
    layer = MegaMoE(H, I, E, K, side_rank=R, backend="fused", base_format=base_format)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    ids, weights = make_routing(T, E, K, kind="masked", seed=0)
    compiled = torch.compile(layer, fullgraph=True, backend=_trace_only)
    with pytest.raises(_Traced) as traced:
        compiled(x, ids, weights.to(torch.bfloat16))
    targets = {str(n.target) for n in traced.value.args[0].graph.nodes}
    assert "megamoe.moe_forward.default" in targets


def test_compiled_mxfp4_prepare_matches_eager_bitwise():
    # Traced, the quantization runs inside the graph (the host-side finite check, a
    # data-dependent branch, is skipped); its bytes must be eager's.
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16)

    def prepare(a, b):
        base = prepare_base_weights(a, b, format="mxfp4")
        return base.w13, base.w2, base.w13_scales, base.w2_scales

    got = torch.compile(prepare, fullgraph=True, backend="aot_eager")(w13, w2)
    want = prepare(w13, w2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.uint8 and torch.equal(g, w)


def test_mxfp4_prepare_rejects_fp32_weights_beyond_bf16s_range():
    # Finite in FP32, Inf once rounded to BF16 (what is quantized): a NaN block otherwise.
    w13 = torch.randn(2, 128, 64)
    w13[1, 5, 7] = 3.4e38
    w2 = torch.randn(2, 64, 64)
    with pytest.raises(ValueError, match="w13: MXFP4 quantization needs finite weights"):
        prepare_base_weights(w13, w2, format="mxfp4")


# ------------------------------------------------------- found missing by a review


def _meta_call(m: MegaMoE, grad: bool = True) -> torch.Tensor:
    """A call on the meta device (the fused path's Python and the ops' fakes)."""
    x = torch.empty(8, H, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    ids = torch.empty(8, K, dtype=torch.int32, device="meta")
    return m(x, ids, torch.empty(8, K, device="meta"))


@pytest.mark.parametrize(("base_format", "param_dtype"), [("bf16", F32), ("mxfp4", torch.bfloat16)])
def test_an_inference_mode_call_leaves_a_cache_a_training_step_can_use(base_format, param_dtype):
    m = MegaMoE(
        H, I, E, K, side_rank=R, base_format=base_format, param_dtype=param_dtype, device="meta"
    )
    with torch.inference_mode():
        _meta_call(m, grad=False)
    _meta_call(m).sum().backward()  # the cached base is no inference tensor


@pytest.mark.parametrize("base_format", ["bf16", "mxfp4"])
def test_an_inference_mode_call_caches_no_inference_tensor(base_format):
    """With real tensors (the meta case above caches nothing: no data to key on), a base
    prepared under inference_mode is cached as a normal tensor, and a training step after
    it runs on that cache (a review: the guard was untested)."""
    m = MegaMoE(H, I, E, K, side_rank=R, base_format=base_format, param_dtype=F32,
                backend="reference")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (8, K), generator=gen)
    weights = torch.rand(8, K, generator=gen)
    with torch.inference_mode():
        m(torch.randn(8, H, generator=gen), ids, weights)
    cached = m._base_cache[2]
    assert not cached.w13.is_inference() and not cached.w2.is_inference()
    x = torch.randn(8, H, generator=gen, requires_grad=True)
    m(x, ids, weights).sum().backward()
    assert m._base_cache[2] is cached and x.grad is not None


def test_dtype_and_device_moves_drop_the_cache_and_swap_the_parameters():
    """``.to()`` drops the prepared base (the old copy's memory is freed at once) and
    works with torch's parameter swapping, which a cache holding weak references to the
    old parameters would refuse ("Couldn't swap"); a parent module's move goes through
    the same path. No test moved a MegaMoE before (a review)."""
    m = MegaMoE(H, I, E, K, side_rank=R, param_dtype=F32, backend="reference")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, E, (8, K), generator=gen)
    weights = torch.rand(8, K, generator=gen)
    m(torch.randn(8, H, generator=gen), ids, weights)
    assert m._base_cache is not None
    swap = torch.__future__.get_swap_module_params_on_conversion()
    try:
        torch.__future__.set_swap_module_params_on_conversion(True)
        m.to(torch.bfloat16)
        assert m._base_cache is None and m.w13.dtype == torch.bfloat16
        parent = torch.nn.Sequential(m)
        m(torch.randn(8, H, generator=gen).bfloat16(), ids, weights)
        parent.float()
        assert m._base_cache is None and m.w13.dtype == F32
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    out = m(torch.randn(8, H, generator=gen), ids, weights)
    assert out.dtype == F32 and m._base_cache is not None


def test_a_new_base_tensor_at_a_freed_ones_address_is_prepared_again():
    """A loader that refills one host buffer: each new parameter has the old one's
    address and version count, and the layer still runs on the new values."""
    np = pytest.importorskip("numpy")
    m = MegaMoE(H, I, 2, 1, side_rank=R, backend="reference", param_dtype=F32)
    x, ids, w = torch.randn(4, H), torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    staging = np.empty((2, 2 * I, H), np.float32)
    for checkpoint in range(2):
        staging[:] = np.random.default_rng(checkpoint).uniform(-1, 1, staging.shape)
        m.w13 = torch.nn.Parameter(torch.from_numpy(staging), requires_grad=False)
        got = m(x, ids, w)
    base = prepare_base_weights(m.w13, m.w2)
    want = reference.moe(x, ids, w, base, m.side_lora(), compute_dtype=F32).to(got.dtype)
    assert torch.equal(got, want)


def test_a_base_only_state_dict_leaves_the_adapter_scale_alone():
    base_only = MegaMoE(H, I, E, K, side_rank=0, backend="reference")
    adapted = MegaMoE(H, I, E, K, side_rank=R, side_alpha=32.0, backend="reference")
    assert adapted.side_scale == 2.0
    missing, unexpected = adapted.load_state_dict(base_only.state_dict(), strict=False)
    assert sorted(missing) == sorted(SIDE) and not unexpected
    assert adapted.side_scale == 2.0
    again = MegaMoE(H, I, E, K, side_rank=0, backend="reference")
    again.load_state_dict(base_only.state_dict())  # and it loads where it came from


def test_a_second_backward_through_a_checkpointed_call_runs():
    """mm.moe's promise under activation checkpointing, on the op route (meta)."""
    m = MegaMoE(H, I, E, K, side_rank=R, activation_checkpoint=True, device="meta")
    out = _meta_call(m)
    out.sum().backward(retain_graph=True)
    out.sum().backward()


def test_ordinary_mxfp4_prepares_its_base_without_a_host_read():
    """Ordinary mode re-quantizes the masters every step: no value is read back to the
    host there (on a GPU, a synchronisation per step that a CUDA graph refuses)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    m = MegaMoE(H, I, E, K, trainable_base=True, base_format="mxfp4", backend="reference")
    with HostReads() as probe:
        base = m.base_weights()
    assert base.format == "mxfp4" and base.trains_master and probe.reads == 0
    with HostReads() as probe:  # a user's own prepare still checks finiteness (one read each)
        prepare_base_weights(m.w13, m.w2, format="mxfp4")
    assert probe.reads == 2


def test_a_module_pickles_after_its_first_call():
    """torch.save of the whole module (and spawn-based workers) failed once a call had
    filled the frozen-base cache: it holds weak references. The copy drops the cache
    (the next call rebuilds it); the live module keeps its own."""
    import copy
    import io

    module = MegaMoE(64, 64, 4, 2, 16, backend="reference")
    gen = torch.Generator().manual_seed(0)
    x, weights = torch.randn(8, 64, generator=gen), torch.rand(8, 2, generator=gen)
    ids = torch.randint(0, 4, (8, 2), generator=gen)
    out = module(x, ids, weights)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    assert module._base_cache is not None
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._base_cache is None and torch.equal(loaded(x, ids, weights), out)
    assert copy.deepcopy(module)._base_cache is None


# ----------------------------------------------- a review's findings (forty-fourth session)


def test_load_state_dict_swaps_parameters_after_a_forward():
    """Under torch.__future__'s swap-on-conversion (the load path for DTensor / FSDP2
    parameters) load_state_dict swaps w13/w2 with torch.utils.swap_tensors, which
    refused them while the base cache held weak references to them."""
    import megamoe as mm
    from megamoe.testing.inputs import make_routing

    layer = mm.MegaMoE(64, 64, 4, 2, side_rank=16, backend="reference", param_dtype=torch.float32)
    x = torch.randn(8, 64)
    ids, weights = make_routing(8, 4, 2, seed=0)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state["w2"] = state["w2"] * 2
    layer(x, ids, weights)  # the cache now holds the base
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.load_state_dict(state)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    fresh = mm.MegaMoE(64, 64, 4, 2, side_rank=16, backend="reference", param_dtype=torch.float32)
    fresh.load_state_dict(state)
    assert torch.equal(layer(x, ids, weights), fresh(x, ids, weights))


def test_top_k_may_exceed_the_local_experts():
    """A layer holding one rank's experts sees more routes per token than it has experts
    (the others masked to -1), as mm.moe and get_block_m allow: MegaMoE refused it."""
    import megamoe as mm
    from megamoe.testing.inputs import make_routing

    layer = mm.MegaMoE(64, 64, 4, 6, backend="reference", param_dtype=torch.float32)
    ids, weights = make_routing(8, 16, 6, seed=2)
    local = torch.where(ids < 4, ids, torch.full_like(ids, -1))  # experts 0..3 are ours
    out = layer(torch.randn(8, 64), local, weights)
    assert out.shape == (8, 64) and bool(torch.isfinite(out).all())


def test_extra_state_is_a_cpu_value_under_a_meta_default_device():
    """Built under ``with torch.device("meta")`` the side scale was saved as a meta
    tensor, which no load can read (``.item()`` on meta)."""
    import megamoe as mm

    with torch.device("meta"):
        layer = mm.MegaMoE(64, 64, 4, 2, side_rank=16, side_scale=0.25)
        state = layer.state_dict()
        assert state["_extra_state"].device.type == "cpu"
        other = mm.MegaMoE(64, 64, 4, 2, side_rank=16, side_scale=1.0)
        other.load_state_dict(state)  # meta -> meta
    assert other.side_scale == 0.25
    other.set_extra_state(torch.empty((), dtype=torch.float64, device="meta"))
    assert other.side_scale == 0.25  # a meta value carries nothing to load


def test_the_fused_backend_checks_x_before_preparing_the_base(monkeypatch):
    """An MXFP4 layer quantized every expert before refusing an FP32 ``x``."""
    import megamoe as mm
    import megamoe.module as module
    from megamoe.testing.inputs import make_routing

    layer = mm.MegaMoE(64, 64, 4, 2, base_format="mxfp4", device="meta")
    prepared = []
    real = module.prepare_base_weights
    monkeypatch.setattr(
        module, "prepare_base_weights", lambda *a, **k: prepared.append(1) or real(*a, **k)
    )
    ids, weights = make_routing(8, 4, 2, seed=0)
    x = torch.randn(8, 64, device="meta")
    with pytest.raises(TypeError, match=r"^x: expected dtype bfloat16"):
        layer(x, ids.to("meta"), weights.to("meta"))
    with pytest.raises(ValueError, match=r"^topk_ids: expected device meta \(where base is\)"):
        layer(x.bfloat16(), ids, weights.to("meta"))
    # Shapes, the router weights' dtype and layouts too (a review: each of these prepared,
    # and cached, the base first).
    x, ids, weights = x.bfloat16(), ids.to("meta"), weights.to("meta")
    bad = [
        (ValueError, r"^topk_ids: expected shape \[8, 2\]", (x, ids[:7], weights)),
        (ValueError, r"^topk_weights: expected shape \[8, 2\]", (x, ids, weights[:7])),
        (
            TypeError,
            r"^topk_weights: expected dtype float32 or bfloat16 for the fused backend",
            (x, ids, weights.double()),
        ),
        (ValueError, r"^x: expected a contiguous", (x.t().contiguous().t(), ids, weights)),
    ]
    for error, match, args in bad:
        with pytest.raises(error, match=match):
            layer(*args)
    assert prepared == []


def test_the_fused_backend_refuses_cpu_weights_before_preparing_them(monkeypatch):
    """A layer built without ``device="cuda"`` quantized (MXFP4) or copied every expert,
    and cached the result, before mm.moe refused its CPU weights (a review: 7.4 s and 53
    MB at H=1024, I=512, E=64); it now refuses first and names the reference backend."""
    import megamoe as mm
    import megamoe.module as module
    from megamoe.testing.inputs import make_routing

    layer = mm.MegaMoE(64, 64, 4, 2, base_format="mxfp4")
    prepared = []
    real = module.prepare_base_weights
    monkeypatch.setattr(
        module, "prepare_base_weights", lambda *a, **k: prepared.append(1) or real(*a, **k)
    )
    ids, weights = make_routing(8, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"^base: expected CUDA weights .*backend='reference'"):
        layer(torch.randn(8, 64).bfloat16(), ids, weights)
    assert prepared == [] and layer._base_cache is None


def test_no_cache_is_keyed_on_fake_parameters():
    """Under FakeTensorMode the cache key read data_ptr() of fake parameters (deprecated,
    soon an error) and cached a fake base for later real calls."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    import megamoe as mm

    with FakeTensorMode():
        layer = mm.MegaMoE(64, 64, 4, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the data_ptr deprecation warning
            layer.base_weights()
    assert layer._base_cache is None
