"""Expert-parallel dispatch plan: who sends which route where, and the receiver's pool.

Rank ``p`` of a group of ``P`` ranks owns the global experts
``[p * E_l, (p + 1) * E_l)`` with ``E_l = E / P``. A route ``(t, k)`` with expert id
``e >= 0`` goes to rank ``e // E_l``; a masked route (``-1``) goes nowhere.

Ordering (the determinism contract, see docs/EXPERT-PARALLEL.md):

- **send order**: the rows a rank sends are its routes sorted by destination rank,
  stable in the flat route index ``t * K + k`` (so ascending ``t * K + k`` inside each
  destination's chunk);
- **receive order**: ``all_to_all_single`` concatenates the chunks by source rank, so a
  rank receives rows ordered by ``(source rank, source t * K + k)``;
- **pool order**: the receiver plans its pool over the received rows (one route per
  row, :func:`~megamoe.wrappers.routing.plan_routes` with ``K = 1``): rows sorted by local expert,
  stable in the receive index, each expert's segment padded to ``BLOCK_M``.

When the global batch is the ranks' token slices concatenated in rank order, the
receive order is ascending global ``t * K + k``: every expert sees its rows in the
order an EP1 run over the global batch would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from ..heuristics import BlockMConfig, block_m_threshold, get_block_m
from ..validation.arguments import check_int, check_tensor
from ..validation.layer import check_block_m
from ..wrappers.routing import RoutePlan, plan_routes

__all__ = [
    "DispatchPlan",
    "ExpertPartition",
    "agree_block_m",
    "group_rank",
    "group_size",
    "plan_dispatch",
    "recv_capacity",
    "refuse_on_every_rank",
    "split_routes",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` means no expert parallelism (1, no torch.distributed)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ExpertPartition:
    """Contiguous expert ownership: rank ``p`` owns ``[p * E_l, (p + 1) * E_l)``."""

    num_experts: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        check_int("num_experts", self.num_experts, minimum=1)
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank", self.rank, minimum=0)
        if self.num_experts % self.world_size != 0:
            raise ValueError(
                f"num_experts: expected a multiple of the EP size {self.world_size}, "
                f"got {self.num_experts}"
            )
        if self.rank >= self.world_size:
            raise ValueError(f"rank: expected < world_size={self.world_size}, got {self.rank}")

    @property
    def num_local_experts(self) -> int:
        """``E_l = E / P``."""
        return self.num_experts // self.world_size

    @property
    def expert_begin(self) -> int:
        """Global id of this rank's local expert 0."""
        return self.rank * self.num_local_experts

    def owner(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Owning rank of each id (int64, same shape), ``-1`` for masked ids (``< 0``)."""
        ids = expert_ids.to(torch.int64)
        return torch.where(ids >= 0, ids // self.num_local_experts, torch.full_like(ids, -1))


def _routes_by_destination(
    topk_ids: torch.Tensor, partition: ExpertPartition
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(flat, order, counts)`` on the device, no host read: ``flat`` ``[T * K]`` the
    ids as int64; ``order`` ``[T * K]`` the flat route indices sorted by destination
    rank (stable), then the masked routes (``-1``), then ids outside ``[-1, E)``;
    ``counts`` ``[P + 2]`` int64: routes per destination rank, then the masked routes and
    the ids outside (the id check's flag, read with the agreement). The first
    ``sum(counts[:P])`` entries of ``order`` are :func:`split_routes`'s ``send_routes``."""
    world = partition.world_size
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Ids outside [0, E) other than -1 (possible only with check_ids=False) are sent
    # nowhere, as EP1's route plan masks them; counted apart, they are the id check.
    valid = (flat >= 0) & (flat < partition.num_experts)
    dest = torch.where(valid, flat // partition.num_local_experts, (flat != -1) + world)
    sorted_dest, order = torch.sort(dest, stable=True)
    # Each class's first position in the sorted order (torch.bincount on a GPU reads the
    # ids' extremes to the host to size its output: two host syncs).
    starts = torch.searchsorted(sorted_dest, torch.arange(world + 3, device=dest.device))
    return flat, order, starts.diff()


def _ids_outside_error(flat: torch.Tensor, num_experts: int) -> ValueError:
    """The id check's error in one process, naming the ids' range (a host read)."""
    low, high = torch.aminmax(flat)
    return ValueError(
        f"topk_ids: expected expert ids in [-1, {num_experts}), got values in "
        f"[{int(low)}, {int(high)}]"
    )


def split_routes(
    topk_ids: torch.Tensor, partition: ExpertPartition
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which routes go to which rank, in send order (pure; no communication).

    Args:
        topk_ids: ``[T, K]`` int32/int64 global expert ids in ``[-1, E)``.
        partition: the expert partition of the group.

    Returns:
        ``(send_routes, send_counts)``: ``send_routes`` ``[N_send]`` int64 flat route
        indices ``t * K + k`` sorted by destination rank, ascending inside each
        destination (masked routes are left out, so ``N_send`` = unmasked routes);
        ``send_counts`` ``[P]`` int64 routes per destination rank. Both on the
        device of ``topk_ids``. Reads ``N_send`` back to the host.
    """
    _, order, counts = _routes_by_destination(topk_ids, partition)
    counts = counts[: partition.world_size]
    return order[: int(counts.sum())], counts


def recv_capacity(max_tokens: int, top_k: int, world_size: int) -> int:
    """Rank-uniform bound on the routes any rank can receive: ``P * T_max * K``.

    Each of the ``P`` sources sends at most all of its ``T_s * K <= T_max * K``
    routes to one rank, whatever the routing (duplicate ids in a token included), so
    the bound needs no knowledge of the counts. It is what
    :func:`~megamoe.workspace.workspace_layout` sizes with ``ep_size=P``.
    """
    return world_size * max_tokens * top_k


def _all_gather_rows(
    head: list[int | torch.Tensor],
    tail: torch.Tensor | None,
    tail_length: int,
    group: dist.ProcessGroup,
    device: torch.device | None = None,
) -> list[list[int]]:
    """Every rank's int64 row ``[*head, *tail]`` (rank order), by one all-gather and one
    host read. An entry of ``head`` may be a 0-d integer tensor still on the device (a
    flag computed there), ``tail`` a ``[tail_length]`` integer tensor there (``None``:
    zeros): both are written into the row there and read only with the result."""
    on_device = {i: v for i, v in enumerate(head) if isinstance(v, torch.Tensor)}
    row = _collective_tensor(
        [0 if i in on_device else v for i, v in enumerate(head)] + [0] * tail_length,
        group,
        device,
    )
    for index, value in on_device.items():
        row[index].copy_(value)
    if tail is not None:
        row[len(head) :].copy_(tail)
    world = group_size(group)
    gathered = row.new_empty(world * row.numel())
    # all_gather_single is all_gather_into_tensor's name from torch 2.13 on.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, row, group=group)
    flat = gathered.tolist()
    width = row.numel()
    return [flat[source * width : (source + 1) * width] for source in range(world)]


def _collective_device(group: dist.ProcessGroup, device: torch.device | None) -> torch.device:
    """Where a collective of ``group`` takes its tensors: NCCL reduces CUDA tensors only
    (``device`` if it is one, else the current CUDA device); other backends the CPU."""
    if dist.get_backend(group) != dist.Backend.NCCL:
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _collective_tensor(
    values: list[int], group: dist.ProcessGroup, device: torch.device | None
) -> torch.Tensor:
    """``values`` as int64 on :func:`_collective_device`. To a GPU through pinned memory,
    without a blocking copy: a pageable copy would wait for every kernel queued on the
    stream, one more host round trip per collective."""
    target = _collective_device(group, device)
    if target.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    staged = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return staged.to(target, non_blocking=True)


#: What a rank that holds no valid value for a slot sends: int64's minimum, which no
#: valid value takes (they lie in (-2^63, 2^63)), so the ranks skip it alike when they
#: take the MAX and MIN of a slot. (-2^62 would not do: float_bits(2.0) is 2^62.)
_NO_VALUE = -(2**63)
_INT64_MAX = 2**63 - 1


def _agreement_values(
    top_k: object,
    num_experts: object,
    uniform: Mapping[str, object] | None,
    max_tokens: object,
    block_m: object,
    check_ids: object,
    min_blocks: object,
) -> tuple[list[str], list[int | None]]:
    """The names and values every rank must hold alike, in the agreement's order (None:
    this rank has no valid value there, it refused its inputs). The length depends only
    on the number of ``uniform`` values (no static bound or BLOCK_M override is -1), so
    ranks that differ in any of them still join the same all-gather. ``check_ids`` is
    among them: a rank that skipped the check beside a bad id elsewhere would fail alone
    in the ids' exchange. So is ``config``'s ``min_blocks_per_expert`` (``min_blocks``):
    with different thresholds the ranks would agree on no BLOCK_M."""
    extra = dict(uniform or {})
    names = ["top_k", "num_experts", *extra, "max_tokens (-1: none)", "block_m (-1: agreed)"]
    names += ["check_ids", "config.min_blocks_per_expert"]
    values = [top_k, num_experts, *(int(v) if type(v) is bool else v for v in extra.values())]
    values += [-1 if max_tokens is None else max_tokens, -1 if block_m is None else block_m]
    values += [int(check_ids) if type(check_ids) is bool else None, min_blocks]
    return names, [v if type(v) is int and abs(v) <= _INT64_MAX else None for v in values]


@dataclass(frozen=True)
class _Agreement:
    """What :func:`_agree` gives every rank alike: the most tokens on a rank, a refusing
    rank + 1 (or 0), the last rank with ids outside ``[-1, E)`` + 1 (or 0), the MAX and
    MIN over the ranks that hold them of each agreed value (None where no rank does),
    and ``counts[source][destination]``, every rank's routes per destination rank
    (zeros from a rank that sent none: a refusal, or a call that plans no routes)."""

    most_tokens: int
    refused: int
    bad_rank: int
    highs: list[int | None]
    lows: list[int | None]
    counts: list[list[int]]


def _agree(
    num_tokens: int,
    refused: int,
    values: list[int | None],
    group: dist.ProcessGroup | None,
    device: torch.device | None,
    route_counts: torch.Tensor | None = None,
) -> _Agreement:
    """The one collective of :func:`plan_dispatch`: every rank's ``[T, refusal flag,
    values..., route counts...]`` by one all-gather and one host read, reduced here alike
    on every rank (:class:`_Agreement`). ``route_counts`` (``[P + 2]``: routes per
    destination rank, masked routes, ids outside; None: zeros) is a tensor on the ids'
    device, read only with the gathered rows. A value None (this rank holds none)
    travels as int64's minimum."""
    world = group_size(group)
    mine = [num_tokens, refused, *(_NO_VALUE if v is None else v for v in values)]
    tail = world + 2
    if group is None:  # one process: its own row, the counts read here
        counts = [0] * tail if route_counts is None else route_counts.tolist()
        rows = [[int(v) for v in mine] + counts]
    else:
        rows = _all_gather_rows(mine, route_counts, tail, group, device)
    n = len(values)
    highs: list[int | None] = []
    lows: list[int | None] = []
    for column in range(2, 2 + n):
        held = [row[column] for row in rows if row[column] != _NO_VALUE]
        highs.append(max(held) if held else None)
        lows.append(min(held) if held else None)
    return _Agreement(
        most_tokens=max(row[0] for row in rows),
        refused=max(row[1] for row in rows),
        bad_rank=max((source + 1 if row[-1] else 0) for source, row in enumerate(rows)),
        highs=highs,
        lows=lows,
        counts=[row[2 + n : 2 + n + world] for row in rows],
    )


def _raise_on_mismatch(
    names: list[str],
    values: list[int | None],
    highs: list[int | None],
    lows: list[int | None],
) -> None:
    """A ``ValueError`` naming the first agreed value the ranks hold differently (this
    rank's values, and the group's MAX and MIN of them from :func:`_agree`)."""
    for name, mine, high, low in zip(names, values, highs, lows, strict=True):
        if high is None or mine is None:  # no rank holds it, or this one refused
            continue
        if high != low:
            raise ValueError(
                f"{name}: expected the same value on every rank of the EP group, got "
                f"values in [{low}, {high}] (this rank: {mine})"
            )


def check_max_tokens(max_tokens: object) -> int:
    """A static ``T_max``: an int in ``[0, 2^31)`` (the pool's rows are int32 indices)."""
    check_int("max_tokens", max_tokens, minimum=0)
    if max_tokens >= 2**31:
        raise ValueError(f"max_tokens: expected fewer than 2^31 tokens, got {max_tokens}")
    return max_tokens


def refuse_on_every_rank(
    error: Exception, group: dist.ProcessGroup | None, num_uniform: int, x: object = None
) -> NoReturn:
    """Raise ``error`` (this rank's refusal of its own inputs) after joining the group's
    dispatch agreement with the refusal flagged, so that the peers, which wait in
    :func:`plan_dispatch`'s all-gather, raise too instead of waiting for this rank.

    ``num_uniform`` is the number of ``uniform`` values the peers pass to
    :func:`plan_dispatch` (the row's length must match theirs); ``x``, this rank's
    tokens where they are a tensor: NCCL gathers on their (CUDA) device, where the peers'
    ids are, else on the current device. ``group=None``: just raises.
    """
    if group is not None:
        device = x.device if isinstance(x, torch.Tensor) else None
        placeholders = dict.fromkeys(range(num_uniform))
        count = len(_agreement_values(None, None, placeholders, None, None, None, None)[1])
        _agree(0, group_rank(group) + 1, [None] * count, group, device)
    raise error


def agree_block_m(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None,
    config: BlockMConfig | None = None,
) -> tuple[int, int]:
    """The group's ``(block_m, max_tokens)``, identical on every rank.

    Gathers every rank's token count, with ``top_k``, ``num_experts`` and ``config``'s
    threshold, which must be the same on every rank, and a flag for a rank that refused
    its own arguments (every rank then raises), in one all-gather; then
    ``get_block_m(MAX tokens, top_k, num_experts, ep_size=P)``. A collective: every
    rank of ``group`` must call it. :func:`plan_dispatch` does the same agreement
    (together with its argument checks and the route counts) in its one all-gather.
    """
    local_error, min_blocks = None, None
    try:
        check_int("num_tokens", num_tokens, minimum=0)
        min_blocks = block_m_threshold(config)
        get_block_m(num_tokens, top_k, num_experts, group_size(group), config)  # its checks
    except Exception as error:  # raised after the all-gather the peers wait in
        if group is None:
            raise
        local_error, num_tokens = error, 0
    names = ["top_k", "num_experts", "config.min_blocks_per_expert"]
    values = [top_k, num_experts, min_blocks] if local_error is None else [None] * 3
    agreed = _agree(
        num_tokens, 0 if local_error is None else group_rank(group) + 1, values, group, None
    )
    if local_error is None:
        _raise_on_mismatch(names, values, agreed.highs, agreed.lows)
    else:
        raise local_error
    max_tokens, refused = agreed.most_tokens, agreed.refused
    if refused:
        raise ValueError(
            f"rank {refused - 1} of the EP group refused its arguments to agree_block_m "
            "(its own error says why); every rank raises with it"
        )
    block_m = get_block_m(max_tokens, top_k, num_experts, group_size(group), config)
    return block_m, max_tokens


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Index maps of one expert-parallel step on one rank (made by :func:`plan_dispatch`).

    Sizes: ``T`` tokens here, ``K`` top-k, ``P`` ranks, ``N_send`` unmasked routes here,
    ``N_recv`` routes received here.

    - ``partition``: experts per rank, this rank's ``expert_begin``.
    - ``num_tokens`` ``T``, ``top_k`` ``K``, ``max_tokens`` ``T_max`` (MAX over ranks),
      ``block_m`` (agreed over ranks).
    - ``send_routes`` ``[N_send]`` int64: flat route index ``t*K + k`` of each sent row,
      in send order (by destination rank, then ascending ``t*K + k``).
    - ``send_splits`` / ``recv_splits``: rows to / from each rank (host ints, ``P``).
    - ``recv_expert`` ``[N_recv]`` int64: global expert id of each received row, in
      receive order ``(source rank, source t*K + k)``; always owned by this rank.
    - ``recv_capacity``: ``P * T_max * K`` (:func:`recv_capacity`), the same on every rank.
    - ``pool``: the :class:`~megamoe.wrappers.routing.RoutePlan` of the received rows padded
      with masked rows to the group's pool routes (``K = 1``: its route index *is* the
      receive index): ``recv_capacity`` with a static ``max_tokens``, else the MAX over
      ranks of ``N_recv``; either way its ``pool_capacity`` is rank-uniform.
    - ``group``: the process group (``None``: one process).
    """

    partition: ExpertPartition
    num_tokens: int
    top_k: int
    max_tokens: int
    block_m: int
    send_routes: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_expert: torch.Tensor
    recv_capacity: int
    pool: RoutePlan
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def num_send(self) -> int:
        """``N_send``: rows this rank sends (its unmasked routes)."""
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        """``N_recv``: rows this rank receives."""
        return sum(self.recv_splits)

    @property
    def send_tokens(self) -> torch.Tensor:
        """``[N_send]`` int64: the token ``t`` of each sent row."""
        return torch.div(self.send_routes, self.top_k, rounding_mode="floor")

    @property
    def send_position(self) -> torch.Tensor:
        """``[T, K]`` int32: each route's row in send order, ``-1`` for masked routes.

        The rows :func:`~megamoe.ep.exchange.combine` gets back arrive in send order, so
        this is the ``route_to_pool_row`` of the returned buffer: the EP1 combine kernels
        (``sum_k w y`` and the side sum, which read routes through ``route_to_pool_row``)
        can run on the returned ``[N_send, H + r]`` rows without a scatter.
        """
        device = self.send_routes.device
        pos = torch.full((self.num_tokens * self.top_k,), -1, dtype=torch.int32, device=device)
        pos[self.send_routes] = torch.arange(self.num_send, dtype=torch.int32, device=device)
        return pos.view(self.num_tokens, self.top_k)

    @property
    def return_plan(self) -> RoutePlan:
        """A one-segment :class:`~megamoe.wrappers.routing.RoutePlan` over the returned rows.

        ``route_to_pool_row`` is :attr:`send_position`, ``pool_row_to_route`` is
        ``send_routes``: the EP1 ``pool.side_sum`` / ``pool.combine`` (kernels or
        references) run unchanged on the ``[N_send, H + r]`` rows :func:`combine`'s
        exchange returns, summing over ``k`` in order with the routing weights.
        """
        device = self.send_routes.device
        sent = self.num_send
        # [0, N_send] made on the device: a copy from host memory would wait for the
        # GEMMs queued before it (the forward's combine and the backward call this).
        # The one segment's count is its end offset.
        if sent:
            offsets = torch.arange(0, 2 * sent, sent, dtype=torch.int32, device=device)
        else:
            offsets = torch.zeros(2, dtype=torch.int32, device=device)
        return RoutePlan(
            expert_counts=offsets[1:],
            expert_pool_offsets=offsets,
            route_to_pool_row=self.send_position,
            pool_row_to_route=self.send_routes.to(torch.int32),
            block_m=self.block_m,
        )

    @property
    def pool_routes(self) -> int:
        """Rows of the receive buffers the pool is planned over (``>= N_recv``, rank-uniform)."""
        return self.pool.route_to_pool_row.shape[0]

    @property
    def pool_capacity(self) -> int:
        """Rows of the rank-uniform pool (``pool_capacity(pool_routes, E_l, BLOCK_M)``)."""
        return self.pool.pool_capacity


def _empty_pool(num_local_experts: int, block_m: int, device: torch.device) -> RoutePlan:
    """The route plan of zero routes (every rank has zero tokens)."""

    def int32(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device=device)

    return RoutePlan(
        expert_counts=int32(num_local_experts),
        expert_pool_offsets=int32(num_local_experts + 1),
        route_to_pool_row=int32(0, 1),
        pool_row_to_route=int32(0),
        block_m=block_m,
    )


def plan_dispatch(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None,
    block_m: int | None = None,
    max_tokens: int | None = None,
    check_ids: bool = True,
    uniform: Mapping[str, int] | None = None,
    config: BlockMConfig | None = None,
) -> DispatchPlan:
    """Plan one expert-parallel step (a collective: every rank of ``group`` calls it).

    Steps: the local routing split (as :func:`split_routes`, on the device) -> one
    all-gather of every rank's ``[T, refusal flag, values..., routes per destination
    rank..., masked routes, ids outside [-1, E)]``, the values ``K, E, uniform...,
    max_tokens (-1: none), block_m (-1: agreed), check_ids`` (BLOCK_M agreement,
    argument checks, the id check, and the ``P x P`` route counts: the split sizes, and
    without a static ``max_tokens`` the MAX over ranks of the routes received, the
    rank-uniform pool size) -> ``all_to_all_single`` of the routes' expert ids, straight
    into the pool plan's input -> the receiver's pool plan. One host read in all: the
    gathered rows. The all-gather always runs and always has the same length: a
    mismatched group, or a rank that refused its own arguments (here, or before the call
    through :func:`refuse_on_every_rank`), raises on every rank instead of pairing
    different collectives.

    Args:
        topk_ids: ``[T, K]`` int32/int64 global expert ids, ``-1`` = masked. ``T`` may
            differ between ranks (and may be 0 on some).
        num_experts: ``E``, experts over the whole group (a multiple of ``P``).
        group: the EP process group (any backend; ``None`` = one process, ``P = 1``).
        block_m: override the agreed BLOCK_M (must then be the same on every rank).
        max_tokens: the group's ``T_max`` if the caller knows it (a static bound: the
            pool is then sized for it, ``P * T_max * K`` routes, instead of the largest
            received count). Checked to be the same on every rank and ``>= T``
            everywhere.
            (An EP step cannot be captured in a CUDA graph: the split sizes are host
            values.)
        check_ids: reject ids outside ``[-1, E)`` (counted on the device by the routing
            split and read with the gathered rows; without it they are masked).
        uniform: extra ints that must be equal on every rank (e.g. ``{"hidden": H}``);
            checked in the same all-gather, a mismatch raises ``ValueError`` on every
            rank (so no rank is left waiting in a later collective).
        config: :func:`~megamoe.get_block_m` thresholds.

    Returns:
        The :class:`DispatchPlan`. One host read, on every backend: the gathered rows
        (the split sizes of ``all_to_all_single`` are host ints).
    """
    world, rank = group_size(group), group_rank(group)
    agrees = group is not None
    static_bound = max_tokens is not None
    # A bad argument here is raised after the all-gather below: raised by one rank
    # alone, it would leave its peers waiting in that collective. A bad E, K or bound
    # is also compared across ranks there (where the ranks agree on it, every rank has
    # the same error); any other refusal is flagged, and every rank raises.
    local_error = None
    num_tokens, top_k = 0, None  # top_k None: not agreed (ids this rank refused)
    min_blocks = None
    try:
        check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        num_tokens, top_k = topk_ids.shape
        check_int("num_experts", num_experts)
        if static_bound:
            check_max_tokens(max_tokens)  # its value is agreed below
        if block_m is not None:
            check_block_m(block_m)
        if not isinstance(check_ids, bool):
            raise TypeError(f"check_ids: expected a bool, got {type(check_ids).__name__}")
        min_blocks = block_m_threshold(config)
        partition = ExpertPartition(num_experts, world, rank)
        if top_k < 1:
            raise ValueError(f"topk_ids: expected at least one route per token, got {top_k}")
    except Exception as error:  # any refusal: the peers are about to wait for this rank
        if not agrees:
            raise
        local_error = error
    names, values = _agreement_values(
        top_k, num_experts, uniform, max_tokens, block_m, check_ids, min_blocks
    )
    if local_error is None:
        given = dict(uniform or {})
        for name, value in zip(names, values):
            if value is None:  # not an int, or past int64 (the all-gather holds int64)
                kind = type(given.get(name, 0))
                local_error = (
                    ValueError(f"{name}: expected an int within int64's range")
                    if issubclass(kind, int)
                    else TypeError(f"{name}: expected an int, got {kind.__name__}")
                )
                if not agrees:
                    # One process: the id check (when E is valid) still comes first.
                    if check_ids and values[1] is not None:
                        flat, _, route_counts = _routes_by_destination(topk_ids, partition)
                        if int(route_counts[-1]):
                            raise _ids_outside_error(flat, num_experts)
                    raise local_error
                break
    # The routes per destination go into the agreement's rows (the second half of one
    # host read), so they are split before it, with the count of ids outside [-1, E)
    # (the id check: its flag is read with the rows, not in a host read of its own); a
    # rank that refused its inputs sends no counts (zeros), and every rank raises below.
    flat = order = route_counts = None
    if local_error is None:
        flat, order, route_counts = _routes_by_destination(topk_ids, partition)
    # One all-gather even with a static bound: the agreement (ids, the uniform values,
    # whether the step has a backward) is what keeps a mismatched group from pairing
    # different collectives; it is one row of a few ints per rank.
    device = topk_ids.device if isinstance(topk_ids, torch.Tensor) else None
    agreed = _agree(
        num_tokens, 0 if local_error is None else rank + 1, values, group, device, route_counts
    )
    _raise_on_mismatch(names, values, agreed.highs, agreed.lows)
    if local_error is not None:
        raise local_error
    most_tokens, refused, bad_rank = agreed.most_tokens, agreed.refused, agreed.bad_rank
    if refused:
        raise ValueError(
            f"rank {refused - 1} of the EP group failed before the exchange (its own "
            "error says why: an argument it refused, say); every rank raises with it"
        )
    if check_ids and bad_rank:
        if group is None:  # one process: name the values (a host read on this error only)
            raise _ids_outside_error(flat, num_experts)
        raise ValueError(
            f"topk_ids: expected expert ids in [-1, {num_experts}) on every rank, rank "
            f"{bad_rank - 1} has ids outside"
        )
    if not static_bound:
        max_tokens = most_tokens
    elif most_tokens > max_tokens:
        raise ValueError(
            f"max_tokens: expected >= every rank's token count, got {max_tokens} while a "
            f"rank holds {most_tokens} tokens"
        )
    if block_m is None:
        block_m = get_block_m(max_tokens, top_k, num_experts, world, config)

    counts = agreed.counts
    send_splits = tuple(counts[rank])
    recv_splits = tuple(row[rank] for row in counts)
    send_routes = order[: sum(send_splits)]

    num_recv = sum(recv_splits)
    capacity = recv_capacity(max_tokens, top_k, world)
    num_local = partition.num_local_experts
    # The pool's routes: rank-uniform. With a static max_tokens, the worst case
    # P * T_max * K; otherwise the MAX over ranks of the routes actually received (from
    # the gathered counts): the worst case is P times the balanced load, too much memory
    # at production sizes. The ids arrive straight into the pool plan's input, whose
    # rows past them are masked.
    received = [sum(row[destination] for row in counts) for destination in range(world)]
    pool_routes = capacity if static_bound else max(received)
    padded = torch.full(
        (max(pool_routes, num_recv), 1), -1, dtype=torch.int64, device=topk_ids.device
    )
    recv_expert = padded[:num_recv, 0]
    send_ids = flat.index_select(0, send_routes)
    if group is None:
        recv_expert.copy_(send_ids)
    else:
        dist.all_to_all_single(
            recv_expert, send_ids, list(recv_splits), list(send_splits), group=group
        )
    if num_recv > capacity:  # after the exchange, which every rank joins
        raise ValueError(
            f"max_tokens: {max_tokens} is below some rank's token count: this rank "
            f"received {num_recv} routes, more than P * max_tokens * K = {capacity}"
        )
    if pool_routes == 0:
        pool = _empty_pool(num_local, block_m, topk_ids.device)
    else:
        pool = plan_routes(
            padded, num_local, block_m, expert_begin=partition.expert_begin, check_ids=False
        )
    return DispatchPlan(
        partition=partition,
        num_tokens=num_tokens,
        top_k=top_k,
        max_tokens=max_tokens,
        block_m=block_m,
        send_routes=send_routes,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_expert=recv_expert,
        recv_capacity=capacity,
        pool=pool,
        group=group,
    )
