"""Expert parallelism on 2 and 4 gloo processes vs EP1 on the same global batch.

One spawn per EP size runs every scenario (spawning costs seconds: torch is imported
in each worker), so each EP size is one test that checks all scenarios and reports
every failure at once. The global batch is the ranks' token slices in rank order;
rank ``p`` holds experts ``[p E_l, (p+1) E_l)``. The EP1 oracle is
``megamoe.reference.forward`` / ``backward`` on the global batch (float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe import ep, get_block_m, reference
from megamoe.side_lora import SideLoRA
from megamoe.testing import compare, make_layer, make_routing

H, INTER, R = 64, 64, 16
E = 8
SIDE = ("a1", "b1", "a3", "b3", "a2", "b2")
SHARED = ("a1", "a3", "b2")
LOCAL = ("b1", "b3", "a2", "w13", "w2")
F64_GATE = 1e-10

# name -> layer options and the tokens per rank for each EP size.
SCENARIOS: dict[str, dict] = {
    "balanced": dict(top_k=2, tokens={2: [6, 11], 4: [4, 1, 7, 5]}),
    "masked_geglu_clamp": dict(
        top_k=3,
        routing="masked",
        masked_fraction=0.4,
        activation="geglu",
        clamp=0.75,
        tokens={2: [9, 1], 4: [3, 6, 2, 5]},
    ),
    "skewed": dict(top_k=2, routing="skewed", skew=2.5, tokens={2: [12, 7], 4: [8, 3, 9, 6]}),
    "empty_experts": dict(top_k=2, routing="empty", tokens={2: [7, 8], 4: [5, 4, 6, 3]}),
    # Every route goes to rank 0's experts: the other ranks receive zero rows.
    "all_to_rank0": dict(top_k=2, to_rank0=True, tokens={2: [5, 6], 4: [3, 4, 1, 5]}),
    # A rank with no tokens sends zero rows (and still receives).
    "empty_rank": dict(top_k=2, tokens={2: [0, 9], 4: [5, 0, 3, 1]}),
    "one_token": dict(top_k=2, tokens={2: [1, 1], 4: [1, 1, 1, 1]}),
    # No adapters, trainable base (ordinary mode): expert-local w13/w2 grads.
    "ordinary_no_side": dict(
        top_k=2, side_rank=None, trainable_base=True, tokens={2: [5, 8], 4: [2, 5, 4, 3]}
    ),
    # The kernels' BF16 rounding points in float32: close, not 1e-10.
    "bf16_points_f32": dict(
        top_k=2, compute=torch.float32, round_bf16=True, tokens={2: [10, 6], 4: [4, 6, 2, 5]}
    ),
}

# Token counts of the BLOCK_M agreement case: rank-local heuristics would disagree.
PLAN_TOKENS = {2: [10, 1100], 4: [10, 1100, 1, 0]}
PLAN_TOP_K = 2


def global_layer(name: str, world: int):
    """The scenario's global batch (float64, seeded: identical in every process)."""
    spec = SCENARIOS[name]
    tokens = spec["tokens"][world]
    kwargs = {}
    routing = spec.get("routing", "balanced")
    if routing == "masked":
        kwargs["masked_fraction"] = spec["masked_fraction"]
    if routing == "skewed":
        kwargs["skew"] = spec["skew"]
    if spec.get("to_rank0"):
        kwargs["empty_experts"] = list(range(E // world, E))
    seed = sorted(SCENARIOS).index(name) + 10 * world
    layer = make_layer(
        H,
        INTER,
        E,
        spec["top_k"],
        spec.get("side_rank", R),
        num_tokens=sum(tokens),
        seed=seed,
        dtype=torch.float64,
        scale=0.5,
        routing=routing,
        activation=spec.get("activation", "swiglu"),
        activation_clamp=spec.get("clamp"),
        **kwargs,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(sum(tokens), H, generator=gen, dtype=torch.float64)
    return layer, dout, tokens


def ep1_oracle(name: str, world: int) -> tuple[torch.Tensor, dict]:
    """EP1 output and gradients of the global batch (closed form, float64 or float32)."""
    spec = SCENARIOS[name]
    layer, dout, _ = global_layer(name, world)
    out, ctx = reference.forward(
        layer.x,
        layer.topk_ids,
        layer.topk_weights,
        layer.w13,
        layer.w2,
        layer.side,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        compute_dtype=spec.get("compute", torch.float64),
        round_bf16=spec.get("round_bf16", False),
    )
    grads = reference.backward(dout, ctx, base_grads=spec.get("trainable_base", False))
    return out, grads


def run_rank(name: str, rank: int, world: int, group) -> dict:
    """This rank's slice through ``ep.reference_moe``; output and gradients."""
    spec = SCENARIOS[name]
    layer, dout, tokens = global_layer(name, world)
    begin = sum(tokens[:rank])
    rows = slice(begin, begin + tokens[rank])
    e_l = E // world
    experts = slice(rank * e_l, (rank + 1) * e_l)

    def leaf(t, grad=True):
        return t.detach().clone().requires_grad_(grad)

    named = {
        "x": leaf(layer.x[rows]),
        "topk_weights": leaf(layer.topk_weights[rows]),
        "w13": leaf(layer.w13[experts], spec.get("trainable_base", False)),
        "w2": leaf(layer.w2[experts], spec.get("trainable_base", False)),
    }
    side = None
    if layer.side is not None:
        s = layer.side
        named.update(
            a1=leaf(s.a1),
            b1=leaf(s.b1[experts]),
            a3=leaf(s.a3),
            b3=leaf(s.b3[experts]),
            a2=leaf(s.a2[experts]),
            b2=leaf(s.b2),
        )
        side = SideLoRA(*(named[n] for n in SIDE), scale=s.scale)
    out = ep.reference_moe(
        named["x"],
        layer.topk_ids[rows].contiguous(),
        named["topk_weights"],
        named["w13"],
        named["w2"],
        side,
        group=group,
        activation=layer.activation,
        activation_clamp=layer.activation_clamp,
        compute_dtype=spec.get("compute", torch.float64),
        round_bf16=spec.get("round_bf16", False),
    )
    (out * dout[rows].to(out.dtype)).sum().backward()
    grads = {k: v.grad for k, v in named.items() if v.requires_grad}
    return {"out": out.detach(), "grads": grads}


def plan_checks(rank: int, world: int, group) -> dict:
    """BLOCK_M agreement, index maps, round trips, autograd through the exchange."""
    tokens = PLAN_TOKENS[world]
    ids, _ = make_routing(sum(tokens), E, PLAN_TOP_K, kind="masked", seed=7, masked_fraction=0.1)
    begin = sum(tokens[:rank])
    my_ids = ids[begin : begin + tokens[rank]].contiguous()
    plan = ep.plan_dispatch(my_ids, E, group=group)
    t, k = plan.num_tokens, plan.top_k
    # Per-route identity payload (rank, t, k): float64, and bf16 per token (exact ints).
    tt = torch.arange(t, dtype=torch.float64)[:, None].expand(t, k)
    kk = torch.arange(k, dtype=torch.float64)[None, :].expand(t, k)
    payload = torch.stack([torch.full_like(tt, rank), tt, kk], dim=2)
    recv = ep.dispatch(payload, plan, per_route=True)
    back = ep.combine(recv, plan)
    tok16 = torch.arange(t)
    payload16 = torch.stack([torch.full_like(tok16, rank), tok16 % 256, tok16 // 256], dim=1).to(
        torch.bfloat16
    )
    recv16 = ep.dispatch(payload16, plan)
    back16 = ep.combine(recv16, plan)
    # Autograd through dispatch -> combine: the gradient of the identity map.
    src = payload.clone().requires_grad_()
    weight = torch.randn(t, k, 3, generator=torch.Generator().manual_seed(rank), dtype=src.dtype)
    (ep.combine(ep.dispatch(src, plan, per_route=True), plan) * weight).sum().backward()
    block_m, max_tokens = ep.agree_block_m(t, k, E, group=group)
    # The returned rows in send order, indexed by send_position, are the combine.
    returned = ep.all_to_all_rows(recv, plan.recv_splits, plan.send_splits, group)
    pos = plan.send_position
    valid = pos >= 0
    send_position_ok = torch.equal(back[valid], returned[pos[valid].long()]) and bool(
        (back[~valid] == 0).all()
    )
    return {
        "block_m": plan.block_m,
        "agreed": (block_m, max_tokens),
        "local_block_m": get_block_m(t, k, E, world),
        "max_tokens": plan.max_tokens,
        "recv_capacity": plan.recv_capacity,
        "pool_capacity": plan.pool_capacity,
        "send_splits": plan.send_splits,
        "recv_splits": plan.recv_splits,
        "recv_expert": plan.recv_expert,
        "pool_counts": plan.pool.expert_counts,
        "pool_offsets": plan.pool.expert_pool_offsets,
        "pool_row_to_route": plan.pool.pool_row_to_route,
        "recv": recv,
        "back": back,
        "recv16": recv16,
        "back16": back16,
        "grad": src.grad,
        "send_position_ok": send_position_ok,
        "weight": weight,
    }


def error_checks(rank: int, world: int, group) -> dict:
    """Bad input on one rank raises ValueError on every rank (nobody hangs)."""
    messages = {}
    ids = torch.tensor([[0, 1], [2, 3]])
    bad = ids.clone()
    if rank == world - 1:
        bad[1, 1] = E  # out of range on the last rank only
    try:
        ep.plan_dispatch(bad, E, group=group)
    except ValueError as exc:
        messages["bad_ids"] = str(exc)
    try:
        ep.plan_dispatch(ids, E, group=group, uniform={"hidden": 64 + (rank == 0)})
    except ValueError as exc:
        messages["mismatch"] = str(exc)
    # A value only this rank's own checks refuse (E not a multiple of P here): every
    # rank still raises, after the all-reduce, instead of the last one alone.
    try:
        ep.plan_dispatch(ids, E + (rank == world - 1), group=group)
    except ValueError as exc:
        messages["local_value"] = str(exc)
    return messages


def worker(rank: int, world: int, names: list[str]) -> dict:
    group = dist.group.WORLD
    results = {"plan": plan_checks(rank, world, group), "errors": error_checks(rank, world, group)}
    for name in names:
        first = run_rank(name, rank, world, group)
        second = run_rank(name, rank, world, group)
        same = torch.equal(first["out"], second["out"]) and all(
            torch.equal(first["grads"][key], second["grads"][key]) for key in first["grads"]
        )
        results[name] = {**first, "repeat_bitwise": same}
    return results


def naive_receive(ids: torch.Tensor, tokens: list[int], world: int, receiver: int):
    """(source, t, k, expert) of every route ``receiver`` gets, in the promised order."""
    e_l = E // world
    rows = []
    for src in range(world):
        begin = sum(tokens[:src])
        for t in range(tokens[src]):
            for k in range(ids.shape[1]):
                e = int(ids[begin + t, k])
                if e >= 0 and e // e_l == receiver:
                    rows.append((src, t, k, e))
    return rows


def check_plan(world: int, results: list[dict], failures: list[str]) -> None:
    tokens = PLAN_TOKENS[world]
    ids, _ = make_routing(sum(tokens), E, PLAN_TOP_K, kind="masked", seed=7, masked_fraction=0.1)
    expected_block_m = get_block_m(max(tokens), PLAN_TOP_K, E, world)
    plans = [r["plan"] for r in results]
    local = {p["local_block_m"] for p in plans}
    if len(local) < 2:
        failures.append(f"plan: the token counts {tokens} do not make local BLOCK_M differ")
    for rank, p in enumerate(plans):

        def fail(msg, rank=rank):
            failures.append(f"plan rank {rank}: {msg}")

        if (p["block_m"], p["max_tokens"]) != (expected_block_m, max(tokens)):
            fail(
                f"block_m/max_tokens {p['block_m']}/{p['max_tokens']}, expected "
                f"{expected_block_m}/{max(tokens)}"
            )
        if p["agreed"] != (expected_block_m, max(tokens)):
            fail(f"agree_block_m gave {p['agreed']}")
        if p["recv_capacity"] != world * max(tokens) * PLAN_TOP_K:
            fail(f"recv_capacity {p['recv_capacity']}")
        if p["pool_capacity"] != plans[0]["pool_capacity"]:
            fail(f"pool capacity {p['pool_capacity']} differs from rank 0's")
        want = naive_receive(ids, tokens, world, rank)
        got = [tuple(int(v) for v in row) for row in p["recv"].tolist()]
        if got != [w[:3] for w in want]:
            fail("received rows are not (source, t*K+k)-ordered identity rows")
        if p["recv_expert"].tolist() != [w[3] for w in want]:
            fail("recv_expert does not match the routes' experts")
        per_source = [sum(1 for w in want if w[0] == s) for s in range(world)]
        if list(p["recv_splits"]) != per_source:
            fail(f"recv_splits {p['recv_splits']}, expected {per_source}")
        for s in range(world):
            if results[s]["plan"]["send_splits"][rank] != per_source[s]:
                fail(f"send_splits of rank {s} disagree with recv_splits")
        want16 = [(src, t % 256, t // 256) for src, t, _, _ in want]
        if [tuple(int(v) for v in row) for row in p["recv16"].float().tolist()] != want16:
            fail("bf16 per-token dispatch rows wrong")
        # Round trip: each unmasked route gets its own row back, masked ones zeros.
        mine = ids[sum(tokens[:rank]) : sum(tokens[: rank + 1])]
        t, k = mine.shape
        expect = (
            torch.stack(
                [
                    torch.full((t, k), float(rank), dtype=torch.float64),
                    torch.arange(t, dtype=torch.float64)[:, None].expand(t, k),
                    torch.arange(k, dtype=torch.float64)[None, :].expand(t, k),
                ],
                dim=2,
            )
            * (mine >= 0)[..., None]
        )
        if not torch.equal(p["back"], expect):
            fail("combine(dispatch(identity)) is not the identity on unmasked routes")
        expect16 = (
            torch.stack(
                [torch.full((t,), rank), torch.arange(t) % 256, torch.arange(t) // 256], dim=1
            )[:, None, :]
            * (mine >= 0)[..., None]
        )
        if not torch.equal(p["back16"], expect16.to(torch.bfloat16)):
            fail("bf16 round trip wrong")
        if not p["send_position_ok"]:
            fail("send_position does not index the returned rows")
        if not torch.equal(p["grad"], p["weight"] * (mine >= 0)[..., None]):
            fail("autograd through dispatch/combine is not the masked identity")
        # Pool: segments hold their expert's receive indices ascending, padded to BLOCK_M.
        counts, offsets = p["pool_counts"].tolist(), p["pool_offsets"].tolist()
        e_l = E // world
        for e in range(e_l):
            seg = p["pool_row_to_route"][offsets[e] : offsets[e + 1]].tolist()
            real = [i for i, w in enumerate(want) if w[3] == rank * e_l + e]
            if seg[: counts[e]] != real or any(v != -1 for v in seg[counts[e] :]):
                fail(f"pool segment of local expert {e} wrong")
            if offsets[e] % expected_block_m:
                fail(f"pool segment {e} does not start at a BLOCK_M multiple")
        if offsets[-1] > p["pool_capacity"]:
            fail("pool rows in use exceed the capacity")


def check_errors(world: int, results: list[dict], failures: list[str]) -> None:
    for rank, r in enumerate(results):
        msgs = r["errors"]
        if f"rank {world - 1} has ids outside" not in msgs.get("bad_ids", ""):
            failures.append(f"errors rank {rank}: bad ids not reported: {msgs.get('bad_ids')}")
        if "hidden: expected the same value on every rank" not in msgs.get("mismatch", ""):
            failures.append(f"errors rank {rank}: mismatch not reported: {msgs.get('mismatch')}")
        if "num_experts: expected the same value on every rank" not in msgs.get("local_value", ""):
            failures.append(
                f"errors rank {rank}: one rank's bad num_experts not reported: "
                f"{msgs.get('local_value')}"
            )


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return compare(actual, expected).rel_l2


def check_scenario(name: str, world: int, results: list[dict], failures: list[str]) -> None:
    spec = SCENARIOS[name]
    out1, grads1 = ep1_oracle(name, world)
    ranks = [r[name] for r in results]
    bf16 = spec.get("round_bf16", False)

    def close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        if actual.shape != expected.shape:
            failures.append(f"{name} {what}: shape {list(actual.shape)} vs {list(expected.shape)}")
            return
        # Gradients come back in the input's dtype (float32 router weights): compare
        # with the oracle rounded the same way.
        expected = expected.to(actual.dtype)
        if not expected.any():
            if actual.any():
                failures.append(f"{name} {what}: expected exact zeros")
            return
        m = compare(actual, expected)
        ok = m.rel_l2 <= 1e-2 and m.cosine >= 0.99999 if bf16 else m.rel_l2 < F64_GATE
        if not ok:
            failures.append(f"{name} {what}: {m}")

    close("out", torch.cat([r["out"] for r in ranks]), out1)
    keys = ["x", "topk_weights"]
    keys += [k for k in LOCAL if k in ranks[0]["grads"]]
    for key in keys:
        close(f"grad {key}", torch.cat([r["grads"][key] for r in ranks]), grads1[key])
    if "a1" in ranks[0]["grads"]:
        for key in SHARED:
            for rank, r in enumerate(ranks):
                close(f"grad {key} (rank {rank})", r["grads"][key], grads1[key])
                if not torch.equal(r["grads"][key], ranks[0]["grads"][key]):
                    failures.append(f"{name} grad {key}: rank {rank} differs from rank 0")
        # Experts without routes: exactly zero expert-local grads.
        e_l = E // world
        layer, _, _ = global_layer(name, world)
        used = set(layer.topk_ids[layer.topk_ids >= 0].tolist())
        for e in range(E):
            if e not in used:
                r = ranks[e // e_l]["grads"]
                if any(r[key][e % e_l].any() for key in ("b1", "b3", "a2")):
                    failures.append(f"{name}: empty expert {e} has nonzero grads")
    for rank, r in enumerate(ranks):
        if not r["repeat_bitwise"]:
            failures.append(f"{name} rank {rank}: two runs are not bitwise equal")


@pytest.mark.parametrize("world", [2, 4])
def test_ep_vs_ep1_on_gloo(world: int) -> None:
    names = sorted(SCENARIOS)
    results = ep.run_gloo(worker, world, names, timeout_s=240.0)
    failures: list[str] = []
    check_plan(world, results, failures)
    check_errors(world, results, failures)
    for name in names:
        check_scenario(name, world, results, failures)
    assert not failures, "\n".join(failures)
