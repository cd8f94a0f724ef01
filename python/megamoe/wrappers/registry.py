"""The kernel variant registry, as the runtime sees it: ``megamoe/variants.toml``, at the
package's top, where CMake and the tools read it too."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant: a unique name, its family and template arguments."""

    name: str
    family: str
    params: dict[str, Any]


@dataclass(frozen=True)
class Registry:
    block_m_choices: tuple[int, ...]
    hidden_multiple: int
    intermediate_multiple: int
    route_plan_routes_per_tile: int
    route_plan_max_local_experts: int
    variants: tuple[Variant, ...]

    def family(self, family: str) -> tuple[Variant, ...]:
        return tuple(v for v in self.variants if v.family == family)


def parse_registry(text: str) -> Registry:
    """Parse and sanity-check the registry text (unique names, sorted BLOCK_M choices)."""
    data = tomllib.loads(text)
    layout = data["layout"]
    variants = []
    for entry in data.get("variant", []):
        entry = dict(entry)
        name = entry.pop("name")
        family = entry.pop("family")
        variants.append(Variant(name=name, family=family, params=entry))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variants.toml: duplicate variant names in {names}")
    block_m_choices = tuple(int(b) for b in layout["block_m_choices"])
    if list(block_m_choices) != sorted(set(block_m_choices)):
        raise ValueError("variants.toml: block_m_choices must be strictly increasing")
    return Registry(
        block_m_choices=block_m_choices,
        hidden_multiple=int(layout["hidden_multiple"]),
        intermediate_multiple=int(layout["intermediate_multiple"]),
        route_plan_routes_per_tile=int(layout["route_plan_routes_per_tile"]),
        route_plan_max_local_experts=int(layout["route_plan_max_local_experts"]),
        variants=tuple(variants),
    )


# Parsed once at import: registry() is then a plain read that torch.compile traces
# (dynamo refuses importlib.resources inside a compiled region).
_REGISTRY = parse_registry(resources.files("megamoe").joinpath("variants.toml").read_text())


def registry() -> Registry:
    """The registry shipped with this package."""
    return _REGISTRY
