#!/usr/bin/env python3
"""Generate the per-variant instantiation files and the variant table from variants.toml.

CMake runs this at configure time: one ``variant_<name>.cu`` per registry entry (each
instantiates one kernel family's templates) and ``variant_table.h`` (what the host
launchers select from). Prints the generated .cu paths, one per line.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

# How each kernel family is instantiated: its header, the kernel-table type, the
# expression that builds the table from the variant's template arguments and, optionally,
# a static_assert that the registry's other fields match the kernel.
FAMILIES = {
    "route_plan": {
        "header": "route_plan.cuh",
        "table_type": "RoutePlanKernels",
        "make": "megamoe::kernels::route_plan_kernels<{index_type}>()",
    },
    "pool_gather": {
        "header": "pool_gather.cuh",
        "table_type": "PoolGatherKernels",
        "make": "megamoe::kernels::pool_gather_kernels()",
    },
    "pool_combine": {
        "header": "pool_combine.cuh",
        "table_type": "PoolCombineKernels",
        "make": "megamoe::kernels::pool_combine_kernels()",
    },
    "mxfp4_decode": {
        "header": "mxfp4_decode.cuh",
        "table_type": "Mxfp4DecodeKernels",
        "make": "megamoe::kernels::mxfp4_decode_kernels()",
    },
    "engine": {
        "header": "engine/engine_kernel.cuh",
        "params_header": "engine/engine_params.h",
        "table_type": "EngineKernels",
        "make": "megamoe::kernels::engine_kernels<megamoe::EngineKind::{kind}, "
        "megamoe::BFormat::{b_format}, {block_m}, {block_n}>()",
    },
    "weight_stream": {
        "header": "engine/weight_stream_kernel.cuh",
        "params_header": "engine/weight_stream_params.h",
        "table_type": "WeightStreamKernels",
        "make": "megamoe::kernels::weight_stream_kernels<megamoe::StreamKind::{kind}, {tokens}>()",
        # The registry's tile columns, which the Python wrappers' shape rules read.
        "check": "static_assert(megamoe::kernels::engine::StreamConfig<megamoe::StreamKind::"
        '{kind}, {tokens}>::kColumns == {columns}, "variants.toml: {name}\'s columns");',
    },
}

BANNER = "// Generated from python/megamoe/variants.toml by tools/gen_variants.py. Do not edit.\n"


def _cpp_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value) + '"'


def _cpp_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "const char*"


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged files keep their timestamps so a re-configure rebuilds nothing.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(registry_path: Path, out_dir: Path) -> list[Path]:
    data = tomllib.loads(registry_path.read_text())
    layout = data["layout"]
    variants = data.get("variant", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    by_family: dict[str, list[dict]] = {}
    for entry in variants:
        family = FAMILIES.get(entry["family"])
        if family is None:
            sys.exit(f"variants.toml: unknown family {entry['family']!r} in {entry['name']!r}")
        params = {k: v for k, v in entry.items() if k not in ("name", "family")}
        by_family.setdefault(entry["family"], []).append(entry)
        text = (
            BANNER
            + f'#include "{family["header"]}"\n\n'
            + "namespace megamoe::variants {\n"
            + f"extern const {family['table_type']} {entry['name']};\n"
            + f"const {family['table_type']} {entry['name']} = "
            + family["make"].format(**params)
            + ";\n}  // namespace megamoe::variants\n"
        )
        if "check" in family:
            text += family["check"].format(**entry) + "\n"
        path = out_dir / f"variant_{entry['name']}.cu"
        _write_if_changed(path, text)
        sources.append(path)

    constants = [BANNER, "#pragma once\n\n", "namespace megamoe::registry {\n"]
    for key, value in layout.items():
        if isinstance(value, int):
            camel = "".join(part.capitalize() for part in key.split("_"))
            constants.append(f"inline constexpr int k{camel} = {value};\n")
    constants.append("}  // namespace megamoe::registry\n")
    _write_if_changed(out_dir / "registry_constants.h", "".join(constants))

    lines = [BANNER, "#pragma once\n", "#include <cstddef>\n"]
    params_headers = {
        FAMILIES[f].get("params_header", FAMILIES[f]["header"].replace(".cuh", "_params.h"))
        for f in by_family
    }
    for name in sorted(params_headers):
        lines.append(f'#include "{name}"\n')
    lines.append("\nnamespace megamoe::variants {\n\n")
    choices = ", ".join(str(b) for b in layout["block_m_choices"])
    lines.append(f"inline constexpr int kBlockMChoices[] = {{{choices}}};\n\n")
    for family_name, entries in by_family.items():
        family = FAMILIES[family_name]
        struct = "".join(part.capitalize() for part in family_name.split("_")) + "Variant"
        params = [k for k in entries[0] if k not in ("name", "family")]
        for entry in entries:
            lines.append(f"extern const {family['table_type']} {entry['name']};\n")
        lines.append(f"\nstruct {struct} {{\n  const char* name;\n")
        for key in params:
            lines.append(f"  {_cpp_type(entries[0][key])} {key};\n")
        lines.append(f"  const {family['table_type']}* kernels;\n}};\n\n")
        lines.append(f"inline const {struct} k{struct}s[] = {{\n")
        for entry in entries:
            # Families without template parameters have no fields between name and table.
            fields = "".join(_cpp_literal(entry[k]) + ", " for k in params)
            lines.append(f'    {{"{entry["name"]}", {fields}&{entry["name"]}}},\n')
        lines.append("};\n\n")
    names = ", ".join(f'"{v["name"]}"' for v in variants)
    lines.append(f"inline constexpr const char* kVariantNames[] = {{{names}}};\n\n")
    lines.append("}  // namespace megamoe::variants\n")
    _write_if_changed(out_dir / "variant_table.h", "".join(lines))
    return sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--registry", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for path in generate(args.registry, args.out):
        print(path)


if __name__ == "__main__":
    main()
