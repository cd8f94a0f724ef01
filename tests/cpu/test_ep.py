"""Expert-parallel logic in one process: routing splits, plans, the P = 1 layer, run_gloo.

The multi-process checks (gloo, EP2/EP4 vs EP1) are in test_ep_gloo.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megamoe import (
    ep,
    get_block_m,
    plan_routes,
    pool_capacity,
    reference,
    workspace_layout,
)
from megamoe.ep.fused_layer import float_bits
from megamoe.side_lora import SideLoRA
from megamoe.testing import make_layer, make_routing
from megamoe.wrappers import pool


def naive_split(ids: torch.Tensor, num_experts: int, world: int):
    e_l = num_experts // world
    per_dest = [[] for _ in range(world)]
    for route, e in enumerate(ids.reshape(-1).tolist()):
        if e >= 0:
            per_dest[e // e_l].append(route)
    return [r for d in per_dest for r in d], [len(d) for d in per_dest]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_split_routes_matches_naive_loop(world, id_dtype, tokens):
    ids, _ = make_routing(tokens, 8, 3, kind="masked", seed=tokens + world, id_dtype=id_dtype)
    routes, counts = ep.split_routes(ids, ep.ExpertPartition(8, world, 0))
    want_routes, want_counts = naive_split(ids, 8, world)
    assert routes.dtype == counts.dtype == torch.int64
    assert routes.tolist() == want_routes
    assert counts.tolist() == want_counts


def test_split_routes_all_masked():
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    routes, counts = ep.split_routes(ids, ep.ExpertPartition(4, 2, 1))
    assert routes.numel() == 0 and counts.tolist() == [0, 0]


def test_split_routes_drops_ids_outside_the_experts():
    """Ids past ``E`` or below -1 (reachable with ``check_ids=False``) are not sent, as
    masked ones: counted with the masked routes, after every destination's."""
    ids = torch.tensor([[7, -1], [8, 0], [-5, 3], [4, 100]])
    routes, counts = ep.split_routes(ids, ep.ExpertPartition(8, 2, 0))
    assert routes.tolist() == [3, 5, 0, 6] and counts.tolist() == [2, 2]


@pytest.mark.parametrize("outside", [[8], [-2], [-5, 100]])
def test_plan_dispatch_checks_the_ids_it_routes(outside):
    """The id check is the routing split's count of ids outside ``[-1, E)`` (no read of
    its own): with ``check_ids`` any such id raises, naming the ids' range; without it
    the plan masks them, and the rows sent are those of the ids in range."""
    ids = torch.tensor([[7, -1], [0, 3], [4, 4]])
    flat = ids.reshape(-1).clone()
    flat[1 : 1 + len(outside)] = torch.tensor(outside)
    bad = flat.view(3, 2)
    low, high = min(flat.tolist()), max(flat.tolist())
    with pytest.raises(ValueError, match=rf"got values in \[{low}, {high}\]$"):
        ep.plan_dispatch(bad, 8, group=None)
    plan = ep.plan_dispatch(bad, 8, group=None, check_ids=False)
    kept = [route for route, e in enumerate(flat.tolist()) if 0 <= e < 8]
    assert plan.send_routes.tolist() == kept
    assert plan.recv_expert.tolist() == [flat[r].item() for r in kept]
    assert plan.send_splits == (len(kept),) == plan.recv_splits
    # Ids in range only: the check passes and plans the same routes.
    ok = ep.plan_dispatch(ids, 8, group=None)
    assert ok.send_routes.tolist() == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("hidden", [1.5, 2**70])
def test_plan_dispatch_in_one_process_checks_the_ids_before_the_uniform_values(hidden):
    """With ``group=None`` a call with bad ids and a bad ``uniform`` value names the ids
    (the id check comes first there, as it did before it rode in the routing split)."""
    bad = torch.tensor([[0, -5], [3, 7]])
    with pytest.raises(ValueError, match=r"got values in \[-5, 7\]$"):
        ep.plan_dispatch(bad, 8, group=None, uniform={"hidden": hidden})
    with pytest.raises((TypeError, ValueError), match=r"^hidden: expected an int"):
        ep.plan_dispatch(bad, 8, group=None, uniform={"hidden": hidden}, check_ids=False)


def _reduce_lone_tensors(rank: int, world: int) -> dict:
    """reduce_shared_grads on lone tensors of each kind: the sums, or the error."""
    out = {}
    plain = torch.full((2, 3), float(rank + 1))
    ep.reduce_shared_grads([plain], dist.group.WORLD)
    out["plain"] = plain.tolist()
    leaf = torch.ones(2, requires_grad=True)
    try:
        ep.reduce_shared_grads([leaf], dist.group.WORLD)
        out["leaf"] = "reduced"
    except RuntimeError as error:
        out["leaf"] = str(error)
    with torch.inference_mode():
        frozen = torch.ones(2)
    try:
        ep.reduce_shared_grads([frozen], dist.group.WORLD)
        out["inference"] = "reduced"
    except RuntimeError as error:
        out["inference"] = str(error)
    # Saved by autograd for a backward still to run: the in-place sum must bump the
    # version, so that backward refuses (it read the sum silently before; a review).
    weight = torch.ones(2, requires_grad=True)
    saved = torch.full((2,), float(rank + 1))
    product = (weight * saved).sum()
    ep.reduce_shared_grads([saved], dist.group.WORLD)
    try:
        product.backward()
        out["saved"] = weight.grad.tolist()
    except RuntimeError as error:
        out["saved"] = str(error)
    return out


def test_reduce_shared_grads_writes_a_lone_tensor_only_where_a_copy_could():
    """A lone contiguous tensor is all-reduced where it is, unless writing it in place
    is refused (a leaf that requires grad, an inference tensor outside inference mode):
    then, as for several tensors, the copy back into it raises torch's error. A tensor
    autograd saved is refused by the backward, as after the copy."""
    results = ep.run_gloo(_reduce_lone_tensors, 2, timeout_s=120.0)
    for result in results:
        assert result["plain"] == [[3.0] * 3] * 2
        assert "leaf Variable that requires grad" in result["leaf"]
        assert "inference tensor" in result["inference"]
        assert "modified by an inplace operation" in result["saved"]


def test_expert_partition():
    part = ep.ExpertPartition(12, 4, 2)
    assert (part.num_local_experts, part.expert_begin) == (3, 6)
    assert part.owner(torch.tensor([-1, 0, 5, 6, 11])).tolist() == [-1, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the EP size 5"):
        ep.ExpertPartition(12, 5, 0)
    with pytest.raises(ValueError, match="rank: expected < world_size=4"):
        ep.ExpertPartition(12, 4, 4)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("max_tokens", [1, 177, 2048])
def test_recv_capacity_matches_workspace_sizing(world, max_tokens):
    """The plan's rank-uniform pool is what workspace_layout(ep_size=P) reserves."""
    top_k, experts, e_l = 6, 16, 16 // world
    block_m = get_block_m(max_tokens, top_k, experts, world)
    cap = ep.recv_capacity(max_tokens, top_k, world)
    assert cap == world * max_tokens * top_k
    layout = workspace_layout(max_tokens, 64, 64, e_l, top_k, 16, ep_size=world)
    assert layout.block_m == block_m
    assert layout.pool_capacity == pool_capacity(cap, e_l, block_m)


@pytest.mark.parametrize("kind", ["balanced", "masked", "skewed"])
def test_single_process_plan_is_the_ep1_route_plan(kind):
    """P = 1 (group=None): the receive order is the route order, the pool the EP1 pool."""
    ids, _ = make_routing(90, 8, 2, kind=kind, seed=3)
    plan = ep.plan_dispatch(ids, 8, group=None)
    assert plan.send_splits == plan.recv_splits == (int((ids >= 0).sum()),)
    assert plan.block_m == get_block_m(90, 2, 8) and plan.max_tokens == 90
    assert torch.equal(plan.recv_expert, ids.reshape(-1)[plan.send_routes].long())
    ep1 = plan_routes(ids, 8, plan.block_m)
    assert torch.equal(plan.pool.expert_counts, ep1.expert_counts)
    assert torch.equal(plan.pool.expert_pool_offsets, ep1.expert_pool_offsets)
    used = int(ep1.expert_pool_offsets[-1])
    pool_rows = plan.pool.pool_row_to_route[:used].long()
    as_routes = torch.where(
        pool_rows >= 0, plan.send_routes[pool_rows.clamp(min=0)], torch.full_like(pool_rows, -1)
    )
    assert as_routes.tolist() == ep1.pool_row_to_route[:used].tolist()


def test_send_position_indexes_the_returned_rows():
    ids, _ = make_routing(17, 8, 3, kind="masked", seed=5, masked_fraction=0.3)
    plan = ep.plan_dispatch(ids, 8, group=None)
    rows = torch.randn(plan.num_recv, 5, generator=torch.Generator().manual_seed(0))
    per_route = ep.combine(rows, plan)
    pos = plan.send_position
    assert pos.dtype == torch.int32 and pos.shape == ids.shape
    assert torch.equal(pos < 0, ids < 0)
    valid = pos >= 0
    assert torch.equal(per_route[valid], rows[pos[valid].long()])  # P = 1: returned == sent


def test_return_plan_feeds_the_ep1_combine():
    """The returned rows + return_plan give pool.side_sum / pool.combine their EP1 inputs."""
    ids, weights = make_routing(23, 8, 3, kind="masked", seed=6, masked_fraction=0.3)
    plan = ep.plan_dispatch(ids, 8, group=None)
    gen = torch.Generator().manual_seed(2)
    returned = torch.randn(plan.num_send, 24, generator=gen).to(torch.bfloat16)
    per_route = ep.combine(returned, plan).float()
    ret = plan.return_plan
    want_y = ep.sum_over_k(per_route[..., :16], weights).to(torch.bfloat16)
    want_p = ep.sum_over_k(per_route[..., 16:], weights).to(torch.bfloat16)
    assert torch.equal(pool.combine(returned, ret, weights, hidden=16), want_y)
    assert torch.equal(pool.side_sum(returned, ret, weights, 16), want_p)


def test_plan_dispatch_checks():
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[-1, 4\)"):
        ep.plan_dispatch(ids + 1, 4, group=None)
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[-1, 4\)"):
        ep.plan_dispatch(ids - 2, 4, group=None)
    with pytest.raises(ValueError, match="max_tokens: expected >= every rank's token count"):
        ep.plan_dispatch(ids, 4, group=None, max_tokens=1)
    with pytest.raises(TypeError, match="topk_ids: expected dtype"):
        ep.plan_dispatch(ids.float(), 4, group=None)
    empty = ep.plan_dispatch(torch.zeros(0, 2, dtype=torch.int64), 4, group=None)
    assert empty.num_send == empty.num_recv == 0 and empty.pool_capacity == 0


def test_exchange_shape_checks():
    plan = ep.plan_dispatch(torch.tensor([[0, -1], [1, 0]]), 2, group=None)
    with pytest.raises(ValueError, match=r"rows: expected per-token rows \[T=2"):
        ep.dispatch(torch.zeros(3, 4), plan)
    with pytest.raises(ValueError, match=r"rows: expected per-route rows \[T=2, K=2"):
        ep.dispatch(torch.zeros(2, 3, 4), plan, per_route=True)
    with pytest.raises(ValueError, match=r"rows: expected \[N_recv=3"):
        ep.combine(torch.zeros(2, 4), plan)
    with pytest.raises(ValueError, match="send: expected 3 rows"):
        ep.all_to_all_rows(torch.zeros(2, 4), [3], [3], None)


def test_sum_over_k_is_in_k_order():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 3, 4, generator=gen, dtype=torch.float32) * 1e4
    w = torch.rand(5, 3, generator=gen)
    want = (w[:, 0, None] * rows[:, 0] + w[:, 1, None] * rows[:, 1]) + w[:, 2, None] * rows[:, 2]
    assert torch.equal(ep.sum_over_k(rows, w), want)
    assert torch.equal(ep.sum_over_k(rows), (rows[:, 0] + rows[:, 1]) + rows[:, 2])


SIDE_NAMES = ("a1", "b1", "a3", "b3", "a2", "b2")


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(activation="geglu", activation_clamp=0.5, routing="masked"),
        dict(side_rank=None, trainable_base=True),
        dict(dtype=torch.float32, compute_dtype=torch.float32, round_bf16=True),
    ],
)
def test_single_process_layer_is_bitwise_the_reference(options):
    """group=None: the EP pipeline computes exactly reference.forward / backward."""
    options = dict(options)
    dtype = options.pop("dtype", torch.float64)
    cd = options.pop("compute_dtype", torch.float64)
    round_bf16 = options.pop("round_bf16", False)
    trainable = options.pop("trainable_base", False)
    layer = make_layer(
        64,
        64,
        8,
        2,
        options.pop("side_rank", 16),
        num_tokens=21,
        dtype=dtype,
        requires_grad=True,
        routing=options.pop("routing", "balanced"),
        activation=options.pop("activation", "swiglu"),
        activation_clamp=options.pop("activation_clamp", None),
    )
    w13 = layer.w13.detach().requires_grad_(trainable)
    w2 = layer.w2.detach().requires_grad_(trainable)
    dout = torch.randn(21, 64, generator=torch.Generator().manual_seed(1), dtype=cd)
    out, ctx = reference.forward(
        layer.x,
        layer.topk_ids,
        layer.topk_weights,
        w13,
        w2,
        layer.side,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        compute_dtype=cd,
        round_bf16=round_bf16,
    )
    want = reference.backward(dout, ctx, base_grads=trainable)
    got_out = ep.reference_moe(
        layer.x,
        layer.topk_ids,
        layer.topk_weights,
        w13,
        w2,
        layer.side,
        group=None,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        compute_dtype=cd,
        round_bf16=round_bf16,
    )
    assert got_out.dtype == cd
    assert torch.equal(got_out, out)
    leaves = {"x": layer.x, "topk_weights": layer.topk_weights}
    if trainable:
        leaves.update(w13=w13, w2=w2)
    if layer.side is not None:
        leaves.update(zip(SIDE_NAMES, layer.side.tensors(), strict=True))
    grads = torch.autograd.grad((got_out * dout).sum(), list(leaves.values()))
    for (name, leaf), grad in zip(leaves.items(), grads, strict=True):
        assert grad.dtype == leaf.dtype, name
        assert torch.equal(grad, want[name].to(leaf.dtype)), name


def test_reference_moe_argument_checks():
    layer = make_layer(64, 64, 4, 2, 16, num_tokens=3, dtype=torch.float64)
    args = (layer.x, layer.topk_ids, layer.topk_weights, layer.w13, layer.w2, layer.side)
    with pytest.raises(ValueError, match=r"num_experts: expected E_l \* P = 4 \* 1 = 4"):
        ep.reference_moe(*args, group=None, num_experts=8)
    with pytest.raises(ValueError, match="w2_local: expected shape"):
        ep.reference_moe(*args[:4], layer.w2[:, :, :32], layer.side, group=None)
    with pytest.raises(
        ValueError, match="side: expected adapters for H=64, I=64, E_l=4, got H=64, I=64, E_l=2"
    ):
        side = SideLoRA(*(t[:2] if t.dim() == 3 else t for t in layer.side.tensors()))
        ep.reference_moe(*args[:5], side, group=None)
    with pytest.raises(TypeError, match="reduce_shared_grads: expected a bool"):
        ep.reference_moe(*args, group=None, reduce_shared_grads=1)
    with pytest.raises(ValueError, match="activation: expected one of"):
        ep.reference_moe(*args, group=None, activation="relu")
    bad = layer.topk_ids.clone()
    bad[0, 0] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[-1, 4\)"):
        ep.reference_moe(layer.x, bad, *args[2:], group=None)


def _raise_on_last_rank(rank: int, world: int) -> int:
    if rank == world - 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the other ranks wait for the failed one: must not hang the run
    return rank


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(3600)


def test_run_gloo_reports_a_failed_rank_without_waiting_for_the_deadline():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 raised.*ValueError: boom on purpose"):
        ep.run_gloo(_raise_on_last_rank, 2, timeout_s=300.0, failure_grace_s=1.0)
    assert time.monotonic() - start < 150.0  # killed after the grace, not at the deadline


def test_run_gloo_deadline_kills_workers():
    with pytest.raises(RuntimeError, match="deadline of 6 s passed, workers killed"):
        ep.run_gloo(_sleep_forever, 1, timeout_s=6.0)


@pytest.mark.parametrize(
    "value",
    [
        float_bits(2.0),  # 2^62: a placeholder of -2^62 once collided with its negation
        float_bits(-2.0),  # -2^62
        float_bits(-1e308),
        float_bits(float("nan")),
        2**63 - 1,
        -(2**63) + 1,
    ],
)
def test_the_agreement_holds_every_int64_value(value):
    """The agreement all-reduces values and their negations (MAX) with a placeholder for
    values a refusing rank does not hold: no value a rank can send may read as it. A side
    scale of 2.0 (float bits 2^62) was refused as a mismatch with itself."""
    ids = torch.tensor([[0, 1], [2, 3]])
    plan = ep.plan_dispatch(ids, 4, group=None, uniform={"side.scale (float64 bits)": value})
    assert plan.num_tokens == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"uniform": {"hidden": 2**64}}, "hidden: expected an int within int64's range"),
        ({"max_tokens": 2**64}, "max_tokens: expected fewer than 2"),
    ],
)
def test_the_agreement_refuses_ints_past_int64(kwargs, match):
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=match):
        ep.plan_dispatch(ids, 4, group=None, **kwargs)


def test_uniform_values_take_bools_and_name_other_types():
    """A bool agrees as 0 or 1 (int() did that before the range check); a value that is
    not an int is a TypeError naming it, not a range error."""
    ids = torch.tensor([[0, 1], [2, 3]])
    ep.plan_dispatch(ids, 4, group=None, uniform={"flag": True})
    with pytest.raises(TypeError, match=r"^flag: expected an int, got float"):
        ep.plan_dispatch(ids, 4, group=None, uniform={"flag": 1.5})
