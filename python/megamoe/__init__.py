"""megamoe: fused Mixture-of-Experts training kernels for NVIDIA Hopper.

Public API (DESIGN §5): ``moe`` (fused forward and backward, EP1, BF16 base; MXFP4
and the fused EP path are later issues), the ``MegaMoE`` module, the weight/adapter
containers and adapter-layout converters (``megamoe.adapter_convert``), the MXFP4
quantizer, the host heuristics and the workspace, the route plan, the float64 oracle
(``megamoe.reference``) and the testing helpers (``megamoe.testing``).
"""

from . import adapter_convert, ep, reference
from .env import resolve_num_sms
from .heuristics import BlockMConfig, get_block_m, get_block_n
from .module import MegaMoE
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .ops import moe
from .routing import RoutePlan, plan_routes, plan_routes_reference, pool_capacity
from .side_lora import SideLoRA
from .weights import BaseWeights, prepare_base_weights
from .workspace import Workspace, get_workspace_size, workspace_layout

__version__ = "0.1.0"

__all__ = [
    "BaseWeights",
    "BlockMConfig",
    "MegaMoE",
    "RoutePlan",
    "SideLoRA",
    "Workspace",
    "__version__",
    "adapter_convert",
    "dequantize_mxfp4",
    "ep",
    "get_block_m",
    "get_block_n",
    "get_workspace_size",
    "moe",
    "plan_routes",
    "plan_routes_reference",
    "pool_capacity",
    "prepare_base_weights",
    "quantize_mxfp4",
    "reference",
    "resolve_num_sms",
    "workspace_layout",
]
