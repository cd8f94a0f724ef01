"""The layer's sums over the tokens, checked where they are made (needs a CUDA GPU).

The side-LoRA backward computes the shared factors' gradients ``a1 | a3`` and ``b2``
as ``torch.mm(..., out_dtype=torch.float32)`` with K = T (``x^T [sg | su]`` and
``p_sum^T dout``, in ``megamoe.pipeline.fused_backward``). At T = 2561 (E = 8, K = 2)
those three gradients were 1.4-2.2e-2 off the oracle while every other output was
within the gates (docs/PERFORMANCE.md, fifty-fourth session). This tool wraps the
pipeline's ``mm_fp32`` for one F+B and reports, for each call:

- the product against float64 on the very operands the call got (a wrong sum);
- the operands against copies taken when they were made: ``x`` (the input), ``p_sum``
  (the forward's side sum) and the shrinks (the backward's side sum), each cloned
  right after it was made (an operand overwritten in between).

    python tools/token_sums_check.py --tokens 2561 [--tokens 2564] [--seed 2561]

Exit status 1 if any product is off by more than 1e-5 relative or any operand changed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import megamoe as mm
import megamoe.pipeline.fused_backward as fused_backward
from megamoe.testing import make_layer
from megamoe.wrappers import pool


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def check(tokens: int, seed: int, hidden: int, inter: int, experts: int, top_k: int) -> bool:
    """One side-LoRA F+B (MXFP4 base, balanced routing); True if every sum and operand
    checked out. Prints one line per check."""
    layer = make_layer(
        hidden, inter, experts, top_k, 16, num_tokens=tokens, seed=seed, device="cuda",
        format="mxfp4", requires_grad=True,
    )  # fmt: skip
    made: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (what, tensor, its copy)
    side_sum = pool.side_sum_unchecked

    def recording_side_sum(*args, **kwargs):  # the forward's p_sum, the backward's shrinks
        out = side_sum(*args, **kwargs)
        made.append(("side sum", out, out.clone()))
        return out

    products: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    mm_fp32 = fused_backward.mm_fp32

    def recording_mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = mm_fp32(a, b)
        products.append((a, b, out))
        return out

    x_copy = layer.x.detach().clone()
    pool.side_sum_unchecked = recording_side_sum  # both pipelines call it through the module
    fused_backward.mm_fp32 = recording_mm_fp32
    try:
        out = layer.call(mm.moe)
        leaves = layer.grad_leaves()
        gen = torch.Generator(device="cuda").manual_seed(7)
        dout = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
        torch.autograd.grad(out, list(leaves.values()), dout)
        torch.cuda.synchronize()
    finally:
        pool.side_sum_unchecked = side_sum
        fused_backward.mm_fp32 = mm_fp32
    ok = True
    for i, (a, b, product) in enumerate(products):
        error = _relative(product, a.double() @ b.double())
        ok = ok and error <= 1e-5
        print(f"T={tokens} sum {i}: [{a.shape[0]}x{a.shape[1]}] x [{b.shape[0]}x{b.shape[1]}]"
              f" FP32 result vs float64 on its operands: {error:.2e}")  # fmt: skip
    for what, tensor, copy in [("x", layer.x.detach(), x_copy), *made]:
        same = torch.equal(tensor, copy)
        ok = ok and same
        print(f"T={tokens} {what} {list(tensor.shape)}: {'unchanged' if same else 'CHANGED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/token_sums_check.py", description=__doc__)
    parser.add_argument("--tokens", type=int, action="append", help="token counts (repeat)")
    parser.add_argument("--seed", type=int, default=None, help="make_layer's seed (default T)")
    parser.add_argument("--dims", type=int, nargs=4, default=(512, 256, 8, 2),
                        metavar=("H", "I", "E", "K"), help="default 512 256 8 2")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ok = True
    for tokens in args.tokens or [2561, 2564]:
        seed = tokens if args.seed is None else args.seed
        ok = check(tokens, seed, *args.dims) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
