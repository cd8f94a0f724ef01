"""Host-side layouts of the grouped GEMM engine's operands (python/megamoe/grouped_gemm.py)."""

import torch

from megamoe.grouped_gemm import block_diagonal_side_weights


def test_block_diagonal_side_weights_follow_the_gate_up_interleave():
    """[q1 | q3] @ side^T must give q1 b1 on w13's gate rows and q3 b3 on its up rows,
    in the kernel's interleave (64 gate rows, then the matching 64 up rows)."""
    gen = torch.Generator().manual_seed(0)
    experts, intermediate, rank, interleave, rows = 3, 256, 16, 64, 5
    b_gate = torch.randn(experts, intermediate, rank, generator=gen, dtype=torch.float64)
    b_up = torch.randn(experts, intermediate, rank, generator=gen, dtype=torch.float64)
    q1 = torch.randn(rows, rank, generator=gen, dtype=torch.float64)
    q3 = torch.randn(rows, rank, generator=gen, dtype=torch.float64)
    side = block_diagonal_side_weights(b_gate, b_up, interleave)
    assert side.shape == (experts, 2 * intermediate, 2 * rank)
    blocks = intermediate // interleave
    for e in range(experts):
        got = (torch.cat([q1, q3], dim=1) @ side[e].T).view(rows, blocks, 2, interleave)
        gate = (q1 @ b_gate[e].T).view(rows, blocks, interleave)
        up = (q3 @ b_up[e].T).view(rows, blocks, interleave)
        # float64 sums of the same products (plus exact zeros): equal up to summation order.
        torch.testing.assert_close(got[:, :, 0], gate, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[:, :, 1], up, rtol=1e-12, atol=1e-12)
    # The off-diagonal halves are exact zeros (they add exact zeros to the sums).
    view = side.view(experts, blocks, 2, interleave, 2 * rank)
    assert not view[:, :, 0, :, rank:].any() and not view[:, :, 1, :, :rank].any()
