"""Argument checks: every public entry point names a bad argument before anything runs.

- :mod:`~megamoe.validation.layer`: the MoE layer call's checks, shared by ``mm.moe``,
  the custom ops and their fake implementations (re-exported here:
  :func:`check_moe_inputs`, :func:`check_base_weights`, :func:`check_backward_inputs`,
  :func:`check_devices`, :func:`check_block_m`, :func:`check_masters`);
- :mod:`~megamoe.validation.arguments`: the per-argument checks every module uses
  (``check_tensor``, ``check_int``, ``check_choice``, ...);
- :mod:`~megamoe.validation.mxfp4`: checks of pre-quantized MXFP4 weights and scales.
"""

from .layer import (
    check_backward_inputs,
    check_base_weights,
    check_block_m,
    check_devices,
    check_masters,
    check_moe_inputs,
)

__all__ = [
    "check_backward_inputs",
    "check_base_weights",
    "check_block_m",
    "check_devices",
    "check_masters",
    "check_moe_inputs",
]
