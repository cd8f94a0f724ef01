"""The SM budget policy: MEGAMOE_NUM_SMS wins; headroom rounds up to even."""

import pytest

from megamoe.env import resolve_num_sms


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, 132),
        ({"MEGAMOE_SM_HEADROOM": "0"}, 132),
        ({"MEGAMOE_SM_HEADROOM": "2"}, 130),
        ({"MEGAMOE_SM_HEADROOM": "3"}, 128),  # 3 rounds up to 4
        ({"MEGAMOE_SM_HEADROOM": "1"}, 130),
        ({"MEGAMOE_NUM_SMS": "100"}, 100),
        ({"MEGAMOE_NUM_SMS": "100", "MEGAMOE_SM_HEADROOM": "20"}, 100),  # absolute wins
        ({"MEGAMOE_NUM_SMS": "7"}, 7),  # absolute is not rounded
        ({"MEGAMOE_NUM_SMS": " 132 "}, 132),
        ({"MEGAMOE_NUM_SMS": ""}, 132),  # empty = unset
    ],
)
def test_policy(environ, expected):
    assert resolve_num_sms(132, environ) == expected


@pytest.mark.parametrize(
    "environ,match",
    [
        ({"MEGAMOE_NUM_SMS": "0"}, "MEGAMOE_NUM_SMS"),
        ({"MEGAMOE_NUM_SMS": "133"}, "MEGAMOE_NUM_SMS"),
        ({"MEGAMOE_NUM_SMS": "many"}, "MEGAMOE_NUM_SMS"),
        ({"MEGAMOE_SM_HEADROOM": "-2"}, "MEGAMOE_SM_HEADROOM"),
        ({"MEGAMOE_SM_HEADROOM": "131"}, "MEGAMOE_SM_HEADROOM"),  # rounds to 132: none left
        ({"MEGAMOE_SM_HEADROOM": "1.5"}, "MEGAMOE_SM_HEADROOM"),
        # int() takes these; an SM count written so is a typo (a review)
        ({"MEGAMOE_NUM_SMS": "1_00"}, "MEGAMOE_NUM_SMS"),
        ({"MEGAMOE_NUM_SMS": "\uff18"}, "MEGAMOE_NUM_SMS"),  # a full-width 8
    ],
)
def test_bad_values_name_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        resolve_num_sms(132, environ)


def test_reads_os_environ(monkeypatch):
    monkeypatch.setenv("MEGAMOE_SM_HEADROOM", "8")
    monkeypatch.delenv("MEGAMOE_NUM_SMS", raising=False)
    assert resolve_num_sms(132) == 124


def test_the_device_count_is_an_int():
    with pytest.raises(TypeError, match=r"^device_sm_count: expected an int, got str"):
        resolve_num_sms("132", {})
    with pytest.raises(TypeError, match=r"^device_sm_count: expected an int, got float"):
        resolve_num_sms(1.5, {})
