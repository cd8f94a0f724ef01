"""The PEFT converter against a live PEFT model (skipped where peft is not installed).

A tiny experts container with per-expert gate/up/down ``nn.Linear`` layers is wrapped
by ``peft.get_peft_model``; the shared factors are made shared (gate/up ``lora_A`` and
down ``lora_B`` copied from expert 0), the adapter is read back with
``get_peft_model_state_dict`` and converted. The independent oracle is PEFT's own
forward of each expert (base + LoRA, its own scaling); megamoe's float64 reference
with top-1 routing to that expert must give the same output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megamoe as mm
from megamoe.adapter_convert import side_lora_from_peft

peft = pytest.importorskip("peft")

H, INTER, E, R, ALPHA = 64, 64, 4, 16, 32


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(H, INTER, bias=False)
        self.up_proj = torch.nn.Linear(H, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # unused: experts are called directly
        return x


@pytest.mark.parametrize("use_rslora", [False, True])
def test_converted_peft_adapter_reproduces_peft_forward(use_rslora):
    torch.manual_seed(0)
    model = Experts().double()
    config = peft.LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random A and B: every adapter path is nonzero
        use_rslora=use_rslora,
    )
    wrapped = peft.get_peft_model(model, config)
    experts = wrapped.base_model.model.experts
    with torch.no_grad():  # shared-outer: one gate/up lora_A and one down lora_B
        for expert in experts[1:]:
            for proj, factor in (("gate_proj", "lora_A"), ("up_proj", "lora_A")):
                getattr(getattr(expert, proj), factor)["default"].weight.copy_(
                    getattr(getattr(experts[0], proj), factor)["default"].weight
                )
            expert.down_proj.lora_B["default"].weight.copy_(
                experts[0].down_proj.lora_B["default"].weight
            )
    state = peft.get_peft_model_state_dict(wrapped)
    side = side_lora_from_peft(
        state,
        "base_model.model.experts",
        lora_alpha=ALPHA,
        use_rslora=use_rslora,
        dtype=torch.float64,
    )

    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]).detach()
    w2 = torch.stack([e.down_proj.weight for e in experts]).detach()
    base = mm.prepare_base_weights(w13.float(), w2.float())
    # prepare_base_weights rounds to BF16: give PEFT the same base values.
    with torch.no_grad():
        for e, expert in enumerate(experts):
            expert.gate_proj.weight.copy_(w13[e, :INTER].to(torch.bfloat16))
            expert.up_proj.weight.copy_(w13[e, INTER:].to(torch.bfloat16))
            expert.down_proj.weight.copy_(w2[e].to(torch.bfloat16))

    tokens = 12
    x = torch.randn(tokens, H, dtype=torch.float64)
    ids = torch.arange(tokens, dtype=torch.int64).remainder(E).view(tokens, 1)
    weights = torch.ones(tokens, 1, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.stack([experts[int(ids[t])](x[t]) for t in range(tokens)])
        out = mm.reference.moe(x, ids, weights, base, side)
    assert torch.allclose(out, expected, rtol=1e-10, atol=1e-10)
