"""``python -m megamoe.bench.hf``: megamoe inside HF transformers vs HF's own paths.

The client is transformers' own ``Qwen3MoeSparseMoeBlock`` (router + experts) with
random weights, built from a config at the benchmark dims, once per implementation:

- **trainable base**: the block with ``experts_implementation="grouped_mm"`` (HF's
  fastest built-in) vs ``"megamoe_fused"``, every parameter trainable;
- **adapters**: ``grouped_mm`` + PEFT LoRA on the experts' 3-D parameters
  (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``, rank ``r``,
  base frozen) vs ``"megamoe_fused"`` with megamoe's side-LoRA of the same rank
  (:func:`megamoe.integrations.transformers.attach_side_lora`, base frozen).

Each case times forward + backward of the block (the router included) with CUDA events:
3 warm-up runs, then the median of ``--iters`` (default 10) runs, gradients dropped
between runs outside the timed window; peak memory is ``torch.cuda.max_memory_allocated``
over the warm-up and timed runs (parameters, inputs and everything the F+B allocates).
Shapes (DESIGN §7): Qwen3-30B-A3B dims (H=2048, I=768, E=128, K=8) at T=4096 and 32768
(trainable) and T=16384 (adapters, r=64); one EP4 rank of DSV4-Flash (E=64, H=4096, I=2048, K=6) at
T=16384, trainable and adapters (r=128). ``--json FILE`` writes every number.

``--cases tiny --impl megamoe_reference`` runs a tiny case on the CPU (a smoke test of
this script: megamoe's float32 reference stands in for the fused kernels).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from .timing import Progress, sample_count, time_fn, warmup_count

GIB = 1 << 30


@dataclass(frozen=True)
class Case:
    """One comparison: dims, tokens, mode (``"trainable"`` or ``"adapters"``), rank."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    mode: str
    rank: int = 0


CASES = {
    c.name: c
    for c in (
        Case("qwen3-30b-t4096-trainable", 2048, 768, 128, 8, 4096, "trainable"),
        Case("qwen3-30b-t32768-trainable", 2048, 768, 128, 8, 32768, "trainable"),
        Case("qwen3-30b-t16384-adapters-r64", 2048, 768, 128, 8, 16384, "adapters", 64),
        Case("dsv4-ep4rank-t16384-trainable", 4096, 2048, 64, 6, 16384, "trainable"),
        Case("dsv4-ep4rank-t16384-adapters-r128", 4096, 2048, 64, 6, 16384, "adapters", 128),
        Case("tiny", 64, 64, 8, 2, 64, "trainable"),
        Case("tiny-adapters", 64, 64, 8, 2, 64, "adapters", 16),
    )
}
DEFAULT_CASES = [n for n in CASES if not n.startswith("tiny")]


def build_block(case: Case, implementation: str, device: torch.device, dtype: torch.dtype):
    """transformers' ``Qwen3MoeSparseMoeBlock`` at the case's dims, random weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=case.hidden,
        moe_intermediate_size=case.intermediate,
        num_experts=case.experts,
        num_experts_per_tok=case.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _adapt(block, case: Case, implementation: str):
    """Frozen base + adapters: PEFT LoRA for HF's paths, megamoe side-LoRA for ours."""
    if implementation.startswith("megamoe"):
        from ..integrations import transformers as mhf

        mhf.attach_side_lora(block, case.rank, alpha=2.0 * case.rank)
        mhf.mark_only_side_lora_as_trainable(block)
        return block
    import peft

    config = peft.LoraConfig(
        r=case.rank,
        lora_alpha=2 * case.rank,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    block.requires_grad_(False)
    return peft.inject_adapter_in_model(config, block)


def run_case(
    case: Case, implementation: str, *, device: torch.device, warmup: int, iters: int
) -> dict[str, object]:
    """Time one implementation on one case; returns the numbers (ms, GiB)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if implementation.startswith("megamoe"):
        import megamoe.integrations.transformers  # noqa: F401  (registers the names)
    block = build_block(case, implementation, device, dtype)
    if case.mode == "adapters":
        block = _adapt(block, case, implementation)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, case.tokens, case.hidden, generator=gen, device=device, dtype=dtype)
    x.requires_grad_(True)
    dout = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)

    def step() -> None:
        block(x).backward(dout)

    def drop_grads() -> None:
        x.grad = None
        block.zero_grad(set_to_none=True)

    if device.type == "cuda":
        # The previous case's block may still be held by a reference cycle: collected
        # here, its memory does not count in this case's peak.
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_fn(step, device=device, warmup=warmup, iters=iters, setup=drop_grads)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    trainable = sum(p.numel() for p in block.parameters() if p.requires_grad)
    return {
        "implementation": implementation,
        "median_ms": timing.median_ms,
        "min_ms": timing.min_ms,
        "samples_ms": list(timing.samples_ms),
        "peak_gib": peak,
        "trainable_params": trainable,
    }


def _baseline_name(case: Case) -> str:
    return "grouped_mm" if case.mode == "trainable" else "grouped_mm+peft"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench.hf",
        description="megamoe inside HF transformers vs HF grouped_mm (and + PEFT LoRA)",
    )
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated case names (default: every real-dims case); all: {list(CASES)}",
    )
    parser.add_argument(
        "--impl",
        default="megamoe_fused",
        choices=("megamoe_fused", "megamoe_reference"),
        help="megamoe's experts implementation (default megamoe_fused; megamoe_reference "
        "for a CPU smoke test)",
    )
    parser.add_argument("--warmup", type=warmup_count, default=3, help="warm-up runs (default 3)")
    parser.add_argument("--iters", type=sample_count, default=10, help="timed runs (default 10)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    # Once each (a repeated name ran twice and wrote two rows).
    names = list(dict.fromkeys(n.strip() for n in args.cases.split(",") if n.strip()))
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and args.impl == "megamoe_fused":
        parser.error(
            "no GPU: the fused kernels need a Hopper GPU (on the CPU: --cases tiny --impl "
            "megamoe_reference: the real-size cases take many minutes there)"
        )
    progress = Progress()
    rows = []
    for name in names:
        case = CASES[name]
        row: dict[str, object] = {"case": asdict(case)}
        for label, impl in ((_baseline_name(case), "grouped_mm"), ("megamoe", args.impl)):
            progress.update(f"{name}: {label}")
            row[label] = run_case(case, impl, device=device, warmup=args.warmup, iters=args.iters)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base, ours = row[_baseline_name(case)], row["megamoe"]
        row["speedup"] = base["median_ms"] / ours["median_ms"]
        if base["peak_gib"] is not None:
            row["peak_ratio"] = ours["peak_gib"] / base["peak_gib"]
        rows.append(row)
    progress.done()
    print(
        f"{'case':36s} {'HF path':>18s} {'megamoe':>12s} {'speed':>7s} {'peak GiB (ours/HF)':>20s}"
    )
    for row in rows:
        case = row["case"]["name"]
        base, ours = row[_baseline_name(CASES[case])], row["megamoe"]
        peak = (
            f"{ours['peak_gib']:.2f}/{base['peak_gib']:.2f}"
            if base["peak_gib"] is not None
            else "-"
        )
        print(
            f"{case:36s} {base['median_ms']:15.2f} ms {ours['median_ms']:9.2f} ms "
            f"{row['speedup']:6.2f}x {peak:>20s}"
        )
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "warmup": args.warmup,
            "iters": args.iters,
        }
        try:
            import peft
            import transformers

            meta.update(transformers=transformers.__version__, peft=peft.__version__)
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
