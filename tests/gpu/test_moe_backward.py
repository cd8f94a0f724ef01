"""mm.moe forward + backward (fused, EP1, BF16) vs the float64 oracle: DESIGN §6 matrix
for every gradient, zero scale, bitwise repeatability, torch.compile, CUDA graphs and
a short training loop."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import (
    GRAD_MIN_COSINE,
    assert_close_to_oracle,
    block_m_transitions,
    make_layer,
    mxfp4_schedule_transitions,
)
from megamoe.testing.inputs import mxfp4_schedule
from megamoe.testing.launches import check_mxfp4_schedule, recording_weight_reads
from megamoe.testing.metrics import compare

pytestmark = pytest.mark.gpu

SIDE_NAMES = ("a1", "b1", "a3", "b3", "a2", "b2")


def _layers(hidden, inter, experts, top_k, rank, tokens, *, trainable_base=False, **kwargs):
    common = dict(num_tokens=tokens, device="cuda", requires_grad=True, **kwargs)
    fast = make_layer(
        hidden,
        inter,
        experts,
        top_k,
        rank,
        dtype=torch.bfloat16,
        trainable_base=trainable_base,
        **common,
    )
    exact = make_layer(
        hidden,
        inter,
        experts,
        top_k,
        rank,
        dtype=torch.float64,
        trainable_base=trainable_base,
        **common,
    )
    return fast, exact


def _dout(tokens, hidden, seed=7):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)


def _fused_grads(layer, dout, **kwargs):
    out = layer.call(mm.moe, **kwargs)
    leaves = layer.grad_leaves()
    grads = torch.autograd.grad(out, list(leaves.values()), dout, allow_unused=True)
    return out, dict(zip(leaves, grads, strict=True))


def run_case(hidden, inter, experts, top_k, rank, tokens, *, trainable_base=False, **kwargs):
    fast, exact = _layers(
        hidden, inter, experts, top_k, rank, tokens, trainable_base=trainable_base, **kwargs
    )
    dout = _dout(tokens, hidden)
    out, grads = _fused_grads(fast, dout)
    clamp = kwargs.get("activation_clamp")
    # With a clamp the gradient mask depends on the BF16-rounded g, u: compare with the
    # float64 oracle that rounds exactly there (tests/cpu/test_fused_backward.py).
    expected_out = exact.call(mm.reference.moe, round_bf16=clamp is not None)
    names = list(grads)
    expected = dict(
        zip(
            names,
            torch.autograd.grad(
                expected_out,
                list(exact.grad_leaves().values()),
                dout.double(),
                allow_unused=True,
            ),
            strict=True,
        )
    )
    assert_close_to_oracle("out", out, exact.call(mm.reference.moe).detach())
    for name in names:
        assert grads[name] is not None, name
        assert grads[name].dtype == fast.grad_leaves()[name].dtype, name
        assert_close_to_oracle(name, grads[name], expected[name], min_cosine=GRAD_MIN_COSINE)
    # Masked routes: exactly-zero router gradient. Empty experts: exactly-zero
    # expert-local gradients.
    masked = fast.topk_ids < 0
    assert torch.all(grads["topk_weights"][masked] == 0)
    counts = torch.bincount(fast.topk_ids[~masked].long(), minlength=experts)
    for name in ("b1", "b3", "a2", "w13", "w2"):
        if name in grads:
            assert torch.all(grads[name][counts == 0] == 0), name
    return fast, grads


TOKENS = [1, 15, 16, 17, 90, 91, 176, 177, 346, 347, 688, 689, 1029, 1030, 2048]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_token_counts(tokens, top_k):
    run_case(256, 128, 16, top_k, 16, tokens, seed=tokens, routing="masked")


@pytest.mark.parametrize("tokens", block_m_transitions(6, 8))
def test_block_m_transitions(tokens):
    run_case(256, 128, 8, 6, 16, tokens, seed=3)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("routing", ["balanced", "skewed", "masked", "empty"])
def test_activation_clamp_routing(activation, clamp, routing):
    run_case(
        512,
        256,
        8,
        2,
        32,
        700,
        seed=5,
        activation=activation,
        activation_clamp=clamp,
        routing=routing,
    )


@pytest.mark.parametrize("empty", [[0], [3], [7], [0, 7]])
def test_empty_experts(empty):
    run_case(256, 128, 8, 2, 16, 300, seed=11, routing="empty", empty_experts=empty)


@pytest.mark.parametrize("rank", [16, 64, 128, 256])
def test_ranks(rank):
    run_case(512, 256, 8, 2, rank, 500, seed=rank)


@pytest.mark.parametrize("hidden,inter", [(1536, 768), (2880, 2880), (4096, 2048)])
def test_model_dims(hidden, inter):
    run_case(hidden, inter, 8, 2, 64, 600, seed=2)


@pytest.mark.parametrize("rank", [None, 32])
@pytest.mark.parametrize("routing", ["balanced", "masked", "empty"])
def test_ordinary_mode(rank, routing):
    """Trainable base: the kernels read the caller's w13/w2 (nn.Linear layout, no copy)
    and their gradients land in that layout."""
    fast, _ = run_case(512, 256, 8, 2, rank, 400, seed=13, routing=routing, trainable_base=True)
    assert fast.base.w13 is fast.w13 and fast.base.w2 is fast.w2


def test_activation_checkpoint_is_bitwise_the_saved_path():
    fast, _ = _layers(512, 256, 8, 2, 32, 333, seed=17)
    dout = _dout(333, 512)
    out_a, grads_a = _fused_grads(fast, dout)
    out_b, grads_b = _fused_grads(fast, dout, activation_checkpoint=True)
    assert torch.equal(out_a, out_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_zero_scale_matches_no_adapter_path():
    fast, _ = _layers(512, 256, 8, 2, 32, 257, seed=19, scale=0.0)
    dout = _dout(257, 512)
    out, grads = _fused_grads(fast, dout)
    plain = mm.moe(fast.x, fast.topk_ids, fast.topk_weights, fast.base, None)
    dx, drouter = torch.autograd.grad(plain, [fast.x, fast.topk_weights], dout)
    assert torch.equal(out, plain)
    assert torch.equal(grads["x"], dx)
    assert torch.equal(grads["topk_weights"], drouter)
    for name in SIDE_NAMES:
        assert torch.count_nonzero(grads[name]) == 0, name


def test_repeated_forward_backward_is_bitwise():
    fast, _ = _layers(1024, 512, 16, 6, 64, 1500, seed=23, routing="skewed")
    dout = _dout(1500, 1024)
    first_out, first = _fused_grads(fast, dout)
    for _ in range(5):
        out, grads = _fused_grads(fast, dout)
        assert torch.equal(out, first_out)
        for name in first:
            assert torch.equal(grads[name], first[name]), name


def test_a_second_backward_through_the_same_graph_raises():
    """dgrad2 writes dg | du over the saved pre-activations (one pool buffer less at the
    peak), so retain_graph=True cannot give a second backward: autograd's saved-tensor
    version check stops it instead of reading them (fresh forwards repeat bitwise:
    test_repeated_forward_backward_is_bitwise)."""
    fast, _ = _layers(1024, 512, 16, 6, 64, 1500, seed=29)
    dout = _dout(1500, 1024)
    out = fast.call(mm.moe)
    leaves = list(fast.grad_leaves().values())
    torch.autograd.grad(out, leaves, dout, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, leaves, dout)


def test_torch_compile_fullgraph():
    fast, _ = _layers(256, 128, 8, 2, 16, 200, seed=31)
    dout = _dout(200, 256)
    side = fast.side

    def layer(x, ids, weights, a1, b1, a3, b3, a2, b2):
        adapters = mm.SideLoRA(a1, b1, a3, b3, a2, b2, scale=side.scale)
        return mm.moe(x, ids, weights, fast.base, adapters)

    compiled = torch.compile(layer, fullgraph=True)
    args = (fast.x, fast.topk_ids, fast.topk_weights, *side.tensors())
    eager_out = layer(*args)
    eager = torch.autograd.grad(eager_out, [fast.x, fast.topk_weights, *side.tensors()], dout)
    out = compiled(*args)
    grads = torch.autograd.grad(out, [fast.x, fast.topk_weights, *side.tensors()], dout)
    assert torch.equal(out, eager_out)
    for a, b in zip(grads, eager, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay():
    fast, _ = _layers(256, 128, 8, 2, 16, 300, seed=37)
    dout = _dout(300, 256)
    eager_out, eager = _fused_grads(fast, dout)

    # Fresh leaves: their autograd accumulators must be created on the capture's side
    # stream, not on the default stream the eager pass above used.
    static_x = fast.x.detach().clone().requires_grad_(True)
    static_w = fast.topk_weights.detach().clone().requires_grad_(True)
    side = mm.SideLoRA(
        *(t.detach().clone().requires_grad_(True) for t in fast.side.tensors()),
        scale=fast.side.scale,
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            out = mm.moe(static_x, fast.topk_ids, static_w, fast.base, side)
            torch.autograd.grad(out, [static_x, static_w, *side.tensors()], dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm.moe(static_x, fast.topk_ids, static_w, fast.base, side)
        grads = torch.autograd.grad(out, [static_x, static_w, *side.tensors()], dout)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    for name, grad in zip(["x", "topk_weights", *SIDE_NAMES], grads, strict=True):
        assert torch.equal(grad, eager[name]), name


def test_training_loop_matches_reference_backend():
    """SGD with momentum, 20 steps, adapters trained with the fused layer and with the
    float64 reference backend from the same start: the loss curves agree, and each
    adapter's total update (the sum of its gradients along the run) passes the gradient
    gates against the reference's. SGD, not Adam, because Adam's update does not see a
    gradient's scale; no weight decay, so a zero gradient cannot look like training."""
    hidden, inter, experts, top_k, rank, tokens = 256, 128, 8, 2, 16, 512
    start = make_layer(
        hidden, inter, experts, top_k, rank, num_tokens=tokens, device="cuda", seed=41
    )
    gen = torch.Generator(device="cuda").manual_seed(43)
    target = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)

    def train(backend, dtype):
        params = [
            torch.nn.Parameter(t.detach().to(torch.float32).clone()) for t in start.side.tensors()
        ]
        # lr 10 lowers the loss by about a fifth in 20 steps (the gradients are small).
        optimizer = torch.optim.SGD(params, lr=10.0, momentum=0.9)
        losses = []
        for _ in range(20):
            side = mm.SideLoRA(*(p.to(dtype) for p in params), scale=start.side.scale)
            out = backend(start.x.to(dtype), start.topk_ids, start.topk_weights, start.base, side)
            loss = torch.nn.functional.mse_loss(out.float(), target.float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        updates = [
            p.detach() - t.float() for p, t in zip(params, start.side.tensors(), strict=True)
        ]
        return losses, updates

    fused, fused_updates = train(mm.moe, torch.bfloat16)
    reference, reference_updates = train(mm.reference.moe, torch.float64)
    assert fused[-1] < 0.9 * fused[0]  # it trains
    for step, (a, b) in enumerate(zip(fused, reference, strict=True)):
        assert abs(a - b) <= 1e-3 * abs(b), (step, a, b)
    for name, got, want in zip(SIDE_NAMES, fused_updates, reference_updates, strict=True):
        assert_close_to_oracle(f"update of {name}", got, want, min_cosine=GRAD_MIN_COSINE)


# ----------------------------------------------------------------- MXFP4 base


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (177, 6), (1030, 2)])
@pytest.mark.parametrize("activation,clamp", [("swiglu", None), ("geglu", 1.5)])
def test_mxfp4_forward_backward(tokens, top_k, activation, clamp):
    """MXFP4 base vs the oracle on the dequantized weights, same gates as BF16."""
    run_case(
        256,
        128,
        16,
        top_k,
        16,
        tokens,
        seed=tokens,
        routing="masked",
        format="mxfp4",
        activation=activation,
        activation_clamp=clamp,
    )


@pytest.mark.parametrize("routing", ["skewed", "empty"])
def test_mxfp4_routing_and_model_dims(routing):
    run_case(1536, 768, 8, 2, 64, 600, seed=4, routing=routing, format="mxfp4")


def test_mxfp4_zero_scale_matches_no_adapter_path():
    fast, _ = _layers(512, 256, 8, 2, 32, 257, seed=19, scale=0.0, format="mxfp4")
    dout = _dout(257, 512)
    out, grads = _fused_grads(fast, dout)
    plain = mm.moe(fast.x, fast.topk_ids, fast.topk_weights, fast.base, None)
    dx, drouter = torch.autograd.grad(plain, [fast.x, fast.topk_weights], dout)
    assert torch.equal(out, plain)
    assert torch.equal(grads["x"], dx)
    assert torch.equal(grads["topk_weights"], drouter)


@pytest.mark.parametrize("tokens,rank", [(1, None), (347, 16), (2048, None)])
def test_mxfp4_ordinary_mode_vs_the_oracle(tokens, rank):
    """Ordinary mode on an MXFP4 base: the master takes the gradient at the MXFP4 values
    (straight through), gated against the oracle run the same way."""
    fast, grads = run_case(
        512, 256, 8, 2, rank, tokens, seed=tokens, trainable_base=True, format="mxfp4"
    )
    assert fast.base.trains_master
    assert grads["w13"].dtype == torch.bfloat16 and grads["w2"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "tokens,rank,master_dtype,checkpoint",
    [
        (600, 16, torch.bfloat16, False),  # 150 routes per expert: GEMMs on the codes
        (600, None, torch.float32, False),
        (600, 16, torch.float32, True),
        (3600, 16, torch.float32, False),  # 900: one decode per call, the BF16 path on it
    ],
)
def test_mxfp4_ordinary_mode_is_the_bf16_path_on_the_decoded_weights(
    tokens, rank, master_dtype, checkpoint, monkeypatch
):
    """Straight through means: bit for bit the BF16 ordinary-mode gradients of a base
    holding the decoded values, cast to the master's dtype, whether the GEMMs ran on the
    packed codes (few rows per expert: no whole-base decode) or on one decode per call."""
    import megamoe.weights as weights_module
    from megamoe.heuristics import mxfp4_master_decodes_once
    from megamoe.wrappers.routing import pool_capacity

    fast, _ = _layers(512, 256, 8, 2, rank, tokens, seed=33)
    masters = [w.detach().to(master_dtype).requires_grad_(True) for w in (fast.w13, fast.w2)]
    base = mm.prepare_base_weights(*masters, format="mxfp4")
    assert base.trains_master
    decodes = []
    decode = weights_module.decode_mxfp4_bf16
    monkeypatch.setattr(
        weights_module, "decode_mxfp4_bf16", lambda *a: decodes.append(1) or decode(*a)
    )
    side = fast.side
    dout = _dout(tokens, 512)
    leaves = [fast.x, fast.topk_weights, *masters, *([] if side is None else side.tensors())]
    out = mm.moe(
        fast.x, fast.topk_ids, fast.topk_weights, base, side, activation_checkpoint=checkpoint
    )
    grads = torch.autograd.grad(out, leaves, dout)
    block_m = mm.get_block_m(tokens, 2, 8)
    once = mxfp4_master_decodes_once(pool_capacity(tokens * 2, 8, block_m), 8)
    assert once == (tokens == 3600)
    assert len(decodes) == (2 if once else 0)

    w13 = base.w13_linear().detach().requires_grad_(True)
    w2 = base.w2_linear().detach().requires_grad_(True)
    twin_base = mm.prepare_base_weights(w13, w2)
    twin_leaves = [fast.x, fast.topk_weights, w13, w2, *leaves[4:]]
    twin_out = mm.moe(
        fast.x, fast.topk_ids, fast.topk_weights, twin_base, side, activation_checkpoint=checkpoint
    )
    twin = torch.autograd.grad(twin_out, twin_leaves, dout)
    assert torch.equal(out, twin_out)
    names = ("x", "topk_weights", "w13", "w2", *(SIDE_NAMES if side is not None else ()))
    for name, got, want in zip(names, grads, twin, strict=True):
        if name in ("w13", "w2"):
            assert got.dtype == master_dtype, name
            want = want.to(master_dtype)
        assert torch.equal(got, want), name


def test_mxfp4_layer_with_wide_scale_range_and_zero_blocks():
    """Block scales far from 127 (2^-30 .. 2^30 across H, 2^-20 .. 2^19 across each
    expert's I) with every block still visible in the output, whole zero blocks and a
    zero expert: still the oracle on the dequantized weights.

    The scaling is compensated, exactly (powers of two): the H blocks of ``w13`` by 2^k
    with the matching columns of ``x`` by 2^-k (and rows of ``a1``, ``a3`` by 2^k); the
    up rows of one expert's I block by 2^-m, with ``b3``'s columns, so ``h`` scales by
    2^-m, and ``w2``'s columns and ``a2``'s rows of that block by 2^m. The float64
    output is the unscaled layer's, so a decode wrong on any block's scale, small or
    large, moves it."""
    hidden, inter, experts = 256, 128, 8
    layer = make_layer(hidden, inter, experts, 2, 16, num_tokens=300, seed=8, device="cuda")
    # The powers of two are made on the CPU, where 2.0 ** k is exact.
    k = torch.linspace(-30, 30, hidden // 32, dtype=torch.float64).round()
    m = (torch.arange(experts * inter // 32) * 7 % 41 - 20).view(experts, -1).double()
    col = (2.0**k).repeat_interleave(32).cuda()  # [H]
    row = (2.0**m).repeat_interleave(32, dim=1).cuda()  # [E, I]
    w13, w2 = layer.w13.double().clone(), layer.w2.double().clone()
    w13[:, :5, :32] = 0  # zero blocks
    w2[0] = 0  # a whole zero expert
    a1, b1, a3, b3, a2, b2 = (t.double() for t in layer.side.tensors())
    unscaled = (w13, w2, layer.x.double(), (a1, b1, a3, b3, a2, b2))
    w13_wide = w13 * col
    w13_wide[:, inter:] /= row[:, :, None]
    side_wide = (a1 * col[:, None], b1, a3 * col[:, None], b3 / row[:, None, :])
    side_wide += (a2 * row[:, :, None], b2)
    wide = (w13_wide, w2 * row[:, None, :], layer.x.double() / col, side_wide)
    for t in (*wide[:3], *side_wide):
        assert torch.equal(t.to(torch.bfloat16).double(), t)  # exact in BF16

    def call(fn, tensors, dtype):
        w13, w2, x, side = tensors
        base = mm.prepare_base_weights(w13.float(), w2.float(), "mxfp4")
        side = mm.SideLoRA(*(t.to(dtype) for t in side), scale=0.5)
        with torch.no_grad():
            out = fn(x.to(dtype), layer.topk_ids, layer.topk_weights, base, side)
        return out, base

    expected, base = call(mm.reference.moe, wide, torch.float64)
    for scales, span in ((base.w13_scales, (100, 150)), (base.w2_scales, (110, 135))):
        used = scales[scales > 0].int()  # a zero block's scale is 0
        assert int(used.min()) < span[0] and int(used.max()) > span[1]
    unscaled_out, _ = call(mm.reference.moe, unscaled, torch.float64)
    assert compare(expected, unscaled_out).rel_l2 < 1e-12  # the compensation is exact
    out, _ = call(mm.moe, wide, torch.bfloat16)
    assert_close_to_oracle("out", out, expected)


# The MXFP4 layer's schedule transitions +-1 at E = 8, K = 2 (the weight-streaming
# chunks, the in-pipeline and streaming limits), below the production sweep's 75 GiB.
SCHEDULE_EXPERTS, SCHEDULE_TOP_K = 8, 2
SCHEDULE_TOKENS = sorted(
    {1, 17, *mxfp4_schedule_transitions(SCHEDULE_TOP_K, SCHEDULE_EXPERTS, 8000)}
)


@pytest.mark.parametrize("tokens", SCHEDULE_TOKENS)
def test_mxfp4_schedule_transitions(tokens):
    """The side-LoRA layer on an MXFP4 base at each schedule transition +-1, routing
    masked / empty / skewed / balanced in turn (empty and balanced with GeGLU and a
    clamp): the kernels the schedule names (each streaming kind once per F+B in its chunk,
    or the engine on the codes, or the transient decode), a repeated F+B bit for bit, and
    the oracle's gates."""
    index = SCHEDULE_TOKENS.index(tokens)
    routing = ("masked", "empty", "skewed", "balanced")[index % 4]
    activation, clamp = (("swiglu", None), ("geglu", 1.5))[index % 2]
    kwargs = dict(routing=routing, format="mxfp4", activation=activation, activation_clamp=clamp)
    hidden, inter, rank = 512, 256, 16  # whole tiles of every streaming kind's chunks
    layer_dims = (hidden, inter, SCHEDULE_EXPERTS, SCHEDULE_TOP_K, rank, tokens)
    # The launches and the repeat first, so that a point failing the gates (an xfail) is
    # still checked for them.
    fast = make_layer(
        *layer_dims[:5], num_tokens=tokens, seed=tokens, device="cuda", dtype=torch.bfloat16,
        requires_grad=True, **kwargs,
    )  # fmt: skip
    dout = _dout(tokens, hidden)
    with recording_weight_reads() as launches:
        first = _fused_grads(fast, dout)
    check_mxfp4_schedule(launches, tokens, SCHEDULE_TOP_K, SCHEDULE_EXPERTS)
    again = _fused_grads(fast, dout)
    for (name, got), want in zip([("out", first[0]), *first[1].items()],
                                 [again[0], *again[1].values()], strict=True):  # fmt: skip
        assert torch.equal(got, want), name
    run_case(*layer_dims, seed=tokens, **kwargs)


def _in_pipeline(tokens: int) -> bool:
    return mxfp4_schedule(tokens, SCHEDULE_TOP_K, SCHEDULE_EXPERTS)[2]


ORDINARY_SWITCH_TOKENS = [
    t for t in SCHEDULE_TOKENS if not _in_pipeline(t - 1) == _in_pipeline(t) == _in_pipeline(t + 1)
]


@pytest.mark.parametrize("tokens", ORDINARY_SWITCH_TOKENS)
def test_mxfp4_ordinary_mode_at_its_switch(monkeypatch, tokens):
    """Ordinary mode on an MXFP4 master at the in-pipeline limit +-1 (448 pool rows per
    expert): the GEMMs on the packed codes below it, one whole-base decode per call above
    it, each against the oracle."""
    import megamoe.weights as weights_module
    from megamoe.heuristics import mxfp4_master_decodes_once
    from megamoe.wrappers.routing import pool_capacity

    decodes = []
    decode = weights_module.decode_mxfp4_bf16
    monkeypatch.setattr(
        weights_module, "decode_mxfp4_bf16", lambda *a: decodes.append(1) or decode(*a)
    )
    experts, top_k = SCHEDULE_EXPERTS, SCHEDULE_TOP_K
    with recording_weight_reads() as launches:
        fast, _ = run_case(
            512, 256, experts, top_k, None, tokens, seed=tokens, trainable_base=True,
            format="mxfp4",
        )  # fmt: skip
    rows = pool_capacity(tokens * top_k, experts, mm.get_block_m(tokens, top_k, experts))
    once = mxfp4_master_decodes_once(rows, experts)
    assert once == (rows > 448 * experts)
    assert len(decodes) == (2 if once else 0)
    # No GEMM made a transient decode of its own: every whole-tensor decode launched is
    # one of the whole base's.
    assert sum(name == "mxfp4_decode" for name, _ in launches) == len(decodes)
    assert fast.base.trains_master


@pytest.mark.parametrize("rank", [None, 32])
@pytest.mark.parametrize("tokens", [300, 2048])  # BLOCK_M 64 and 128 pools
def test_engine_backward_at_both_block_m(tokens, rank):
    """Every backward GEMM (the fused dgrad2, the K-grouped weight gradients, dgrad1 with
    the b1/b3 shrink columns) on BLOCK_M 64 and 128 pools, side-LoRA and ordinary mode,
    skewed routing. Same gates."""
    block_m = mm.get_block_m(tokens, 2, 8)
    assert block_m == (64 if tokens == 300 else 128)
    kwargs = dict(trainable_base=True) if rank is None else dict(routing="skewed")
    run_case(512, 256, 8, 2, rank, tokens, seed=47 + tokens, **kwargs)


@pytest.mark.parametrize("rank", [None, 16])
def test_more_routes_than_local_experts(rank):
    # A trainer's own expert parallelism (HF's, transformers.py) hands one rank's layer
    # its 4 experts of 8 with K = 6 routes per token, the other ranks' routes masked
    # (-1): K > E_l, which planning and the kernels take like any masked routing.
    experts, local, tokens = 8, 4, 300
    dout = _dout(tokens, 256)
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        full = make_layer(
            256, 128, experts, 6, rank, num_tokens=tokens, device="cuda", dtype=dtype, seed=11
        )
        ids = torch.where(full.topk_ids < local, full.topk_ids, -1)
        assert ids.shape[1] > local and (ids < 0).any() and (ids >= 0).any()

        def leaf(t):
            return t.detach()[:local].clone().requires_grad_()

        side = None
        if full.side is not None:
            a1, b1, a3, b3, a2, b2 = (t.detach() for t in full.side.tensors())
            side = mm.SideLoRA(
                a1.clone().requires_grad_(),
                leaf(b1),
                a3.clone().requires_grad_(),
                leaf(b3),
                leaf(a2),
                b2.clone().requires_grad_(),
                scale=full.side.scale,
            )
        wide = torch.float32 if dtype == torch.float64 else dtype
        base = mm.prepare_base_weights(full.w13[:local].to(wide), full.w2[:local].to(wide))
        x = full.x.detach().clone().requires_grad_()
        weights = full.topk_weights.detach().clone().requires_grad_()
        fn = mm.moe if dtype == torch.bfloat16 else mm.reference.moe
        out = fn(x, ids, weights, base, side)
        leaves = [x, weights, *(side.tensors() if side is not None else ())]
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
        results.append((out, grads))
    (out, grads), (expected_out, expected) = results
    assert_close_to_oracle("out", out, expected_out.detach())
    names = ["x", "topk_weights", *(SIDE_NAMES if rank is not None else ())]
    for name, got, want in zip(names, grads, expected, strict=True):
        assert_close_to_oracle(name, got, want, min_cosine=GRAD_MIN_COSINE)
    assert torch.all(grads[1][ids < 0] == 0)
