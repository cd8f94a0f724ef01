"""Host-side layouts of the engine's operands (python/megamoe/wrappers/grouped_gemm.py)."""

import torch

from megamoe.wrappers.grouped_gemm import block_diagonal_side_weights


def test_block_diagonal_side_weights_are_b1_then_b3_on_w13s_rows():
    """(dg | du) @ side must give dg b1^T on the gate columns' rows and du b3^T on the up
    rows': side is [[b1^T, 0], [0, b3^T]] in w13's row order (gate rows, then up)."""
    gen = torch.Generator().manual_seed(0)
    experts, intermediate, rank, rows = 3, 256, 16, 5
    b_gate = torch.randn(experts, intermediate, rank, generator=gen, dtype=torch.float64)
    b_up = torch.randn(experts, intermediate, rank, generator=gen, dtype=torch.float64)
    dg = torch.randn(rows, intermediate, generator=gen, dtype=torch.float64)
    du = torch.randn(rows, intermediate, generator=gen, dtype=torch.float64)
    side = block_diagonal_side_weights(b_gate, b_up)
    assert side.shape == (experts, 2 * intermediate, 2 * rank)
    for e in range(experts):
        got = torch.cat([dg, du], dim=1) @ side[e]
        # float64 sums of the same products (plus exact zeros): equal up to summation order.
        torch.testing.assert_close(got[:, :rank], dg @ b_gate[e], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[:, rank:], du @ b_up[e], rtol=1e-12, atol=1e-12)
    # The off-diagonal blocks are exact zeros (they add exact zeros to the sums).
    assert not side[:, :intermediate, rank:].any() and not side[:, intermediate:, :rank].any()
