"""The expert-parallel custom ops (python/megamoe/ep/ops.py: ``megamoe::moe_ep_forward``
and ``megamoe::moe_ep_backward``, what ``mm.moe(group=pg)`` and ``ep.fused_moe`` run) on
gloo processes: FlopCounterMode counts them with their formulas, fake tensors give their
shapes (unbacked sizes for the routing-dependent state), and bad calls name the
argument. Their numerics against EP1 and the oracle: tests/cpu/test_ep_fused_gloo.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils.flop_counter import FlopCounterMode

from megamoe import ep
from megamoe.custom_ops.flop_formulas import backward_flops, forward_flops
from megamoe.ep import ops as ep_ops
from megamoe.side_lora import SideLoRA
from megamoe.testing import OpRoute, make_layer

H, INTER, R, E, K = 64, 64, 16, 8, 2
TOKENS = (5, 9)


def _rank_layer(rank: int, world: int, tokens: tuple[int, ...] = TOKENS, trainable=False):
    """This rank's tokens, experts and adapters of one global layer (BF16, side-LoRA;
    ``trainable``: the base requires grad too)."""
    layer = make_layer(
        H, INTER, E, K, R, dtype=torch.bfloat16, num_tokens=sum(tokens), seed=3, scale=0.5
    )
    begin = sum(tokens[:rank])
    rows = slice(begin, begin + tokens[rank])
    e_l = E // world
    experts = slice(rank * e_l, (rank + 1) * e_l)
    base = layer.base
    w13 = base.w13[experts].clone().requires_grad_(trainable)
    w2 = base.w2[experts].clone().requires_grad_(trainable)
    local_base = type(base)(base.format, w13, w2, None, None, e_l, H, INTER)
    s = layer.side
    parts = (s.a1, s.b1[experts], s.a3, s.b3[experts], s.a2[experts], s.b2)
    side = SideLoRA(*(p.clone().requires_grad_(True) for p in parts), scale=s.scale)
    x = layer.x[rows].clone().requires_grad_(True)
    weights = layer.topk_weights[rows].clone().requires_grad_(True)
    return x, layer.topk_ids[rows].contiguous(), weights, local_base, side


def _flop_worker(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    group = dist.group.WORLD
    results = []
    # The second: a rank with no tokens; the third: activation checkpointing.
    for tokens, checkpoint in ((TOKENS, False), ((0, 7), False), (TOKENS, True)):
        x, ids, weights, base, side = _rank_layer(rank, world, tokens)
        plain = ep.fused_moe(x, ids, weights, base, side, group=group)
        with FlopCounterMode(display=False) as counter:
            out = ep.fused_moe(
                x, ids, weights, base, side, group=group, activation_checkpoint=checkpoint
            )
            out.backward(torch.ones_like(out))
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        results.append(
            {
                "counts": counts,
                "total": counter.get_total_flops(),
                "same": torch.equal(out, plain),
                "tokens": x.shape[0],
                "checkpoint": checkpoint,
            }
        )
    return results


def test_flop_counter_counts_the_ep_ops_with_their_formulas():
    """Each rank counts its own tokens' routes (none on a rank without tokens; with
    activation checkpointing the recomputed GEMM1 and adapter shrink too): the two ops'
    formulas and nothing else (the stages inside an op are not counted again)."""
    for per_rank in ep.run_gloo(_flop_worker, 2, timeout_s=300):
        for result in per_rank:
            t = result["tokens"]
            assert result["same"], "the output under FlopCounterMode differs from a plain call"
            forward = forward_flops(t, K, H, INTER, R)
            backward = backward_flops(
                t, K, H, INTER, R, base_grads=False, side_grads=True,
                recompute=result["checkpoint"],
            )  # fmt: skip
            if result["checkpoint"]:  # the token rows' q13 = x [a1 | a3] computed again
                backward += 4 * t * H * R
            counts = result["counts"]
            assert counts.get("megamoe.moe_ep_forward", 0) == forward
            assert counts.get("megamoe.moe_ep_backward", 0) == backward
            assert result["total"] == forward + backward
            assert (forward == 0) == (t == 0)


def _compiled_matches_eager(layer, compiled, inputs: tuple, leaves: tuple) -> tuple:
    """``(output equal, gradients equal, gradients)`` of ``compiled`` against ``layer``
    on ``inputs``, the gradients of ``sum(out^2)`` with respect to ``leaves``."""
    eager = layer(*inputs)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), leaves)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    same = all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
    return torch.equal(out, eager), same, grads


def _compile_worker(rank: int, world: int, dynamic: bool) -> list[tuple[bool, bool]]:
    import torch.distributed as dist

    group = dist.group.WORLD

    def layer(x, ids, weights, base, side):
        return ep.fused_moe(x, ids, weights, base, side, group=group)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    results = []
    for tokens in (TOKENS, (0, 4)):
        x, ids, weights, base, side = _rank_layer(rank, world, tokens)
        leaves = (x, weights, *side.tensors())
        same_out, same_grads, _ = _compiled_matches_eager(
            layer, compiled, (x, ids, weights, base, side), leaves
        )
        results.append((same_out, same_grads))
    return results


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_ep_step_traces_both_ops_and_matches_eager(dynamic):
    """torch.compile(fullgraph=True) of an EP forward + backward on 2 gloo ranks (one
    of them without tokens in the second call; ``dynamic``: every size symbolic): no
    graph break through the ops and their unbacked state sizes, and the same bits as
    eager."""
    for per_rank in ep.run_gloo(_compile_worker, 2, dynamic, timeout_s=400):
        assert per_rank == [(True, True), (True, True)]


def _op_args(x, ids, weights, base, side, group, save: str) -> dict:
    a1, b1, a3, b3, a2, b2 = side.tensors()
    return dict(
        x=x, topk_ids=ids, topk_weights=weights, w13=base.w13, w2=base.w2, w13_scales=None,
        w2_scales=None, a1=a1, b1=b1, a3=a3, b3=b3, a2=a2, b2=b2, scale=side.scale,
        activation="swiglu", activation_clamp=None,
        group_name="" if group is None else group.group_name,
        max_tokens=None, check_ids=True, reduce_shared_grads=True, keep_x=False, save=save,
    )  # fmt: skip


def _fake_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    group = dist.group.WORLD
    x, ids, weights, base, side = _rank_layer(rank, world)
    real = torch.ops.megamoe.moe_ep_forward(
        **_op_args(x.detach(), ids, weights.detach(), base, side, group, "preact")
    )
    shapes = {}
    for name, mode, save in (
        ("training", FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True), "preact"),
        ("inference", FakeTensorMode(), "none"),  # no shape environment: inference only
    ):
        fake = [mode.from_tensor(t) for t in (x.detach(), ids, weights.detach())]
        fake_base = type(base)(
            base.format, mode.from_tensor(base.w13), mode.from_tensor(base.w2), None, None,
            base.num_experts, H, INTER,
        )  # fmt: skip
        fake_side = SideLoRA(*(mode.from_tensor(t.detach()) for t in side.tensors()), side.scale)
        with mode:
            outs = torch.ops.megamoe.moe_ep_forward(
                **_op_args(*fake, fake_base, fake_side, group, save)
            )
        shapes[name] = [(tuple(str(d) for d in t.shape), t.dtype, t.device.type) for t in outs]
    real_shapes = [(tuple(t.shape), t.dtype, t.device.type) for t in real]
    return {"fake": shapes, "real": real_shapes, "tokens": x.shape[0]}


def test_fake_shapes_match_the_real_ones_with_unbacked_routing_sizes():
    """The fake forward gives every static size the real one has and an unbacked
    symbol where the size depends on the routing of every rank."""
    for rank, result in enumerate(ep.run_gloo(_fake_worker, 2, timeout_s=300)):
        t = TOKENS[rank]
        fake, real = result["fake"]["training"], result["real"]
        assert len(fake) == len(real) == 14
        for (fake_shape, fake_dtype, fake_device), (real_shape, real_dtype, real_device) in zip(
            fake, real, strict=True
        ):
            assert (fake_dtype, fake_device) == (real_dtype, real_device)
            assert len(fake_shape) == len(real_shape)
            for symbolic, concrete in zip(fake_shape, real_shape, strict=True):
                assert symbolic == str(concrete) or symbolic.startswith("u"), (symbolic, concrete)
        assert real[0][0] == (t, H) and fake[0][0] == (str(t), str(H))
        assert real[7][2] == "cpu" and real[7][0] == (6 + 2 * 2,)  # host_plan
        assert fake[8][0][1] == str(2 * INTER)  # preact [pool capacity, 2I]
        assert any(d.startswith("u") for d in fake[1][0])  # send_routes [N_send]
        inference = [shape for shape, _, _ in result["fake"]["inference"]]
        assert inference[0] == (str(t), str(H)) and all(s == ("0",) for s in inference[1:])


def test_bad_ep_op_calls_name_the_argument():
    """Checked before any collective, without torch.distributed initialized."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    args = _op_args(x.detach(), ids, weights.detach(), base, side, group=None, save="preact")
    with pytest.raises(ValueError, match=r"^group_name: no process group named 'nope'"):
        torch.ops.megamoe.moe_ep_forward(**{**args, "group_name": "nope"})
    with pytest.raises(ValueError, match=r"^save: expected one of"):
        torch.ops.megamoe.moe_ep_forward(**{**args, "group_name": "", "save": "all"})
    with pytest.raises(ValueError, match=r"^side: expected all six adapter tensors"):
        torch.ops.megamoe.moe_ep_forward(**{**args, "group_name": "", "b2": None})
    with pytest.raises(TypeError, match=r"^group: expected a torch.distributed.ProcessGroup"):
        ep.fused_moe(x, ids, weights, base, side, group="world")
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor"):
        ep.fused_moe([1.0], ids, weights, base, side, group=None)


def test_one_process_ep_op_backward_runs_without_a_group():
    """``group=None`` (one process) runs the same ops with group_name "": the output and
    the gradients exist and are finite (their values: test_ep_fused_gloo.py)."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    out = ep.fused_moe(x, ids, weights, base, side, group=None)
    out.float().square().sum().backward()
    for t in (x, weights, *side.tensors()):
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()


def test_a_second_backward_through_a_checkpointed_step_runs():
    """Under activation checkpointing nothing a second backward needs is overwritten
    (mm.moe's promise): ``retain_graph`` then a second backward gives the same bits."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    out = ep.fused_moe(x, ids, weights, base, side, group=None, activation_checkpoint=True)
    inputs = [x, weights, side.a1, side.b2]
    first = torch.autograd.grad(out.float().square().sum(), inputs, retain_graph=True)
    second = torch.autograd.grad(out.float().square().sum(), inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("route", ["eager", "op"])
def test_a_second_backward_is_refused_also_where_no_route_was_computed(route):
    """Every route masked: the stages compute nothing and never write the saved
    pre-activations, yet the backward counts as their mutation on both routes (the op
    declares it; the eager route bumps their version), so a second backward through the
    graph fails autograd's saved-tensor check as it does with routes."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    mode = OpRoute() if route == "op" else contextlib.nullcontext()
    with mode:
        out = ep.fused_moe(x, torch.full_like(ids, -1), weights, base, side, group=None)
        loss = out.float().square().sum()
        torch.autograd.grad(loss, [x, side.b1], retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, [x, side.b1])


@pytest.mark.parametrize("unpack", ["same", "detach"])
@pytest.mark.parametrize("route", ["eager", "op"])
def test_a_second_backward_under_a_hook_that_keeps_the_saved_tensor_is_refused(route, unpack):
    """Under a saved-tensor hook whose unpack returns the saved tensor itself or an alias
    of it, autograd's version check does not run: a second backward read the dg | du
    the first wrote over the pre-activations as g | u (a review). Refused on both
    routes."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    mode = OpRoute() if route == "op" else contextlib.nullcontext()
    with mode:
        hook = (lambda t: t) if unpack == "same" else (lambda t: t.detach())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, hook):
            out = ep.fused_moe(x, ids, weights, base, side, group=None)
        loss = out.float().square().sum()
        torch.autograd.grad(loss, [x, side.b1], retain_graph=True)
        with pytest.raises(RuntimeError, match=r"^Trying to backward through the graph a"):
            torch.autograd.grad(loss, [x, side.b1])


def test_vmap_with_inputs_that_need_grad_saves_for_the_backward():
    """Under vmap a batched wrapper reads requires_grad False, yet autograd records the
    op on the tensor it wraps: the EP call chose the inference save mode and its backward
    raised (a review; mm.moe had the fix). Each slice's gradient is the plain call's."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    x = x.detach()
    side = SideLoRA(*(t.detach() for t in side.tensors()), scale=side.scale)  # x alone

    def one(rows):
        return ep.fused_moe(rows, ids, weights.detach(), base, side, group=None)

    batch = torch.stack([x, x * 0.5]).requires_grad_()
    torch.vmap(one)(batch).float().sum().backward()
    for i in range(2):
        rows = batch[i].detach().clone().requires_grad_()
        one(rows).float().sum().backward()
        assert torch.equal(batch.grad[i], rows.grad), i
    assert batch.grad.abs().sum() > 0


def test_a_meta_call_runs_the_fake_implementation():
    """Meta tensors take the registered op (its fake implementation), not the eager
    route, whose plan reads the device: an inference call gives a meta ``[T, H]``."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    meta = [t.detach().to("meta") for t in (x, ids, weights, base.w13, base.w2)]
    meta_base = type(base)(base.format, meta[3], meta[4], None, None, E, H, INTER)
    meta_side = SideLoRA(*(t.detach().to("meta") for t in side.tensors()), scale=side.scale)
    with torch.no_grad():
        out = ep.fused_moe(meta[0], meta[1], meta[2], meta_base, meta_side, group=None)
    assert out.device.type == "meta" and tuple(out.shape) == tuple(x.shape)


def _grad_mode_worker(rank: int, world: int) -> str:
    import torch.distributed as dist

    x, ids, weights, base, side = _rank_layer(rank, world)
    try:
        with torch.set_grad_enabled(rank == 0):  # only rank 0 would run a backward
            ep.fused_moe(x, ids, weights, base, side, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "ran"


def test_ranks_that_differ_in_needing_a_backward_all_raise():
    """The backward is a collective: a rank that needs it beside one that does not
    would run it alone. Both raise at the forward's agreement instead."""
    for message in ep.run_gloo(_grad_mode_worker, 2, timeout_s=120.0):
        assert message.startswith("save (0: no backward, 1: pre-activations kept"), message


def _static_bound_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    x, ids, weights, base, side = _rank_layer(rank, world)
    group, messages = dist.group.WORLD, []
    for kwargs in (
        {"max_tokens": 16, "activation_checkpoint": rank == 1},  # the backwards would differ
        {"max_tokens": 6},  # rank 1 holds 9 tokens: above the bound
    ):
        try:
            ep.fused_moe(x, ids, weights, base, side, group=group, **kwargs)
            messages.append("ran")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_a_static_bound_keeps_the_cross_rank_checks():
    """``max_tokens`` sizes the pool statically; the ranks still agree (and raise
    together) on everything that would pair different collectives."""
    for checkpoint, bound in ep.run_gloo(_static_bound_worker, 2, timeout_s=120.0):
        assert checkpoint.startswith("save (0: no backward"), checkpoint
        assert bound.startswith("max_tokens: expected >= every rank's token count"), bound


def test_an_ep_step_under_graph_capture_is_refused_by_name(monkeypatch):
    """Its split sizes are host values: under capture the call says so before the
    plan's first host read would break the capture. (Capture simulated on the CPU.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, ids, weights, base, side = _rank_layer(0, 1)
    with pytest.raises(RuntimeError, match=r"^group: an expert-parallel step cannot be captured"):
        ep.fused_moe(x, ids, weights, base, side, group=None)


def test_opcheck_the_ep_forward_op():
    """torch.library.opcheck on one process (group_name ""): the schema (no aliasing,
    no undeclared mutation), the autograd registration and the fake implementation
    against the real one."""
    x, ids, weights, base, side = _rank_layer(0, 1)
    args = _op_args(x.detach(), ids, weights.detach(), base, side, group=None, save="preact")
    torch.library.opcheck(
        torch.ops.megamoe.moe_ep_forward.default,
        (),
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def _backward_args(trainable: bool) -> dict:
    """The backward op's arguments with the real state of one forward on one process."""
    x, ids, weights, base, side = _rank_layer(0, 1, trainable=trainable)
    args = _op_args(x.detach(), ids, weights.detach(), base, side, group=None, save="preact")
    args.update(w13=base.w13.detach(), w2=base.w2.detach(), keep_x=trainable)
    outs = torch.ops.megamoe.moe_ep_forward(**args)
    state = dict(zip(ep_ops._STATE_NAMES, outs[1:], strict=True))
    kept = ("x", "topk_weights", "w13", "w2", "w13_scales", "w2_scales")
    return dict(
        dout=torch.randn(x.shape).bfloat16(),
        **{name: args[name] for name in kept},
        **{name: args[name] for name in ("a1", "b1", "a3", "b3", "a2", "b2")},
        **{name: args[name] for name in ("scale", "activation", "activation_clamp")},
        group_name="",
        reduce_shared_grads=True,
        **state,
        base_grads=trainable,
    )


@pytest.mark.parametrize("trainable", [False, True])
def test_opcheck_the_ep_backward_op(trainable):
    """opcheck of the backward op on one process with the forward's real state (side
    adapters; ``trainable``: a base that requires grad, so dw13 and dw2 too)."""
    torch.library.opcheck(
        torch.ops.megamoe.moe_ep_backward.default,
        (),
        _backward_args(trainable),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def _with_host_field(host_plan: torch.Tensor, index: int, value: int) -> torch.Tensor:
    changed = host_plan.clone()
    changed[index] = value
    return changed


def test_a_backward_state_that_is_not_this_forwards_is_named():
    """The backward checks the forward's state it is handed before any kernel or
    collective: the plan's BLOCK_M and (T, K), each state tensor's dtype and shape."""
    args = _backward_args(trainable=False)
    host = args["host_plan"]
    bad = {
        r"^host_plan: the forward's plan is corrupt \(block_m: expected one of": {
            "host_plan": _with_host_field(host, 3, 96)
        },
        r"^host_plan: made for \(T, K\) = \(\d+, 7\)": {"host_plan": _with_host_field(host, 1, 7)},
        # Another registry BLOCK_M than the pool was planned with (rows would meet the
        # wrong expert's weights in the kernels).
        r"^block_m: expected the BLOCK_M the forward planned with": {
            "host_plan": _with_host_field(host, 3, 128 if int(host[3]) == 64 else 64)
        },
        r"^pool_expert_counts: expected dtype": {
            "pool_expert_counts": args["pool_expert_counts"].long()
        },
        r"^send_routes: expected shape": {"send_routes": args["send_routes"][1:]},
        r"^preact: expected shape": {"preact": args["preact"][:, 1:]},
        r"^p_sum: expected dtype": {"p_sum": args["p_sum"].float()},
        # The side path's saved tensors given empty: refused before the exchanges and
        # dgrad2 overwrite preact (an unnamed AttributeError midway before; a review).
        r"^p_sum: the adapters' backward needs the forward's p_sum": {
            "p_sum": args["p_sum"].new_empty(0)
        },
        r"^recv_q13: the adapters' backward needs the forward's recv_q13": {
            "recv_q13": args["recv_q13"].new_empty(0)
        },
        r"^dout: expected device cpu, got meta": {"dout": args["dout"].to("meta")},
    }
    preact = args["preact"].clone()
    for message, change in bad.items():
        with pytest.raises(ValueError if "dtype" not in message else TypeError, match=message):
            torch.ops.megamoe.moe_ep_backward(**{**args, **change})
        # Refused before any write (bit for bit: the pool's unused rows are never
        # written, and their bytes may read as NaN).
        assert torch.equal(args["preact"].view(torch.int16), preact.view(torch.int16)), message


def _outcome(call) -> str:
    """``"ran"``, or the error ``call()`` raised as ``"Type: message"``."""
    try:
        call()
    except (TypeError, ValueError, RuntimeError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ran"


def _one_rank_refuses_worker(rank: int, world: int) -> list[str]:
    """Each call has one argument only the last rank gets wrong; returns each call's
    outcome ("ran" or the error) on this rank."""
    import torch.distributed as dist

    group, outcomes = dist.group.WORLD, []
    last = rank == world - 1

    def attempt(call) -> None:
        outcomes.append(_outcome(call))

    x, ids, weights, base, side = _rank_layer(rank, world)
    bad_x = x.float() if last else x
    attempt(lambda: ep.fused_moe(bad_x, ids, weights, base, side, group=group))
    # The static bound given on one rank only (the agreement's vector had another length).
    bound = None if last else 16
    attempt(lambda: ep.fused_moe(x, ids, weights, base, side, group=group, max_tokens=bound))
    # The op's own checks (a caller of the op, not through fused_moe).
    args = _op_args(x.detach(), ids, weights.detach(), base, side, group=group, save="preact")
    if last:
        args["save"] = "all"
    attempt(lambda: torch.ops.megamoe.moe_ep_forward(**args))
    # The reference layer's checks and the dispatch plan's own.
    w13, w2 = base.w13.float(), base.w2.float()
    flag = 1 if last else False  # 1: not a bool
    attempt(lambda: ep.reference_moe(x, ids, weights, w13, w2, group=group, round_bf16=flag))
    bad_ids = ids[:, 0] if last else ids
    attempt(lambda: ep.plan_dispatch(bad_ids, E, group=group))
    # And the same step on good inputs still runs (nothing is left half-exchanged).
    attempt(lambda: ep.fused_moe(x, ids, weights, base, side, group=group))
    return outcomes


def test_inputs_one_rank_refuses_raise_on_every_rank():
    """An argument only one rank refuses (before the exchange) raised on that rank alone,
    leaving its peers in the agreement all-reduce (a hang on NCCL; gloo saw the closed
    connection). Now that rank joins the agreement with its refusal flagged: it raises
    its own error naming the argument, its peers a ValueError naming the rank, and the
    next step runs. A static bound given on one rank only made the agreement vectors of
    different lengths (gloo aborted the process); now it is a named mismatch."""
    world = 2
    last = world - 1
    results = ep.run_gloo(_one_rank_refuses_worker, world, timeout_s=120.0)
    peer_message = f"ValueError: rank {last} of the EP group failed before the exchange"
    own_messages = [
        "TypeError: x: expected dtype bfloat16",
        None,  # the bound: a mismatch, named alike on every rank
        "ValueError: save: expected one of",
        "TypeError: round_bf16: expected a bool",
        "ValueError: topk_ids: expected 2 dimensions",
    ]
    for rank, outcomes in enumerate(results):
        assert len(outcomes) == 6, outcomes
        for own, outcome in zip(own_messages, outcomes, strict=False):
            if own is None:
                assert outcome.startswith(
                    "ValueError: max_tokens (-1: none): expected the same value on every rank"
                ), outcome
            elif rank == last:
                assert outcome.startswith(own), outcome
            else:
                assert outcome.startswith(peer_message), outcome
        assert outcomes[5] == "ran", outcomes


def _refusals_found_in_review_worker(rank: int, world: int) -> list[str]:
    """More arguments only the last rank gets wrong (a review's reproductions)."""
    import torch.distributed as dist

    group, outcomes = dist.group.WORLD, []
    last = rank == world - 1

    def attempt(call) -> None:
        outcomes.append(_outcome(call))

    x, ids, weights, base, side = _rank_layer(rank, world)
    # ids that are not a tensor (an AttributeError from .numel() before).
    attempt(lambda: ep.plan_dispatch(ids.tolist() if last else ids, E, group=group))
    # A bound past int64 (the op's schema refused it after this rank left the checks).
    bound = 2**63 if last else None
    attempt(lambda: ep.fused_moe(x, ids, weights, base, side, group=group, max_tokens=bound))
    # The id check on one rank only, beside an id out of range there (the unchecked rank
    # failed alone in the ids' exchange).
    bad = ids.clone()
    if last:
        bad[0, 0] = 100
    attempt(lambda: ep.plan_dispatch(bad, E, group=group, check_ids=not last))
    # A BLOCK_M override on one rank only, and a bad one (refused after every collective).
    attempt(lambda: ep.plan_dispatch(ids, E, group=group, block_m=64 if last else None))
    attempt(lambda: ep.plan_dispatch(ids, E, group=group, block_m=7 if last else 64))
    attempt(lambda: ep.fused_moe(x, ids, weights, base, side, group=group))
    return outcomes


def test_more_one_rank_refusals_raise_on_every_rank():
    results = ep.run_gloo(_refusals_found_in_review_worker, 2, timeout_s=120.0)
    peer = "ValueError: rank 1 of the EP group failed before the exchange"
    for rank, outcomes in enumerate(results):
        assert len(outcomes) == 6, outcomes
        ids_list, bound, check_ids, override, bad_block_m, good = outcomes
        if rank == 1:
            assert ids_list.startswith("TypeError: topk_ids: expected a torch.Tensor"), ids_list
            assert bound.startswith("ValueError: max_tokens: expected fewer than 2^31"), bound
        else:
            for outcome in (ids_list, bound):
                assert outcome.startswith(peer), outcome
        # An agreed int is compared before any rank's own refusal: a mismatch everywhere.
        assert bad_block_m.startswith("ValueError: block_m (-1: agreed): expected the same")
        assert check_ids.startswith("ValueError: check_ids: expected the same value"), check_ids
        assert override.startswith("ValueError: block_m (-1: agreed): expected the same"), override
        assert good == "ran", outcomes


def _config_refusals_worker(rank: int, world: int) -> list[str]:
    """BLOCK_M thresholds (``config=``) that differ between ranks, or that one rank
    refuses, in the dispatch plan and in the bare agreement."""
    import torch.distributed as dist

    from megamoe import BlockMConfig

    group, outcomes = dist.group.WORLD, []
    last = rank == world - 1

    def attempt(call) -> None:
        outcomes.append(_outcome(call))

    _, ids, _, _, _ = _rank_layer(rank, world)
    # Different thresholds: before, each rank took its own BLOCK_M with no error.
    differing = BlockMConfig(min_blocks_per_expert=1 if last else 4)
    attempt(lambda: ep.plan_dispatch(ids, E, group=group, config=differing))
    # Not a BlockMConfig on one rank: refused after the agreement, and its peers went on
    # into the counts' exchange alone.
    bad = "fast" if last else None
    attempt(lambda: ep.plan_dispatch(ids, E, group=group, config=bad))
    attempt(lambda: ep.agree_block_m(ids.shape[0], K, E, group=group, config=differing))
    attempt(lambda: ep.agree_block_m(ids.shape[0], K, E, group=group, config=bad))
    # top_k that differs (agree_block_m all-reduced only T: each rank its own BLOCK_M),
    # and a num_tokens one rank refuses (refused before its all-reduce: a hang).
    attempt(lambda: ep.agree_block_m(ids.shape[0], 8 if last else K, E, group=group))
    attempt(lambda: ep.agree_block_m(-1 if last else ids.shape[0], K, E, group=group))
    # Equal thresholds given on every rank: the default's agreement.
    same = BlockMConfig(min_blocks_per_expert=4)
    attempt(lambda: ep.plan_dispatch(ids, E, group=group, config=same).block_m)
    outcomes.append(str(ep.plan_dispatch(ids, E, group=group, config=same).block_m))
    outcomes.append(str(ep.plan_dispatch(ids, E, group=group).block_m))
    return outcomes


def test_block_m_thresholds_are_agreed_across_ranks():
    results = ep.run_gloo(_config_refusals_worker, 2, timeout_s=120.0)
    for rank, outcomes in enumerate(results):
        plan_diff, plan_bad, agree_diff, agree_bad, agree_k, agree_t = outcomes[:6]
        same, same_block_m, default = outcomes[6:]
        assert agree_k.startswith("ValueError: top_k: expected the same value"), agree_k
        if rank == 1:
            assert agree_t.startswith("ValueError: num_tokens: expected an int >= 0"), agree_t
        else:
            assert agree_t.startswith("ValueError: rank 1 of the EP group refused"), agree_t
        mismatch = "ValueError: config.min_blocks_per_expert: expected the same value"
        assert plan_diff.startswith(mismatch), plan_diff
        assert agree_diff.startswith(mismatch), agree_diff
        if rank == 1:
            for outcome in (plan_bad, agree_bad):
                assert outcome.startswith("TypeError: config: expected megamoe.BlockMConfig")
        else:
            assert plan_bad.startswith("ValueError: rank 1 of the EP group failed"), plan_bad
            assert agree_bad.startswith("ValueError: rank 1 of the EP group refused"), agree_bad
        assert same == "ran" and same_block_m == default, outcomes


def _unchecked_ids_worker(rank: int, world: int) -> list[object]:
    """``check_ids=False`` with ids outside ``[-1, E)`` on one rank: the layer's output and
    router gradient against the same step with those ids masked (-1); and the reference
    layer given an adapter scale and a clamp that differ between ranks."""
    import torch.distributed as dist

    group = dist.group.WORLD
    last = rank == world - 1
    results: list[object] = []
    x, ids, weights, base, side = _rank_layer(rank, world)
    bad, masked = ids.clone(), ids.clone()
    if last:
        # E + 5 lies past every rank's experts (its split had a route no count held);
        # E + 1 and -7 were dropped from the split, but not from the pool's bound.
        bad[0, 0], bad[1, 1], bad[2, 0] = E + 5, E + 1, -7
        masked[0, 0], masked[1, 1], masked[2, 0] = -1, -1, -1
    outs = []
    for routes in (bad, masked):
        xi, wi = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
        try:
            out = ep.fused_moe(xi, routes, wi, base, side, group=group, check_ids=False)
            out.float().square().sum().backward()
            outs.append((out.detach(), wi.grad))
        except (RuntimeError, ValueError) as error:
            outs.append(f"{type(error).__name__}: {error}")
    results.append(
        outs
        if any(isinstance(o, str) for o in outs)
        else [torch.equal(outs[0][0], outs[1][0]), torch.equal(outs[0][1], outs[1][1])]
    )
    w13, w2 = base.w13.float(), base.w2.float()
    for clamp, scale in ((7.0 if last else 0.5, None), (None, 2.0 if last else 0.5)):
        s = side if scale is None else SideLoRA(*side.tensors(), scale=scale)
        results.append(
            _outcome(
                lambda s=s, clamp=clamp: ep.reference_moe(
                    x, ids, weights, w13, w2, s, group=group, activation_clamp=clamp
                )
            )
        )
    return results


def test_unchecked_out_of_range_ids_are_masked_and_the_reference_agrees_its_floats():
    """``check_ids=False`` with an id past ``E`` broke the split sizes on its rank alone
    (a hang on NCCL) and ids in ``[E, E + E_l)`` or below -1 were dropped from the split:
    all are now masked, as EP1's route plan treats them, bitwise like -1. The reference
    layer compared only whether a clamp was set, not its value, nor the adapter scale:
    each rank ran with its own."""
    results = ep.run_gloo(_unchecked_ids_worker, 2, timeout_s=120.0)
    for outcomes in results:
        unchecked, clamp, scale = outcomes
        assert unchecked == [True, True], unchecked
        assert clamp.startswith(
            "ValueError: activation_clamp (float64 bits, -1: none): expected the same"
        ), clamp
        assert scale.startswith("ValueError: side scale (float64 bits): expected the same"), scale


def _autocast_worker(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    def step(autocast: bool) -> list[torch.Tensor]:
        x, ids, weights, base, side = _rank_layer(rank, world)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ep.fused_moe(x, ids, weights, base, side, group=dist.group.WORLD)
            out.float().square().sum().backward()
        return [out, x.grad, weights.grad, *(t.grad for t in side.tensors())]

    return [torch.equal(a, b) for a, b in zip(step(False), step(True), strict=True)]


def test_the_ep_layer_runs_at_its_own_precision_under_autocast():
    """As the EP1 ops (tests/cpu/test_autocast.py): autocast reached the FP32 products
    of the EP stages."""
    for equal in ep.run_gloo(_autocast_worker, 2, timeout_s=120.0):
        assert all(equal), equal


def test_the_ep_layer_frees_its_exchange_buffers_before_its_peaks(monkeypatch):
    """The receive buffer ([pool routes, H + 2r]) is freed once its q13 columns are
    copied, before the return exchange and the combine (the forward's largest moment);
    the activation-checkpoint backward's recomputed pool input is freed after GEMM1, not
    held through dgrad2, dgrad1 and the weight gradients (a review: about 3.2 and 3.5 GB
    at ep4rank)."""
    import weakref

    from megamoe.ep import fused_layer

    layer = make_layer(64, 64, 8, 2, 16, dtype=torch.bfloat16, num_tokens=12, seed=3, scale=0.5)
    made: list[weakref.ref] = []

    def tracked(function):
        def call(*args, **kwargs):
            out = function(*args, **kwargs)
            made.append(weakref.ref(out))
            return out

        return call

    def alive_at(function, seen: list[bool]):
        def call(*args, **kwargs):
            seen.append(any(ref() is not None for ref in made))
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(
        fused_layer, "_dispatch_token_rows", tracked(fused_layer._dispatch_token_rows)
    )
    monkeypatch.setattr(
        fused_layer.pool, "gather_pool_unchecked", tracked(fused_layer.pool.gather_pool_unchecked)
    )
    at_combine, at_pool_backward = [], []
    monkeypatch.setattr(
        fused_layer.pool,
        "combine_unchecked",
        alive_at(fused_layer.pool.combine_unchecked, at_combine),
    )
    monkeypatch.setattr(
        fused_layer, "pool_backward", alive_at(fused_layer.pool_backward, at_pool_backward)
    )
    x = layer.x.clone().requires_grad_()
    side = SideLoRA(*(t.clone().requires_grad_() for t in layer.side.tensors()), scale=0.5)
    out = ep.fused_moe(
        x, layer.topk_ids, layer.topk_weights, layer.base, side, group=None,
        activation_checkpoint=True,
    )  # fmt: skip
    assert at_combine == [False]
    made.clear()  # the backward's own buffers from here
    out.float().sum().backward()
    assert at_pool_backward == [False]


def _mxfp4_masters_layer(rank: int, world: int, tokens: tuple[int, ...] = TOKENS):
    """This rank's slice of one global layer with an MXFP4 base prepared from FP32
    masters that require grad (ordinary mode, side-LoRA): ``(x, ids, weights, base,
    side, masters)``."""
    import megamoe as mm

    x, ids, weights, bf16_base, side = _rank_layer(rank, world, tokens)
    masters = [w.detach().float().requires_grad_(True) for w in (bf16_base.w13, bf16_base.w2)]
    return x, ids, weights, mm.prepare_base_weights(*masters, format="mxfp4"), side, masters


def _always_decode_once(rows: int, experts: int) -> bool:
    return True


def _mxfp4_compile_worker(rank: int, world: int, dynamic: bool) -> list[tuple]:
    import torch.distributed as dist

    group = dist.group.WORLD

    def layer(x, ids, weights, base, side):
        return ep.fused_moe(x, ids, weights, base, side, group=group)

    results = []
    decides = ep_ops.mxfp4_master_decodes_once
    for once in (False, True):
        if once:  # these pools are below the in-pipeline limit: the decode forced
            ep_ops.mxfp4_master_decodes_once = _always_decode_once
        try:
            torch._dynamo.reset()
            compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=dynamic)
            x, ids, weights, base, side, masters = _mxfp4_masters_layer(rank, world)
            leaves = (x, weights, *masters, *side.tensors())
            same_out, same_grads, grads = _compiled_matches_eager(
                layer, compiled, (x, ids, weights, base, side), leaves
            )
        finally:
            ep_ops.mxfp4_master_decodes_once = decides
        master_grad = grads[2].dtype == torch.float32 and bool(grads[2].abs().sum() > 0)
        results.append((same_out, same_grads, master_grad))
    return results


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_ep_step_on_a_trainable_mxfp4_base_matches_eager(dynamic):
    """torch.compile(fullgraph=True) of an ordinary-MXFP4 EP step (the masters op
    inputs; the decoded state's unbacked size where the op decodes once): the same bits
    as eager, kept packed and decoded once, the masters' gradients FP32."""
    for per_rank in ep.run_gloo(_mxfp4_compile_worker, 2, dynamic, timeout_s=400):
        assert per_rank == [(True, True, True), (True, True, True)]


def _masters_op_args() -> tuple[dict, list[torch.Tensor]]:
    """The forward op's arguments on one process with an MXFP4 base and its masters."""
    x, ids, weights, base, side, masters = _mxfp4_masters_layer(0, 1)
    args = _op_args(x.detach(), ids, weights.detach(), base, side, group=None, save="preact")
    args.update(
        w13=base.w13, w2=base.w2, w13_scales=base.w13_scales, w2_scales=base.w2_scales,
        keep_x=True, w13_master=masters[0], w2_master=masters[1],
    )  # fmt: skip
    return args, masters


@pytest.mark.parametrize("once", [False, True])
def test_ep_forward_op_with_masters_keeps_a_decode_only_where_it_decodes_once(monkeypatch, once):
    """The forward op given the masters: its state holds the BF16 decode of the codes
    where it decodes once (``[E_l, 2I, H]``, ``[E_l, H, I]``), else no experts of it;
    the fake gives its leading size as an unbacked symbol (the pool decides); opcheck
    passes in both regimes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import megamoe.weights as weights_module

    if once:
        monkeypatch.setattr(ep_ops, "mxfp4_master_decodes_once", _always_decode_once)
    args, _ = _masters_op_args()
    outs = torch.ops.megamoe.moe_ep_forward(**args)
    state = dict(zip(ep_ops._STATE_NAMES, outs[1:], strict=True))
    experts = E if once else 0
    assert state["w13_decoded"].shape == (experts, 2 * INTER, H)
    assert state["w2_decoded"].shape == (experts, H, INTER)
    if once:
        base = weights_module.BaseWeights(
            "mxfp4", args["w13"], args["w2"], args["w13_scales"], args["w2_scales"], E, H, INTER
        )
        assert torch.equal(state["w13_decoded"], base.w13_for_gemm())
        assert torch.equal(state["w2_decoded"], base.w2_for_gemm())
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fake_args = {
        k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()
    }
    with mode:
        fake = torch.ops.megamoe.moe_ep_forward(**fake_args)
    decoded = fake[len(outs) - 2 :]
    assert str(decoded[0].shape[0]).startswith("u") and decoded[0].shape[1:] == (2 * INTER, H)
    assert str(decoded[1].shape[0]) == str(decoded[0].shape[0])  # one symbol for both
    torch.library.opcheck(
        torch.ops.megamoe.moe_ep_forward.default,
        (),
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_a_decoded_state_that_is_not_this_calls_is_named(monkeypatch):
    """The backward checks the decoded state before any kernel or collective: its
    shape against the base's, beside a BF16 base, and with a partial expert count."""
    monkeypatch.setattr(ep_ops, "mxfp4_master_decodes_once", _always_decode_once)
    args, _ = _masters_op_args()
    outs = torch.ops.megamoe.moe_ep_forward(**args)
    state = dict(zip(ep_ops._STATE_NAMES, outs[1:], strict=True))
    names = ("x", "topk_weights", "w13", "w2", "w13_scales", "w2_scales", *ep_ops.SIDE_NAMES)
    backward = dict(
        dout=torch.randn(args["x"].shape).bfloat16(),
        **{name: args[name] for name in names},
        **{name: args[name] for name in ("scale", "activation", "activation_clamp")},
        group_name="",
        reduce_shared_grads=True,
        **state,
        base_grads=True,
    )
    w13d, w2d = state["w13_decoded"], state["w2_decoded"]
    bad = {
        r"^w13_decoded: expected the decode of the call's MXFP4 base or no experts": {
            "w13_decoded": w13d[:1]
        },
        r"^w2_decoded: expected shape": {"w2_decoded": w2d[:, :, 1:]},
        r"^w13_decoded: expected dtype": {"w13_decoded": w13d.float()},
    }
    for message, change in bad.items():
        with pytest.raises(TypeError if "dtype" in message else ValueError, match=message):
            torch.ops.megamoe.moe_ep_backward(**{**backward, **change})
    grads = torch.ops.megamoe.moe_ep_backward(**backward)
    assert grads[2].shape == (E, 2 * INTER, H) and grads[2].dtype == torch.bfloat16
