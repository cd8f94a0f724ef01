"""The route plan: routes sorted by local expert into the BLOCK_M-padded pool.

Every route ``(t, k)`` whose expert is local gets one pool row. Experts own
contiguous segments, each starting at a multiple of ``block_m``; inside a segment
rows follow ascending route index ``t * K + k`` (a stable sort), so the plan and
everything gathered through it are deterministic. Padding rows map to -1.

Expert ids outside the valid range are found without a host synchronisation: ids on
the CPU are read at once (:func:`check_expert_ids`); on a GPU the route-plan kernels also
write the ids' extremes into pinned host memory (:func:`plan_routes`), and the host reads
them once the GPU has passed the plan, at the next planning call or in
:func:`check_errors` (which waits for it). The kernels treat such ids as masked.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from ..validation.arguments import check_int, check_tensor, has_data
from . import _native
from .registry import registry

#: The largest pool row index the route plan's int32 maps and kernels hold.
_INT32_MAX = 2**31 - 1


#: Routes per token the pool kernels take (``int`` loop counters stepping by 8).
MAX_TOP_K = 2**31 - 8


@dataclass(frozen=True)
class RoutePlan:
    """Index maps of one routing (all int32, on the routing's device).

    - ``expert_counts`` ``[E_l]``: routes per local expert.
    - ``expert_pool_offsets`` ``[E_l + 1]``: segment starts; the last entry is the
      number of pool rows in use.
    - ``route_to_pool_row`` ``[T, K]``: pool row of each route, -1 if masked/remote.
    - ``pool_row_to_route`` ``[pool_capacity]``: flat route index ``t*K + k`` of each
      pool row, -1 for padding and unused rows.

    All four are checked when a plan is made (int32, contiguous, their ranks, one
    device, ``E_l >= 1``, ``expert_counts`` of ``E_l`` entries), so the ops that take a
    plan need not check them again.
    """

    expert_counts: torch.Tensor
    expert_pool_offsets: torch.Tensor
    route_to_pool_row: torch.Tensor
    pool_row_to_route: torch.Tensor
    block_m: int

    def __post_init__(self) -> None:
        # Checked once here rather than by every pool op that reads the plan: a small-token
        # step pays host time per check (docs/DESIGN-NOTES.md, "The op layer").
        device = self.pool_row_to_route.device
        check_tensor(
            "plan.pool_row_to_route",
            self.pool_row_to_route,
            ndim=1,
            dtypes=(torch.int32,),
            contiguous=True,
        )
        for name in ("route_to_pool_row", "expert_pool_offsets"):
            check_tensor(
                f"plan.{name}",
                getattr(self, name),
                ndim=2 if name == "route_to_pool_row" else 1,
                dtypes=(torch.int32,),
                device=device,
                contiguous=True,
            )
        if self.expert_pool_offsets.shape[0] < 2:
            raise ValueError(
                "plan.expert_pool_offsets: expected [E_l + 1] entries with E_l >= 1, got shape "
                f"{list(self.expert_pool_offsets.shape)}"
            )
        # The kernels index expert_counts by expert and take E_l from its length
        # (check_plan_block_m, the weight checks): it must agree with the offsets.
        check_tensor(
            "plan.expert_counts",
            self.expert_counts,
            shape=(self.expert_pool_offsets.shape[0] - 1,),
            dtypes=(torch.int32,),
            device=device,
            contiguous=True,
        )
        if self.route_to_pool_row.shape[1] > MAX_TOP_K:
            # The pool kernels step through a token's routes 8 at a time in int32: past
            # this their counter would wrap (a hang and reads past the route maps).
            raise ValueError(
                f"plan.route_to_pool_row: expected at most {MAX_TOP_K} routes per token (K), "
                f"got {self.route_to_pool_row.shape[1]}"
            )

    @property
    def pool_capacity(self) -> int:
        return self.pool_row_to_route.shape[0]


def pool_capacity(num_routes: int, num_local_experts: int, block_m: int) -> int:
    """Pool rows that hold any routing of ``num_routes`` routes, known without a sync.

    Worst case: every expert's segment wastes ``block_m - 1`` rows of padding.
    Rounded up to a whole block.
    """
    check_int("num_routes", num_routes, minimum=0)
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_int("block_m", block_m, minimum=1)
    worst = num_routes + num_local_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def route_plan_num_tiles(num_routes: int) -> int:
    """Tiles of the route-plan kernels (rows of their per-tile scratch)."""
    per_tile = registry().route_plan_routes_per_tile
    return -(-num_routes // per_tile)


@dataclass(frozen=True, eq=False)
class _IdExtremes:
    """One GPU call's ``(min, max)`` of its ids, on its way to the host."""

    host: torch.Tensor  # [2] pinned: (min, max), valid once ``landed`` has completed
    landed: torch.cuda.Event  # recorded after the plan that writes ``host``
    limit: int | None  # ids must lie in [-1, limit) (None: no upper bound)
    device: torch.device


_pending: list[_IdExtremes] = []
_pending_lock = threading.Lock()

# Pinned [2] slots and CUDA events are reused across calls: a pinned allocation and an
# event's creation and destruction per plan are host time before a small-token forward's
# first GEMM. A slot or event is free again once its check has been read.
_free_slots: list[torch.Tensor] = []
_free_events: dict[torch.device, list[torch.cuda.Event]] = {}


def _take_slot_and_event(device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A zeroed pinned ``[2]`` int64 slot and an event for ``device`` (events belong to
    the device they were first recorded on)."""
    with _pending_lock:
        slot = _free_slots.pop() if _free_slots else None
        events = _free_events.get(device)
        event = events.pop() if events else torch.cuda.Event()
    if slot is None:
        # A pinned allocation of its own (the launcher maps its start to a device pointer),
        # made only while more checks are in flight than ever before.
        slot = torch.empty(2, dtype=torch.int64, pin_memory=True)
    # Zeros read as in range if the launches stop before the plan writes them.
    slot.zero_()
    return slot, event


def _id_range_error(low: int, high: int, limit: int | None, where: str = "") -> ValueError:
    if limit is None:
        return ValueError(f"topk_ids: expected expert ids >= -1 (-1 = masked), got {low}{where}")
    return ValueError(
        f"topk_ids: expected expert ids in [-1, {limit}), got values in [{low}, {high}]{where}"
    )


def _is_bad(low: int, high: int, limit: int | None) -> bool:
    return low < -1 or (limit is not None and high >= limit)


def _raise_checked(snapshots: list[_IdExtremes]) -> None:
    """Raise for the first of ``snapshots`` (all landed) whose ids were out of range."""
    bad = [s for s in snapshots if _is_bad(*s.host, s.limit)]
    if not bad:
        return
    first = bad[0]
    low, high = first.host
    more = f"; {len(bad) - 1} later call(s) too" if len(bad) > 1 else ""
    raise _id_range_error(
        low,
        high,
        first.limit,
        f" in an earlier call on {first.device} (checked on the device after it was "
        f"launched: its routes with these ids were computed as masked{more}). Map other "
        "ranks' experts to -1 before the call",
    )


def _take_landed() -> list[_IdExtremes]:
    """Remove and return the pending checks whose extremes have reached the host (no
    wait), their ``host`` read into a ``(min, max)`` tuple; their slots and events are
    free again."""
    with _pending_lock:
        done = [s for s in _pending if s.landed.query()]
        if not done:
            return []
        _pending[:] = [s for s in _pending if s not in done]
        read = [dataclasses.replace(s, host=tuple(s.host.tolist())) for s in done]
        for s in done:
            _free_slots.append(s.host)
            _free_events.setdefault(s.device, []).append(s.landed)
    return read


def check_errors() -> None:
    """Wait for every pending device-side id check and raise the first error.

    The route plans of CUDA ``topk_ids`` check them on the GPU without synchronising
    (:func:`plan_routes`); their result is read at the next planning call, once the GPU
    has passed it. This waits for all of them instead (a synchronisation).
    Calls captured in a CUDA graph are not checked (the host cannot read a replay's
    ids without a synchronisation): check the ids of a captured step eagerly.

    Raises:
        ValueError: starting with ``topk_ids:``, the range and the values of the first
            call whose ids were outside it.
    """
    with _pending_lock:
        snapshots = list(_pending)
    for snapshot in snapshots:
        snapshot.landed.synchronize()
    _raise_checked(_take_landed())


def raise_finished_id_checks() -> None:
    """Raise the first error among the earlier calls' id checks whose result has reached
    the host (no wait; see :func:`plan_routes`). A no-op with none pending, under
    torch.compile and during CUDA-graph capture (no event query there). A checking plan
    calls it before its launches, so a fused forward raises before it launches anything."""
    if not _pending or torch.compiler.is_compiling():
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    _raise_checked(_take_landed())


def _record_id_check(
    host: torch.Tensor, landed: torch.cuda.Event, topk_ids: torch.Tensor, limit: int | None
) -> None:
    """Queue ``host`` (a slot of :func:`_take_slot_and_event`, written by the current
    stream's work so far) as the ids' ``(min, max)`` of one call, read once ``landed``,
    recorded here, has completed."""
    landed.record(torch.cuda.current_stream(topk_ids.device))
    with _pending_lock:
        _pending.append(_IdExtremes(host, landed, limit, topk_ids.device))


def _checks_on_device() -> bool:
    """Whether a CUDA plan checks its ids now: not while torch.compile traces (fake
    tensors have no values) and not during CUDA-graph capture (no event query)."""
    return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()


def check_expert_ids(topk_ids: torch.Tensor, limit: int | None) -> None:
    """Check that every id of CPU ``topk_ids`` lies in ``[-1, limit)`` (``limit`` None:
    ``>= -1``): a ``ValueError`` now. CUDA ids are checked by the route plan's kernels
    (:func:`plan_routes`); meta and fake tensors have no values to check.
    """
    if topk_ids.numel() == 0 or torch.compiler.is_compiling():
        return
    from torch._subclasses.fake_tensor import is_fake

    if topk_ids.device.type == "meta" or is_fake(topk_ids):
        return
    if topk_ids.is_cuda:
        raise ValueError(
            "topk_ids: CUDA ids are checked on the device by plan_routes(check_ids=True)"
        )
    low, high = (int(v) for v in torch.aminmax(topk_ids))
    if _is_bad(low, high, limit):
        raise _id_range_error(low, high, limit)


def check_local_experts(name: str, num_local_experts: int) -> None:
    """At most the route plan's local experts (its pass 2 runs a thread per expert in one
    block), checked before anything launches: past it the native plan would refuse under
    its own argument's name, after an ordinary-mode MXFP4 base was already decoded."""
    limit = registry().route_plan_max_local_experts
    if num_local_experts > limit:
        raise ValueError(
            f"{name}: expected at most {limit} local experts (the route plan's limit), "
            f"got {num_local_experts}"
        )


def _check_plan_args(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, expert_begin: int
) -> None:
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), contiguous=True)
    if topk_ids.numel() == 0:
        raise ValueError(f"topk_ids: expected at least one route, got shape {list(topk_ids.shape)}")
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_local_experts("num_local_experts", num_local_experts)
    check_int("expert_begin", expert_begin, minimum=0)
    check_int("block_m", block_m, minimum=1)
    if block_m not in registry().block_m_choices:
        raise ValueError(
            f"block_m: expected one of {list(registry().block_m_choices)}, got {block_m}"
        )
    rows = pool_capacity(topk_ids.numel(), num_local_experts, block_m)
    if rows > _INT32_MAX:
        raise ValueError(
            f"topk_ids: {topk_ids.numel()} routes over {num_local_experts} experts at BLOCK_M "
            f"{block_m} need a pool of {rows} rows (T*K + E_l*(BLOCK_M-1), whole blocks); "
            f"pool rows are int32 indices (at most {_INT32_MAX})"
        )


def _check_ids_have_values(topk_ids: torch.Tensor) -> None:
    """After :func:`_check_plan_args`, as a device the plan cannot be made on. (Under
    torch.compile the graph breaks where the plan reads values, and runs on.)"""
    if not torch.compiler.is_compiling() and not has_data(topk_ids):
        raise ValueError(
            "topk_ids: the route plan is made from the ids' values, and a meta or fake "
            "tensor holds none"
        )


def plan_routes_reference(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, *, expert_begin: int = 0
) -> RoutePlan:
    """The route plan with plain torch ops (CPU or CUDA ids; not meta or fake: the plan
    is made from their values): the oracle of the kernel."""
    _check_plan_args(topk_ids, num_local_experts, block_m, expert_begin)
    _check_ids_have_values(topk_ids)
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    local = flat - expert_begin
    is_local = (flat >= 0) & (local >= 0) & (local < num_local_experts)
    # Non-local routes sort after every expert; stable sort keeps route order per expert.
    key = torch.where(is_local, local, torch.full_like(local, num_local_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key[is_local], minlength=num_local_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    num_local_routes = int(is_local.sum())
    sorted_routes = order[:num_local_routes]
    sorted_experts = key[sorted_routes]
    starts = torch.zeros(num_local_experts, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    rank_in_expert = torch.arange(num_local_routes, device=device) - starts[sorted_experts]
    rows = offsets[sorted_experts] + rank_in_expert
    capacity = pool_capacity(flat.numel(), num_local_experts, block_m)
    route_to_row = torch.full((flat.numel(),), -1, dtype=torch.int32, device=device)
    route_to_row[sorted_routes] = rows.to(torch.int32)
    row_to_route = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    row_to_route[rows] = sorted_routes.to(torch.int32)
    return RoutePlan(
        expert_counts=counts.to(torch.int32),
        expert_pool_offsets=offsets.to(torch.int32),
        route_to_pool_row=route_to_row.view(num_tokens, top_k),
        pool_row_to_route=row_to_route,
        block_m=block_m,
    )


def plan_routes(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    *,
    expert_begin: int = 0,
    check_ids: bool = True,
    id_limit: int | None = None,
) -> RoutePlan:
    """Plan ``topk_ids`` ``[T, K]`` (int32/int64, -1 = masked) for local experts
    ``expert_begin .. expert_begin + num_local_experts - 1`` (at most the registry's
    ``route_plan_max_local_experts``, 1024).

    On CUDA this runs the route-plan kernels on the current stream, with no host
    synchronisation; on CPU it runs :func:`plan_routes_reference`.

    ``check_ids=True`` rejects ids below -1 and, with ``id_limit``, ids at or past it
    (a ``ValueError`` now for CPU ids). For CUDA ids the plan's kernels write the ids'
    extremes into pinned host memory, and a later call or :func:`check_errors` raises
    while the kernels treat such ids as masked; the earlier calls' finished checks raise
    here, before this plan launches. Not under CUDA-graph capture or torch.compile
    tracing. ``False``: the caller has checked them.
    """
    _check_plan_args(topk_ids, num_local_experts, block_m, expert_begin)
    _check_ids_have_values(topk_ids)
    if not isinstance(check_ids, bool):
        raise TypeError(f"check_ids: expected a bool, got {type(check_ids).__name__}")
    if not topk_ids.is_cuda:
        if check_ids:
            check_expert_ids(topk_ids, id_limit)
        return plan_routes_reference(
            topk_ids, num_local_experts, block_m, expert_begin=expert_begin
        )
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_routes = num_tokens * top_k
    capacity = pool_capacity(num_routes, num_local_experts, block_m)

    def int32(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    num_tiles = route_plan_num_tiles(num_routes)
    scratch = int32(num_tiles, num_local_experts)
    plan = RoutePlan(
        expert_counts=int32(num_local_experts),
        expert_pool_offsets=int32(num_local_experts + 1),
        route_to_pool_row=int32(num_tokens, top_k),
        pool_row_to_route=int32(capacity),
        block_m=block_m,
    )
    dl = _native.dlpack
    with _native.on_device(device):  # the capture query asks the current device's stream
        tile_extremes = host_extremes = landed = None
        if check_ids and _checks_on_device():
            if _pending:  # the earlier calls' errors, before this launch
                _raise_checked(_take_landed())
            tile_extremes = torch.empty(num_tiles, 2, dtype=torch.int64, device=device)
            host_extremes, landed = _take_slot_and_event(device)
        try:
            _native.native().route_plan(
                dl(topk_ids),
                expert_begin,
                num_local_experts,
                block_m,
                dl(scratch),
                dl(plan.expert_counts),
                dl(plan.expert_pool_offsets),
                dl(plan.route_to_pool_row.view(-1)),
                dl(plan.pool_row_to_route),
                None if tile_extremes is None else dl(tile_extremes),
                0 if host_extremes is None else host_extremes.data_ptr(),
                _native.current_stream(device),
            )
        finally:
            # Queued even if a launch failed: the pinned memory then lives until the
            # stream has passed whatever of the plan did launch.
            if host_extremes is not None:
                _record_id_check(host_extremes, landed, topk_ids, id_limit)
    return plan
