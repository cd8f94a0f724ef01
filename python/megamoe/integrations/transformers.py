"""megamoe as an HF transformers experts implementation, and side-LoRA for HF models.

Importing this module registers two names in transformers' experts interface
(``transformers.integrations.moe.ExpertsInterface``, transformers >= 5):

- ``"megamoe_fused"`` (:data:`FUSED`): :func:`megamoe.moe` on the fused Hopper kernels,
  forward and backward (training and inference);
- ``"megamoe_reference"`` (:data:`REFERENCE`): :func:`megamoe.reference.moe` in float32,
  on any device. Slow; for tests and debugging (it is what the CPU tests run).

Usage::

    import megamoe.integrations.transformers  # registers the names
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="megamoe_fused")

Which experts modules are supported. Any class decorated with transformers'
``@use_experts_implementation`` whose weights are ``gate_up_proj [E, 2I, H]`` (rows
``0..I-1`` gate, ``I..2I-1`` up: ``is_concatenated=True``) and ``down_proj [E, H, I]``
(Qwen2/3-MoE, Qwen3-Next, Mixtral, OLMoE, DeepSeek-V3/V4, ...). ``is_transposed=True``
(``[E, H, 2I]`` / ``[E, I, H]``) is accepted at the cost of a transposed copy of the
weights every call. Unsupported, with a ``ValueError`` naming the reason: biases
(``has_bias=True``), interleaved gate/up rows (``is_concatenated=False``, gpt-oss),
ungated experts (``has_gate=False``), and a gate other than megamoe's: the activation
is the module's ``act_fn`` where it is SiLU or tanh-GELU (Lfm2-MoE sets ``F.silu``),
else the name in its config (``hidden_act``, or ``hidden_activation`` as Gemma's configs
call it: ``silu``/``swish`` -> SwiGLU, ``gelu_pytorch_tanh``/``gelu_new`` -> GeGLU), and
the clamp from the module's ``limit`` (DeepSeek-V4's
``config.swiglu_limit``: ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` before the
activation). On first use in eager mode the module's own ``_apply_gate`` is evaluated on
a fixed probe and compared with megamoe's activation, so a model whose gate differs
(a clamp after the activation, a custom GLU) is refused instead of silently changed.

Routing as HF hands it over: ``top_k_index [T, K]`` int64 and ``top_k_weights [T, K]``
in the model dtype (BF16 in a BF16 model: cast to FP32 here, differentiably). Expert
ids outside ``[0, E_l)`` are masked routes: HF's expert-parallel router marks routes to
other ranks with the sentinel ``E_l`` (``num_local_experts``) and a zero weight, and
megamoe's masked route (id ``-1``) contributes nothing to the output and gets a zero
router gradient, which is what HF's ``grouped_mm`` gives a sentinel slot. Under HF's
expert parallelism the expert weights may be DTensors: their local shards are used
(``to_local()``, no gather); side-LoRA adapters are refused on experts split over ranks
(:func:`check_adapters_allowed`).

Side-LoRA (shared-outer adapters, DESIGN §1) for HF models: :func:`attach_side_lora`
puts a :class:`SideLoRAAdapter` (the six factors as ``nn.Parameter``s) on every experts
module as ``experts.megamoe_side_lora``; both implementations above use it.
:func:`save_side_lora` / :func:`load_side_lora` write and read PEFT-format files
(``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's ``target_parameters``
layout on ``gate_up_proj``/``down_proj``: PEFT itself loads them onto the plain HF
model), :func:`megatron_state_dict` / :func:`load_megatron_state_dict` convert to and
from Megatron-Bridge's shared-outer layout. To train them next to a PEFT adapter on
other modules, pass ``modules_to_save=PEFT_MODULES_TO_SAVE`` to ``LoraConfig``: PEFT
then keeps the factors trainable and writes them into its ``adapter_model.safetensors``
(without it PEFT freezes every parameter that is not its own and saves none of them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError as exc:  # transformers 4 has no experts interface
    raise ImportError(
        "megamoe.integrations.transformers needs transformers >= 5 (its experts "
        "interface); install the extra: pip install 'megamoe[hf]'"
    ) from exc

from .. import ops, reference
from ..adapter_convert import (
    side_lora_from_megatron,
    side_lora_from_peft_fused,
    side_lora_to_megatron,
    side_lora_to_peft_fused,
)
from ..side_lora import SIDE_NAMES, SIDE_RANK_MULTIPLE, SideLoRA, check_side_rank
from ..validation.arguments import check_finite_float, check_int
from ..validation.layer import not_hopper
from ..weights import prepare_base_weights

__all__ = [
    "ADAPTER_ATTR",
    "FUSED",
    "PEFT_MODULES_TO_SAVE",
    "REFERENCE",
    "ExpertsSpec",
    "SideLoRAAdapter",
    "attach_side_lora",
    "check_device",
    "check_experts",
    "experts_modules",
    "experts_spec",
    "fused_experts_forward",
    "load_megatron_state_dict",
    "load_side_lora",
    "mark_only_side_lora_as_trainable",
    "mask_foreign_ids",
    "megatron_state_dict",
    "reference_experts_forward",
    "register",
    "save_side_lora",
    "side_lora_layers",
]

#: The fused experts implementation's name (``experts_implementation=FUSED``).
FUSED = "megamoe_fused"
#: The float32 reference implementation's name (any device; tests and debugging).
REFERENCE = "megamoe_reference"
#: Attribute name of the :class:`SideLoRAAdapter` on an experts module.
ADAPTER_ATTR = "megamoe_side_lora"
#: ``LoraConfig(modules_to_save=PEFT_MODULES_TO_SAVE)`` keeps megamoe's adapters
#: trainable under a PEFT model and saves them in its adapter file.
PEFT_MODULES_TO_SAVE = [ADAPTER_ATTR]

#: ``config.hidden_act`` (or ``hidden_activation``) -> megamoe activation (the gate's
#: ``act(g) * u``).
ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
}

_ADAPTER_DTYPES = (torch.bfloat16, torch.float32)
_ALTERNATIVE = "use experts_implementation='grouped_mm' for this model"


# ------------------------------------------------------------------- experts spec


@dataclass(frozen=True)
class ExpertsSpec:
    """What megamoe computes for one HF experts module: ``activation`` (``"swiglu"``
    or ``"geglu"``) and ``clamp`` (``None`` or ``c > 0``, applied before the
    activation: ``g = min(g, c)``, ``u = clamp(u, -c, c)``)."""

    activation: str
    clamp: float | None


def _unsupported(module: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"{FUSED}: {type(module).__name__} {what}; megamoe's experts are bias-free gated "
        f"SwiGLU/GeGLU MLPs with gate_up_proj rows [gate; up]; {_ALTERNATIVE}"
    )


def _static_spec(module: nn.Module) -> ExpertsSpec:
    """The spec from the module's flags and config, without evaluating its gate."""
    if not getattr(module, "has_gate", True):
        raise _unsupported(module, "has no gate (has_gate=False: act(up), not act(gate) * up)")
    if getattr(module, "has_bias", False):
        raise _unsupported(module, "has biases (has_bias=True), which megamoe does not implement")
    if not getattr(module, "is_concatenated", True):
        raise _unsupported(
            module,
            "stores gate and up rows interleaved (is_concatenated=False, e.g. gpt-oss), not as "
            "[gate; up] blocks",
        )
    config = getattr(module, "config", None)
    activation = _activation_of(module, config)
    limit = getattr(module, "limit", None)
    if limit is None:
        limit = getattr(config, "swiglu_limit", None)
    clamp = None
    if limit is not None and math.isfinite(float(limit)) and float(limit) > 0:
        if getattr(module, "_fp8_experts_clamp_after_activation", False):
            raise _unsupported(module, f"clamps after the activation (limit {limit})")
        clamp = float(limit)
    return ExpertsSpec(activation, clamp)


def _act_fn_activation(act_fn: object) -> str | None:
    """megamoe's activation for an ``act_fn`` it recognizes (SiLU, tanh-GELU), else None."""
    from transformers import activations as hf

    if act_fn is F.silu:
        return "swiglu"
    if isinstance(act_fn, nn.GELU):
        return "geglu" if act_fn.approximate == "tanh" else None
    kinds = {
        "SiLU": "swiglu",
        "SiLUActivation": "swiglu",
        "GELUTanh": "geglu",
        "NewGELUActivation": "geglu",
    }
    for name, activation in kinds.items():
        kind = getattr(nn, name, None) or getattr(hf, name, None)
        if isinstance(kind, type) and isinstance(act_fn, kind):
            return activation
    return None


def _activation_of(module: nn.Module, config: object) -> str:
    """The gate's activation: the module's ``act_fn`` where it is one megamoe knows (what
    the module computes), else its config's name: ``hidden_act``, or
    ``hidden_activation`` (Gemma). The eager probe then checks the whole gate."""
    activation = _act_fn_activation(getattr(module, "act_fn", None))
    if activation is not None:
        return activation
    for field in ("hidden_act", "hidden_activation"):
        act = getattr(config, field, None)
        if act is None:
            continue
        if not isinstance(act, str) or act.lower() not in ACTIVATIONS:
            raise _unsupported(
                module, f"uses config.{field}={act!r}; supported: {sorted(ACTIVATIONS)}"
            )
        return ACTIVATIONS[act.lower()]
    raise _unsupported(
        module,
        f"has act_fn={getattr(module, 'act_fn', None)!r} and no config.hidden_act or "
        f"config.hidden_activation; supported: SiLU or tanh-GELU, {sorted(ACTIVATIONS)}",
    )


def _megamoe_gate(gate_up: torch.Tensor, spec: ExpertsSpec) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    if spec.clamp is not None:
        g, u = g.clamp(max=spec.clamp), u.clamp(-spec.clamp, spec.clamp)
    act = F.silu(g) if spec.activation == "swiglu" else F.gelu(g, approximate="tanh")
    return act * u


def _probe(module: nn.Module, spec: ExpertsSpec) -> None:
    """Compare the module's own ``_apply_gate`` with megamoe's on fixed values."""
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:
        return
    # 2 x 64 pre-activations in each half, in different orders so gate and up differ
    # everywhere, spanning past the clamp on both sides in both halves (gate +-R, up
    # +-0.75 R with R >= 2 * clamp), so a gate that clamps one half only, or at another
    # limit, differs from megamoe's on the probe.
    span = 12.0 if spec.clamp is None else max(12.0, 2.0 * spec.clamp)
    gate = torch.linspace(-span, span, 128, dtype=torch.float32).view(2, 64)
    up = torch.linspace(0.75 * span, -0.75 * span, 128, dtype=torch.float32).view(2, 64)
    gate_up = torch.cat([gate, up], dim=-1)
    with torch.no_grad():
        got = apply_gate(gate_up).float()
    want = _megamoe_gate(gate_up, spec)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise _unsupported(
            module,
            f"computes a gate other than megamoe's {spec.activation}"
            + (f" with clamp {spec.clamp:g}" if spec.clamp is not None else "")
            + f" (max difference {diff} on a probe of its _apply_gate)",
        )


def _probe_and_cache(module: nn.Module, spec: ExpertsSpec) -> None:
    """:func:`_probe`, then ``spec`` cached on the module."""
    _probe(module, spec)
    module.__dict__["_megamoe_spec"] = spec


# The probe compares values, a data-dependent branch: under torch.compile it runs
# outside the graph (one graph break on the module's first traced call; the cached spec
# then guards it away). With fullgraph=True dynamo refuses the break and names why.
_probe_outside_graphs = torch.compiler.disable(
    _probe_and_cache,
    reason=(
        "megamoe checks an experts module's own _apply_gate on an eager probe before it "
        "runs it; with fullgraph=True, call megamoe.integrations.transformers."
        "check_experts(model) (or run one step) before compiling"
    ),
)


def experts_spec(module: nn.Module) -> ExpertsSpec:
    """Check that megamoe can run ``module`` (an HF experts module) and say how.

    The result is cached on the module after the module's own gate (its
    ``_apply_gate``, where it has one) has been checked against megamoe's on a probe
    (see the module docstring). Under ``torch.compile`` an uncached module with its own
    ``_apply_gate`` is probed outside the graph: a graph break on its first traced call,
    which ``fullgraph=True`` refuses (:func:`check_experts` first avoids it).

    Raises:
        ValueError: naming what the module has that megamoe does not implement.
    """
    spec = module.__dict__.get("_megamoe_spec")
    if spec is not None:
        return spec
    spec = _static_spec(module)
    if not torch.compiler.is_compiling():
        _probe_and_cache(module, spec)
    elif getattr(module, "_apply_gate", None) is not None:
        _probe_outside_graphs(module, spec)
    return spec


def check_experts(model: nn.Module) -> dict[str, ExpertsSpec]:
    """Check every HF experts module of ``model`` as :func:`experts_spec` does (eagerly,
    with the probe of a module's own ``_apply_gate``) and cache the result on it: what
    to call before ``torch.compile(..., fullgraph=True)``, so that no probe is left for
    the compiled graph.

    Returns:
        ``{module name: spec}``.

    Raises:
        ValueError: the first module megamoe cannot run, naming why.
    """
    return {name: experts_spec(module) for name, module in experts_modules(model)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (expert-parallel HF models), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it), else ``t``: adapters
    attached before FSDP2's ``fully_shard`` are sharded DTensors between steps."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _expert_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E_l, 2I, H], w2 [E_l, H, I])`` in nn.Linear layout, as the module holds
    them (no copy) unless it stores them transposed."""
    w13, w2 = _local(module.gate_up_proj), _local(module.down_proj)
    if getattr(module, "is_transposed", False):
        # [E, H, 2I] / [E, I, H]: megamoe reads nn.Linear rows; a transposed copy.
        w13 = w13.transpose(-1, -2).contiguous()
        w2 = w2.transpose(-1, -2).contiguous()
    return w13, w2


def mask_foreign_ids(top_k_index: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """HF routing ids -> megamoe's: ids outside ``[0, E_l)`` become ``-1`` (masked).

    Args:
        top_k_index: ``[T, K]`` int32/int64, HF's local expert ids (the expert-parallel
            router's sentinel is ``E_l``).
        num_local_experts: ``E_l``, the experts this module holds.

    Returns:
        ``[T, K]``, same dtype, a new tensor (the caller's routing is not modified).
    """
    foreign = (top_k_index < 0) | (top_k_index >= num_local_experts)
    return torch.where(foreign, torch.full_like(top_k_index, -1), top_k_index)


# ------------------------------------------------------------------ capability


def check_device(device: torch.device) -> None:
    """Raise one clear ``RuntimeError`` unless ``device`` is a Hopper GPU (sm_90).

    The fused kernels are compiled for ``sm_90a`` only (H100/H200/GH200).
    """
    if device.type != "cuda":
        raise RuntimeError(
            f"{FUSED}: the fused kernels need the model on an NVIDIA Hopper GPU (sm_90, e.g. "
            f"H100/H200), got hidden states on {device}; move the model to a Hopper GPU, or "
            f"{_ALTERNATIVE} ('{REFERENCE}' is a slow float32 megamoe reference that runs "
            "anywhere)"
        )
    if torch.compiler.is_compiling():
        return  # checked when the model ran eagerly; the probe is not traceable
    other = not_hopper(device)
    if other is not None:
        raise RuntimeError(
            f"{FUSED}: the fused kernels need an NVIDIA Hopper GPU (sm_90, e.g. H100/H200); "
            f"{other}; {_ALTERNATIVE}"
        )


# --------------------------------------------------------------------- forwards


def _sharded_over(module: nn.Module) -> int:
    """How many ranks the experts' weights are split over (HF expert or tensor
    parallelism: DTensor parameters), 1 when they are whole on this rank."""
    sizes = [
        w.device_mesh.size()
        for w in (module.gate_up_proj, module.down_proj)
        # a DTensor (duck-typed: torch builds without torch.distributed have none)
        if hasattr(w, "device_mesh") and any(not p.is_replicate() for p in w.placements)
    ]
    return max(sizes, default=1)


def check_adapters_allowed(module: nn.Module) -> None:
    """Raise unless side-LoRA adapters can train on this experts module: not on weights
    that HF's expert or tensor parallelism split over ranks. Each rank then computes only
    its experts' (or its slice of I's) part of the shared factors' gradients (``a1``,
    ``a3``, ``b2``), and nothing in HF's parallel plan sums them: the replicas would
    train on wrong gradients and drift apart."""
    ranks = _sharded_over(module)
    if ranks > 1:
        raise ValueError(
            f"side-LoRA: {type(module).__name__}'s expert weights are split over {ranks} "
            "ranks (DTensor parameters: HF expert/tensor parallelism, or FSDP2's "
            "fully_shard). Under HF's expert/tensor parallelism the shared factors a1, a3, "
            "b2 would get only each rank's part of their gradients: train adapters on "
            "unsplit experts (data parallelism: DDP, or FSDP2 with the adapters attached "
            "or loaded before fully_shard, which then shards and synchronizes them too), "
            "or under torchtitan's parallelize (megamoe.integrations.torchtitan)"
        )


def _adapter_of(module: nn.Module) -> SideLoRA | None:
    adapter = getattr(module, ADAPTER_ATTR, None)
    if adapter is None:
        return None
    check_adapters_allowed(module)
    # Called, not read: under PEFT's modules_to_save the attribute is a wrapper whose
    # forward dispatches to the active (trainable) copy.
    return adapter()


def fused_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"megamoe_fused"`` experts forward (HF's experts-interface signature).

    Args:
        self: the HF experts module (``gate_up_proj``, ``down_proj``, ``config``).
        hidden_states: ``[T, H]`` in the model dtype, on a Hopper GPU (cast to BF16
            for the kernels, the result cast back).
        top_k_index: ``[T, K]`` int64 expert ids; ids outside ``[0, E_l)`` are masked.
        top_k_weights: ``[T, K]`` router weights in any float dtype (FP32 inside).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    check_device(hidden_states.device)
    spec = experts_spec(self)
    w13, w2 = _expert_weights(self)
    base = prepare_base_weights(w13, w2)
    side = _adapter_of(self)
    if side is not None and side.dtype != torch.bfloat16:
        side = SideLoRA(*(t.to(torch.bfloat16) for t in side.tensors()), scale=side.scale)
    out = ops.moe(
        hidden_states.to(torch.bfloat16),
        mask_foreign_ids(top_k_index, w13.shape[0]),
        top_k_weights.to(torch.float32),
        base,
        side,
        activation=spec.activation,
        activation_clamp=spec.clamp,
    )
    return out.to(hidden_states.dtype)


def reference_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"megamoe_reference"`` experts forward: :func:`megamoe.reference.moe` in
    float32 on any device, same arguments as :func:`fused_experts_forward`. The expert
    weights are rounded to BF16 (as :func:`~megamoe.prepare_base_weights` does)."""
    spec = experts_spec(self)
    w13, w2 = _expert_weights(self)
    base = prepare_base_weights(w13, w2)
    out = reference.moe(
        hidden_states,
        mask_foreign_ids(top_k_index, w13.shape[0]),
        top_k_weights.to(torch.float32),
        base,
        _adapter_of(self),
        activation=spec.activation,
        activation_clamp=spec.clamp,
        compute_dtype=torch.float32,
    )
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register :data:`FUSED` and :data:`REFERENCE` in transformers' experts interface.

    Idempotent; runs on import of this module. Raises ``RuntimeError`` if transformers
    already has a different implementation under one of the names.
    """
    for name, fn in ((FUSED, fused_experts_forward), (REFERENCE, reference_experts_forward)):
        existing = ExpertsInterface._global_mapping.get(name)
        if existing is not None and existing is not fn:
            raise RuntimeError(
                f"{name}: transformers already registers an experts implementation under this "
                f"name ({getattr(existing, '__qualname__', existing)}); megamoe will not replace it"
            )
        ExpertsInterface.register(name, fn)


register()


# ------------------------------------------------------------------- side-LoRA


class SideLoRAAdapter(nn.Module):
    """Shared-outer side-LoRA factors for one HF experts module (DESIGN §1).

    Parameters ``a1 [H, r]``, ``b1 [E, r, I]``, ``a3 [H, r]``, ``b3 [E, r, I]``,
    ``a2 [E, I, r]``, ``b2 [r, H]`` and the scale ``s`` (a float, kept in the state dict
    as a 0-d float64 tensor so ``save_pretrained``/safetensors accept it). Calling the
    module returns the :class:`~megamoe.SideLoRA` of its current parameters (no copy).

    Initialization as :class:`~megamoe.MegaMoE`'s: the expand factors ``b1, b3, b2``
    are zero and the shrink factors drawn like ``nn.Linear`` weights, so attaching
    adapters leaves the model's output exactly as it was.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        rank: int,
        *,
        scale: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rank = check_int("rank", rank, minimum=SIDE_RANK_MULTIPLE)
        check_side_rank("rank", rank)
        if dtype not in _ADAPTER_DTYPES:
            raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
        self.hidden, self.intermediate, self.num_experts, self.rank = (
            hidden,
            intermediate,
            num_experts,
            rank,
        )
        self.scale = check_finite_float("scale", scale, float32=True)  # a float32 in kernels
        h, i, e, r = hidden, intermediate, num_experts, rank
        shapes = {
            "a1": (h, r),
            "b1": (e, r, i),
            "a3": (h, r),
            "b3": (e, r, i),
            "a2": (e, i, r),
            "b2": (r, h),
        }
        for name, shape in shapes.items():
            value = torch.empty(shape, dtype=dtype, device=device)
            self.register_parameter(name, nn.Parameter(value))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Shrink factors ``U(+-1/sqrt(fan_in))`` (fan-in H for a1/a3, I for a2), expand
        factors zero (see :meth:`megamoe.MegaMoE.reset_parameters` for why)."""
        with torch.no_grad():
            fan_ins = {"a1": self.hidden, "a3": self.hidden, "a2": self.intermediate}
            for name, fan_in in fan_ins.items():
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(getattr(self, name), -bound, bound)
            for name in ("b1", "b3", "b2"):
                getattr(self, name).zero_()

    def forward(self) -> SideLoRA:
        """The :class:`~megamoe.SideLoRA` of the current parameters (differentiable)."""
        return SideLoRA(*(getattr(self, n) for n in SIDE_NAMES), scale=self.scale)

    @torch.no_grad()
    def load(self, side: SideLoRA) -> None:
        """Copy ``side``'s tensors (cast to this module's dtype/device) and scale in."""
        want = (self.hidden, self.intermediate, self.num_experts, self.rank)
        got = (side.hidden, side.intermediate, side.num_experts, side.rank)
        if got != want:
            raise ValueError(
                f"side: expected adapters for (H, I, E, r)={want}, got {got}; build the "
                "adapter with the file's rank"
            )
        for name, value in zip(SIDE_NAMES, side.tensors(), strict=True):
            getattr(self, name).copy_(value)
        self.scale = side.scale

    # Tensors only: huggingface_hub / safetensors (save_pretrained) reject other values.
    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float64)

    def set_extra_state(self, state: torch.Tensor | float) -> None:
        value = state.item() if isinstance(state, torch.Tensor) else state
        self.scale = check_finite_float("scale", value, float32=True)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, "
            f"num_experts={self.num_experts}, rank={self.rank}, scale={self.scale:g}"
        )


def _is_experts(module: nn.Module) -> bool:
    """An HF experts module: 3-D ``gate_up_proj``/``down_proj`` and the flags that
    ``@use_experts_implementation`` sets."""
    w13 = getattr(module, "gate_up_proj", None)
    w2 = getattr(module, "down_proj", None)
    return (
        isinstance(w13, torch.Tensor)
        and isinstance(w2, torch.Tensor)
        and w13.dim() == 3
        and hasattr(module, "has_gate")
    )


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every HF experts module in ``model``."""
    for name, module in model.named_modules():
        if _is_experts(module):
            yield name, module


def _dims(module: nn.Module) -> tuple[int, int, int]:
    """``(E_l, H, I)`` of an experts module (from its weights' shape, local shard)."""
    experts, rows, cols = _local(module.gate_up_proj).shape
    if getattr(module, "is_transposed", False):  # [E, H, 2I]
        return experts, rows, cols // 2
    return experts, cols, rows // 2


def attach_side_lora(
    model: nn.Module,
    rank: int,
    *,
    alpha: float | None = None,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    replace: bool = False,
) -> list[str]:
    """Put a fresh :class:`SideLoRAAdapter` on every MoE experts module of ``model``.

    Args:
        model: an HF model (``PreTrainedModel`` or any module containing experts).
        rank: adapter rank ``r``, a multiple of 16 in [16, 256].
        alpha: LoRA-style alpha: ``s = alpha / rank``. Give at most one of ``alpha`` and
            ``scale``; with neither, ``s = 1`` (``alpha = r``).
        scale: the adapter scale ``s``.
        dtype: the factors' dtype, ``torch.bfloat16`` or ``torch.float32`` (master
            weights; the fused path casts them to BF16 every call). Default: the expert
            weights' dtype if it is one of those, else BF16.
        replace: put fresh adapters where a module already has one. Without it such a
            model is refused (a trained adapter would be dropped silently, and an
            optimizer holding its factors would go on training tensors no longer used).

    Returns:
        The names of the experts modules that got adapters. Each module is checked
        first (:func:`experts_spec`); the base is left as it is (see
        :func:`mark_only_side_lora_as_trainable`).
    """
    if not isinstance(replace, bool):
        raise TypeError(f"replace: expected a bool, got {type(replace).__name__}")
    if not replace:
        held = [name for name, _ in _adapters(model)]
        if held:
            raise ValueError(
                f"model: {len(held)} experts module(s) already hold side-LoRA adapters "
                f"(first: {held[0]!r}); pass replace=True to put fresh ones in their place"
            )
    if alpha is not None and scale is not None:
        raise ValueError(f"scale: give alpha or scale, not both; got alpha={alpha}, scale={scale}")
    s = 1.0 if scale is None else check_finite_float("scale", scale, float32=True)
    if alpha is not None:
        s = check_finite_float("alpha", alpha) / check_int("rank", rank, minimum=1)
        s = check_finite_float("scale (alpha / rank)", s, float32=True)
    names = []
    for name, module in experts_modules(model):
        experts_spec(module)
        check_adapters_allowed(module)
        experts, hidden, intermediate = _dims(module)
        weight = module.gate_up_proj
        want = dtype or (weight.dtype if weight.dtype in _ADAPTER_DTYPES else torch.bfloat16)
        adapter = SideLoRAAdapter(
            hidden, intermediate, experts, rank, scale=s, dtype=want, device=weight.device
        )
        _put_adapter(module, adapter)
        names.append(name)
    if not names:
        raise ValueError(
            f"model: found no HF experts module (gate_up_proj [E, 2I, H] + down_proj) in "
            f"{type(model).__name__}"
        )
    return names


def _adapters(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in experts_modules(model):
        adapter = getattr(module, ADAPTER_ATTR, None)
        if adapter is not None:
            yield name, adapter


def mark_only_side_lora_as_trainable(model: nn.Module) -> list[nn.Parameter]:
    """Freeze every parameter of ``model`` except megamoe's side-LoRA factors (under
    PEFT's ``modules_to_save``, the active adapter's copies: the original never runs).

    Returns:
        The adapter parameters (for the optimizer).
    """
    model.requires_grad_(False)
    params = []
    for _, adapter in _adapters(model):
        copies = getattr(adapter, "modules_to_save", None)
        if copies is not None:  # PEFT's modules_to_save: the active copies train, as PEFT
            adapter = nn.ModuleList(copies[name] for name in adapter.active_adapters)
        for p in adapter.parameters():
            p.requires_grad_(True)
            params.append(p)
    if not params:
        raise ValueError("model: no megamoe side-LoRA attached (call attach_side_lora first)")
    return params


def side_lora_layers(model: nn.Module) -> dict[str, SideLoRA]:
    """``{experts module name: SideLoRA}`` of the attached adapters (the live tensors)."""
    return {name: adapter() for name, adapter in _adapters(model)}


# ------------------------------------------------------------- PEFT-format files

#: PEFT keys put the model under ``base_model.model.`` (``PeftModel`` wrapping a
#: ``LoraModel``); the adapter file drops the adapter name from the keys.
_PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _hf_model(model: nn.Module) -> nn.Module:
    """The HF model under a PEFT ``PeftModel`` (whose module names carry PEFT's
    ``base_model.model.``), else ``model``: adapter files name the HF model's modules."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and hasattr(model, "peft_config"):
        return get_base_model()
    return model


def _target_parameters(names: list[str]) -> list[str]:
    """PEFT ``target_parameters`` for the experts modules: one suffix pattern per
    parameter when the names differ only in their layer index (the usual case)."""
    generic = {re.sub(r"\.\d+\.", ".*.", n) for n in names}
    patterns = []
    for n in sorted(generic) if len(generic) == 1 else names:
        # PEFT matches a target parameter by the suffix of its qualified name.
        tail = n.split(".*.")[-1] if ".*." in n else n
        patterns += [f"{tail}.gate_up_proj", f"{tail}.down_proj"]
    return patterns


def save_side_lora(
    model: nn.Module,
    save_directory: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    gate_up: str = "auto",
) -> dict[str, object]:
    """Write the attached adapters as a PEFT LoRA adapter (``target_parameters``).

    Files: ``adapter_config.json`` and ``adapter_model.safetensors`` in
    ``save_directory``. The adapter is PEFT's LoRA on ``gate_up_proj``/``down_proj`` of
    each experts module (:func:`megamoe.adapter_convert.side_lora_to_peft_fused`: rank
    ``r``, or ``2r`` with a block-diagonal gate/up when ``a1 != a3``), so
    ``peft.PeftModel.from_pretrained(hf_model, save_directory)`` reproduces the model's
    function on any experts implementation, and :func:`load_side_lora` reads it back.

    Args:
        model: the HF model with adapters attached (every layer the same rank and scale:
            one LoRA config), or a PEFT model around it.
        save_directory: created if missing.
        base_model_name_or_path: written into the config (PEFT's field).
        gate_up: ``"auto"``, ``"shared"`` or ``"stacked"`` (see the converter).

    Under FSDP2 (adapters attached before ``fully_shard``) the factors are gathered
    whole, a collective: call it on every rank; each writes the whole adapter.

    Returns:
        The config dict written to ``adapter_config.json``.
    """
    from safetensors.torch import save_file

    layers = side_lora_layers(_hf_model(model))
    if not layers:
        raise ValueError("model: no megamoe side-LoRA attached (call attach_side_lora first)")
    tensors: dict[str, torch.Tensor] = {}
    configs = []
    for name, side in layers.items():
        plain = SideLoRA(*(_whole(t.detach()).cpu() for t in side.tensors()), scale=side.scale)
        state, config = side_lora_to_peft_fused(plain, _PEFT_PREFIX + name, gate_up=gate_up)
        tensors.update(state)
        configs.append((config["r"], config["lora_alpha"]))
    if len(set(configs)) != 1:
        raise ValueError(
            f"model: the layers' adapters need different LoRA configs (r, alpha): "
            f"{sorted(set(configs))}; use one rank, one scale and gate_up='stacked'"
        )
    r, lora_alpha = configs[0]
    config = _lora_config(r, lora_alpha, _target_parameters(list(layers)), base_model_name_or_path)
    path = Path(save_directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    return config


def _lora_config(
    r: int, lora_alpha: float, target_parameters: list[str], base_model: str | None
) -> dict[str, object]:
    """PEFT's own ``LoraConfig`` serialization when peft is installed (every field PEFT
    writes), else the fields PEFT needs to load the adapter."""
    fields = {
        "r": r,
        "lora_alpha": lora_alpha,
        "target_modules": [],
        "target_parameters": target_parameters,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "base_model_name_or_path": base_model,
    }
    try:
        from peft import LoraConfig
    except ImportError:
        return {"peft_type": "LORA", "task_type": None, "inference_mode": True, **fields}
    config = LoraConfig(**fields).to_dict()
    config["inference_mode"] = True  # what PeftModel.save_pretrained writes
    return {
        k: (v.value if hasattr(v, "value") else sorted(v) if isinstance(v, set) else v)
        for k, v in config.items()
    }


def load_side_lora(
    model: nn.Module,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    split_gate_up: bool | None = None,
) -> list[str]:
    """Load a PEFT ``target_parameters`` LoRA adapter as megamoe side-LoRA.

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (written by
    :func:`save_side_lora`, or by PEFT for a shared-outer adapter: gate_up's ``A`` and
    down's ``B`` identical across experts) and attaches a :class:`SideLoRAAdapter` to
    every experts module the file has keys for (replacing one that is there).

    Args:
        model: the HF model (built with the same architecture), or a PEFT model around it.
        directory: the adapter directory.
        dtype: the factors' dtype (default as in :func:`attach_side_lora`).
        split_gate_up: read a block-diagonal gate/up of rank ``2r`` as ``a1``, ``a3``
            of rank ``r`` (what :func:`save_side_lora` writes when ``a1 != a3``).
            ``None``: split when the gate/up adapter is block-diagonal with both blocks
            in use (either reading gives the same function). A zero B (an adapter at
            its initial state) is block-diagonal whatever its A: it is read split when
            the down pair holds a stacked export's zero padding (slots ``r .. 2r - 1``
            zero, the first ``r`` in use), and otherwise whole, so that one shared A
            keeps its full trainable rank; past the kernels' 256 the padding cannot be
            read and a ``ValueError`` asks for ``split_gate_up=True``.

    Returns:
        The names of the experts modules that got adapters.
    """
    from safetensors.torch import load_file

    path = Path(directory)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type")
        raise ValueError(f"{ADAPTER_CONFIG}: expected a LORA adapter, got {kind}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{ADAPTER_CONFIG}: {key} is not supported (one r and alpha)")
    state = load_file(str(path / ADAPTER_WEIGHTS))
    names = []
    for name, module in experts_modules(_hf_model(model)):
        prefix = _PEFT_PREFIX + name
        if not any(k.startswith(prefix + ".") for k in state):
            continue
        experts, _, _ = _dims(module)
        options = dict(
            num_experts=experts,
            lora_alpha=config["lora_alpha"],
            use_rslora=bool(config.get("use_rslora", False)),
        )
        # The caller's dtype reaches the converter: an FP16 file is read into it exactly
        # (without it the converter refused FP16 and asked for the dtype= given here).
        read = partial(side_lora_from_peft_fused, state, prefix, dtype=dtype, **options)
        side = _read_gate_up(read, split_gate_up, int(config["r"]))
        _install_adapter(module, side, dtype)
        names.append(name)
    if not names:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: no keys for any experts module of the model")
    return names


def _install_adapter(module, side: SideLoRA, dtype: torch.dtype | None) -> None:
    """Attach ``side`` to an experts module as its :class:`SideLoRAAdapter`, in ``dtype``
    (default: the module's weight dtype where adapters support it, else BF16), on the
    weights' device. Under PEFT's ``modules_to_save`` the values go into the active
    adapters' copies, in their dtype (replacing the wrapper would leave PEFT nothing to
    train or save; the original module stays as it was: it is what runs with the
    adapters disabled)."""
    check_adapters_allowed(module)
    wrapper = getattr(module, ADAPTER_ATTR, None)
    if wrapper is not None and hasattr(wrapper, "modules_to_save"):
        held_copies = wrapper.modules_to_save
        copies = [held_copies[name] for name in wrapper.active_adapters if name in held_copies]
        if not copies:
            raise ValueError(
                f"{type(module).__name__}: PEFT's modules_to_save wrapper of the side-LoRA "
                "has no active adapter to load into"
            )
        for copy in copies:
            held = copy.a1.dtype
            if dtype is not None and dtype != held:
                raise ValueError(
                    f"dtype: the side-LoRA under PEFT's modules_to_save is {held}; it keeps "
                    f"its dtype (got dtype={dtype})"
                )
            copy.load(side)  # a ValueError names a rank other than the attached one
        return
    weight = module.gate_up_proj
    want = dtype or (weight.dtype if weight.dtype in _ADAPTER_DTYPES else torch.bfloat16)
    adapter = SideLoRAAdapter(
        side.hidden,
        side.intermediate,
        side.num_experts,
        side.rank,
        scale=side.scale,
        dtype=want,
        device=weight.device,
    )
    adapter.load(side)
    _put_adapter(module, adapter)


def _only_megamoe_reads_adapters(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of an experts module that holds side-LoRA: another experts
    implementation (``grouped_mm``, eager, ...) would run without the adapter, a silent
    change of the model's function; refuse it."""
    if getattr(module, ADAPTER_ATTR, None) is None:
        return
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in (FUSED, REFERENCE):
        raise ValueError(
            f"experts_implementation: {type(module).__name__} holds a megamoe side-LoRA "
            f"adapter, which {implementation!r} does not apply; use {FUSED!r} (or "
            f"{REFERENCE!r}), or delete the module's {ADAPTER_ATTR}"
        )


def _put_adapter(module: nn.Module, adapter: SideLoRAAdapter) -> None:
    """Attach ``adapter`` to an experts module, with the hook that refuses a forward
    through an experts implementation that ignores it (once per module)."""
    setattr(module, ADAPTER_ATTR, adapter)
    if _only_megamoe_reads_adapters not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_only_megamoe_reads_adapters)


def _padded_rank(rank: int) -> int:
    """``rank`` rounded up to the kernels' rank multiple: a file's smaller rank (PEFT's
    default is 8) read with zero rows and columns added, the same function."""
    return -(-max(rank, 1) // SIDE_RANK_MULTIPLE) * SIDE_RANK_MULTIPLE


def _split_rank(file_rank: int) -> int:
    """megamoe's rank for a gate/up adapter of rank ``2r`` read split: ``r``, rounded
    up to the kernels' rank multiple. Passing it trims the down pair's zero padding
    (a stacked export pads down to ``2r``), which the converter would otherwise keep."""
    return _padded_rank(file_rank // 2)


def _read_gate_up(
    read: Callable[..., SideLoRA], split_gate_up: bool | None, file_rank: int
) -> SideLoRA:
    """A file's adapter through ``read`` (a converter taking ``split_gate_up`` and
    ``rank``): split or whole as asked; ``None``: split where the split read succeeds
    (gate/up B block-diagonal, the down pair within the half rank) and the file is a
    stacked export (:func:`_is_stacked_export`), else whole."""
    split = {"split_gate_up": True, "rank": _split_rank(file_rank)}
    whole = {"split_gate_up": False, "rank": _padded_rank(file_rank)}
    if split_gate_up is not None:
        return read(**(split if split_gate_up else whole))
    try:
        side = read(**split)
    except ValueError:  # not block-diagonal, or down uses all 2r slots: one shared A
        return read(**whole)
    if bool(side.b1.any()) and bool(side.b3.any()):
        return side
    try:
        whole_side = read(**whole)
    except ValueError as error:  # 2r past the kernels' 256: the padding cannot be seen
        raise ValueError(
            f"split_gate_up: this gate/up adapter of rank {file_rank} has a zero B (its "
            f"initial state), so it reads split (rank {file_rank // 2}: a stacked export "
            f"of a megamoe adapter before its first step) or whole (rank {file_rank}: one "
            f"shared A, past the kernels' 256). Pass split_gate_up=True if it is the "
            f"former; the latter cannot load"
        ) from error
    return side if _is_stacked_export(whole_side, file_rank // 2) else whole_side


def _is_stacked_export(whole: SideLoRA, half: int) -> bool:
    """Whether an adapter whose gate/up B is block-diagonal but not in both blocks (a
    zero B: an adapter at its initial state), read whole at the file's rank ``2 half``,
    is a stacked export: its down pair in use in the first ``half`` slots and zero in the
    rest, the padding the export adds (megamoe's adapter before its first step, ``a1``
    and ``a3`` independent, every B zero). An adapter with one shared A uses all its
    slots in the down pair too (Megatron's and PEFT's initial A are random); splitting
    its A would halve the trainable rank, each half meeting only zero rows of B. The
    whole read is the one to look at: a split read drops the down slots whose product
    is zero, which with a zero B is all of them."""
    a2, b2 = whole.a2, whole.b2
    in_use = bool(a2[..., :half].any()) or bool(b2[:half].any())
    return in_use and not a2[..., half:].any() and not b2[half:].any()


# --------------------------------------------------------------- Megatron-Bridge

#: ``model.layers.{i}.mlp.experts`` (HF) <-> ``decoder.layers.{i}.mlp.experts`` (Megatron).
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


def _megatron_prefix(hf_name: str) -> str | None:
    """The Megatron prefix of the experts module ``hf_name``, None where its name has no
    ``layers.<i>.mlp.experts`` form."""
    match = _HF_LAYER.search(hf_name)
    return None if match is None else f"decoder.layers.{match.group(1)}.mlp.experts"


def _megatron_prefixes(names: list[str]) -> dict[str, str]:
    """Each experts module's Megatron prefix, by name; raises where two modules map to one
    prefix (models with several decoder stacks, e.g. a thinker and a talker: only the
    layer index survives the mapping, and one stack's adapters would overwrite the
    other's)."""
    prefixes: dict[str, str] = {}
    owner: dict[str, str] = {}
    for name in names:
        prefix = _megatron_prefix(name)
        if prefix is None:
            continue
        if prefix in owner:
            raise ValueError(
                f"model: experts modules {owner[prefix]!r} and {name!r} both map to "
                f"Megatron's {prefix!r} (only the layer index is kept); the Megatron "
                "layout holds one decoder stack: use save_side_lora / load_side_lora"
            )
        owner[prefix] = name
        prefixes[name] = prefix
    return prefixes


def megatron_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The attached adapters in Megatron-Bridge's shared-outer layout.

    Keys ``decoder.layers.{i}.mlp.experts.linear_fc{1,2}.adapter.linear_{in,out}.weight``
    (:func:`megamoe.adapter_convert.side_lora_to_megatron`), ``i`` the HF layer index.

    Returns:
        ``(state_dict, config)``, config ``{"dim", "alpha", "experts_shared_outer_loras"}``
        (one for all layers; they must agree).
    """
    out: dict[str, torch.Tensor] = {}
    configs = []
    layers = side_lora_layers(_hf_model(model))
    prefixes = _megatron_prefixes(list(layers))
    for name, side in layers.items():
        if name not in prefixes:
            raise ValueError(
                f"{name}: expected an experts module named '...layers.<i>.mlp.experts' to "
                "map to Megatron's 'decoder.layers.<i>.mlp.experts'"
            )
        plain = SideLoRA(*(_whole(t.detach()) for t in side.tensors()), scale=side.scale)
        state, config = side_lora_to_megatron(plain, prefixes[name])
        out.update(state)
        configs.append(tuple(sorted(config.items())))
    if not configs:
        raise ValueError("model: no megamoe side-LoRA attached (call attach_side_lora first)")
    if len(set(configs)) != 1:
        raise ValueError(f"model: the layers' adapters need different Megatron configs: {configs}")
    return out, dict(configs[0])


def load_megatron_state_dict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    alpha: float,
    dtype: torch.dtype | None = None,
    split_gate_up: bool | None = None,
) -> list[str]:
    """Attach adapters read from a Megatron-Bridge shared-outer state dict.

    Args:
        model: the HF model, or a PEFT model around it.
        state_dict: keys as :func:`megatron_state_dict` writes (one rank's experts: the
            HF model must hold the same experts).
        alpha: the Megatron LoRA config's ``alpha`` (scaling ``alpha / dim``, ``dim``
            read from the shapes).
        dtype: the factors' dtype (default as in :func:`attach_side_lora`).
        split_gate_up: as in :func:`load_side_lora`.

    Returns:
        The names of the experts modules that got adapters.
    """
    names = []
    modules = list(experts_modules(_hf_model(model)))
    prefixes = _megatron_prefixes([name for name, _ in modules])
    for name, module in modules:
        prefix = prefixes.get(name)  # a module of another name no Megatron key names
        if prefix is None or not any(k.startswith(prefix + ".") for k in state_dict):
            continue
        experts, _, _ = _dims(module)
        options = dict(alpha=alpha, num_experts=experts)
        fc1_in = f"{prefix}.linear_fc1.adapter.linear_in.weight"
        if fc1_in not in state_dict:
            raise ValueError(f"state_dict: has keys under {prefix!r} but no {fc1_in!r}")
        dim = state_dict[fc1_in].shape[-2]
        read = partial(side_lora_from_megatron, state_dict, prefix, dtype=dtype, **options)
        side = _read_gate_up(read, split_gate_up, dim)
        _install_adapter(module, side, dtype)
        names.append(name)
    if not names:
        raise ValueError("state_dict: no Megatron keys for any experts module of the model")
    return names
