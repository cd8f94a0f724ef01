"""megamoe: fused Mixture-of-Experts training kernels for NVIDIA Hopper (sm_90a).

Public API (docs/DESIGN.md §5):

- ``moe``: the layer call on the fused kernels, forward and backward, BF16 or MXFP4
  base, side-LoRA or ordinary mode (trainable base), EP1 or expert parallel over a
  process group (``group=``); torch custom ops (torch.compile; CUDA graphs for EP1);
- ``MegaMoE``: the module; ``prepare_base_weights`` / ``BaseWeights`` and ``SideLoRA``:
  the weight and adapter containers; ``megamoe.adapter_convert``: PEFT and
  Megatron-Bridge adapter layouts;
- ``quantize_mxfp4`` / ``dequantize_mxfp4``: the MXFP4 quantizer;
- ``plan_routes`` (and its float reference), ``get_block_m``, the
  SM budget (``resolve_num_sms``) and the forward's scratch sizes
  (``workspace_layout``): the host heuristics;
- ``megamoe.ep``: the expert-parallel layer and its CPU twins; ``megamoe.reference``:
  the float64 oracle; ``megamoe.testing``: inputs, metrics, the unfused baseline;
  ``megamoe.validation``: the argument checks.

The layers below it, a subpackage each: ``megamoe.custom_ops`` (the torch custom ops),
``megamoe.pipeline`` (the fused forward and backward), ``megamoe.wrappers`` (one wrapper
per native kernel, the variant registry).
"""

# First: a clear message where torch is missing (a wheel installed with --no-deps).
from . import _requires  # noqa: F401

# isort: split

# The argument checks first: most modules import megamoe.validation.arguments, which
# runs validation/__init__, which imports validation.layer and through it side_lora,
# weights and the wrappers; started from one of those (half initialized), it would fail.
from . import validation

# isort: split
from . import adapter_convert, ep, reference

# FlopCounterMode counts the megamoe ops through their registered formulas.
from .custom_ops import flop_formulas as _flop_formulas  # noqa: F401
from .env import resolve_num_sms
from .heuristics import BlockMConfig, get_block_m
from .module import MegaMoE
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .ops import moe
from .side_lora import SideLoRA
from .weights import BaseWeights, prepare_base_weights
from .workspace import workspace_layout
from .wrappers.routing import (
    RoutePlan,
    check_errors,
    plan_routes,
    plan_routes_reference,
    pool_capacity,
)

__version__ = "0.1.0"

__all__ = [
    "BaseWeights",
    "BlockMConfig",
    "MegaMoE",
    "RoutePlan",
    "SideLoRA",
    "__version__",
    "adapter_convert",
    "check_errors",
    "dequantize_mxfp4",
    "ep",
    "get_block_m",
    "moe",
    "plan_routes",
    "plan_routes_reference",
    "pool_capacity",
    "prepare_base_weights",
    "quantize_mxfp4",
    "reference",
    "resolve_num_sms",
    "validation",
    "workspace_layout",
]
