"""megamoe's HF transformers experts implementation, against transformers itself (CPU).

Tiny Qwen3-MoE and DeepSeek-V3 models are built from a config and run with
``experts_implementation="megamoe_reference"`` (megamoe's float32 reference behind the
same integration code as ``"megamoe_fused"``: weight layout, activation, clamp, routing
dtype, sentinel ids, adapters). The oracle is transformers' own ``grouped_mm`` experts
path on the same float32 model; the weights are rounded to BF16 values first because
megamoe's base is BF16 (``prepare_base_weights`` rounds), so both sides compute on the
same values and differ only by float32 summation order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import (  # noqa: E402
    ExpertsInterface,
    grouped_mm_experts_forward,
    use_experts_implementation,
)

import megamoe.integrations.transformers as mhf  # noqa: E402

VOCAB, H, I, E, K = 128, 64, 64, 8, 2


def qwen3_config(**overrides):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=64,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def deepseek_v3_config():
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
    )


MODELS = {
    "qwen3_moe": (qwen3_config, transformers.Qwen3MoeForCausalLM),
    "deepseek_v3": (deepseek_v3_config, transformers.DeepseekV3ForCausalLM),
}


def build(kind: str, seed: int = 0):
    make_config, cls = MODELS[kind]
    torch.manual_seed(seed)
    model = cls(make_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
            p.copy_(p.to(torch.bfloat16))  # BF16 values (see the module docstring)
    return model


def tokens(seed: int = 1, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float | None = None):
    if rtol is None:
        # The base's gradient passes prepare_base_weights' differentiable BF16 cast, so
        # it arrives BF16-rounded (as from the fused kernels): one rounding, <= 2^-8.
        rtol = 4e-3 if what.endswith(("gate_up_proj", "down_proj")) else 1e-4
    got, want = got.double(), want.double()
    rel = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert torch.isfinite(got).all(), what
    assert rel <= rtol, f"{what}: relative L2 {rel.item():.3e} > {rtol}"


# ----------------------------------------------------------------- registration


def test_names_are_registered_and_collide_with_nothing_hf_registers():
    interface = ExpertsInterface()
    assert interface[mhf.FUSED] is mhf.fused_experts_forward
    assert interface[mhf.REFERENCE] is mhf.reference_experts_forward
    # HF's own names (experts interface, FP8 experts, tensor-parallel styles) are untouched.
    assert mhf.FUSED not in ("deepgemm_megamoe", "megamoe_router", "megamoe_experts")
    assert interface["grouped_mm"] is grouped_mm_experts_forward
    mhf.register()  # idempotent


def test_register_refuses_to_replace_a_foreign_implementation(monkeypatch):
    monkeypatch.setitem(ExpertsInterface._global_mapping, mhf.FUSED, grouped_mm_experts_forward)
    with pytest.raises(RuntimeError, match="already registers"):
        mhf.register()


# ------------------------------------------------------------ model vs grouped_mm


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_logits_and_every_gradient_match_grouped_mm(kind):
    model = build(kind)
    ids = tokens()
    model.set_experts_implementation("grouped_mm")
    logits_hf, loss_hf, grads_hf = loss_and_grads(model, ids)
    model.set_experts_implementation(mhf.REFERENCE)
    logits, loss, grads = loss_and_grads(model, ids)
    assert_close(logits, logits_hf, "logits", rtol=1e-5)
    assert abs(loss.item() - loss_hf.item()) <= 1e-5 * abs(loss_hf.item())
    assert grads.keys() == grads_hf.keys()
    assert any("experts.gate_up_proj" in n for n in grads)  # trainable base reached
    for name in grads_hf:
        assert_close(grads[name], grads_hf[name], name)


def test_from_pretrained_with_experts_implementation(tmp_path):
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    ids = tokens()
    cls = transformers.Qwen3MoeForCausalLM
    ours = cls.from_pretrained(tmp_path, experts_implementation=mhf.REFERENCE)
    hf = cls.from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert ours.config._experts_implementation == mhf.REFERENCE
    with torch.no_grad():  # inference
        assert_close(ours(ids).logits, hf(ids).logits, "logits", rtol=1e-5)
    fused = cls.from_pretrained(tmp_path, experts_implementation=mhf.FUSED)
    with pytest.raises(RuntimeError, match=r"Hopper GPU \(sm_90"):
        fused(ids)


def test_twenty_adamw_steps_follow_grouped_mm():
    """Twenty AdamW steps on one batch (which the model learns: the loss falls), no
    weight decay: the loss curves agree, and so does each expert weight's total update
    (the loss alone would not see the experts' gradients dropped)."""
    runs = {}
    ids = tokens(seed=100)
    for impl in ("grouped_mm", mhf.REFERENCE):
        model = build("qwen3_moe", seed=3)
        model.set_experts_implementation(impl)
        experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
        start = {n: p.detach().clone() for n, p in experts.items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        curve = []
        for _ in range(20):
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        updates = {n: p.detach() - start[n] for n, p in experts.items()}
        runs[impl] = (torch.tensor(curve), updates)
    (ours, ours_updates), (hf, hf_updates) = runs[mhf.REFERENCE], runs["grouped_mm"]
    assert ours[-1] < 0.97 * ours[0], ours  # 5.04 -> 3.99
    assert torch.allclose(ours, hf, rtol=1e-3, atol=0), (ours, hf)
    assert len(hf_updates) == 4  # gate_up_proj and down_proj of both layers
    for name, want in hf_updates.items():
        # Adam's update is about sign(gradient) where the gradient is small, and
        # megamoe's base gradient arrives BF16-rounded: measured 0.5-3.4% apart. A dropped,
        # negated or misplaced gradient is 100% or more.
        assert_close(ours_updates[name], want, f"update of {name}", rtol=0.1)


# ------------------------------------------------------------- experts module level


def qwen3_experts(seed: int = 0, **config_overrides) -> nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(seed)
    module = Qwen3MoeExperts(qwen3_config(**config_overrides))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)
            p.copy_(p.to(torch.bfloat16))
    return module


def routing(tokens_: int, experts: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens_, H, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:K] for _ in range(tokens_)])
    weights = torch.rand(tokens_, K, generator=gen).to(dtype)
    return x, ids, weights


def run(forward, module, x, ids, weights):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = forward(module, x, ids, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {"x": x.grad, "weights": weights.grad}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return out.detach(), grads


def test_expert_parallel_sentinel_ids_are_masked_like_grouped_mm():
    module = qwen3_experts()
    x, ids, weights = routing(24, E)
    # HF's EP router: routes to other ranks get the sentinel E_l and a zero weight.
    foreign = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) < 0.3
    ids = torch.where(foreign, torch.full_like(ids, E), ids)
    weights = torch.where(foreign, torch.zeros_like(weights), weights)
    got, got_grads = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, want_grads = run(grouped_mm_experts_forward, module, x, ids, weights)
    assert_close(got, want, "out", rtol=1e-5)
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], name)
    # The masked slots' router gradient is exactly zero, as grouped_mm's.
    assert torch.all(got_grads["weights"][foreign] == 0)
    masked = mhf.mask_foreign_ids(ids, E)
    assert torch.equal(masked, torch.where(foreign, torch.full_like(ids, -1), ids))
    assert masked is not ids and int(ids.max()) == E  # the caller's routing is kept


def test_bf16_router_weights_are_accepted_and_get_a_bf16_gradient():
    module = qwen3_experts()
    x, ids, weights = routing(16, E, dtype=torch.bfloat16)
    got, grads = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, want_grads = run(mhf.reference_experts_forward, module, x, ids, weights.float())
    assert grads["weights"].dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(grads["weights"], want_grads["weights"].to(torch.bfloat16))


def test_gelu_tanh_config_maps_to_geglu():
    module = qwen3_experts(hidden_act="gelu_pytorch_tanh")
    assert mhf.experts_spec(module) == mhf.ExpertsSpec("geglu", None)
    x, ids, weights = routing(16, E)
    got, _ = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, _ = run(grouped_mm_experts_forward, module, x, ids, weights)
    assert_close(got, want, "out", rtol=1e-5)


@pytest.mark.parametrize(
    ("module_path", "config_name", "expected"),
    [
        # Gemma4 names its activation config.hidden_activation.
        (
            "transformers.models.gemma4.modeling_gemma4.Gemma4TextExperts",
            "Gemma4TextConfig",
            "geglu",
        ),
        # Lfm2-MoE sets act_fn = F.silu, with no activation in its config.
        (
            "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeExperts",
            "Lfm2MoeConfig",
            "swiglu",
        ),
    ],
)
def test_the_activation_comes_from_act_fn_or_hidden_activation(module_path, config_name, expected):
    module_name, cls_name = module_path.rsplit(".", 1)
    cls = getattr(pytest.importorskip(module_name), cls_name)
    config = getattr(transformers, config_name)(
        hidden_size=H, moe_intermediate_size=I, num_experts=E
    )
    torch.manual_seed(0)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)
            p.copy_(p.to(torch.bfloat16))
    assert mhf.experts_spec(module) == mhf.ExpertsSpec(expected, None)
    x, ids, weights = routing(16, E)
    got, _ = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, _ = run(grouped_mm_experts_forward, module, x, ids, weights)
    assert_close(got, want, "out", rtol=1e-5)


def test_swiglu_limit_maps_to_the_clamp_deepseek_v4():
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config = transformers.DeepseekV4Config(
        hidden_size=H, moe_intermediate_size=I, intermediate_size=I, num_local_experts=E,
        n_routed_experts=E, swiglu_limit=0.5, hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(0)
    module = v4.DeepseekV4Experts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
            p.copy_(p.to(torch.bfloat16))
    assert mhf.experts_spec(module) == mhf.ExpertsSpec("swiglu", 0.5)
    x, ids, weights = routing(32, E)
    got, got_grads = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, want_grads = run(grouped_mm_experts_forward, module, x, ids, weights)
    assert_close(got, want, "out", rtol=1e-5)
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], name)


@use_experts_implementation(is_transposed=True)
class TransposedExperts(nn.Module):
    """Experts stored ``[E, H, 2I]`` / ``[E, I, H]`` (``is_transposed=True``)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate_up_proj = nn.Parameter((torch.randn(E, H, 2 * I) * 0.2).bfloat16().float())
        self.down_proj = nn.Parameter((torch.randn(E, I, H) * 0.2).bfloat16().float())
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states, top_k_index, top_k_weights):  # eager path unused here
        raise NotImplementedError


def test_transposed_experts_are_supported():
    torch.manual_seed(0)
    module = TransposedExperts(qwen3_config())
    x, ids, weights = routing(16, E)
    got, got_grads = run(mhf.reference_experts_forward, module, x, ids, weights)
    want, want_grads = run(grouped_mm_experts_forward, module, x, ids, weights)
    assert_close(got, want, "out", rtol=1e-5)
    for name in want_grads:
        assert got_grads[name].shape == want_grads[name].shape
        assert_close(got_grads[name], want_grads[name], name)


@use_experts_implementation
class ClampAfterActivationExperts(nn.Module):
    """A gate megamoe does not compute: the clamp after the activation (Step-3.7)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.act_fn = ACT2FN[config.hidden_act]

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate).clamp(max=2.0) * up


@use_experts_implementation
class ClampedExperts(nn.Module):
    """A gate clamped at ``limit`` (DeepSeek-V4's default 10): both halves as megamoe
    clamps them, or the gate only (a gate megamoe does not compute)."""

    def __init__(self, config, *, clamp_up: bool):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.act_fn = ACT2FN[config.hidden_act]
        self.limit = 10.0
        self.clamp_up = clamp_up

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if self.clamp_up:
            up = up.clamp(-self.limit, self.limit)
        return self.act_fn(gate.clamp(max=self.limit)) * up


def test_the_gate_probe_spans_past_the_clamp_in_both_halves():
    # The probe once fed `up` values within +-9 only: a limit of 10 on the gate alone
    # passed it, and megamoe then clamped `up` too (a different result).
    spec = mhf.experts_spec(ClampedExperts(qwen3_config(), clamp_up=True))
    assert spec.clamp == 10.0
    refused = "computes a gate other than megamoe's swiglu with clamp 10"
    with pytest.raises(ValueError, match=refused):
        mhf.experts_spec(ClampedExperts(qwen3_config(), clamp_up=False))


def _compiled_spec(module: nn.Module, fullgraph: bool):
    """``experts_spec`` as a compiled model's first traced call reaches it."""
    torch._dynamo.reset()

    def spec_clamp(x):
        return x * mhf.experts_spec(module).clamp

    return torch.compile(spec_clamp, backend="eager", fullgraph=fullgraph)(torch.ones(2))


def test_a_first_call_under_torch_compile_still_probes_the_gate():
    """A module whose first call is traced by torch.compile once got the static checks
    only, so a gate megamoe does not compute ran as megamoe's (a review, with
    MiniMax-M3's gate). The probe now runs outside the graph: the same refusal as in
    eager mode, and a module that passes is cached (no probe in later traces)."""
    refused = "computes a gate other than megamoe's swiglu with clamp 10"
    with pytest.raises(ValueError, match=refused):
        _compiled_spec(ClampedExperts(qwen3_config(), clamp_up=False), fullgraph=False)
    passing = ClampedExperts(qwen3_config(), clamp_up=True)
    assert _compiled_spec(passing, fullgraph=False).tolist() == [10.0, 10.0]
    assert mhf.experts_spec(passing) is passing.__dict__["_megamoe_spec"]
    # fullgraph=True cannot break the graph for the probe: dynamo refuses, naming why;
    # check_experts first probes eagerly, and the compiled call reads the cached spec.
    fresh = ClampedExperts(qwen3_config(), clamp_up=True)
    with pytest.raises(Exception, match=r"check_experts\(model\)"):
        _compiled_spec(fresh, fullgraph=True)
    model = nn.ModuleDict({"experts": ClampedExperts(qwen3_config(), clamp_up=True)})
    assert list(mhf.check_experts(model)) == ["experts"]
    assert _compiled_spec(model["experts"], fullgraph=True).tolist() == [10.0, 10.0]


def test_unsupported_experts_get_a_clear_error():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    module = gpt_oss.GptOssExperts(
        transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E)
    )
    with pytest.raises(ValueError, match="has biases"):
        mhf.experts_spec(module)
    module.has_bias = False  # the next check in line: the interleaved layout
    with pytest.raises(ValueError, match="is_concatenated=False"):
        mhf.experts_spec(module)

    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    config = transformers.NemotronHConfig(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_hidden_layers=1
    )
    with pytest.raises(ValueError, match="has_gate=False"):
        mhf.experts_spec(nemotron.NemotronHExperts(config))

    with pytest.raises(ValueError, match="computes a gate other than"):
        mhf.experts_spec(ClampAfterActivationExperts(qwen3_config()))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        mhf.experts_spec(qwen3_experts(hidden_act="relu"))


def test_fused_name_on_cpu_raises_one_clear_message():
    module = qwen3_experts()
    x, ids, weights = routing(4, E)
    with pytest.raises(RuntimeError, match=r"Hopper GPU \(sm_90.*grouped_mm"):
        mhf.fused_experts_forward(module, x, ids, weights)


# ----------------------------------------------------------------------- side-LoRA


def randomize_adapters(model, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter in mhf._adapters(model):
            for p in adapter.parameters():
                p.copy_((torch.randn(p.shape, generator=gen) * 0.3).to(p.dtype))


def test_attached_adapters_start_at_zero_and_train_with_the_base_frozen():
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
    names = mhf.attach_side_lora(model, rank=16, alpha=32.0, dtype=torch.float32)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # b1, b3, b2 start at zero
    params = mhf.mark_only_side_lora_as_trainable(model)
    assert len(params) == 6 * len(names)
    assert all(p.requires_grad == any(p is q for q in params) for p in model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    side = mhf.side_lora_layers(model)[names[0]]
    assert side.scale == 2.0 and side.b2.abs().sum() > 0
    # A second attach would drop the trained adapters silently (the optimizer above would
    # go on training orphaned tensors; a review): refused unless asked to replace them.
    with pytest.raises(ValueError, match=r"^model: 2 experts module\(s\) already hold"):
        mhf.attach_side_lora(model, rank=16)
    assert mhf.side_lora_layers(model)[names[0]].b2.abs().sum() > 0  # nothing changed
    assert mhf.attach_side_lora(model, rank=16, replace=True) == names
    assert mhf.side_lora_layers(model)[names[0]].b2.abs().sum() == 0  # fresh ones


def test_an_experts_implementation_that_ignores_the_adapters_is_refused():
    """Side-LoRA attached, the experts switched to ``grouped_mm`` (which has no idea of
    the adapter): the forward raises instead of silently running without it."""
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(model, rank=16, dtype=torch.float32)
    randomize_adapters(model)
    ids = tokens()
    with torch.no_grad():
        model(ids)
        model.set_experts_implementation("grouped_mm")
        refused = r"^experts_implementation: .* 'grouped_mm' does not apply"
        with pytest.raises(ValueError, match=refused):
            model(ids)
        for _, module in mhf.experts_modules(model):
            delattr(module, mhf.ADAPTER_ATTR)
        model(ids)  # without adapters grouped_mm is the model's function again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_adapter_loads_in_peft_and_round_trips(tmp_path, dtype):
    peft = pytest.importorskip("peft")
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(model, rank=16, alpha=32.0, dtype=dtype)
    randomize_adapters(model)
    ids = tokens()
    with torch.no_grad():
        ours = model(ids).logits
    config = mhf.save_side_lora(model, tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["r"] == 32  # a1 != a3: the exact stacked export at rank 2r

    # Oracle: PEFT's own LoRA on the experts' parameters, on transformers' grouped_mm.
    plain = build("qwen3_moe")
    plain.set_experts_implementation("grouped_mm")
    peft_model = peft.PeftModel.from_pretrained(plain, str(tmp_path))
    with torch.no_grad():
        theirs = peft_model(ids).logits
    assert_close(ours, theirs, "logits vs PEFT", rtol=1e-5 if dtype == torch.float32 else 2e-3)

    # Back into megamoe: the same factors (bitwise for float32) and the same function.
    again = build("qwen3_moe")
    again.set_experts_implementation(mhf.REFERENCE)
    assert mhf.load_side_lora(again, tmp_path, dtype=dtype) == list(mhf.side_lora_layers(model))
    for name, side in mhf.side_lora_layers(model).items():
        loaded = mhf.side_lora_layers(again)[name]
        assert loaded.scale == side.scale and loaded.rank == side.rank
        for a, b in zip(loaded.tensors(), side.tensors(), strict=True):
            assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)


@pytest.mark.parametrize("rank", [16, 8])
def test_adapter_trained_by_peft_with_shared_outer_factors_loads(tmp_path, rank):
    """A PEFT-trained ``target_parameters`` adapter whose gate_up ``A`` and down ``B``
    are tied across experts is a shared-outer adapter: it loads and gives PEFT's output,
    also at PEFT's default rank 8 (read at the kernels' rank 16, zeros added)."""
    peft = pytest.importorskip("peft")
    plain = build("qwen3_moe")
    plain.set_experts_implementation("grouped_mm")
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=16,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    peft_model = peft.get_peft_model(plain, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name and "base_layer" in name:  # gate_up A: [E*r, H]
                p.copy_(p[:rank].repeat(E, 1))
            elif "lora_B" in name and "base_layer" not in name:  # down B: [H, r*E]
                p.copy_(p.view(H, rank, E)[:, :, :1].expand(H, rank, E).reshape(H, rank * E))
    ids = tokens()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.load_side_lora(model, tmp_path, dtype=torch.float32)
    side = next(iter(mhf.side_lora_layers(model).values()))
    assert torch.equal(side.a1, side.a3)  # one shared A for gate and up
    assert side.rank == 16
    with torch.no_grad():
        assert_close(model(ids).logits, theirs, "logits vs PEFT", rtol=1e-5)


def test_megatron_round_trip_is_exact():
    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=16, scale=0.25, dtype=torch.float32)
    randomize_adapters(model)
    state, config = mhf.megatron_state_dict(model)
    assert set(state) >= {
        "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight",
        "decoder.layers.1.mlp.experts.linear_fc2.adapter.linear_out.weight",
    }
    assert config["experts_shared_outer_loras"] is True
    again = build("qwen3_moe")
    mhf.load_megatron_state_dict(again, state, alpha=config["alpha"], dtype=torch.float32)
    for name, side in mhf.side_lora_layers(model).items():
        loaded = mhf.side_lora_layers(again)[name]
        assert loaded.scale == side.scale
        for a, b in zip(loaded.tensors(), side.tensors(), strict=True):
            assert torch.equal(a, b)


def test_float16_adapter_files_load_into_the_dtype_asked_for(tmp_path):
    """PEFT saves an FP16 model's adapter in FP16. ``load_side_lora`` and
    ``load_megatron_state_dict`` did not hand their ``dtype=`` to the converter, which
    then refused FP16 asking for the very ``dtype=`` given (a review). FP16 widens to
    FP32 exactly: the FP16 file loads bit for bit as its FP32 widening does."""
    from safetensors.torch import load_file, save_file

    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=16, alpha=32.0, dtype=torch.float32)
    randomize_adapters(model)
    mhf.save_side_lora(model, tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    state = load_file(str(weights))
    save_file({k: v.half() for k, v in state.items()}, str(weights))
    half = build("qwen3_moe")
    mhf.load_side_lora(half, tmp_path, dtype=torch.float32)
    save_file({k: v.half().float() for k, v in state.items()}, str(weights))
    widened = build("qwen3_moe")
    mhf.load_side_lora(widened, tmp_path, dtype=torch.float32)
    megatron, config = mhf.megatron_state_dict(model)
    half_megatron = build("qwen3_moe")
    mhf.load_megatron_state_dict(
        half_megatron, {k: v.half() for k, v in megatron.items()}, alpha=config["alpha"],
        dtype=torch.float32,
    )  # fmt: skip
    widened_megatron = build("qwen3_moe")
    mhf.load_megatron_state_dict(
        widened_megatron, {k: v.half().float() for k, v in megatron.items()},
        alpha=config["alpha"], dtype=torch.float32,
    )  # fmt: skip
    for got, want in ((half, widened), (half_megatron, widened_megatron)):
        for name, side in mhf.side_lora_layers(want).items():
            loaded = mhf.side_lora_layers(got)[name]
            assert loaded.scale == side.scale and loaded.a1.dtype == torch.float32
            for a, b in zip(loaded.tensors(), side.tensors(), strict=True):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"^dtype: the adapter's factors are torch.float16"):
        mhf.load_megatron_state_dict(
            build("qwen3_moe"), {k: v.half() for k, v in megatron.items()}, alpha=config["alpha"]
        )


def test_megatron_layout_refuses_two_stacks_on_one_layer_index():
    """Two decoder stacks (a thinker and a talker, as Qwen3-Omni-MoE has) map their
    layer i to one Megatron prefix: exporting or loading refuses instead of letting one
    stack's adapters overwrite the other's. A Megatron file without the fc1 input key
    is a ValueError too."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.Module()
            layer.mlp = nn.Module()
            layer.mlp.experts = Qwen3MoeExperts(qwen3_config())
            self.layers = nn.ModuleList([layer])

    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=16, dtype=torch.float32)
    state, config = mhf.megatron_state_dict(model)

    two = nn.Module()
    two.thinker, two.talker = Stack(), Stack()
    with pytest.raises(ValueError, match="both map to Megatron's 'decoder.layers.0.mlp.experts'"):
        mhf.load_megatron_state_dict(two, state, alpha=config["alpha"])
    mhf.attach_side_lora(two, rank=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="both map to Megatron's"):
        mhf.megatron_state_dict(two)

    partial_state = {k: v for k, v in state.items() if "linear_fc1.adapter.linear_in" not in k}
    with pytest.raises(ValueError, match="no 'decoder.layers.0.mlp.experts.linear_fc1"):
        mhf.load_megatron_state_dict(build("qwen3_moe"), partial_state, alpha=config["alpha"])


def test_peft_keeps_and_saves_the_adapters_with_modules_to_save(tmp_path):
    """Under a PEFT model (LoRA on attention here) the side-LoRA factors stay trainable
    and land in PEFT's adapter_model.safetensors when named in ``modules_to_save``."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(model, rank=16, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, target_modules=["q_proj"], modules_to_save=mhf.PEFT_MODULES_TO_SAVE
    )
    peft_model = peft.get_peft_model(model, config)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert sum("megamoe_side_lora" in n for n in trainable) == 2 * 6
    assert not any("gate_up_proj" in n for n in trainable)
    ids = tokens()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # the trainable copy is the one the experts use
        loss = peft_model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = {n: s.b2.detach().clone() for n, s in mhf.side_lora_layers(peft_model).items()}
    assert all(b2.abs().sum() > 0 for b2 in trained.values())
    peft_model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sum("megamoe_side_lora" in k for k in saved) >= 2 * 6
    with torch.no_grad():
        want = peft_model(ids).logits

    fresh = build("qwen3_moe")
    fresh.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(fresh, rank=16, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)


def test_loading_under_peft_fills_the_active_copies_only(tmp_path):
    """Under PEFT's ``modules_to_save`` the loaded adapter goes into the active copies:
    the original module is what runs with the adapters disabled, so it keeps the zero
    adapter and ``disable_adapter()`` gives the base model (it had been loaded too). A
    dtype other than the copies' is refused (it was ignored)."""
    peft = pytest.importorskip("peft")
    source = build("qwen3_moe")
    mhf.attach_side_lora(source, rank=16, alpha=32.0, dtype=torch.float32)
    randomize_adapters(source)
    mhf.save_side_lora(source, tmp_path)

    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    ids = tokens()
    with torch.no_grad():
        base = model(ids).logits
    mhf.attach_side_lora(model, rank=16, alpha=32.0, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, target_modules=["q_proj"], modules_to_save=mhf.PEFT_MODULES_TO_SAVE
    )
    wrapped = peft.get_peft_model(model, config)
    with pytest.raises(ValueError, match=r"^dtype: the side-LoRA under PEFT's modules_to_save"):
        mhf.load_side_lora(wrapped, tmp_path, dtype=torch.bfloat16)
    mhf.load_side_lora(wrapped, tmp_path)
    source.set_experts_implementation(mhf.REFERENCE)
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, source(ids).logits)  # q_proj's B is zero
        with wrapped.disable_adapter():
            assert torch.equal(wrapped(ids).logits, base)


def test_side_lora_files_of_a_peft_model_name_the_hf_modules(tmp_path):
    """``save_side_lora`` / ``load_side_lora`` / the Megatron export on a PEFT model
    (side-LoRA under ``modules_to_save``) use the HF model's module names, not PEFT's
    ``base_model.model.`` ones: the file loads in PEFT and back into megamoe."""
    peft = pytest.importorskip("peft")
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(model, rank=16, alpha=32.0, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, target_modules=["q_proj"], modules_to_save=mhf.PEFT_MODULES_TO_SAVE
    )
    peft_model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for side in mhf.side_lora_layers(peft_model).values():  # the active copies
            for t in side.tensors():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
    ids = tokens()
    with torch.no_grad():
        ours = peft_model(ids).logits  # q_proj's LoRA starts at zero
    mhf.save_side_lora(peft_model, tmp_path)
    state, _ = mhf.megatron_state_dict(peft_model)
    assert sorted({k.split(".mlp.")[0] for k in state}) == ["decoder.layers.0", "decoder.layers.1"]

    again = build("qwen3_moe")
    again.set_experts_implementation(mhf.REFERENCE)
    assert mhf.load_side_lora(again, tmp_path) == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)

    # Loading into a PEFT model fills PEFT's copies (which it trains and saves).
    from safetensors.torch import load_file

    config = peft.LoraConfig(
        r=8, target_modules=["q_proj"], modules_to_save=mhf.PEFT_MODULES_TO_SAVE
    )
    wrapped = peft.get_peft_model(again, config)
    names = mhf.load_side_lora(wrapped, tmp_path)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, ours)
    wrapped.save_pretrained(tmp_path / "peft")
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert sum("megamoe_side_lora" in k for k in saved) >= 2 * 6

    plain = build("qwen3_moe")
    plain.set_experts_implementation("grouped_mm")  # (a global setting: last)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(plain, str(tmp_path))(ids).logits
    assert_close(ours, theirs, "logits vs PEFT", rtol=1e-5)


def test_save_pretrained_accepts_a_model_with_adapters(tmp_path):
    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=16, scale=0.5)
    model.save_pretrained(tmp_path)  # extra state is a tensor: safetensors accepts it
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.0.mlp.experts.megamoe_side_lora._extra_state"
    assert state[key].item() == 0.5
    again = build("qwen3_moe")
    mhf.attach_side_lora(again, rank=16, scale=1.0)
    again.load_state_dict(state, strict=False)
    assert next(iter(mhf.side_lora_layers(again).values())).scale == 0.5


def _fsdp2_worker(rank: int, world: int, directory: str) -> dict:
    """Adapters under FSDP2 data parallelism: attached before ``fully_shard`` they train
    and save whole (the sharded factors gathered); attaching after is refused with a
    message that names ``fully_shard`` (FSDP would not synchronize them)."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(model, rank=16, dtype=torch.float32)
    randomize_adapters(model)
    mhf.save_side_lora(model, f"{directory}/whole{rank}")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(tokens(seed=rank), labels=tokens(seed=rank)).loss.backward()
    mhf.save_side_lora(model, f"{directory}/sharded{rank}")
    whole = load_file(f"{directory}/whole{rank}/{mhf.ADAPTER_WEIGHTS}")
    sharded = load_file(f"{directory}/sharded{rank}/{mhf.ADAPTER_WEIGHTS}")
    saved_whole = whole.keys() == sharded.keys() and all(
        torch.equal(whole[k], sharded[k]) for k in whole
    )
    late = build("qwen3_moe")
    fully_shard(late, mesh=mesh)
    try:
        mhf.attach_side_lora(late, rank=16)
        refused = False
    except ValueError as exc:
        refused = "fully_shard" in str(exc)
    return {"saved_whole": saved_whole, "late_attach_refused": refused}


def test_adapters_under_fsdp2_train_and_save_whole(tmp_path):
    from megamoe.ep import run_gloo

    got = run_gloo(_fsdp2_worker, 2, str(tmp_path))
    assert got == [{"saved_whole": True, "late_attach_refused": True}] * 2


def _split_experts_worker(rank: int, world: int) -> dict:
    """Adapters on experts that HF's expert parallelism split over the ranks (DTensor
    weights, Shard(0) on the experts) are refused, at attach, load and forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    refused = []

    def split(model, placement):
        for _, experts in mhf.experts_modules(model):
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name).detach()
                shard = distribute_tensor(full, mesh, [placement])
                setattr(experts, name, nn.Parameter(shard, requires_grad=False))

    def expect_refusal(fn):
        try:
            fn()
        except ValueError as exc:
            refused.append(f"split over {world} ranks" in str(exc))
        else:
            refused.append(False)

    model = build("qwen3_moe")
    model.set_experts_implementation(mhf.REFERENCE)
    split(model, Shard(0))
    expect_refusal(lambda: mhf.attach_side_lora(model, rank=16))
    # Attached first, split afterwards: the forward refuses.
    attached = build("qwen3_moe")
    attached.set_experts_implementation(mhf.REFERENCE)
    mhf.attach_side_lora(attached, rank=16, dtype=torch.float32)
    layers = mhf.side_lora_layers(attached)
    split(attached, Shard(0))
    expect_refusal(lambda: attached(tokens()))
    # Loading adapters onto split experts: refused too.
    fresh = build("qwen3_moe")
    split(fresh, Shard(0))
    name, side = next(iter(layers.items()))
    experts = dict(mhf.experts_modules(fresh))[name]
    expect_refusal(lambda: mhf._install_adapter(experts, side, torch.float32))
    # Replicated weights are whole on every rank: adapters are allowed.
    whole = build("qwen3_moe")
    split(whole, Replicate())
    mhf.attach_side_lora(whole, rank=16)
    return {"refused": refused}


def test_adapters_on_experts_split_over_ranks_are_refused():
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    from megamoe.ep import run_gloo

    assert run_gloo(_split_experts_worker, 2) == [{"refused": [True, True, True]}] * 2


def test_fused_name_on_another_gpu_names_it(monkeypatch):
    """(The GPU simulated: the check reads torch's answers for the device.)"""
    from megamoe.validation import layer

    monkeypatch.setattr(layer, "_HOPPER_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"Hopper GPU \(sm_90.*cuda:2 is NVIDIA A100.*sm_80"):
        mhf.check_device(torch.device("cuda", 2))


def test_an_adapter_at_its_initial_state_keeps_its_full_rank_on_load(tmp_path):
    """A zero gate/up B (the adapter before its first step: Megatron's zero-initialised
    linear_out, or a save right after attaching with a3 tied to a1) is block-diagonal
    too. The automatic split read it as two halves: half of every A's slots met only
    zero rows of B, so they never trained, and the round trip was not exact."""
    experts = dict(mhf.experts_modules(build("qwen3_moe")))["model.layers.0.mlp.experts"]
    num_experts, hidden, inter = mhf._dims(experts)
    rank, gen = 16, torch.Generator().manual_seed(0)
    state = {}
    for i in (0, 1):
        prefix = f"decoder.layers.{i}.mlp.experts"
        state[f"{prefix}.linear_fc1.adapter.linear_in.weight"] = torch.randn(
            rank, hidden, generator=gen
        )
        state[f"{prefix}.linear_fc1.adapter.linear_out.weight"] = torch.zeros(
            num_experts, 2 * inter, rank
        )
        state[f"{prefix}.linear_fc2.adapter.linear_in.weight"] = torch.randn(
            num_experts, rank, inter, generator=gen
        )
        state[f"{prefix}.linear_fc2.adapter.linear_out.weight"] = torch.zeros(hidden, rank)
    model = build("qwen3_moe")
    mhf.load_megatron_state_dict(model, state, alpha=32.0, dtype=torch.float32)
    for side in mhf.side_lora_layers(model).values():
        assert side.rank == rank and torch.equal(side.a1, side.a3)
        assert int(side.a1.abs().sum(0).ne(0).sum()) == rank  # every slot live

    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=rank, dtype=torch.float32)
    with torch.no_grad():
        for side in mhf.side_lora_layers(model).values():
            side.a3.copy_(side.a1)  # tied gate/up A, B still zero
    mhf.save_side_lora(model, tmp_path)
    loaded = build("qwen3_moe")
    mhf.load_side_lora(loaded, tmp_path)
    pairs = zip(mhf.side_lora_layers(model).values(), mhf.side_lora_layers(loaded).values())
    for saved, read in pairs:
        assert all(torch.equal(a, b) for a, b in zip(saved.tensors(), read.tensors()))


@pytest.mark.parametrize("rank", [16, 160])
@pytest.mark.parametrize("form", ["peft", "megatron"])
def test_an_untrained_adapter_round_trips_at_its_rank(tmp_path, rank, form):
    """attach_side_lora's adapter before its first step (a1, a3 independent, every B
    zero) is written stacked at rank 2r, the down pair zero-padded. The automatic read
    took its zero B for one shared A and read it whole: rank 2r with a1 == a3 (rank 16
    came back as 32; 160 failed, 320 being past the kernels' 256). The padded down pair
    marks the stacked form: it reads back at r, bit for bit. Past 256 the whole read that
    shows the padding cannot run, and a shared-A adapter there must not be split
    silently: the automatic read asks for split_gate_up=True, which reads it exactly."""
    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=rank, dtype=torch.float32)
    loaded = build("qwen3_moe")
    past = 2 * rank > 256
    if form == "peft":
        mhf.save_side_lora(model, tmp_path)

        def load(**kw):
            return mhf.load_side_lora(loaded, tmp_path, **kw)
    else:
        state, config = mhf.megatron_state_dict(model)
        assert config["dim"] == 2 * rank  # the stacked form

        def load(**kw):
            return mhf.load_megatron_state_dict(loaded, state, alpha=config["alpha"], **kw)

    if past:
        with pytest.raises(ValueError, match=r"^split_gate_up: .* Pass split_gate_up=True"):
            load()
        load(split_gate_up=True)
    else:
        load()
    saved, read = mhf.side_lora_layers(model), mhf.side_lora_layers(loaded)
    assert saved.keys() == read.keys()
    for name in saved:
        assert read[name].rank == rank and read[name].scale == saved[name].scale, name
        assert all(torch.equal(a, b) for a, b in zip(saved[name].tensors(), read[name].tensors()))


def test_under_peft_modules_to_save_only_the_active_copies_are_marked_trainable():
    """PEFT keeps the original adapter beside its trainable copy; the original never runs
    in the forward, so it got no gradient but was handed to the optimizer as trainable."""
    import peft

    model = build("qwen3_moe")
    mhf.attach_side_lora(model, rank=16, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, target_modules=["q_proj"], modules_to_save=mhf.PEFT_MODULES_TO_SAVE
    )
    peft_model = peft.get_peft_model(model, config)
    params = mhf.mark_only_side_lora_as_trainable(peft_model)
    trainable = {id(p) for p in peft_model.parameters() if p.requires_grad}
    assert {id(p) for p in params} == trainable
    assert len(params) == 6 * len(mhf.side_lora_layers(peft_model))
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert names and not any("original_module" in n for n in names)
