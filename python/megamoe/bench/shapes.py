"""Benchmark shape presets (docs/DESIGN.md §7) and what they cost in memory."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megamoe.testing.inputs import LayerInputs

#: Bytes per weight element of a prepared base: BF16, or MXFP4's half-byte E2M1 code
#: plus one UE8M0 scale byte per 32 elements (0.27x BF16).
BASE_BYTES_PER_ELEMENT = {"bf16": 2.0, "mxfp4": 0.5 + 1 / 32}
_DTYPE_BYTES = {"bf16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Shape:
    """One rank's layer: ``num_tokens`` tokens over ``num_local_experts`` experts."""

    name: str
    num_tokens: int
    hidden: int
    intermediate: int
    num_local_experts: int
    top_k: int
    side_rank: int
    description: str

    @property
    def num_routes(self) -> int:
        return self.num_tokens * self.top_k

    def with_tokens(self, num_tokens: int) -> Shape:
        """The same dims with ``num_tokens`` tokens (a point of a token sweep)."""
        return dataclasses.replace(self, num_tokens=num_tokens)

    def weight_bytes(self, format: str) -> int:
        """Bytes of the prepared base ``w13 + w2`` (``[E_l, 2I, H]`` and ``[E_l, H, I]``)
        in ``format`` (``"bf16"`` or ``"mxfp4"``, scales included): what one pass must
        read at least once, the weight-read floor's numerator."""
        elements = self.num_local_experts * 3 * self.hidden * self.intermediate
        return round(elements * BASE_BYTES_PER_ELEMENT[format])

    def make_layer(self, *, ordinary: bool, **kwargs) -> LayerInputs:
        """:func:`megamoe.testing.make_layer` at this shape: side-LoRA of ``side_rank``,
        or no adapters in ordinary mode; ``kwargs`` go through (device, grads, ..)."""
        from megamoe.testing.inputs import make_layer

        return make_layer(
            self.hidden,
            self.intermediate,
            self.num_local_experts,
            self.top_k,
            None if ordinary else self.side_rank,
            num_tokens=self.num_tokens,
            **kwargs,
        )


def estimate_peak_bytes(shape: Shape, *, compute: str, mode: str, format: str) -> int:
    """An upper estimate of the memory one forward + backward of the bench takes.

    Args:
        shape: the layer.
        compute: the backend's element type: ``"bf16"`` (fused; baseline on a GPU),
            ``"float32"`` (baseline on a CPU, reference on a GPU) or ``"float64"``
            (reference on a CPU).
        mode: ``"side-lora"`` or ``"ordinary"`` (weight gradients too).
        format: ``"bf16"`` or ``"mxfp4"`` base.

    Returns:
        Bytes: the layer's weights in the compute type plus the prepared base (the
        bench builds both), the adapters and their gradients, four ``[T, H]`` token
        tensors (x, dout, out, dx), and per route the forward's saved rows (gathered
        ``x``, ``g|u``, ``h``, ``y``: ``2H + 3I``) and as much again of backward
        temporaries. At ep4rank (29.2 GiB in BF16) the peaks measured on an H200
        are 0.5x this for the fused side-LoRA layer (14.6 GiB) and 0.77x for the BF16
        baseline (22.5 GiB): a bound to compare with the memory at hand, not a
        prediction.
    """
    d = _DTYPE_BYTES[compute]
    h, i, e = shape.hidden, shape.intermediate, shape.num_local_experts
    weights = e * 3 * h * i * d + shape.weight_bytes(format)
    if mode == "ordinary":
        weights += e * 3 * h * i * d  # their gradients
    rank = 0 if mode == "ordinary" else shape.side_rank
    adapters = 2 * (3 * h * rank + 3 * e * rank * i) * d  # values and gradients
    tokens = 4 * shape.num_tokens * h * d
    routes = 2 * shape.num_routes * (2 * h + 3 * i) * d
    return weights + adapters + tokens + routes


def host_memory_available() -> int | None:
    """Bytes of host memory available to a new allocation (Linux ``MemAvailable``), or
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


SHAPES = {
    # Small enough for the reference and the baseline on a CPU in seconds.
    "small": Shape("small", 256, 256, 128, 8, 2, 16, "CPU-sized smoke shape"),
    # One EP4 rank of the production layer (DeepSeek-V4-Flash class): 65,536 tokens,
    # 64 of 256 experts, top-6, r = 128.
    "ep4rank": Shape(
        "ep4rank", 65536, 4096, 2048, 64, 6, 128, "one EP4 rank of the production layer"
    ),
    # The whole production layer on one GPU: the same tokens per GPU, all 256 experts.
    "ep1": Shape("ep1", 65536, 4096, 2048, 256, 6, 128, "production layer, all experts local"),
}


def add_shape_and_mode(parser: argparse.ArgumentParser, *, mode_help: str) -> None:
    """``--shape`` (a preset, default ep4rank) and ``--mode`` (side-lora or ordinary),
    the per-stage tools' common options (``megamoe.bench.breakdown``, ``.memory``)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="ep4rank",
                        help="bench shape (default: ep4rank)")  # fmt: skip
    parser.add_argument("--mode", choices=("side-lora", "ordinary"), default="side-lora",
                        help=f"{mode_help} (default: side-lora)")  # fmt: skip
