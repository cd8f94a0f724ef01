"""The expert-id range check without a host synchronisation (megamoe.wrappers.routing).

CPU ids are checked at once; CUDA ids leave their extremes on the way to pinned host
memory, read by a later call or ``check_errors``. The GPU half runs in
tests/gpu/test_id_check.py; here the bookkeeping is driven with stand-in events.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.wrappers import routing


class _Event:
    """A stand-in for a CUDA event: done or not, and whether someone waited on it."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


@pytest.fixture
def pending(monkeypatch: pytest.MonkeyPatch) -> list:
    queue: list = []
    monkeypatch.setattr(routing, "_pending", queue)
    # Landed checks return their slots and events: keep the stand-ins off the real lists.
    monkeypatch.setattr(routing, "_free_slots", [])
    monkeypatch.setattr(routing, "_free_events", {})
    return queue


def _snapshot(low: int, high: int, limit: int | None, *, done: bool) -> routing._IdExtremes:
    return routing._IdExtremes(
        torch.tensor([low, high]), _Event(done), limit, torch.device("cuda", 0)
    )


def test_cpu_ids_are_checked_at_once() -> None:
    ids = torch.tensor([[0, 3], [-1, 2]], dtype=torch.int32)
    routing.check_expert_ids(ids, 4)
    routing.check_expert_ids(ids, None)
    above = r"^topk_ids: expected expert ids in \[-1, 3\), got values in \[-1, 3\]$"
    with pytest.raises(ValueError, match=above):
        routing.check_expert_ids(ids, 3)
    below = r"^topk_ids: expected expert ids >= -1 \(-1 = masked\), got -2$"
    with pytest.raises(ValueError, match=below):
        routing.check_expert_ids(ids - 1, None)


def test_meta_ids_have_nothing_to_check(pending: list) -> None:
    routing.check_expert_ids(torch.empty(4, 2, dtype=torch.int64, device="meta"), 1)
    assert pending == []


def test_check_errors_waits_and_raises_the_first_bad_call_once(pending: list) -> None:
    good = _snapshot(-1, 7, 8, done=True)
    bad = _snapshot(-1, 9, 8, done=False)
    worse = _snapshot(-4, 2, None, done=False)
    pending.extend([good, bad, worse])
    with pytest.raises(
        ValueError,
        match=r"^topk_ids: expected expert ids in \[-1, 8\), got values in \[-1, 9\] in an "
        r"earlier call on cuda:0 .*masked; 1 later call\(s\) too\)",
    ):
        routing.check_errors()
    assert bad.landed.waited and worse.landed.waited
    assert pending == []  # each error is reported once
    routing.check_errors()


def test_a_later_call_reads_only_what_has_reached_the_host(pending: list) -> None:
    in_flight = _snapshot(-1, 99, 8, done=False)
    pending.append(in_flight)
    assert routing._take_landed() == []  # no wait: the extremes have not landed
    assert pending == [in_flight] and not in_flight.landed.waited
    in_flight.landed.done = True
    with pytest.raises(ValueError, match=r"got values in \[-1, 99\] in an earlier call"):
        routing._raise_checked(routing._take_landed())
    assert pending == []


def test_the_forward_raises_finished_checks_before_launching(pending: list) -> None:
    # raise_finished_id_checks runs before a checking route plan launches (the plan then
    # records its own ids' check): no wait, only what has reached the host.
    routing.raise_finished_id_checks()  # nothing pending: a no-op
    in_flight = _snapshot(-1, 99, 8, done=False)
    pending.append(in_flight)
    routing.raise_finished_id_checks()
    assert pending == [in_flight] and not in_flight.landed.waited
    in_flight.landed.done = True
    with pytest.raises(ValueError, match=r"got values in \[-1, 99\] in an earlier call"):
        routing.raise_finished_id_checks()
    assert pending == []


def test_planning_cpu_ids_checks_them_at_once(pending: list) -> None:
    ids = torch.tensor([[0, 7], [3, -1], [-1, 9]])
    with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids in \[-1, 8\), got "):
        routing.plan_routes(ids, 8, 64, id_limit=8)
    routing.plan_routes(ids, 8, 64)  # no limit: 9 may be another rank's expert
    with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids >= -1"):
        routing.plan_routes(ids - 1, 8, 64)
    routing.plan_routes(ids - 1, 8, 64, check_ids=False)  # the caller checked them
    assert pending == []  # CPU ids leave nothing to read later


def test_a_landed_check_frees_its_slot_and_event(pending: list) -> None:
    # A check's pinned slot and event are reused by later plans once its values have
    # been read; one still in flight keeps both.
    device = torch.device("cuda", 0)
    landed = routing._IdExtremes(torch.tensor([-1, 9]), _Event(True), 8, device)
    in_flight = routing._IdExtremes(torch.tensor([0, 3]), _Event(False), 8, device)
    pending.extend([landed, in_flight])
    taken = routing._take_landed()
    assert [s.host for s in taken] == [(-1, 9)]  # read before the slot is freed
    assert routing._free_slots == [landed.host]
    assert routing._free_events == {device: [landed.landed]}
    assert pending == [in_flight]
    with pytest.raises(ValueError, match=r"got values in \[-1, 9\] in an earlier call"):
        routing._raise_checked(taken)
