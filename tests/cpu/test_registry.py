"""The variant registry: one file read by CMake (via the generator) and the runtime."""

import importlib.util
import sys
from pathlib import Path

import pytest

from megamoe.wrappers.registry import parse_registry, registry

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_variants", ROOT / "tools/gen_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_registry_parses_and_is_small():
    reg = registry()
    assert 1 <= len(reg.variants) <= 40  # DESIGN §2 variant budget
    assert reg.block_m_choices == tuple(sorted(reg.block_m_choices))
    assert all(b % 64 == 0 for b in reg.block_m_choices)  # wgmma M is 64 per warpgroup
    assert reg.family("route_plan")


def test_generator_writes_one_source_per_variant(tmp_path):
    sources = load_generator().generate(ROOT / "python/megamoe/variants.toml", tmp_path)
    assert sorted(p.name for p in sources) == sorted(
        f"variant_{v.name}.cu" for v in registry().variants
    )
    table = (tmp_path / "variant_table.h").read_text()
    for variant in registry().variants:
        assert f'"{variant.name}"' in table
    constants = (tmp_path / "registry_constants.h").read_text()
    assert f"kRoutePlanRoutesPerTile = {registry().route_plan_routes_per_tile}" in constants


def test_weight_stream_variants_name_their_tile_columns(tmp_path):
    """Each weight-streaming variant names its tile's output columns, which the wrappers'
    shape rules read; its generated source checks them against the kernel's
    StreamConfig::kColumns at compile time (tools/compile_variants.py builds them)."""
    variants = registry().family("weight_stream")
    assert variants and all(v.params["columns"] in (64, 128, 256) for v in variants)
    load_generator().generate(ROOT / "python/megamoe/variants.toml", tmp_path)
    for v in variants:
        kind, tokens, columns = v.params["kind"], v.params["tokens"], v.params["columns"]
        source = (tmp_path / f"variant_{v.name}.cu").read_text()
        assert f"StreamKind::{kind}, {tokens}>::kColumns == {columns}" in source


def test_generator_rewrites_nothing_when_unchanged(tmp_path):
    generator = load_generator()
    generator.generate(ROOT / "python/megamoe/variants.toml", tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    generator.generate(ROOT / "python/megamoe/variants.toml", tmp_path)
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}


def test_generator_rejects_unknown_family(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (ROOT / "python/megamoe/variants.toml").read_text()
        + '\n[[variant]]\nname = "x"\nfamily = "no_such_family"\n'
    )
    with pytest.raises(SystemExit, match="unknown family"):
        load_generator().generate(bad, tmp_path / "out")


def test_duplicate_names_are_rejected():
    text = (ROOT / "python/megamoe/variants.toml").read_text()
    with pytest.raises(ValueError, match="duplicate"):
        parse_registry(text + '\n[[variant]]\nname = "route_plan_i32"\nfamily = "route_plan"\n')


def test_unsorted_block_m_choices_are_rejected():
    text = (ROOT / "python/megamoe/variants.toml").read_text()
    text = text.replace("block_m_choices = [64, 128]", "block_m_choices = [128, 64]")
    with pytest.raises(ValueError, match="block_m_choices"):
        parse_registry(text)


def test_compiled_module_agrees_with_registry():
    try:
        from megamoe import _C
    except ImportError:
        pytest.skip("megamoe._C not built")
    reg = registry()
    assert list(_C.variant_names()) == [v.name for v in reg.variants]
    assert tuple(_C.block_m_choices()) == reg.block_m_choices
    from megamoe.wrappers.routing import route_plan_num_tiles

    for routes in (1, 2047, 2048, 2049, 393216):
        assert _C.route_plan_num_tiles(routes) == route_plan_num_tiles(routes)


def test_module_is_importable_without_a_gpu():
    if "megamoe._C" not in sys.modules:
        try:
            import megamoe._C  # noqa: F401
        except ImportError:
            pytest.skip("megamoe._C not built")
    from megamoe import _C

    assert _C.cuda_runtime_version() >= 13000
