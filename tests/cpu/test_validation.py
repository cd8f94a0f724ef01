"""``mm.moe`` validates its arguments before the device (issue 19, items 1 and 2), on the
CPU: no GPU and no compiled module needed.

- On a machine without a GPU, a wrong call reports what is wrong with it (dtype,
  shape, rank, id range, activation, ...), not "base: expected CUDA weights"; only a
  valid call gets that message.
- A Python list or None where a tensor belongs is a ``TypeError`` naming the argument.
- Mixed devices (one tensor on ``meta``, the rest on the CPU) are rejected with every
  argument named, whether through ``mm.moe``, ``MegaMoE`` or the custom ops directly
  (which dispatch such a call to their fake implementations).
- All-fake inputs (``meta``, ``FakeTensorMode``, torch.compile tracing) still give
  outputs and gradients of the right shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megamoe as mm
from megamoe.validation import check_backward_inputs, check_base_weights, check_moe_inputs

H, I, E, R, T, K = 64, 64, 4, 16, 12, 2
META = torch.device("meta")
SIDE_SHAPES = {
    "a1": (H, R),
    "b1": (E, R, I),
    "a3": (H, R),
    "b3": (E, R, I),
    "a2": (E, I, R),
    "b2": (R, H),
}


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def routing() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[t % E, (t + 1) % E] for t in range(T)], dtype=torch.int32)
    return ids, torch.full((T, K), 0.5)


def base(format: str = "bf16") -> mm.BaseWeights:
    return mm.prepare_base_weights(bf16(E, 2 * I, H), bf16(E, H, I), format=format)


def side(dtype: torch.dtype = torch.bfloat16, rank: int = R, **changes) -> mm.SideLoRA:
    tensors = {}
    for name, shape in SIDE_SHAPES.items():
        shape = tuple(rank if s == R else s for s in shape)
        tensors[name] = torch.randn(*shape).to(dtype)
    tensors.update(changes)
    return mm.SideLoRA(**tensors, scale=0.5)


def to_device(b: mm.BaseWeights, device: torch.device) -> mm.BaseWeights:
    moved = {
        name: getattr(b, name).to(device)
        for name in ("w13", "w2", "w13_scales", "w2_scales")
        if getattr(b, name) is not None
    }
    return dataclasses.replace(b, **moved)


def call(grad: bool = False, **overrides: object) -> torch.Tensor:
    """``mm.moe`` on valid CPU inputs with ``overrides``; ``grad`` takes the training op."""
    ids, weights = routing()
    args = dict(
        x=bf16(T, H).requires_grad_(grad),
        topk_ids=ids,
        topk_weights=weights,
        base=base(),
        side=side(),
    )
    args.update(overrides)
    with torch.set_grad_enabled(grad):
        return mm.moe(**args)


Case = tuple[Callable[[], object], type[Exception], str]

# Each of these is wrong in a way a CPU-only user can see; before issue 19 every one of
# them reported "base: expected CUDA weights for the fused path".
ARGUMENT_CASES: dict[str, Case] = {
    "x-float32": (lambda: call(x=torch.randn(T, H)), TypeError, r"^x: expected dtype bfloat16"),
    "x-hidden": (lambda: call(x=bf16(T, H + 64)), ValueError, r"^x: expected shape \[\*, 64\]"),
    "x-3d": (lambda: call(x=bf16(1, T, H)), ValueError, r"^x: expected 2 dimensions"),
    "x-strided": (lambda: call(x=bf16(H, T).t()), ValueError, r"^x: expected a contiguous"),
    "x-no-tokens": (
        lambda: call(x=bf16(0, H), topk_ids=routing()[0][:0], topk_weights=routing()[1][:0]),
        ValueError,
        r"^x: expected at least one token",
    ),
    "ids-float": (
        lambda: call(topk_ids=routing()[0].float()),
        TypeError,
        r"^topk_ids: expected dtype int32 or int64",
    ),
    "ids-tokens": (
        lambda: call(topk_ids=routing()[0][:-1]),
        ValueError,
        r"^topk_ids: expected shape \[12, \*\]",
    ),
    "ids-1d": (
        lambda: call(topk_ids=routing()[0].reshape(-1)),
        ValueError,
        r"^topk_ids: expected 2 dimensions",
    ),
    "ids-no-routes": (
        lambda: call(topk_ids=torch.zeros(T, 0, dtype=torch.int32), topk_weights=torch.ones(T, 0)),
        ValueError,
        r"^topk_ids: expected at least one route per token",
    ),
    "ids-too-large": (
        lambda: call(topk_ids=routing()[0].index_fill(0, torch.tensor([3]), E)),
        ValueError,
        r"^topk_ids: expected expert ids in \[-1, 4\), got values in \[0, 4\]",
    ),
    "ids-below-minus-one": (
        lambda: call(topk_ids=routing()[0].index_fill(0, torch.tensor([0]), -2)),
        ValueError,
        r"^topk_ids: expected expert ids in \[-1, 4\), got values in \[-2, ",
    ),
    "weights-bf16": (
        lambda: call(topk_weights=routing()[1].bfloat16()),
        TypeError,
        r"^topk_weights: expected dtype float32",
    ),
    "weights-top-k": (
        lambda: call(topk_weights=torch.ones(T, 1)),
        ValueError,
        r"^topk_weights: expected shape \[12, 2\]",
    ),
    "activation-misspelled": (
        lambda: call(activation="swiglue"),
        ValueError,
        r"^activation: expected one of \['swiglu', 'geglu'\], got 'swiglue'",
    ),
    "activation-none": (lambda: call(activation=None), TypeError, r"^activation: expected a str"),
    "clamp-zero": (
        lambda: call(activation_clamp=0.0),
        ValueError,
        r"^activation_clamp: expected a positive finite float",
    ),
    "clamp-nan": (
        lambda: call(activation_clamp=float("nan")),
        ValueError,
        r"^activation_clamp: expected a positive finite float",
    ),
    "clamp-str": (
        lambda: call(activation_clamp="10"),
        TypeError,
        r"^activation_clamp: expected a positive finite float or None, got str",
    ),
    "side-float32": (
        lambda: call(side=side(torch.float32)),
        TypeError,
        r"^side: expected bfloat16 tensors",
    ),
    "side-dims": (
        lambda: call(side=side(a1=bf16(H + 64, R), a3=bf16(H + 64, R), b2=bf16(R, H + 64))),
        ValueError,
        r"^side: \(H, I, E_l\) = \(128, 64, 4\) does not match base \(64, 64, 4\)",
    ),
    "side-rank": (lambda: call(side=side(rank=24)), ValueError, r"^side\.a1: rank must be"),
    "side-dict": (
        lambda: call(side=dict(SIDE_SHAPES)),
        TypeError,
        r"^side: expected megamoe\.SideLoRA or None, got dict",
    ),
    "checkpoint-int": (
        lambda: call(activation_checkpoint=1),
        TypeError,
        r"^activation_checkpoint: expected a bool",
    ),
    "reduce-shared-grads-none": (
        lambda: call(reduce_shared_grads=None),
        TypeError,
        r"^reduce_shared_grads: expected a bool",
    ),
    # A Python list or None where a tensor belongs: a TypeError naming it (it was an
    # AttributeError from ops.py).
    "x-list": (
        lambda: call(x=[[0.0] * H] * T),
        TypeError,
        r"^x: expected a torch\.Tensor, got list",
    ),
    "x-none": (lambda: call(x=None), TypeError, r"^x: expected a torch\.Tensor, got NoneType"),
    "ids-list": (
        lambda: call(topk_ids=routing()[0].tolist()),
        TypeError,
        r"^topk_ids: expected a torch\.Tensor, got list",
    ),
    "weights-none": (
        lambda: call(topk_weights=None),
        TypeError,
        r"^topk_weights: expected a torch\.Tensor, got NoneType",
    ),
    "base-none": (lambda: call(base=None), TypeError, r"^base: expected megamoe\.BaseWeights"),
    "base-tuple": (
        lambda: call(base=(bf16(E, 2 * I, H), bf16(E, H, I))),
        TypeError,
        r"^base: expected megamoe\.BaseWeights, got tuple",
    ),
    # A BaseWeights edited by hand is checked against its own format and dims.
    "base-w2-dtype": (
        lambda: call(base=dataclasses.replace(base(), w2=torch.randn(E, H, I))),
        TypeError,
        r"^base\.w2: expected dtype bfloat16",
    ),
    "base-mxfp4-scales-missing": (
        lambda: call(base=dataclasses.replace(base("mxfp4"), w2_scales=None)),
        TypeError,
        r"^base\.w2_scales: expected a torch\.Tensor, got NoneType",
    ),
    "base-format": (
        lambda: call(base=dataclasses.replace(base(), format="fp8")),
        ValueError,
        r"^base\.format: expected one of",
    ),
    # The kernels read b1, b3 and a2 as given: a strided view is named before anything runs.
    "side-b1-strided": (
        lambda: call(side=side(b1=torch.randn(E, I, R).to(torch.bfloat16).transpose(1, 2))),
        ValueError,
        r"^side\.b1: expected a contiguous tensor",
    ),
    "side-a2-strided": (
        lambda: call(side=side(a2=torch.randn(E, R, I).to(torch.bfloat16).transpose(1, 2))),
        ValueError,
        r"^side\.a2: expected a contiguous tensor",
    ),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", list(ARGUMENT_CASES))
def test_argument_errors_come_before_the_device_check(case: str, grad: bool) -> None:
    make, error, match = ARGUMENT_CASES[case]
    with torch.set_grad_enabled(grad), pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
def test_mxfp4_base_gets_the_same_checks(format: str) -> None:
    with pytest.raises(ValueError, match=r"^activation: expected one of"):
        call(base=base(format), activation="relu")
    with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids in \[-1, 4\)"):
        call(base=base(format), topk_ids=routing()[0] + 1)


@pytest.mark.parametrize("grad", [False, True])
def test_a_valid_call_on_the_cpu_names_the_base(grad: bool) -> None:
    with pytest.raises(ValueError, match=r"^base: expected CUDA weights for the fused path"):
        call(grad=grad)


# -------------------------------------------------------------------- mixed devices


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("argument", ["x", "topk_ids", "topk_weights"])
def test_one_tensor_on_meta_is_named(argument: str, grad: bool) -> None:
    ids, weights = routing()
    value = {"x": bf16(T, H), "topk_ids": ids, "topk_weights": weights}[argument]
    where = rf"^{argument}: expected device cpu \(where base is\), got meta"
    match = rf"{where}.* elsewhere: {argument} \(meta\)$"
    with pytest.raises(ValueError, match=match):
        call(grad=grad, **{argument: value.to(META)})


def test_every_argument_elsewhere_is_listed() -> None:
    with pytest.raises(ValueError) as info:
        call(base=to_device(base(), META), side=None)
    message = str(info.value)
    assert message.startswith("x: expected device meta (where base is), got cpu")
    assert message.endswith("elsewhere: x (cpu), topk_ids (cpu), topk_weights (cpu)")


def test_adapters_on_another_device_are_named() -> None:
    meta_side = mm.SideLoRA(*(t.to(META) for t in side().tensors()), scale=0.5)
    with pytest.raises(ValueError) as info:
        call(side=meta_side)
    message = str(info.value)
    assert message.startswith("side.a1: expected device cpu (where base is), got meta")
    listed = ", ".join(f"side.{n} (meta)" for n in ("a1", "b1", "a3", "b3", "a2", "b2"))
    assert message.endswith(f"elsewhere: {listed}")


def test_base_tensors_on_two_devices_are_named() -> None:
    split = dataclasses.replace(base("mxfp4"), w2_scales=base("mxfp4").w2_scales.to(META))
    with pytest.raises(ValueError, match=r"^base\.w2_scales: expected device cpu.*got meta"):
        call(base=split, side=None)


def _op_args(device: torch.device) -> list[object]:
    ids, weights = routing()
    b = base()
    adapters = list(side().tensors())
    tensors = [bf16(T, H), ids, weights, b.w13, b.w2, None, None]
    tensors = [t if t is None else t.to(device) for t in tensors]
    adapters = [t.to(device) for t in adapters]
    return [*tensors, *adapters]


def test_the_ops_called_directly_reject_mixed_devices() -> None:
    """One meta tensor sends the call to the fake implementation, which checks like the
    real one (it used to return uninitialized memory)."""
    args = _op_args(torch.device("cpu"))
    args[0] = args[0].to(META)
    with pytest.raises(ValueError, match=r"^x: expected device cpu \(where base is\), got meta"):
        torch.ops.megamoe.moe_forward(*args, 0.5, "swiglu", None, 64, "none")
    args = _op_args(torch.device("cpu"))
    args[1] = args[1].to(META)
    with pytest.raises(ValueError, match=r"^topk_ids: expected device cpu"):
        torch.ops.megamoe.moe_forward(*args, 0.5, "swiglu", None, 64, "preact")


def _train_outputs(args: list[object]) -> tuple:
    return torch.ops.megamoe.moe_forward(*args, 0.5, "swiglu", None, 64, "preact")


def test_the_backward_op_rejects_a_dout_elsewhere_or_misshapen() -> None:
    args = _op_args(META)
    out, *state = _train_outputs(args)
    x, _, weights, w13, w2, s13, s2, *adapters = args
    rest = (0.5, "swiglu", None)

    def backward(dout: torch.Tensor, saved: list[torch.Tensor] = state) -> list[torch.Tensor]:
        return torch.ops.megamoe.moe_backward(
            dout, x, weights, w13, w2, s13, s2, *adapters, *rest, *saved, False, True, 64
        )

    assert [tuple(g.shape) for g in backward(out)][:2] == [(T, H), (T, K)]
    with pytest.raises(ValueError, match=r"^dout: expected device meta \(where x is\), got cpu"):
        backward(torch.zeros(T, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^dout: expected shape \[12, 64\]"):
        backward(out[:-1])
    with pytest.raises(TypeError, match=r"^dout: expected dtype bfloat16"):
        backward(out.float())
    # The saved state is named too (route_to_pool_row stands in for the ids' [T, K]).
    short = [*state[:2], state[2][:-1], *state[3:]]
    with pytest.raises(ValueError, match=r"^route_to_pool_row: expected shape \[12, \*\]"):
        backward(out, short)


# ---------------------------------------------------------------- all-fake inputs


@pytest.mark.parametrize("format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("with_side", [False, True])
def test_all_meta_inputs_give_the_shapes_and_gradients(format: str, with_side: bool) -> None:
    ids, weights = routing()
    x = torch.empty(T, H, dtype=torch.bfloat16, device=META, requires_grad=True)
    weights = weights.to(META).requires_grad_(True)
    adapters = None
    if with_side:
        adapters = mm.SideLoRA(
            *(t.to(META).requires_grad_(True) for t in side().tensors()), scale=0.5
        )
    out = mm.moe(x, ids.to(META), weights, to_device(base(format), META), adapters)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and out.device == META
    out.backward(torch.empty_like(out))
    assert x.grad.shape == (T, H) and weights.grad.shape == (T, K)
    if with_side:
        for tensor, shape in zip(adapters.tensors(), SIDE_SHAPES.values(), strict=True):
            assert tensor.grad.shape == shape and tensor.grad.device == META
    with torch.no_grad():
        assert mm.moe(x, ids.to(META), weights, to_device(base(format), META)).shape == (T, H)


def test_meta_inputs_are_still_checked() -> None:
    with pytest.raises(TypeError, match=r"^topk_weights: expected dtype float32"):
        mm.moe(
            torch.empty(T, H, dtype=torch.bfloat16, device=META),
            routing()[0].to(META),
            torch.empty(T, K, dtype=torch.float16, device=META),
            to_device(base(), META),
        )


def test_fake_tensor_mode_gives_shapes_and_runs_the_checks() -> None:
    b = base()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(bf16(T, H))
        ids, weights = (mode.from_tensor(t) for t in routing())
        out = mm.moe(x, ids, weights, b, side())
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"^activation: expected one of"):
            mm.moe(x, ids, weights, b, activation="gelu")
        # The op itself, called directly under the fake mode, checks too.
        with pytest.raises(ValueError, match=r"^x: expected shape \[\*, 64\]"):
            torch.ops.megamoe.moe_forward(
                mode.from_tensor(bf16(T, 128)), ids, weights, b.w13, b.w2, None, None,
                *[None] * 6, 0.0, "swiglu", None, 64, "none",
            )  # fmt: skip


def test_fake_cuda_inputs_read_no_data_pointer() -> None:
    """Fake CUDA tensors (what torch.compile traces a GPU call with) pass the checks
    without a data-pointer read (deprecated on fake tensors, an error under compile),
    through mm.moe and each op, and get the right shapes. (No autograd here: a CPU-only
    torch cannot record autograd metadata for CUDA tensors, fake or not.)"""
    import warnings

    cuda = torch.device("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("error")  # "Accessing the data pointer of FakeTensor"
        x = torch.empty(T, H, dtype=torch.bfloat16, device=cuda)
        ids = torch.empty(T, K, dtype=torch.int32, device=cuda)
        weights = torch.empty(T, K, device=cuda)
        b = base()
        b = dataclasses.replace(b, w13=torch.empty_like(b.w13, device=cuda),
                                w2=torch.empty_like(b.w2, device=cuda))  # fmt: skip
        adapters = [torch.empty(s, dtype=torch.bfloat16, device=cuda) for s in SIDE_SHAPES.values()]
        with torch.no_grad():
            out = mm.moe(x, ids, weights, b, mm.SideLoRA(*adapters, scale=0.5))
        assert out.shape == (T, H) and out.device.type == "cuda"
        args = (x, ids, weights, b.w13, b.w2, None, None, *adapters, 0.5, "swiglu", None)
        out, *state = torch.ops.megamoe.moe_forward(*args, 64, "preact")
        rest = (x, weights, b.w13, b.w2, None, None, *adapters, 0.5, "swiglu", None)
        grads = torch.ops.megamoe.moe_backward(out, *rest, *state, False, True, 64)
        assert [tuple(g.shape) for g in grads[4:]] == list(SIDE_SHAPES.values())


def test_torch_compile_traces_through_the_fakes() -> None:
    """torch.compile (fullgraph) traces mm.moe through the ops' fake implementations:
    the traced output has the layer's shape; running it on the CPU reaches the real
    implementation, whose checks then ask for CUDA weights."""
    b = base()
    traced: list[torch.Size] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        (output,) = [n for n in graph_module.graph.nodes if n.op == "output"]
        node = output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0]
        traced.append(node.meta["example_value"].shape)
        return graph_module.forward

    def layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return mm.moe(x, ids, weights, b)

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    ids, weights = routing()
    with torch.no_grad(), pytest.raises(ValueError, match=r"^base: expected CUDA weights"):
        compiled(bf16(T, H), ids, weights)
    assert traced == [torch.Size([T, H])]


# ------------------------------------------------------------- MegaMoE on meta


def test_meta_module_with_the_fused_backend() -> None:
    layer = mm.MegaMoE(H, I, E, K, side_rank=R, device="meta")
    x = torch.empty(T, H, dtype=torch.bfloat16, device=META, requires_grad=True)
    ids, weights = routing()
    out = layer(x, ids.to(META), weights.to(META))
    assert out.shape == (T, H) and out.device == META
    out.backward(torch.empty_like(out))
    assert layer.b1.grad.shape == (E, R, I) and x.grad.shape == (T, H)
    # CPU inputs to a meta module: every CPU argument is named.
    with pytest.raises(ValueError) as info:
        layer(bf16(T, H), ids, weights)
    message = str(info.value)
    assert message.startswith("x: expected device meta (where base is), got cpu")
    assert message.endswith("elsewhere: x (cpu), topk_ids (cpu), topk_weights (cpu)")


# -------------------------------------------------------------- the check itself


def test_check_moe_inputs_returns_the_device_and_honours_its_switches() -> None:
    ids, weights = routing()
    x, b = bf16(T, H), base()
    assert check_moe_inputs(x, ids, weights, b, side(), "swiglu", 10.0, require_cuda=False) == (
        torch.device("cpu")
    )
    with pytest.raises(ValueError, match=r"^base: expected CUDA weights"):
        check_moe_inputs(x, ids, weights, b, None, "geglu", None)
    # EP: a rank may hold no tokens; global ids are not range-checked here.
    empty = check_moe_inputs(
        bf16(0, H), ids[:0], weights[:0], b, None, "swiglu", None,
        require_cuda=False, allow_no_tokens=True,
    )  # fmt: skip
    assert empty == torch.device("cpu")
    check_moe_inputs(x, ids + 100, weights, b, None, "swiglu", None, require_cuda=False)
    with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids in \[-1, 4\)"):
        check_moe_inputs(
            x, ids + 100, weights, b, None, "swiglu", None, require_cuda=False, expert_id_limit=4
        )


def test_meta_ids_are_not_read() -> None:
    ids = routing()[0].to(META)
    check_moe_inputs(
        torch.empty(T, H, dtype=torch.bfloat16, device=META),
        ids,
        routing()[1].to(META),
        to_device(base(), META),
        None,
        "swiglu",
        None,
        require_cuda=False,
        expert_id_limit=1,  # every id would fail this: it is not looked at on meta
    )


def test_check_base_weights_accepts_what_prepare_makes() -> None:
    for format in ("bf16", "mxfp4"):
        assert check_base_weights(base(format)).format == format
    with pytest.raises(ValueError, match=r"^base\.num_experts: expected an int >= 1"):
        check_base_weights(dataclasses.replace(base(), num_experts=0))
    with pytest.raises(ValueError, match=r"^base\.w13: expected shape \[4, 128, 128\]"):
        check_base_weights(dataclasses.replace(base(), hidden=128))
    # Past the route plan's 1024 local experts: named before anything runs (the native
    # plan refused it under its own argument's name, after an MXFP4 decode).
    with pytest.raises(ValueError, match=r"^base\.num_experts: expected at most 1024 local"):
        check_base_weights(dataclasses.replace(base(), num_experts=1025))


def test_check_backward_inputs_names_the_saved_state() -> None:
    x, b = bf16(T, H), base()
    state = {
        "expert_counts": torch.zeros(E, dtype=torch.int32),
        "expert_pool_offsets": torch.zeros(E + 1, dtype=torch.int32),
        "route_to_pool_row": torch.zeros(T, K, dtype=torch.int32),
        "pool_row_to_route": torch.zeros(256, dtype=torch.int32),
        "preact": torch.empty(0, dtype=torch.bfloat16),
        "q13": torch.empty(0, dtype=torch.bfloat16),
        "p_sum": torch.empty(0, dtype=torch.bfloat16),
    }
    check_backward_inputs(bf16(T, H), x, b, None, state)
    bad = {**state, "preact": bf16(256, I)}
    with pytest.raises(ValueError, match=r"^preact: expected shape \[256, 128\]"):
        check_backward_inputs(bf16(T, H), x, b, None, bad)
    bad = {**state, "q13": bf16(T, 2 * R)}
    with pytest.raises(ValueError, match=r"^q13: saved adapter state given without adapters"):
        check_backward_inputs(bf16(T, H), x, b, None, bad)
    bad = {**state, "expert_counts": torch.zeros(E, dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"^expert_counts: expected dtype int32"):
        check_backward_inputs(bf16(T, H), x, b, None, bad)


@pytest.mark.parametrize(
    ("masters", "error", "match"),
    [
        (lambda w13, w2: (w13, None), ValueError, r"^w2_master: expected both masters or neither"),
        (
            lambda w13, w2: (w13[:, :-1], w2),
            ValueError,
            rf"^w13_master: expected shape \[{E}, {2 * I}, {H}\]",
        ),
        (lambda w13, w2: (w13, w2.half()), TypeError, r"^w2_master: expected dtype"),
        (lambda w13, w2: (w13.float(), w2), TypeError, r"^w2_master: expected the dtype of w13"),
        (lambda w13, w2: (w13, w2.to(META)), ValueError, r"^w2_master: expected device cpu"),
    ],
)
def test_the_forward_op_checks_the_masters_it_is_given(masters, error, match) -> None:
    """``w13_master``/``w2_master`` (ordinary mode on a packed MXFP4 base) are checked
    like every other input, by the op itself, before anything runs."""
    b = base("mxfp4")
    w13_master, w2_master = masters(bf16(E, 2 * I, H), bf16(E, H, I))
    ids, weights = routing()
    with pytest.raises(error, match=match):
        torch.ops.megamoe.moe_forward(
            bf16(T, H), ids, weights, b.w13, b.w2, b.w13_scales, b.w2_scales, *[None] * 6,
            0.0, "swiglu", None, 64, "preact", w13_master=w13_master, w2_master=w2_master,
        )  # fmt: skip


@pytest.mark.parametrize("given", ["w13_master", "w2_master"])
def test_masters_go_with_an_mxfp4_base_only(given) -> None:
    b = base()
    ids, weights = routing()
    masters = {"w13_master": bf16(E, 2 * I, H), "w2_master": bf16(E, H, I)}
    masters = {given: masters[given]}  # one is enough to be refused, and is named
    with pytest.raises(ValueError, match=rf"^{given}: master weights go with an MXFP4 base"):
        torch.ops.megamoe.moe_forward(
            bf16(T, H), ids, weights, b.w13, b.w2, None, None, *[None] * 6, 0.0, "swiglu",
            None, 64, "preact", **masters,
        )  # fmt: skip


def test_a_malformed_base_is_named_before_the_masters() -> None:
    b = base("mxfp4")
    ids, weights = routing()
    with pytest.raises(ValueError, match=r"^base\.w2"):
        torch.ops.megamoe.moe_forward(
            bf16(T, H), ids, weights, b.w13, b.w2[:, :, :-1].contiguous(), b.w13_scales,
            b.w2_scales, *[None] * 6, 0.0, "swiglu", None, 64, "preact",
            w13_master=bf16(E, 2 * I, H), w2_master=bf16(E, H, I),
        )  # fmt: skip
