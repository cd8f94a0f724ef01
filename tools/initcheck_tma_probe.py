"""Does compute-sanitizer's initcheck see the TMA stores of torch's Hopper BF16 GEMMs?

Runs a few torch-only phases under ``compute-sanitizer --tool initcheck`` and counts
the "Uninitialized __global__ memory read" records per phase. Every phase writes a
tensor and then reads all of it with ``.clone()``, so a correct tool reports nothing.
Phases: ``fill`` (an elementwise fill, the control), ``bf16-mm`` (cuBLAS), ``fp32-mm``,
``bf16-grouped-mm`` (``torch._grouped_mm``, CUTLASS), and megamoe's fused forward and
forward + backward without adapters (our kernels only: since the GEMM engine runs the
dgrads and weight gradients too, no torch GEMM is left in that backward).

    python tools/initcheck_tma_probe.py            # starts compute-sanitizer itself

GPU only. Seen on an H200 (CUDA 13.0, torch 2.11, 2026-11-29), records per phase in
two runs: fill 0/0, bf16-mm 6144/0, fp32-mm 0/0, bf16-grouped-mm 6400/256, megamoe
forward 0/0. The clones read values that are right, so initcheck misses some GEMM
kernels' output stores: torch's CUTLASS grouped GEMM every time, cuBLAS's BF16 GEMM
when its heuristic picks such a kernel (likely the TMA bulk stores of Hopper kernels;
the FP32 kernel and the engine v1 kernels stored from registers). The engine v2 kernels
store their tiles with TMA from shared memory: the forward and forward + backward
phases tell whether initcheck sees those stores (not measured yet).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PHASE_MARK = "@@phase "


def phases() -> None:
    import torch

    import megamoe as mm
    from megamoe.testing.inputs import make_layer

    device = "cuda"
    a = torch.randn(256, 512, device=device).bfloat16()
    b = torch.randn(512, 384, device=device).bfloat16()
    offsets = torch.tensor([128, 256], device=device, dtype=torch.int32)
    grouped_b = torch.randn(2, 512, 384, device=device).bfloat16()
    layer = make_layer(256, 256, 8, 2, None, num_tokens=100, device=device)

    def fill() -> None:
        torch.empty(256, 384, device=device, dtype=torch.bfloat16).fill_(1.0).clone()

    def moe_forward() -> None:
        with torch.no_grad():
            layer.call(mm.moe).clone()

    def moe_forward_backward() -> None:
        x = layer.x.detach().clone().requires_grad_(True)
        weights = layer.topk_weights.detach().clone().requires_grad_(True)
        out = mm.moe(x, layer.topk_ids, weights, layer.base)
        dx, dweights = torch.autograd.grad(out, [x, weights], torch.ones_like(out))
        dx.clone()
        dweights.clone()

    cases = {
        "fill": fill,
        "bf16-mm": lambda: (a @ b).clone(),
        "fp32-mm": lambda: (a.float() @ b.float()).clone(),
        "bf16-grouped-mm": lambda: torch._grouped_mm(a, grouped_b, offs=offsets).clone(),
        "megamoe-forward-no-side": moe_forward,
        "megamoe-fwd+bwd-no-side": moe_forward_backward,
    }
    for name, run in cases.items():
        torch.cuda.synchronize()
        print(PHASE_MARK + name, flush=True)
        run()
        torch.cuda.synchronize()
    print(PHASE_MARK + "end", flush=True)


def count(log: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    phase = None
    for line in log.splitlines():
        if line.startswith(PHASE_MARK):
            phase = line[len(PHASE_MARK) :].strip()
            if phase != "end":
                counts[phase] = 0
        elif phase and phase != "end" and re.search(r"Uninitialized __global__ memory read", line):
            counts[phase] += 1
    return counts


def main() -> int:
    if os.environ.get("MEGAMOE_INITCHECK_PROBE_CHILD"):
        phases()
        return 0
    from megamoe.testing.sanitizer import find_compute_sanitizer

    sanitizer = find_compute_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found", file=sys.stderr)
        return 2
    env = dict(os.environ, MEGAMOE_INITCHECK_PROBE_CHILD="1", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    command = [
        sanitizer,
        "--tool",
        "initcheck",
        "--print-limit",
        "1000000",
        "--show-backtrace",
        "no",
        sys.executable,
        __file__,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    counts = count(result.stdout)
    if "megamoe-forward-no-side" not in counts:
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        return 1
    print(f"{'phase':<26} uninitialized-read records")
    for name, records in counts.items():
        print(f"{name:<26} {records}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
