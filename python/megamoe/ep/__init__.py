"""Expert parallelism (DESIGN §4): experts sharded over a torch.distributed group.

Backend-agnostic pieces (gloo on CPU today, NCCL on GPU):

- :func:`plan_dispatch` -> :class:`DispatchPlan`: the routing split per destination
  rank, one all-gather of every rank's token count, checks and route counts (the
  BLOCK_M agreement, the split sizes), the rank-uniform receive bound and the
  receiver's pool plan;
- :func:`dispatch` / :func:`combine` / :func:`sum_over_k`: the row exchanges of the
  forward (``[x | q13]`` out, ``[y | p]`` back) and backward (``[dout | dout b2^T | w]``
  out, ``[dx | dg b1^T | du b3^T | dw]`` back) and the fixed-order sum over ``k``;
- :func:`reduce_shared_grads`: the all-reduce (SUM) of the ``a1, a3, b2`` grads;
- :func:`reference_moe`: the EP layer on the reference math (float64/float32),
  differentiable, equal to EP1 on the same global batch;
- :func:`fused_moe`: the EP layer on the fused pipeline (what ``mm.moe(group=pg)``
  runs, through the custom ops ``megamoe::moe_ep_forward`` / ``moe_ep_backward``:
  :mod:`megamoe.ep.ops`; NCCL on GPUs, the stages' torch twins with gloo on CPU);
- :func:`run_gloo`: run a function on ``P`` local gloo processes.

See docs/EXPERT-PARALLEL.md for the data flow and the ordering guarantees.
"""

from .exchange import (
    AllToAllRows,
    all_to_all_rows,
    combine,
    dispatch,
    reduce_shared_grads,
    sum_over_k,
)
from .launch import run_gloo
from .ops import moe as fused_moe
from .plan import (
    DispatchPlan,
    ExpertPartition,
    agree_block_m,
    group_rank,
    group_size,
    plan_dispatch,
    recv_capacity,
    split_routes,
)
from .reference_layer import ExpertState, ReferenceExperts, reference_moe

__all__ = [
    "AllToAllRows",
    "DispatchPlan",
    "ExpertPartition",
    "ExpertState",
    "ReferenceExperts",
    "agree_block_m",
    "all_to_all_rows",
    "combine",
    "dispatch",
    "fused_moe",
    "group_rank",
    "group_size",
    "plan_dispatch",
    "recv_capacity",
    "reduce_shared_grads",
    "reference_moe",
    "run_gloo",
    "split_routes",
    "sum_over_k",
]
