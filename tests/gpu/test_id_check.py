"""The fused layer's expert-id range check runs on the device, without a host
synchronisation: a bad call is computed with its out-of-range ids as masked routes and
reported by a later call or ``megamoe.wrappers.routing.check_errors``."""

import pytest
import torch

import megamoe as mm
from megamoe.testing import make_layer
from megamoe.wrappers.routing import check_errors

pytestmark = pytest.mark.gpu

ID_ERROR = r"^topk_ids: expected expert ids in \[-1, 8\), got values in \[-?\d+, 8\] in an earlier"


def _layer():
    return make_layer(256, 128, 8, 2, 16, num_tokens=40, device="cuda", seed=3)


@pytest.mark.parametrize("bad_id", [8, -5])
def test_bad_ids_compute_as_masked_and_are_reported_later(bad_id):
    layer = _layer()
    check_errors()  # nothing pending from earlier tests
    bad, masked = layer.topk_ids.clone(), layer.topk_ids.clone()
    bad[3, 1] = bad_id
    masked[3, 1] = -1
    with torch.no_grad():
        out = mm.moe(layer.x, bad, layer.topk_weights, layer.base, layer.side)  # no raise
        torch.cuda.synchronize()
        # The next call raises before it launches anything, once the GPU has passed the
        # bad call's check; the bad call itself ran with that route masked.
        with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids in \[-1, 8\)"):
            mm.moe(layer.x, masked, layer.topk_weights, layer.base, layer.side)
        assert torch.equal(out, mm.moe(layer.x, masked, layer.topk_weights, layer.base, layer.side))
    check_errors()  # reported once


def test_check_errors_waits_for_the_device():
    layer = _layer()
    check_errors()
    bad = layer.topk_ids.clone()
    bad[0, 0] = 8
    layer.x.requires_grad_(True)
    out = mm.moe(layer.x, bad, layer.topk_weights, layer.base, layer.side)  # training op
    with pytest.raises(ValueError, match=ID_ERROR):
        check_errors()
    out.sum().backward()
    check_errors()


def test_good_calls_leave_nothing_to_report():
    layer = _layer()
    with torch.no_grad():
        for _ in range(3):
            layer.call(mm.moe)
    check_errors()


@pytest.mark.parametrize("id_limit", [None, 8])
def test_plan_routes_checks_ids_on_the_device(id_limit):
    """plan_routes itself: ids below -1 always, and ids at or past id_limit, reported by
    check_errors; the plan treats them as masked."""
    check_errors()
    ids = torch.tensor([[0, 7], [3, -1], [-3, 9]], dtype=torch.int64, device="cuda")
    plan = mm.plan_routes(ids, 8, 64, id_limit=id_limit)
    low = r"-3" if id_limit is None else r"\[-3, 9\]"
    with pytest.raises(ValueError, match=rf"^topk_ids: expected expert ids .*{low}"):
        check_errors()
    masked = ids.clone()
    masked[2] = -1
    reference = mm.plan_routes_reference(masked.cpu(), 8, 64)
    assert torch.equal(plan.expert_counts.cpu(), reference.expert_counts)
    assert torch.equal(plan.route_to_pool_row.cpu(), reference.route_to_pool_row)
    mm.plan_routes(masked, 8, 64, id_limit=id_limit)
    check_errors()  # in range: nothing to report
