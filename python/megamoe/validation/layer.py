"""Argument checks of the MoE layer call, shared by ``mm.moe``, the custom ops and their
fake (meta) implementations, so every path rejects the same inputs with the same message.

Order (docs/DESIGN.md §5): first what the arguments are (types, shapes, dtypes, ranks,
layouts, the activation, id values where they can be read without a device
synchronisation), then where they are (one device for all), and only then whether
that device can run the fused kernels. A user on a machine without a GPU therefore
learns what is wrong with the call itself, not just that there is no GPU.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device, layout or value); the message starts with the argument's name.
"""

from __future__ import annotations

import torch

from ..side_lora import SIDE_NAMES, SideLoRA
from ..weights import BASE_FORMATS, BaseWeights
from ..wrappers.grouped_gemm import ACTIVATIONS
from ..wrappers.registry import registry
from ..wrappers.routing import check_local_experts, pool_capacity
from .arguments import (
    FLOAT32_MAX,
    check_int,
    check_str_choice,
    check_tensor,
    float32_value,
    has_data,
)

__all__ = [
    "check_backward_inputs",
    "check_base_weights",
    "check_call_structure",
    "check_devices",
    "check_masters",
    "check_moe_inputs",
]

# MXFP4 packs two E2M1 codes per byte and keeps one UE8M0 scale per 32 values.
_CODES_PER_BYTE = 2
_SCALE_BLOCK = 32
_BF16 = (torch.bfloat16,)


def _reads_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read on the host without a device synchronisation:
    a CPU tensor with data (:func:`has_data`)."""
    return t.device.type == "cpu" and has_data(t)


def check_kernel_dims(hidden_name: str, hidden: int, inter_name: str, intermediate: int) -> None:
    """``ValueError`` naming the argument unless ``H`` (``hidden``) and ``I``
    (``intermediate``) are multiples of the kernels' tiles: for the constructors that
    take the dims before any weight exists (``megamoe.MegaMoE``, torchtitan's experts)."""
    reg = registry()
    for name, value, multiple, tile in (
        (hidden_name, hidden, reg.hidden_multiple, "K tile"),
        (inter_name, intermediate, reg.intermediate_multiple, "gate/up tile"),
    ):
        if value % multiple != 0:
            raise ValueError(
                f"{name}: expected a multiple of {multiple} (the kernels' {tile}), got {value}"
            )


def check_base_weights(base: object) -> BaseWeights:
    """Check that ``base`` is a :class:`~megamoe.BaseWeights` whose tensors agree with
    its own ``format`` and dims (it may have been built by hand, or by the custom ops
    from their raw tensor inputs). Devices are checked by :func:`check_devices`.

    BF16: ``w13 [E_l, 2I, H]`` and ``w2 [E_l, H, I]`` bfloat16, no scales. MXFP4:
    ``w13 [E_l, 2I, H/2]``, ``w2 [E_l, H, I/2]`` uint8 codes and ``w13_scales
    [E_l, 2I, H/32]``, ``w2_scales [E_l, H, I/32]`` uint8 scales. Every tensor
    contiguous, and ``H``, ``I`` multiples of the kernels' tiles (what
    :func:`~megamoe.prepare_base_weights` gives), so a hand-built base is refused here
    and not by a kernel launcher midway through a call.
    """
    if not isinstance(base, BaseWeights):
        raise TypeError(f"base: expected megamoe.BaseWeights, got {type(base).__name__}")
    check_str_choice("base.format", base.format, BASE_FORMATS)
    experts, hidden, inter = base.num_experts, base.hidden, base.intermediate
    for name, value in (("num_experts", experts), ("hidden", hidden), ("intermediate", inter)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 1:
            raise ValueError(f"base.{name}: expected an int >= 1, got {value!r}")
    if isinstance(experts, int):
        check_local_experts("base.num_experts", experts)
    reg = registry()
    if hidden % reg.hidden_multiple or inter % reg.intermediate_multiple:
        raise ValueError(
            f"base: expected H a multiple of {reg.hidden_multiple} (the kernels' K tile) and "
            f"I a multiple of {reg.intermediate_multiple} (their gate/up tile), got H={hidden}, "
            f"I={inter}"
        )
    if base.format == "bf16":
        check_tensor(
            "base.w13", base.w13, shape=(experts, 2 * inter, hidden), dtypes=_BF16,
            contiguous=True,
        )  # fmt: skip
        check_tensor(
            "base.w2", base.w2, shape=(experts, hidden, inter), dtypes=_BF16, contiguous=True
        )
        for name in ("w13_scales", "w2_scales"):
            if getattr(base, name) is not None:
                raise ValueError(f"base.{name}: expected None for a bf16 base")
        return base
    if hidden % _SCALE_BLOCK or inter % _SCALE_BLOCK:
        raise ValueError(
            f"base: an mxfp4 base needs H and I multiples of {_SCALE_BLOCK}, got H={hidden}, "
            f"I={inter}"
        )
    shapes = {
        "w13": (experts, 2 * inter, hidden // _CODES_PER_BYTE),
        "w13_scales": (experts, 2 * inter, hidden // _SCALE_BLOCK),
        "w2": (experts, hidden, inter // _CODES_PER_BYTE),
        "w2_scales": (experts, hidden, inter // _SCALE_BLOCK),
    }
    for name, shape in shapes.items():
        check_tensor(
            f"base.{name}", getattr(base, name), shape=shape, dtypes=(torch.uint8,),
            contiguous=True,
        )  # fmt: skip
    return base


def check_activation(activation: object, activation_clamp: object) -> None:
    """``activation`` one of ACTIVATIONS; ``activation_clamp`` None or a positive float
    finite in float32 (the kernels take it as float32)."""
    check_str_choice("activation", activation, tuple(ACTIVATIONS))
    if activation_clamp is None:
        return
    if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float)):
        raise TypeError(
            f"activation_clamp: expected a positive finite float or None, got "
            f"{type(activation_clamp).__name__}"
        )
    try:
        positive_finite = 0 < float(activation_clamp) <= FLOAT32_MAX  # NaN fails it too
    except OverflowError:  # an int beyond float's range
        positive_finite = False
    if not positive_finite:
        raise ValueError(
            "activation_clamp: expected a positive finite float (finite in float32) or "
            f"None, got {activation_clamp!r}"
        )
    if float32_value(float(activation_clamp)) == 0:  # the kernels' float32 clamp
        raise ValueError(
            f"activation_clamp: expected a value that stays positive in float32, got "
            f"{activation_clamp!r} (0 in float32)"
        )


def check_call_structure(topk_ids: object, side: object, *, ids_name: str = "topk_ids") -> None:
    """What a layer call reads before its full checks run (``mm.moe``'s route plan
    size, the adapter's tensors): ``side`` a :class:`~megamoe.SideLoRA` or None, and
    ``topk_ids`` a 2-D tensor with ``K >= 1``. Part of :func:`check_moe_inputs`, and on
    its own where those checks run later (inside the custom op, or at trace time)."""
    if side is not None and not isinstance(side, SideLoRA):
        raise TypeError(f"side: expected megamoe.SideLoRA or None, got {type(side).__name__}")
    check_tensor(ids_name, topk_ids, ndim=2)
    if topk_ids.shape[1] < 1:
        raise ValueError(
            f"{ids_name}: expected at least one route per token (K >= 1), got shape "
            f"{list(topk_ids.shape)}"
        )


def check_masters(
    base: BaseWeights,
    w13_master: torch.Tensor | None,
    w2_master: torch.Tensor | None,
) -> None:
    """The op inputs ``w13_master``/``w2_master`` (ordinary mode on an MXFP4 base kept
    packed): both None, or, with an MXFP4 ``base``, both given, shaped like its decode
    (``[E, 2I, H]``, ``[E, H, I]``), bfloat16 or float32 (what
    :func:`~megamoe.prepare_base_weights` quantizes). Their values are never read: they
    take the gradient. Part of :func:`check_moe_inputs` (which also puts them on the
    call's device), after the base's own checks."""
    if w13_master is None and w2_master is None:
        return
    if base.format != "mxfp4":
        name = "w13_master" if w13_master is not None else "w2_master"
        raise ValueError(
            f"{name}: master weights go with an MXFP4 base (a BF16 base takes its "
            f"gradients itself), got a {base.format} base"
        )
    experts, hidden, inter = base.num_experts, base.hidden, base.intermediate
    shapes = {"w13_master": (experts, 2 * inter, hidden), "w2_master": (experts, hidden, inter)}
    masters = {"w13_master": w13_master, "w2_master": w2_master}
    for name, master in masters.items():
        if master is None:
            raise ValueError(f"{name}: expected both masters or neither, got only the other")
        check_tensor(name, master, shape=shapes[name], dtypes=(torch.bfloat16, torch.float32))
    if w2_master.dtype != w13_master.dtype:
        raise TypeError(
            f"w2_master: expected the dtype of w13_master ({w13_master.dtype}), got "
            f"{w2_master.dtype}"
        )


def check_devices(named: list[tuple[str, torch.Tensor | None]], where: str) -> torch.device:
    """All tensors of ``named`` on one device: the first's. ``None`` entries are skipped.

    Raises ``ValueError`` starting with the first argument elsewhere and listing every
    argument that is not on that device, e.g. ``x: expected device meta (where base
    is), got cpu; the call's tensors must share one device, and these are elsewhere:
    x (cpu), topk_ids (cpu)``. ``where`` names the reference (the first entry).
    """
    present = [(name, t) for name, t in named if t is not None]
    device = present[0][1].device
    off = [(name, t.device) for name, t in present if t.device != device]
    if off:
        first, got = off[0]
        listing = ", ".join(f"{name} ({d})" for name, d in off)
        raise ValueError(
            f"{first}: expected device {device} (where {where} is), got {got}; the call's "
            f"tensors must share one device, and these are elsewhere: {listing}"
        )
    return device


def check_moe_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    activation: str,
    activation_clamp: float | None,
    *,
    require_cuda: bool = True,
    allow_no_tokens: bool = False,
    expert_id_limit: int | None = None,
    ids_name: str = "topk_ids",
    masters: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.device:
    """Every argument check of the MoE layer call, before anything runs.

    Args:
        x: ``[T, H]`` bfloat16, contiguous (16-byte aligned on CUDA).
        topk_ids: ``[T, K]`` int32/int64, contiguous, ``K >= 1``.
        topk_weights: ``[T, K]`` float32, contiguous.
        base: a :class:`~megamoe.BaseWeights` (see :func:`check_base_weights`).
        side: a bfloat16 :class:`~megamoe.SideLoRA` with the base's ``H``, ``I``,
            ``E_l``, or None.
        activation: ``"swiglu"`` or ``"geglu"``; activation_clamp: ``c > 0`` or None.
        require_cuda: reject weights that are not on a CUDA device (the fused kernels'
            requirement), checked last. The fake implementations and the CPU twins of
            the EP layer pass False.
        allow_no_tokens: accept ``T = 0`` (an EP rank may hold no tokens).
        expert_id_limit: reject ids outside ``[-1, expert_id_limit)``, where the ids can
            be read without a device synchronisation (CPU tensors; never meta, fake or
            CUDA tensors, whose range the fused forward checks on the device). None:
            no value check (EP: global ids, checked by the dispatch plan).
        ids_name: the name ``topk_ids`` goes by in messages (the backward passes the
            saved ``route_to_pool_row`` map, which has the ids' shape, in its place).
        masters: the forward op's ``(w13_master, w2_master)``, an MXFP4 base's trainable
            masters in ordinary mode, or two Nones (see :func:`check_masters`).

    Returns:
        The one device of every tensor.

    Raises:
        TypeError: a tensor argument is not a tensor, or has the wrong dtype; ``base``
            or ``side`` is of the wrong type.
        ValueError: wrong shapes, layouts, activation, clamp or id values; tensors on
            several devices (all of them named); a non-CUDA base with ``require_cuda``.
    """
    check_base_weights(base)
    check_call_structure(topk_ids, side, ids_name=ids_name)
    # Kinds first, so a list or None is a TypeError naming it, whatever else is wrong.
    for name, value in (("x", x), (ids_name, topk_ids), ("topk_weights", topk_weights)):
        check_tensor(name, value)
    check_tensor("x", x, shape=(None, base.hidden), dtypes=_BF16, contiguous=True)
    num_tokens = x.shape[0]
    if num_tokens < 1 and not allow_no_tokens:
        raise ValueError("x: expected at least one token")
    check_tensor(
        ids_name,
        topk_ids,
        shape=(num_tokens, None),
        dtypes=(torch.int32, torch.int64),
        contiguous=True,
    )
    check_tensor(
        "topk_weights",
        topk_weights,
        shape=tuple(topk_ids.shape),
        dtypes=(torch.float32,),
        contiguous=True,
    )
    check_activation(activation, activation_clamp)
    if side is not None:
        dims = (side.hidden, side.intermediate, side.num_experts)
        if dims != (base.hidden, base.intermediate, base.num_experts):
            raise ValueError(
                f"side: (H, I, E_l) = {dims} does not match base "
                f"{(base.hidden, base.intermediate, base.num_experts)}"
            )
        if side.dtype != torch.bfloat16:
            raise TypeError(f"side: expected bfloat16 tensors, got {side.dtype}")
        for name in ("b1", "b3", "a2"):  # the kernels read these as given (TMA)
            check_tensor(f"side.{name}", getattr(side, name), contiguous=True)
    check_masters(base, *masters)
    if expert_id_limit is not None and topk_ids.numel() and _reads_data(topk_ids):
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < -1 or high >= expert_id_limit:
            raise ValueError(
                f"{ids_name}: expected expert ids in [-1, {expert_id_limit}), got values in "
                f"[{low}, {high}]"
            )

    # Where: the weights decide (they are the large, long-lived tensors).
    named = [
        ("base.w13", base.w13),
        ("x", x),
        (ids_name, topk_ids),
        ("topk_weights", topk_weights),
        ("base.w2", base.w2),
        ("base.w13_scales", base.w13_scales),
        ("base.w2_scales", base.w2_scales),
    ]
    if side is not None:
        named += [(f"side.{n}", t) for n, t in zip(SIDE_NAMES, side.tensors(), strict=True)]
    named += [("w13_master", masters[0]), ("w2_master", masters[1])]
    device = check_devices(named, "base")
    if device.type == "cuda" and has_data(x):  # (a fake tensor has no data pointer)
        # What the kernels read by TMA: 16-byte aligned addresses (a view into a flat
        # buffer may not be), named here rather than by the tensor map's encode.
        tma_read = [("x", x), ("base.w13", base.w13), ("base.w2", base.w2)]
        if side is not None:
            tma_read += [(f"side.{name}", getattr(side, name)) for name in ("b1", "b3", "a2")]
        for name, tensor in tma_read:
            check_tensor(name, tensor, alignment=16)
    if require_cuda and device.type != "cuda":
        raise ValueError(
            f"base: expected CUDA weights for the fused path, got {device} (the arguments "
            "are otherwise valid; megamoe.reference.moe runs the same math on the CPU)"
        )
    if require_cuda and has_data(x):  # (fake tensors: no device to ask)
        check_hopper(device)
    return device


#: Devices already found to be Hopper GPUs (the question costs host time every call).
_HOPPER_DEVICES: set[int] = set()


def not_hopper(device: torch.device) -> str | None:
    """None where CUDA ``device`` is a Hopper GPU (sm_90, the fused kernels' only
    target), else what it is (``"cuda:1 is NAME (sm_80)"``), for an error message."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index in _HOPPER_DEVICES:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return f"cuda:{index} is {torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    _HOPPER_DEVICES.add(index)
    return None


def check_hopper(device: torch.device) -> None:
    """``ValueError`` naming ``base`` unless ``device`` is a Hopper GPU: elsewhere the
    first launch would fail with a CUDA error that names no argument."""
    other = not_hopper(device)
    if other is not None:
        raise ValueError(
            f"base: the fused kernels need an NVIDIA Hopper GPU (sm_90, e.g. H100/H200); "
            f"{other}; megamoe.reference.moe runs the same math anywhere"
        )


def check_block_m(block_m: object) -> int:
    """``block_m``: one of the registry's row-tile heights (the plans' and kernels')."""
    check_int("block_m", block_m, minimum=1)
    if block_m not in registry().block_m_choices:
        raise ValueError(
            f"block_m: expected one of {list(registry().block_m_choices)}, got {block_m}"
        )
    return block_m


def check_plan_block_m(
    block_m: int,
    route_to_pool_row: torch.Tensor,
    pool_row_to_route: torch.Tensor,
    experts: int,
    *,
    name: str = "block_m",
    planner: str = "the forward",
) -> None:
    """``block_m`` against a plan's maps (by default the backward's against the forward's
    saved plan): a pool holds ``pool_capacity(T * K, E_l, block_m)`` rows for the BLOCK_M
    it was planned with, and no other registry BLOCK_M gives the same count. The kernels
    find each expert's tiles as ``offset / BLOCK_M``: under another BLOCK_M rows would
    meet the wrong expert's weights (or none). Host sizes only; skipped for symbolic
    sizes (torch.compile's fake tensors)."""
    routes, capacity = route_to_pool_row.numel(), pool_row_to_route.shape[0]
    if not (isinstance(routes, int) and isinstance(capacity, int)):
        return
    planned = pool_capacity(routes, experts, block_m)
    if capacity != planned:
        raise ValueError(
            f"{name}: expected the BLOCK_M {planner} planned with; {block_m} gives a pool "
            f"of {planned} rows for {routes} routes over {experts} experts, the plan "
            f"holds {capacity}"
        )


def check_backward_inputs(
    dout: torch.Tensor,
    x: torch.Tensor,
    base: BaseWeights,
    side: SideLoRA | None,
    state: dict[str, torch.Tensor],
) -> None:
    """Checks of the fused backward's inputs beyond the forward's (which it was given).

    Args:
        dout: ``[T, H]`` bfloat16 gradient of the output, on ``x``'s device.
        x: the forward's ``x`` ``[T, H]``.
        base, side: the forward's weights (``side`` None without an active adapter).
        state: the forward's saved tensors by name: ``expert_counts [E_l]``,
            ``expert_pool_offsets [E_l + 1]``, ``route_to_pool_row [T, K]``,
            ``pool_row_to_route [P]`` (int32), ``preact [P, 2I]`` bfloat16 or empty
            (recomputed), ``q13 [T, 2r]`` and ``p_sum [T, r]`` bfloat16 or empty (no
            active adapter).
    """
    check_tensor("dout", dout, shape=tuple(x.shape), dtypes=_BF16)
    experts, inter = base.num_experts, base.intermediate
    tokens = x.shape[0]
    index = (torch.int32,)
    check_tensor("expert_counts", state["expert_counts"], shape=(experts,), dtypes=index)
    check_tensor(
        "expert_pool_offsets", state["expert_pool_offsets"], shape=(experts + 1,), dtypes=index
    )
    check_tensor(
        "route_to_pool_row", state["route_to_pool_row"], shape=(tokens, None), dtypes=index
    )
    check_tensor("pool_row_to_route", state["pool_row_to_route"], ndim=1, dtypes=index)
    capacity = state["pool_row_to_route"].shape[0]
    if state["preact"].numel():
        check_tensor("preact", state["preact"], shape=(capacity, 2 * inter), dtypes=_BF16)
    rank = 0 if side is None else side.rank
    for name, width in (("q13", 2 * rank), ("p_sum", rank)):
        if state[name].numel():
            if side is None:
                raise ValueError(f"{name}: saved adapter state given without adapters")
            check_tensor(name, state[name], shape=(tokens, width), dtypes=_BF16)
    check_devices([("x", x), ("dout", dout), *state.items()], "x")
