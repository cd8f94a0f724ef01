"""FLOP counts of one MoE layer call: the useful math of DESIGN §1, no padding.

``N`` routes (unmasked, local), ``T`` tokens, one multiply-add = 2 FLOPs. The counts
are what "effective TFLOP/s" divides by, for every backend alike.
"""

from __future__ import annotations


def forward_flops(
    num_tokens: int, num_routes: int, hidden: int, intermediate: int, side_rank: int
) -> int:
    """GEMM1 (gate+up), GEMM2, and with adapters the shared shrink, the expert-local
    expand (extra K of GEMM1), the a2 shrink (extra N of GEMM2) and the b2 expand."""
    t, n, h, i, r = num_tokens, num_routes, hidden, intermediate, side_rank
    base = 2 * n * h * (2 * i) + 2 * n * i * h
    side = 2 * t * h * (2 * r) + 2 * n * r * (2 * i) + 2 * n * i * r + 2 * t * r * h
    return base + (side if r else 0)


def backward_flops(
    num_tokens: int,
    num_routes: int,
    hidden: int,
    intermediate: int,
    side_rank: int,
    base_grads: bool,
) -> int:
    """dgrad2 and dgrad1 and the router gradient's dots ``<z, h>`` always; with adapters
    their side terms plus every adapter grad; with ``base_grads`` (ordinary mode) dw13
    and dw2. The same count as ``megamoe.custom_ops.flop_formulas`` for unmasked routes."""
    t, n, h, i, r = num_tokens, num_routes, hidden, intermediate, side_rank
    dgrad = 2 * n * h * i + 2 * n * (2 * i) * h + 2 * n * i
    side = 0
    if r:
        side += 2 * t * h * r + 2 * n * r * i  # z side term: (dout b2^T) a2^T
        side += 2 * n * (2 * i) * r + 2 * t * (2 * r) * h  # dx side: (dg b1^T) a1^T, du likewise
        side += 2 * t * h * (2 * r)  # da1, da3
        side += 2 * n * r * (2 * i)  # db1, db3
        side += 2 * n * i * r  # da2
        side += 2 * t * r * h  # db2
    wgrad = (2 * n * (2 * i) * h + 2 * n * h * i) if base_grads else 0
    return dgrad + side + wgrad
