"""Testing helpers: accuracy metrics and gates, seeded inputs, the unfused baseline.

``megamoe.testing.baseline.moe`` is the DESIGN §7 baseline (torch ops + autograd);
``megamoe.testing.inputs`` makes seeded routing and layers; ``megamoe.testing.metrics``
holds the DESIGN §6 oracle gates; ``megamoe.testing.op_route.OpRoute`` forces the
layer's registered ops where it would take its eager route.
"""

from __future__ import annotations

from . import baseline, inputs, metrics
from .inputs import (
    ROUTING_KINDS,
    LayerInputs,
    block_m_transitions,
    make_layer,
    make_routing,
    mxfp4_schedule_transitions,
)
from .metrics import (
    GRAD_MIN_COSINE,
    ORACLE_MAX_REL_L2,
    ORACLE_MAX_WORST_ROW,
    ORACLE_MIN_COSINE,
    Metrics,
    assert_close_to_oracle,
    compare,
)
from .op_route import OpRoute

__all__ = [
    "GRAD_MIN_COSINE",
    "ORACLE_MAX_REL_L2",
    "ORACLE_MAX_WORST_ROW",
    "ORACLE_MIN_COSINE",
    "ROUTING_KINDS",
    "LayerInputs",
    "Metrics",
    "OpRoute",
    "assert_close_to_oracle",
    "baseline",
    "block_m_transitions",
    "compare",
    "inputs",
    "make_layer",
    "make_routing",
    "metrics",
    "mxfp4_schedule_transitions",
]
