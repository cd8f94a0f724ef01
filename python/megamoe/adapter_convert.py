"""Convert shared-outer MoE LoRA adapters between external layouts and :class:`SideLoRA`.

"Shared-outer" (DESIGN §1): the outer factors are shared by all experts, the inner
factors are expert-local. In LoRA terms (``y = x W^T + scaling * x A^T B^T``, ``A`` =
``lora_A`` / ``linear_in`` ``[r, in]``, ``B`` = ``lora_B`` / ``linear_out`` ``[out, r]``):
the gate and up projections share ``A`` across experts, the down projection shares
``B`` across experts. The mapping to megamoe (``s`` = megamoe's scale)::

    a1 = A_gate^T [H, r]     b1[e] = (scaling_gate / s) * B_gate[e]^T [r, I]
    a3 = A_up^T   [H, r]     b3[e] = (scaling_up / s)   * B_up[e]^T   [r, I]
    a2[e] = A_down[e]^T [I, r]   b2 = (scaling_down / s) * B_down^T   [r, H]

With one ``scaling`` for all three projections (the usual case) ``s = scaling`` and no
factor is rescaled, so a round trip is bit-exact. An export's default alpha ``s * r``
gives back ``s`` unless ``s * r / r`` rounds off it (no float64 alpha does for some
pairs: ``s = 0.1`` at ``r = 48`` gives ``0.10000000000000002``); then the expand
factors are rescaled by ``s / scaling``, within a rounding of 1: FP32 and BF16 factors
keep their bits (float64 ones may move by an ulp), and the imported scale is that
scaling, the same float32 the kernels compute with.

Layouts (citations in ``docs/ADAPTERS.md``):

- **PEFT, per-expert modules** (:func:`side_lora_from_peft` / :func:`side_lora_to_peft`):
  LoRA on per-expert ``nn.Linear`` modules (``target_modules``), keys
  ``{prefix}.{e}.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight``. The shared factors
  may also come once under the expert-agnostic name ``{prefix}.{proj}.lora_X.weight``
  with shape ``[1, ...]`` (the SGLang shared-outer contract Megatron-Bridge exports).
- **PEFT, fused 3D expert parameters** (:func:`side_lora_from_peft_fused` /
  :func:`side_lora_to_peft_fused`): ``target_parameters`` on transformers-v5 expert
  modules (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), wrapped by PEFT's
  ``lora.ParamWrapper``: ``lora_A.weight [E*r, in]`` (expert-major rows) and
  ``lora_B.weight [out, r*E]`` (column ``j*E + e`` is rank ``j`` of expert ``e``).
- **Megatron-Bridge** (:func:`side_lora_from_megatron` / :func:`side_lora_to_megatron`):
  ``LoRA(experts_shared_outer_loras=True)``'s ``SharedOuterGroupedExpertAdapter`` on
  ``linear_fc1`` (gate and up packed along the output dim) and ``linear_fc2``:
  ``adapter.linear_in.weight`` / ``adapter.linear_out.weight``, scaling ``alpha / dim``.

A fused gate/up adapter has one ``A`` for both halves, so it maps to ``a1 == a3``.
Adapters with ``a1 != a3`` are exported *stacked*: ``A = [a1^T; a3^T]`` (rank ``2r``)
and ``B[e] = [[b1[e]^T, 0], [0, b3[e]^T]]``, which is exact; ``split_gate_up=True``
reads such a block-diagonal adapter back at rank ``r``.

Ranks: megamoe has one rank ``r`` (a multiple of 16 in [16, 256]) for all three
projections. Smaller ranks are zero-padded (``rank=`` picks the target; padding is
exact, but a slot that is zero in both factors never receives a gradient), and
trailing rank slots are trimmed only when their contribution is exactly zero.

Every converter takes and returns plain tensors (state-dict entries); nothing here
depends on ``peft`` or Megatron being installed. Expert-tensor-parallel shards are not
handled: pass the full (ETP=1 or gathered) tensors.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .side_lora import SIDE_RANK_MAX, SIDE_RANK_MULTIPLE, SideLoRA
from .validation.arguments import check_choice, check_finite_float, check_int, check_str_choice
from .validation.layer import check_devices

__all__ = [
    "PEFT_PROJECTIONS",
    "lora_scaling",
    "side_lora_from_megatron",
    "side_lora_from_peft",
    "side_lora_from_peft_fused",
    "side_lora_to_megatron",
    "side_lora_to_peft",
    "side_lora_to_peft_fused",
]

#: Default per-expert module names (gate, up, down): Qwen2/3-MoE, DeepSeek-V2/V3 in
#: transformers 4. Mixtral names them ``("w1", "w3", "w2")``.
PEFT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

GATE_UP_MODES = ("auto", "shared", "stacked")
_OUT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def lora_scaling(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """LoRA's output scaling: ``alpha / rank``, or ``alpha / sqrt(rank)`` for rsLoRA."""
    alpha = check_finite_float("lora_alpha", alpha)
    rank = check_int("rank", rank, minimum=1)
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


# ---------------------------------------------------------------------------------------
# Internal form: one LoRA'd projection in megamoe orientation.


@dataclass(frozen=True)
class _Projection:
    """``shrink`` (``a1``/``a3`` ``[H, r]`` or ``a2`` ``[E, I, r]``), ``expand`` (``b1``/
    ``b3`` ``[E, r, I]`` or ``b2`` ``[r, H]``) and its LoRA ``scaling``. ``name`` is the
    source key used in messages."""

    name: str
    shrink: torch.Tensor
    expand: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.shrink.shape[-1]


def _fit_rank(p: _Projection, rank: int) -> _Projection:
    """Zero-pad ``p`` to ``rank`` or drop trailing rank slots that contribute nothing."""
    have = p.rank
    if have == rank:
        return p
    if have < rank:
        pad = rank - have
        shrink = torch.cat([p.shrink, p.shrink.new_zeros(*p.shrink.shape[:-1], pad)], dim=-1)
        exp = p.expand
        expand = torch.cat([exp, exp.new_zeros(*exp.shape[:-2], pad, exp.shape[-1])], dim=-2)
        return _Projection(p.name, shrink, expand, p.scaling)
    # A slot contributes nothing when either of its two factors is zero there.
    extra = have - rank
    live_shrink = p.shrink[..., rank:].reshape(-1, extra).any(0)
    live_expand = p.expand[..., rank:, :].movedim(-2, 0).reshape(extra, -1).any(1)
    live = (live_shrink & live_expand).nonzero()
    if live.numel():
        raise ValueError(
            f"rank: cannot trim {p.name} from rank {have} to {rank}: its rank slot "
            f"{rank + int(live[0])} is nonzero in both LoRA factors (pass a larger rank)"
        )
    return _Projection(p.name, p.shrink[..., :rank], p.expand[..., :rank, :], p.scaling)


def _assemble(
    gate: _Projection,
    up: _Projection,
    down: _Projection,
    *,
    scale: float | None,
    rank: int | None,
    dtype: torch.dtype | None,
) -> SideLoRA:
    """Build the SideLoRA: common rank, one scale (the others folded into ``b``), dtype."""
    projections = (gate, up, down)
    factors = [(f"{p.name} ({part})", t) for p in projections for part, t in
               (("A", p.shrink), ("B", p.expand))]  # fmt: skip
    check_devices(factors, projections[0].name)
    s = gate.scaling if scale is None else check_finite_float("scale", scale)
    if s == 0.0:
        raise ValueError("scale: expected a nonzero scale (the expand factors are divided by it)")
    if rank is None:
        rank = max(p.rank for p in projections)
    rank = check_int("rank", rank, minimum=1)
    if rank % SIDE_RANK_MULTIPLE != 0 or rank > SIDE_RANK_MAX:
        found = ", ".join(f"{p.name}: {p.rank}" for p in projections)
        raise ValueError(
            f"rank: megamoe adapters need a rank that is a multiple of {SIDE_RANK_MULTIPLE} in "
            f"[{SIDE_RANK_MULTIPLE}, {SIDE_RANK_MAX}], got {rank} (ranks found: {found}); pass "
            f"rank=<multiple of {SIDE_RANK_MULTIPLE}> to zero-pad or trim"
        )
    inferred = dtype is None
    if inferred:
        dtype = gate.shrink.dtype
        for p in projections:
            dtype = torch.promote_types(torch.promote_types(dtype, p.shrink.dtype), p.expand.dtype)
    if inferred and dtype not in _OUT_DTYPES:
        # e.g. a PEFT adapter saved in float16: the adapters are BF16 or FP32 here.
        raise ValueError(
            f"dtype: the adapter's factors are {dtype}, which megamoe adapters are not; pass "
            "dtype=torch.float32 (exact for float16 factors) or dtype=torch.bfloat16"
        )
    check_choice("dtype", dtype, _OUT_DTYPES)
    out = []
    for p in projections:
        p = _fit_rank(p, rank)
        expand = p.expand
        if p.scaling != s:
            # Fold this projection's scaling into its expand factor, in float64 so the
            # only rounding is the final cast.
            expand = expand.to(torch.float64) * (p.scaling / s)
        out += [p.shrink.to(dtype).contiguous(), expand.to(dtype).contiguous()]
    a1, b1, a3, b3, a2, b2 = out
    return SideLoRA(a1, b1, a3, b3, a2, b2, scale=s)


def _split_side(side: SideLoRA, scaling: tuple[float, float, float]) -> tuple[torch.Tensor, ...]:
    """``(a1, b1, a3, b3, a2, b2)`` with each expand factor rescaled to the LoRA
    ``scaling`` of its projection (gate, up, down); unchanged where it equals ``s``.

    Detached: an export of live ``nn.Parameter``s must not carry autograd history into
    a state dict (``safetensors`` and ``load_state_dict`` want plain tensors)."""
    if not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected a megamoe.SideLoRA, got {type(side).__name__}")
    a1, b1, a3, b3, a2, b2 = (t.detach() for t in side.tensors())

    def rescale(t: torch.Tensor, target: float) -> torch.Tensor:
        if target == side.scale:
            return t
        if target == 0.0:
            raise ValueError("lora_alpha: expected a nonzero alpha (the scaling divides B)")
        return (t.to(torch.float64) * (side.scale / target)).to(t.dtype)

    return a1, rescale(b1, scaling[0]), a3, rescale(b3, scaling[1]), a2, rescale(b2, scaling[2])


# ---------------------------------------------------------------------------------------
# State-dict helpers.


def _check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise TypeError(
            f"prefix: expected a str (the module's key prefix), got {type(prefix).__name__}"
        )
    return prefix


def _check_state_dict(state_dict: object) -> Mapping[str, torch.Tensor]:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict: expected a mapping of keys to tensors, got {type(state_dict).__name__}"
        )
    return state_dict


def _join(prefix: str, *parts: str) -> str:
    prefix = _check_prefix(prefix).rstrip(".")
    return ".".join(([prefix] if prefix else []) + list(parts))


def _lora_key(base: str, factor: str, adapter_name: str | None) -> str:
    """``{base}.lora_A.weight`` (saved files) or ``{base}.lora_A.{adapter}.weight`` (a
    live ``PeftModel.state_dict()``)."""
    return _join(base, factor, *([adapter_name] if adapter_name else []), "weight")


def _get(state_dict: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state_dict:
        raise ValueError(f"{key}: missing from the state dict")
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{key}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _check_shape(key: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    ok = t.dim() == len(shape) and all(w is None or w == g for w, g in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{key}: expected shape {want}, got {list(t.shape)}")


def _identical(factors: Sequence[torch.Tensor], keys: Sequence[str], what: str) -> torch.Tensor:
    """The one tensor all ``factors`` equal, else a ValueError naming the first that differs."""
    ref = factors[0]
    for t, key in zip(factors[1:], keys[1:]):
        if t.shape != ref.shape:
            raise ValueError(
                f"{key}: the shared-outer {what} must be identical for every expert; its shape "
                f"{list(t.shape)} differs from {keys[0]} {list(ref.shape)}"
            )
        if not torch.equal(t, ref):
            diff = (t.to(torch.float64) - ref.to(torch.float64)).abs().max().item()
            raise ValueError(
                f"{key}: the shared-outer {what} must be identical for every expert (megamoe "
                f"keeps one copy), but it differs from {keys[0]} (max |diff| = {diff:.3g}); "
                "this adapter is per-expert and has no exact shared-outer form"
            )
    return ref


def _reject_unsupported(state_dict: Mapping[str, torch.Tensor], prefix: str) -> None:
    # DoRA magnitudes and LoRA biases change the math; refusing beats a silent mismatch.
    head = _check_prefix(prefix).rstrip(".")
    _check_state_dict(state_dict)
    for key in state_dict:
        if head and not key.startswith(head + "."):
            continue
        if "lora_magnitude_vector" in key or re.search(r"lora_B(\.[^.]+)?\.bias$", key):
            raise ValueError(
                f"{key}: DoRA magnitudes and LoRA biases have no side-LoRA equivalent; "
                "convert a plain LoRA adapter"
            )


def _alpha_for(lora_alpha: float | Mapping[str, float], name: str) -> float:
    if isinstance(lora_alpha, Mapping):
        if name not in lora_alpha:
            raise ValueError(
                f"lora_alpha: no alpha for {name!r} in the mapping (keys: {sorted(lora_alpha)})"
            )
        return check_finite_float(f"lora_alpha[{name!r}]", lora_alpha[name])
    return check_finite_float("lora_alpha", lora_alpha)


def _gate_up_mode(a1: torch.Tensor, a3: torch.Tensor, gate_up: str) -> str:
    check_str_choice("gate_up", gate_up, GATE_UP_MODES)
    if gate_up == "auto":
        return "shared" if torch.equal(a1, a3) else "stacked"
    if gate_up == "shared" and not torch.equal(a1, a3):
        raise ValueError(
            "gate_up: 'shared' exports one A for gate and up, which needs side.a1 == side.a3 "
            "exactly; they differ. Use gate_up='stacked' (exact, rank 2r) or 'auto'"
        )
    return gate_up


def _fused_from_side(
    side: SideLoRA, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused gate/up LoRA from megamoe factors (scales already applied).

    Returns ``fc1_a [R, H]`` (shared), ``fc1_b [E, 2I, R]``, ``fc2_a [E, r, I]``,
    ``fc2_b [H, r]`` (shared), with ``R = r`` ("shared") or ``2r`` ("stacked").
    """
    a1, b1, a3, b3, a2, b2 = side.tensors()
    if mode == "shared":
        fc1_a = a1.T
        fc1_b = torch.cat([b1.transpose(1, 2), b3.transpose(1, 2)], dim=1)
    else:
        experts, rank, inter = b1.shape
        fc1_a = torch.cat([a1.T, a3.T], dim=0)
        fc1_b = b1.new_zeros(experts, 2 * inter, 2 * rank)
        fc1_b[:, :inter, :rank] = b1.transpose(1, 2)
        fc1_b[:, inter:, rank:] = b3.transpose(1, 2)
    return tuple(_own_storage(t) for t in (fc1_a, fc1_b, a2.transpose(1, 2), b2.T))


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous in storage of its own: views are copied (a transposed view of a
    factor built as ``A.T`` is contiguous already, so ``.contiguous()`` would return
    ``A``'s storage), new tensors (a ``cat``'s result) are kept."""
    if t._base is None and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _projections_from_fused(
    fc1_a: torch.Tensor,
    fc1_b: torch.Tensor,
    fc2_a: torch.Tensor,
    fc2_b: torch.Tensor,
    *,
    names: tuple[str, str, str, str],
    scaling: tuple[float, float],
    split_gate_up: bool,
) -> tuple[_Projection, _Projection, _Projection]:
    """Gate/up/down projections from a fused gate/up LoRA (``fc1_a [R, H]`` shared,
    ``fc1_b [E, 2I, R]``, ``fc2_a [E, r, I]``, ``fc2_b [H, r]`` shared)."""
    inter2 = fc1_b.shape[1]
    if inter2 % 2:
        raise ValueError(f"{names[1]}: expected an even output dim 2*I, got {list(fc1_b.shape)}")
    inter = inter2 // 2
    rank = fc1_a.shape[0]
    b_gate, b_up = fc1_b[:, :inter], fc1_b[:, inter:]  # [E, I, R]
    if split_gate_up:
        half = rank // 2
        if rank % 2 or b_gate[..., half:].any() or b_up[..., :half].any():
            raise ValueError(
                f"{names[1]}: split_gate_up=True needs a block-diagonal gate/up B (gate rows "
                f"use rank slots 0..{half - 1}, up rows {half}..{rank - 1}, the rest zero), as "
                "a stacked export writes it; this one is not (pass split_gate_up=False)"
            )
        gate_a, up_a = fc1_a[:half].T, fc1_a[half:].T
        b_gate, b_up = b_gate[..., :half], b_up[..., half:]
    else:
        gate_a = up_a = fc1_a.T
    gate = _Projection(f"{names[0]} (gate rows)", gate_a, b_gate.transpose(1, 2), scaling[0])
    up = _Projection(f"{names[0]} (up rows)", up_a, b_up.transpose(1, 2), scaling[0])
    down = _Projection(names[2], fc2_a.transpose(1, 2), fc2_b.T, scaling[1])
    if split_gate_up and down.rank > half:
        # A stacked export pads the down pair to 2r with zeros: read it back at r.
        with contextlib.suppress(ValueError):  # down uses slots past r: it keeps its rank
            down = _fit_rank(down, half)
    return gate, up, down


# ---------------------------------------------------------------------------------------
# PEFT, per-expert modules.


def _expert_ids(experts: Sequence[int]) -> list[int]:
    """``experts`` as a list of distinct non-negative ints: each names one local
    expert's keys, so a repeated id would read or write one expert's factors twice."""
    ids = [check_int("experts[i]", e, minimum=0) for e in experts]
    repeated = sorted(e for e, n in Counter(ids).items() if n > 1)
    if repeated:
        raise ValueError(f"experts: expected distinct global ids, got {repeated} more than once")
    return ids


def _discover_experts(
    state_dict: Mapping[str, torch.Tensor], prefix: str, projections: Sequence[str]
) -> list[int]:
    pattern = re.compile(
        re.escape(_join(prefix, "")) + r"(\d+)\.(" + "|".join(map(re.escape, projections)) + r")\."
    )
    found = sorted({int(m.group(1)) for key in state_dict if (m := pattern.match(key))})
    if not found:
        raise ValueError(
            f"state_dict: no per-expert LoRA keys like "
            f"'{_join(prefix, '0', projections[0], 'lora_B.weight')}' found"
        )
    if found != list(range(len(found))):
        missing = sorted(set(range(found[-1] + 1)) - set(found))
        raise ValueError(
            f"state_dict: expert ids under '{prefix}' must be 0..E-1; missing {missing[:8]} "
            "(pass experts=[...] to convert a subset)"
        )
    return found


def _shared_factor(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    experts: Sequence[int],
    proj: str,
    factor: str,
    adapter_name: str | None,
) -> tuple[torch.Tensor, str]:
    """The shared factor of ``proj`` as a 2D tensor, from the expert-agnostic name or the
    per-expert copies (all of them, identical)."""
    agnostic = _lora_key(_join(prefix, proj), factor, adapter_name)
    per_expert = [_lora_key(_join(prefix, str(e), proj), factor, adapter_name) for e in experts]
    present = [k for k in per_expert if k in state_dict]
    if present and len(present) != len(per_expert):
        missing = next(k for k in per_expert if k not in state_dict)
        raise ValueError(f"{missing}: missing from the state dict (other experts have it)")
    keys = ([agnostic] if agnostic in state_dict else []) + present
    if not keys:
        raise ValueError(
            f"{agnostic}: missing from the state dict (nor per-expert {per_expert[0]})"
        )
    tensors = []
    for key in keys:
        t = _get(state_dict, key)
        if t.dim() == 3 and t.shape[0] == 1:  # the [1, out, in] expert-agnostic export
            t = t[0]
        if t.dim() != 2:
            raise ValueError(f"{key}: expected a 2D LoRA factor (or [1, ...]), got {list(t.shape)}")
        tensors.append(t)
    what = f"{proj}.{factor}"
    return _identical(tensors, keys, what), keys[0]


def side_lora_from_peft(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    *,
    lora_alpha: float | Mapping[str, float],
    use_rslora: bool = False,
    experts: Sequence[int] | None = None,
    projections: tuple[str, str, str] = PEFT_PROJECTIONS,
    adapter_name: str | None = None,
    scale: float | None = None,
    rank: int | None = None,
    dtype: torch.dtype | None = None,
) -> SideLoRA:
    """A :class:`SideLoRA` from a PEFT LoRA on per-expert ``nn.Linear`` modules.

    Shared-outer means: ``gate_proj.lora_A`` is one tensor for all experts, so is
    ``up_proj.lora_A``, and so is ``down_proj.lora_B``; ``gate_proj.lora_B``,
    ``up_proj.lora_B`` and ``down_proj.lora_A`` are per expert. Keys (``P = prefix``,
    the experts container such as ``base_model.model.model.layers.3.mlp.experts``;
    ``.lora_A.weight`` becomes ``.lora_A.{adapter_name}.weight`` if given):

    - ``P.{e}.gate_proj.lora_B.weight`` ``[I, r]`` and ``P.{e}.up_proj.lora_B.weight``
      ``[I, r]`` for every expert ``e``; ``P.{e}.down_proj.lora_A.weight`` ``[r, I]``;
    - the shared ``gate_proj.lora_A`` ``[r, H]``, ``up_proj.lora_A`` ``[r, H]`` and
      ``down_proj.lora_B`` ``[H, r]``: either per expert under ``P.{e}.…`` (the copies
      must be bit-identical, else a ``ValueError`` names the first differing key), or
      once under the expert-agnostic ``P.gate_proj.lora_A.weight`` etc., 2D or with a
      leading ``1`` (Megatron-Bridge's SGLang-style export).

    Args:
        state_dict: the adapter's tensors (``adapter_model.safetensors`` or
            ``get_peft_model_state_dict``).
        prefix: the experts container key prefix (with or without a trailing dot).
        lora_alpha: ``lora_alpha`` of the adapter config, or a mapping from projection
            name to alpha (``alpha_pattern``).
        use_rslora: the config's ``use_rslora`` (scaling ``alpha / sqrt(r)``).
        experts: global expert ids to take, in local order (expert parallelism);
            default all, which must be ``0..E-1``.
        projections: module names of (gate, up, down); Mixtral: ``("w1", "w3", "w2")``.
        adapter_name: set for keys that carry the adapter name.
        scale: megamoe's ``s``; default the gate projection's LoRA scaling (the other
            projections' scalings are folded into their ``b`` factor when they differ).
        rank: target rank (multiple of 16); default the largest rank found.
        dtype: output dtype (bf16/fp32/fp64); default the promoted input dtype.

    Returns:
        ``SideLoRA`` with ``a1/a3 [H, r]``, ``b1/b3 [E, r, I]``, ``a2 [E, I, r]``,
        ``b2 [r, H]`` on the input device.
    """
    if len(projections) != 3:
        raise ValueError(f"projections: expected (gate, up, down) names, got {projections!r}")
    _reject_unsupported(state_dict, prefix)
    if experts is None:
        experts = _discover_experts(state_dict, prefix, projections)
    experts = _expert_ids(experts)
    if not experts:
        raise ValueError("experts: expected at least one expert id, got []")
    gate_name, up_name, down_name = projections

    def per_expert(proj: str, factor: str) -> tuple[torch.Tensor, str]:
        keys = [_lora_key(_join(prefix, str(e), proj), factor, adapter_name) for e in experts]
        tensors = [_get(state_dict, k) for k in keys]
        check_devices(list(zip(keys, tensors)), keys[0])  # before they are stacked
        _check_shape(keys[0], tensors[0], (None, None))
        for k, t in zip(keys[1:], tensors[1:]):
            _check_shape(k, t, tuple(tensors[0].shape))
        return torch.stack(tensors), keys[0]

    out = []
    for proj in (gate_name, up_name):
        a, a_key = _shared_factor(state_dict, prefix, experts, proj, "lora_A", adapter_name)
        b, b_key = per_expert(proj, "lora_B")  # [E, I, r]
        r = a.shape[0]
        _check_shape(b_key, b[0], (None, r))
        _check_shape(a_key, a, (r, None))
        scaling = lora_scaling(_alpha_for(lora_alpha, proj), r, use_rslora)
        out.append(_Projection(a_key, a.T, b.transpose(1, 2), scaling))
    a, a_key = per_expert(down_name, "lora_A")  # [E, r, I]
    b, b_key = _shared_factor(state_dict, prefix, experts, down_name, "lora_B", adapter_name)
    r = a.shape[1]
    _check_shape(b_key, b, (None, r))
    scaling = lora_scaling(_alpha_for(lora_alpha, down_name), r, use_rslora)
    out.append(_Projection(a_key, a.transpose(1, 2), b.T, scaling))
    return _assemble(*out, scale=scale, rank=rank, dtype=dtype)


def side_lora_to_peft(
    side: SideLoRA,
    prefix: str,
    *,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    experts: Sequence[int] | None = None,
    projections: tuple[str, str, str] = PEFT_PROJECTIONS,
    adapter_name: str | None = None,
    shared: str = "per_expert",
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A PEFT per-expert-module state dict from a :class:`SideLoRA` (inverse of
    :func:`side_lora_from_peft`).

    Args:
        side: the adapters (``E`` local experts, rank ``r``).
        prefix: the experts container key prefix.
        lora_alpha: alpha for the config; default ``s * r`` (``s * sqrt(r)`` with
            rsLoRA) so the LoRA scaling equals ``s`` and no factor is rescaled (up to
            the rounding of ``s * r / r``: module docstring).
        use_rslora: write an rsLoRA adapter.
        experts: global expert id of each local expert (default ``0..E-1``).
        projections: module names of (gate, up, down).
        adapter_name: put the adapter name into the keys.
        shared: ``"per_expert"``: each expert gets its own copy of the shared factors
            (plain PEFT, vLLM); ``"expert_agnostic"``: one ``[1, out, in]`` tensor under
            ``P.gate_proj.lora_A.weight`` etc. (SGLang's shared-outer contract).

    Returns:
        ``(state_dict, config)``: contiguous tensors that share no storage (safetensors
        refuses shared storage), and ``{"r", "lora_alpha", "use_rslora",
        "target_modules"}`` for ``adapter_config.json``.
    """
    check_str_choice("shared", shared, ("per_expert", "expert_agnostic"))
    if not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected a megamoe.SideLoRA, got {type(side).__name__}")
    r = side.rank
    if experts is None:
        experts = list(range(side.num_experts))
    experts = _expert_ids(experts)
    if len(experts) != side.num_experts:
        raise ValueError(
            f"experts: expected {side.num_experts} global ids (one per local expert), got "
            f"{len(experts)}"
        )
    if lora_alpha is None:
        lora_alpha = side.scale * (math.sqrt(r) if use_rslora else r)
    scaling = lora_scaling(lora_alpha, r, use_rslora)
    a1, b1, a3, b3, a2, b2 = _split_side(side, (scaling, scaling, scaling))
    gate, up, down = projections
    out: dict[str, torch.Tensor] = {}

    def put_shared(proj: str, factor: str, t: torch.Tensor) -> None:
        if shared == "expert_agnostic":
            copy = t.unsqueeze(0).clone(memory_format=torch.contiguous_format)
            out[_lora_key(_join(prefix, proj), factor, adapter_name)] = copy
            return
        for e in experts:
            out[_lora_key(_join(prefix, str(e), proj), factor, adapter_name)] = t.clone(
                memory_format=torch.contiguous_format
            )

    put_shared(gate, "lora_A", a1.T)
    put_shared(up, "lora_A", a3.T)
    put_shared(down, "lora_B", b2.T)
    for local, e in enumerate(experts):
        out[_lora_key(_join(prefix, str(e), gate), "lora_B", adapter_name)] = b1[local].T.clone(
            memory_format=torch.contiguous_format
        )
        out[_lora_key(_join(prefix, str(e), up), "lora_B", adapter_name)] = b3[local].T.clone(
            memory_format=torch.contiguous_format
        )
        out[_lora_key(_join(prefix, str(e), down), "lora_A", adapter_name)] = a2[local].T.clone(
            memory_format=torch.contiguous_format
        )
    config = {
        "r": r,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_modules": list(projections),
    }
    return out, config


# ---------------------------------------------------------------------------------------
# PEFT, fused 3D expert parameters (lora.ParamWrapper).

#: Where PEFT puts the two nested ParamWrappers of an experts module, relative to it:
#: ``gate_up_proj`` is the inner one (``base_layer``), ``down_proj`` the outer one.
PEFT_FUSED_GATE_UP = "base_layer"
PEFT_FUSED_DOWN = ""


def _unpack_param_wrapper(
    a: torch.Tensor, b: torch.Tensor, experts: int, keys: tuple[str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """ParamWrapper ``lora_A [E*r, in]``, ``lora_B [out, r*E]`` -> ``[E, r, in]``,
    ``[E, out, r]``. PEFT reshapes A to ``[E, r, in]`` but B to ``[out, r, E]``."""
    if a.dim() != 2 or a.shape[0] % experts:
        raise ValueError(f"{keys[0]}: expected [E*r, in] with E={experts}, got {list(a.shape)}")
    rank = a.shape[0] // experts
    _check_shape(keys[1], b, (None, rank * experts))
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(
        2, 0, 1
    )


def _pack_param_wrapper(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_unpack_param_wrapper`: ``[E, r, in]``, ``[E, out, r]``."""
    experts, rank, _ = a.shape
    return (
        a.reshape(experts * rank, a.shape[2]).contiguous(),
        b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous(),
    )


def side_lora_from_peft_fused(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    *,
    num_experts: int,
    lora_alpha: float | Mapping[str, float],
    use_rslora: bool = False,
    adapter_name: str | None = None,
    split_gate_up: bool = False,
    scale: float | None = None,
    rank: int | None = None,
    dtype: torch.dtype | None = None,
) -> SideLoRA:
    """A :class:`SideLoRA` from PEFT ``target_parameters`` LoRA on fused expert weights.

    The experts module (``prefix``, e.g. ``base_model.model.model.layers.0.mlp.experts``)
    holds ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``.
    PEFT wraps each in a ``lora.ParamWrapper``; the two wrappers nest, so one pair of
    keys is ``P.lora_A.weight``/``P.lora_B.weight`` and the other
    ``P.base_layer.lora_A.weight``/``P.base_layer.lora_B.weight`` (which is which is
    read from the shapes). Per wrapper, ``lora_A.weight [E*R, in]`` holds expert ``e``'s
    ``A_e`` in rows ``e*R .. e*R+R-1`` and ``lora_B.weight [out, R*E]`` holds its
    ``B_e`` in columns ``j*E + e`` (PEFT ≥ 0.17, ``ParamWrapper.get_delta_weight``).

    Shared-outer means: gate_up's ``A_e`` is identical for every expert (and serves
    both gate and up: ``a1 = a3``) and down's ``B_e`` is identical for every expert;
    otherwise a ``ValueError`` names the key and expert.

    Args:
        state_dict, prefix, adapter_name: as in :func:`side_lora_from_peft`.
        num_experts: ``E`` (the packed dims cannot tell ``E`` from ``R``).
        lora_alpha: the config's alpha, or a mapping ``{"gate_up_proj": ..,
            "down_proj": ..}``.
        use_rslora: the config's ``use_rslora``.
        split_gate_up: read a block-diagonal gate/up adapter of rank ``2r`` (a stacked
            export, or PEFT's conversion of transformers-4 per-expert gate/up LoRA) as
            ``a1``, ``a3`` of rank ``r``; a non-block-diagonal one is rejected.
        scale, rank, dtype: as in :func:`side_lora_from_peft`.
    """
    num_experts = check_int("num_experts", num_experts, minimum=1)
    _reject_unsupported(state_dict, prefix)
    outer = tuple(_lora_key(prefix, f, adapter_name) for f in ("lora_A", "lora_B"))
    inner_prefix = _join(prefix, PEFT_FUSED_GATE_UP)
    inner = tuple(_lora_key(inner_prefix, f, adapter_name) for f in ("lora_A", "lora_B"))
    pairs = {keys: tuple(_get(state_dict, k) for k in keys) for keys in (outer, inner)}

    def fits(gu_keys: tuple[str, str], down_keys: tuple[str, str]) -> bool:
        (gu_a, gu_b), (dn_a, dn_b) = pairs[gu_keys], pairs[down_keys]
        if min(t.dim() for t in (gu_a, gu_b, dn_a, dn_b)) != 2:
            return False
        hidden, inter = gu_a.shape[1], dn_a.shape[1]
        return gu_b.shape[0] == 2 * inter and dn_b.shape[0] == hidden

    # In H/I terms the two assignments need 2I == out_gu, H == out_down for one and
    # 2H' == ... for the other; both cannot hold, so the shapes decide unambiguously.
    if fits(inner, outer):
        gu_keys, dn_keys = inner, outer
    elif fits(outer, inner):
        gu_keys, dn_keys = outer, inner
    else:
        shapes = {k: list(t.shape) for keys in (outer, inner) for k, t in zip(keys, pairs[keys])}
        raise ValueError(
            f"state_dict: the LoRA pairs under '{prefix}' do not look like gate_up_proj "
            f"(A [E*R, H], B [2I, R*E]) and down_proj (A [E*R, I], B [H, R*E]): {shapes}"
        )
    gu_a, gu_b = _unpack_param_wrapper(*pairs[gu_keys], num_experts, gu_keys)
    dn_a, dn_b = _unpack_param_wrapper(*pairs[dn_keys], num_experts, dn_keys)
    keys_a = [f"{gu_keys[0]} (expert {e})" for e in range(num_experts)]
    keys_b = [f"{dn_keys[1]} (expert {e})" for e in range(num_experts)]
    fc1_a = _identical(list(gu_a), keys_a, "gate_up_proj lora_A")
    fc2_b = _identical(list(dn_b), keys_b, "down_proj lora_B")
    scaling = (
        lora_scaling(_alpha_for(lora_alpha, "gate_up_proj"), fc1_a.shape[0], use_rslora),
        lora_scaling(_alpha_for(lora_alpha, "down_proj"), fc2_b.shape[1], use_rslora),
    )
    gate, up, down = _projections_from_fused(
        fc1_a,
        gu_b,
        dn_a,
        fc2_b,
        names=(gu_keys[0], gu_keys[1], dn_keys[0], dn_keys[1]),
        scaling=scaling,
        split_gate_up=split_gate_up,
    )
    return _assemble(gate, up, down, scale=scale, rank=rank, dtype=dtype)


def side_lora_to_peft_fused(
    side: SideLoRA,
    prefix: str,
    *,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    gate_up: str = "auto",
    adapter_name: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A PEFT ``target_parameters`` state dict (inverse of :func:`side_lora_from_peft_fused`).

    Writes ``gate_up_proj``'s pair under ``P.base_layer.lora_{A,B}.weight`` and
    ``down_proj``'s under ``P.lora_{A,B}.weight``: the nesting PEFT produces when it
    wraps ``gate_up_proj`` first, which is also what PEFT's transformers-v5 adapter
    conversion and Megatron-Bridge's export write. Every expert gets a copy of the
    shared factors (PEFT's ParamWrapper has no shared form).

    Args:
        side: the adapters.
        prefix: the experts module key prefix.
        lora_alpha: the config's alpha; default ``s * R`` (``s * sqrt(R)`` for rsLoRA)
            with ``R`` the exported rank, so no factor is rescaled (up to the
            rounding of ``s * R / R``: module docstring).
        use_rslora: write an rsLoRA adapter.
        gate_up: ``"shared"`` (needs ``a1 == a3``: one ``A``, rank ``r``),
            ``"stacked"`` (``A = [a1^T; a3^T]``, block-diagonal ``B``, rank ``2r``) or
            ``"auto"`` (shared when ``a1 == a3`` bitwise, else stacked). down_proj is
            zero-padded to the same rank, so the config needs one ``r``.
        adapter_name: put the adapter name into the keys.

    Returns:
        ``(state_dict, config)`` with config ``{"r", "lora_alpha", "use_rslora",
        "target_parameters"}`` (``target_parameters`` as parameter names relative
        to the experts module: ``["gate_up_proj", "down_proj"]``; prefix them with the
        module path your model needs, e.g. ``"mlp.experts.gate_up_proj"``).
    """
    if not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected a megamoe.SideLoRA, got {type(side).__name__}")
    mode = _gate_up_mode(side.a1, side.a3, gate_up)
    rank = side.rank if mode == "shared" else 2 * side.rank
    if lora_alpha is None:
        lora_alpha = side.scale * (math.sqrt(rank) if use_rslora else rank)
    scaling = lora_scaling(lora_alpha, rank, use_rslora)
    rescaled = SideLoRA(*_split_side(side, (scaling,) * 3), scale=scaling)
    fc1_a, fc1_b, fc2_a, fc2_b = _fused_from_side(rescaled, mode)
    fc2_a, fc2_b = _pad_down(fc2_a, fc2_b, rank)
    experts = side.num_experts
    gu_a, gu_b = _pack_param_wrapper(fc1_a.unsqueeze(0).expand(experts, -1, -1), fc1_b)
    dn_a, dn_b = _pack_param_wrapper(fc2_a, fc2_b.unsqueeze(0).expand(experts, -1, -1))
    inner_prefix = _join(prefix, PEFT_FUSED_GATE_UP)
    out = {
        _lora_key(inner_prefix, "lora_A", adapter_name): gu_a,
        _lora_key(inner_prefix, "lora_B", adapter_name): gu_b,
        _lora_key(prefix, "lora_A", adapter_name): dn_a,
        _lora_key(prefix, "lora_B", adapter_name): dn_b,
    }
    config = {
        "r": rank,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_parameters": ["gate_up_proj", "down_proj"],
    }
    return out, config


def _pad_down(
    fc2_a: torch.Tensor, fc2_b: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the down pair (``[E, r, I]``, ``[H, r]``) to ``rank`` (exact)."""
    pad = rank - fc2_a.shape[1]
    if pad == 0:
        return fc2_a, fc2_b
    fc2_a = torch.cat([fc2_a, fc2_a.new_zeros(fc2_a.shape[0], pad, fc2_a.shape[2])], dim=1)
    fc2_b = torch.cat([fc2_b, fc2_b.new_zeros(fc2_b.shape[0], pad)], dim=1)
    return fc2_a, fc2_b


# ---------------------------------------------------------------------------------------
# Megatron-Bridge.

MEGATRON_FC1 = "linear_fc1"
MEGATRON_FC2 = "linear_fc2"


def _megatron_key(prefix: str, linear: str, side: str) -> str:
    return _join(prefix, linear, "adapter", side, "weight")


def side_lora_from_megatron(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    *,
    alpha: float,
    num_experts: int | None = None,
    split_gate_up: bool = False,
    scale: float | None = None,
    rank: int | None = None,
    dtype: torch.dtype | None = None,
) -> SideLoRA:
    """A :class:`SideLoRA` from Megatron-Bridge grouped-expert LoRA (shared-outer).

    Keys (``P = prefix``, the experts module, e.g. ``decoder.layers.0.mlp.experts``),
    from ``LoRA(experts_shared_outer_loras=True)``'s ``SharedOuterGroupedExpertAdapter``:

    - ``P.linear_fc1.adapter.linear_in.weight`` ``[R, H]``: shared ``A`` of gate and up;
    - ``P.linear_fc1.adapter.linear_out.weight`` ``[E_l, 2I, R]``: per-expert ``B``,
      rows ``0..I-1`` gate, ``I..2I-1`` up (Megatron's fused SwiGLU ``linear_fc1``);
    - ``P.linear_fc2.adapter.linear_in.weight`` ``[E_l, R, I]``: per-expert ``A``;
    - ``P.linear_fc2.adapter.linear_out.weight`` ``[H, R]``: shared ``B``.

    Scaling ``alpha / R`` (the adapter's ``alpha / dim``). Also accepted: the other two
    grouped-expert layouts when their values are shared-outer: a 3D shared side
    (``share_expert_adapters=False``, one pair per expert) whose experts are
    bit-identical, and a 2D per-expert side (``share_expert_adapters=True``, one
    adapter for all experts), broadcast to ``num_experts``. Tensors must be unsharded
    (expert tensor parallel size 1, or gathered).

    Args:
        state_dict: e.g. ``model.state_dict()`` of the Megatron module, or a gathered
            checkpoint.
        prefix: the experts module key prefix.
        alpha: the LoRA config's ``alpha``.
        num_experts: ``E_l``; needed only when every side is 2D.
        split_gate_up, scale, rank, dtype: as in :func:`side_lora_from_peft_fused`.
    """
    alpha = check_finite_float("alpha", alpha)
    _check_state_dict(state_dict)
    keys = {
        (linear, side): _megatron_key(prefix, linear, side)
        for linear in (MEGATRON_FC1, MEGATRON_FC2)
        for side in ("linear_in", "linear_out")
    }
    raw = {k: _get(state_dict, key) for k, key in keys.items()}
    experts = None
    for k in ((MEGATRON_FC1, "linear_out"), (MEGATRON_FC2, "linear_in")):
        if raw[k].dim() == 3:
            experts = raw[k].shape[0] if experts is None else experts
            if raw[k].shape[0] != experts:
                raise ValueError(
                    f"{keys[k]}: expected {experts} local experts like the fc1 adapter, got "
                    f"{list(raw[k].shape)}"
                )
    if num_experts is not None:
        num_experts = check_int("num_experts", num_experts, minimum=1)
        if experts is not None and experts != num_experts:
            raise ValueError(
                f"num_experts: the adapter holds {experts} local experts, got {num_experts}"
            )
        experts = num_experts
    if experts is None:
        raise ValueError(
            "num_experts: every adapter side is 2D (one adapter for all experts); pass "
            "num_experts=E_l to broadcast it"
        )

    def shared(k: tuple[str, str]) -> torch.Tensor:
        t = raw[k]
        if t.dim() == 2:
            return t
        if t.dim() != 3 or t.shape[0] != experts:
            raise ValueError(
                f"{keys[k]}: expected [*, *] or [{experts}, *, *], got {list(t.shape)}"
            )
        names = [f"{keys[k]} (expert {e})" for e in range(experts)]
        return _identical(list(t), names, f"{k[0]} {k[1]}")

    def per_expert(k: tuple[str, str]) -> torch.Tensor:
        t = raw[k]
        if t.dim() == 2:
            return t.unsqueeze(0).expand(experts, -1, -1)
        if t.dim() != 3:
            raise ValueError(
                f"{keys[k]}: expected [{experts}, *, *] or [*, *], got {list(t.shape)}"
            )
        return t

    fc1_a = shared((MEGATRON_FC1, "linear_in"))
    fc1_b = per_expert((MEGATRON_FC1, "linear_out"))
    fc2_a = per_expert((MEGATRON_FC2, "linear_in"))
    fc2_b = shared((MEGATRON_FC2, "linear_out"))
    r1, r2 = fc1_a.shape[0], fc2_b.shape[1]
    _check_shape(keys[MEGATRON_FC1, "linear_out"], fc1_b, (experts, None, r1))
    _check_shape(keys[MEGATRON_FC2, "linear_in"], fc2_a, (experts, r2, None))
    scaling = (lora_scaling(alpha, r1), lora_scaling(alpha, r2))
    names = (
        keys[MEGATRON_FC1, "linear_in"],
        keys[MEGATRON_FC1, "linear_out"],
        keys[MEGATRON_FC2, "linear_in"],
        keys[MEGATRON_FC2, "linear_out"],
    )
    gate, up, down = _projections_from_fused(
        fc1_a, fc1_b, fc2_a, fc2_b, names=names, scaling=scaling, split_gate_up=split_gate_up
    )
    return _assemble(gate, up, down, scale=scale, rank=rank, dtype=dtype)


def side_lora_to_megatron(
    side: SideLoRA,
    prefix: str,
    *,
    alpha: float | None = None,
    gate_up: str = "auto",
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Megatron-Bridge ``SharedOuterGroupedExpertAdapter`` tensors from a :class:`SideLoRA`.

    Inverse of :func:`side_lora_from_megatron`. Megatron has one ``dim`` for fc1 and
    fc2, so with ``gate_up="stacked"`` (rank ``2r``) the fc2 pair is zero-padded to
    ``2r`` too.

    Args:
        side: the adapters (``E_l`` local experts).
        prefix: the experts module key prefix.
        alpha: the config's ``alpha``; default ``s * dim`` so ``alpha / dim == s``.
        gate_up: ``"shared"``, ``"stacked"`` or ``"auto"`` as in
            :func:`side_lora_to_peft_fused`.

    Returns:
        ``(state_dict, config)`` with config ``{"dim", "alpha",
        "experts_shared_outer_loras": True}`` for ``megatron.bridge.peft.lora.LoRA``.
    """
    if not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected a megamoe.SideLoRA, got {type(side).__name__}")
    mode = _gate_up_mode(side.a1, side.a3, gate_up)
    dim = side.rank if mode == "shared" else 2 * side.rank
    if alpha is None:
        alpha = side.scale * dim
    scaling = lora_scaling(alpha, dim)
    rescaled = SideLoRA(*_split_side(side, (scaling,) * 3), scale=scaling)
    fc1_a, fc1_b, fc2_a, fc2_b = _fused_from_side(rescaled, mode)
    fc2_a, fc2_b = _pad_down(fc2_a, fc2_b, dim)
    out = {
        _megatron_key(prefix, MEGATRON_FC1, "linear_in"): fc1_a,
        _megatron_key(prefix, MEGATRON_FC1, "linear_out"): fc1_b,
        _megatron_key(prefix, MEGATRON_FC2, "linear_in"): fc2_a.contiguous(),
        _megatron_key(prefix, MEGATRON_FC2, "linear_out"): fc2_b.contiguous(),
    }
    config = {"dim": dim, "alpha": alpha, "experts_shared_outer_loras": True}
    return out, config
