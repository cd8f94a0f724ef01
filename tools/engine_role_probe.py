"""Where each role of the engine spends its cycles, per GEMM kind: a probe build's
counters (kernels/engine/role_probe.cuh), summed over the CTAs of one launch.

    pip install --no-build-isolation -C cmake.define.MEGAMOE_ENGINE_PROBE=ON .
    python tools/engine_role_probe.py

A quarter of the ep4rank pool (16,384 tokens, top-6 over 16 experts, balanced), H =
4096, I = 2048, r = 128. The cases: dgrad2 plain, dgrad2 + activation backward (without
and with the a2 side segment), GEMM1's product with the store epilogue and with the gated
activation. Each runs twice, and the second launch is reported. Every figure is the mean
over the CTAs of SM cycles (`clock64`), and as a share of consumer warpgroup 0's total,
which spans the CTA's tiles:
- the producer's wait for free stages;
- each consumer warpgroup's waits for landed stages (`full`; the BF16 path) and for the
  epilogue warps (`drained`), and its staging of the accumulators;
- the epilogue warps' wait for staged tiles and their time finishing them.

Waits on `full` overlap the MMAs still in flight. A consumer's wait on `drained` is time
in which its tensor cores idle. The reading of the sixteenth session's run is in
docs/ENGINE.md. GPU only, and only on a probe build (a release build has no counters).
"""

from __future__ import annotations

import statistics

import torch

import megamoe as mm
from megamoe.env import num_sms
from megamoe.testing.inputs import make_routing
from megamoe.wrappers._native import native
from megamoe.wrappers.activation_backward import fused_dgrad2_activation_backward
from megamoe.wrappers.grouped_gemm import gated_grouped_gemm, grouped_gemm

TOKENS, EXPERTS, TOP_K, HIDDEN, INTER, RANK = 16384, 16, 6, 4096, 2048, 128
SLOTS = 16  # ProbeSlot::kProbeSlots (kernels/engine/engine_params.h)
# (name, slot) of the ProbeSlot layout.
ROWS = [
    ("producer total", 0),
    ("producer waits for free stages", 1),
    ("consumer 0 total", 2),
    ("consumer 0 waits for landed stages", 3),
    ("consumer 0 waits for the epilogue", 4),
    ("consumer 0 stages its tile", 5),
    ("consumer 1 waits for landed stages", 7),
    ("consumer 1 waits for the epilogue", 8),
    ("epilogue total", 10),
    ("epilogue waits for a staged tile", 11),
    ("epilogue finishes tiles", 12),
]


def main() -> int:
    module = native()
    if not hasattr(module, "engine_probe_read"):
        raise SystemExit(
            "megamoe._C has no probe counters: build with "
            "-C cmake.define.MEGAMOE_ENGINE_PROBE=ON (see this script's docstring)"
        )
    sms = num_sms()  # the CTAs the wrappers launch (MEGAMOE_NUM_SMS, headroom)
    ids, weights = make_routing(TOKENS, EXPERTS, TOP_K, kind="balanced", seed=0)
    plan = mm.plan_routes(ids.cuda(), EXPERTS, 128)
    rows = plan.pool_capacity
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    preact = randn(rows, 2 * INTER, scale=2.0)
    dout_pool = randn(rows, HIDDEN + RANK)
    x = randn(rows, HIDDEN)
    w2 = randn(EXPERTS, HIDDEN, INTER, scale=1 / 64)
    w13 = randn(EXPERTS, 2 * INTER, HIDDEN, scale=1 / 64)
    side_a2 = randn(EXPERTS, INTER, RANK, scale=1 / 16)  # a2 as given [E, I, r]
    weights = weights.cuda()
    cases = {
        "dgrad2": lambda: grouped_gemm(dout_pool, w2, plan, b_major="mn"),
        "dgrad2 + act backward": lambda: fused_dgrad2_activation_backward(
            dout_pool, w2, preact, weights, plan
        ),
        "dgrad2 + act backward + a2": lambda: fused_dgrad2_activation_backward(
            dout_pool, w2, preact, weights, plan, side_a2=side_a2
        ),
        "GEMM1 product, store": lambda: grouped_gemm(x, w13, plan),
        "GEMM1 + act": lambda: gated_grouped_gemm(x, w13, plan, k=HIDDEN),
    }
    for name, run in cases.items():
        for _ in range(2):
            run()
            counters = module.engine_probe_read(sms)
        per_slot = [counters[slot::SLOTS] for slot in range(SLOTS)]
        total = statistics.mean(per_slot[2])
        print(f"{name}: {total / 1e6:.3f} M cycles per CTA (consumer 0's total)")
        for label, slot in ROWS:
            mean = statistics.mean(per_slot[slot])
            print(f"  {label:36s} {mean / 1e3:9.1f} k  {100 * mean / total:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
