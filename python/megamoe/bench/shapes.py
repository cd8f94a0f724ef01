"""Benchmark shape presets (DESIGN §7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megamoe.testing.inputs import LayerInputs


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
