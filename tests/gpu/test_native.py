"""The compiled module on the GPU: device queries and the SM policy."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_device_queries_match_torch():
    from megamoe import _C

    props = torch.cuda.get_device_properties(0)
    assert _C.device_sm_count(0) == props.multi_processor_count
    assert _C.device_compute_capability(0) == props.major * 10 + props.minor == 90


def test_sm_policy_on_the_device(monkeypatch):
    from megamoe.env import num_sms

    total = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv("MEGAMOE_NUM_SMS", raising=False)
    monkeypatch.setenv("MEGAMOE_SM_HEADROOM", "7")
    assert num_sms(0) == total - 8
    monkeypatch.setenv("MEGAMOE_NUM_SMS", "64")
    assert num_sms(0) == 64
