"""tools/compile_variants.py without nvcc: log parsing, the checks, the baseline, the cache key.

The tool itself (nvcc + cuobjdump over every variant) runs in ``nox -s
compile_variants``; these tests pin down what it fails on, and that the committed
baseline is consistent with the registry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def _load_tool():
    sys.path.insert(0, str(TOOLS))  # compile_variants imports gen_variants
    spec = importlib.util.spec_from_file_location("compile_variants", TOOLS / "compile_variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


cv = _load_tool()

# The real lines; the first entry-function line is one past the length limit.
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7megamoe7kernels4gemmILi128EEEvNS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7megamoe7kernels4gemmILi128EEEvNS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 105 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z7offsetsv' for 'sm_90a'
ptxas info    : Function properties for _Z7offsetsv
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 50 registers, used 1 barriers, 4256 bytes smem
"""  # noqa: E501


def row(variant="gemm_v", family="engine", symbol="_Zk", **values):
    base = {
        "variant": variant,
        "family": family,
        "kernel": f"void ns::{symbol}<1>(P)",
        "symbol": symbol,
        "registers": 100,
        "smem": 0,
        "stack": 0,
        "spill_stores": 0,
        "spill_loads": 0,
        "local_memory_instructions": 0,
        "hgmma_instructions": 10,
    }
    return {**base, **values}


def test_parse_ptxas():
    kernels = cv.parse_ptxas(PTXAS_LOG)
    assert kernels == {
        "_ZN7megamoe7kernels4gemmILi128EEEvNS_6ParamsE": {
            "registers": 105,
            "smem": 0,
            "stack": 0,
            "spill_stores": 0,
            "spill_loads": 0,
            "wgmma_serialized": None,
        },
        "_Z7offsetsv": {
            "registers": 50,
            "smem": 4256,
            "stack": 16,
            "spill_stores": 8,
            "spill_loads": 4,
            "wgmma_serialized": None,
        },
    }


def test_parse_ptxas_finds_serialized_wgmma():
    log = (
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
        "the function '_Zgated'\n"
        "ptxas info    : Compiling entry function '_Zgated' for 'sm_90a'\n"
        "ptxas info    : Used 104 registers\n"
    )
    kernels = cv.parse_ptxas(log)
    assert kernels["_Zgated"]["registers"] == 104
    reason = "program dependence on compiler-inserted WG.AR in divergent path"
    assert kernels["_Zgated"]["wgmma_serialized"] == reason
    failures = cv.check_absolute([row(symbol="_Zgated", wgmma_serialized=reason)], ["gemm_v"])
    assert failures == [f"gemm_v: _Zgated<1> has its wgmma serialized by ptxas ({reason})"]


def test_count_sass():
    sass = {
        "_Zk": "  /*0010*/ HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
        "  /*0020*/ LDL.LU R2, [R1+0x4] ;\n  /*0030*/ STL.64 [R1], R4 ;\n",
        "_Zj": "  /*0010*/ FFMA R1, R2, R3, R4 ;\n",
    }
    counts = cv.count_sass(sass)
    assert {k: v[:4] for k, v in counts.items()} == {
        "_Zk": (2, 1, None, None),
        "_Zj": (0, 0, None, None),
    }
    # The last field is the SHA-256 of the kernel's SASS: equal text, equal digest.
    assert counts["_Zj"][4] == hashlib.sha256(sass["_Zj"].encode()).hexdigest()
    assert counts["_Zk"][4] != counts["_Zj"][4]


def _producer_sass(rotated: bool) -> str:
    """A streaming producer's loop of one step at 0x100: the words from the slot's pairs
    (R20), the slot's next load (into R20, or into R12 copied back within the step),
    the stage's words and the arrival, then the back edge."""
    load_into = "R12" if rotated else "R20"
    lines = [
        "PRMT R6, R20, 0x4140, RZ",
        f"LDG.E.U16.CONSTANT {load_into}, desc[UR4][R2.64]",
        "STS [R17+UR8+0x5000], R6",
        "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR9], RZ",
        *(["IMAD.MOV.U32 R20, RZ, RZ, R12"] if rotated else []),
        "@!P1 BRA 0x100",
    ]
    return "\n".join(f"  /*{0x100 + 16 * n:04x}*/ {line} ;" for n, line in enumerate(lines))


@pytest.mark.parametrize("rotated", [True, False])
def test_count_sass_finds_a_producer_waiting_for_its_own_loads(rotated):
    name = "_ZN7megamoe7kernels20weight_stream_kernelILi0ELi32EEEvNS_18WeightStreamParamsE"
    (counts,) = cv.count_sass({name: _producer_sass(rotated)}).values()
    assert counts[:4] == (0, 0, 1 if rotated else 0, None)


def _epilogue_sass(batched: bool) -> str:
    """A streaming producer loop (no early reads), then an epilogue over eight rows: each
    row's g and u loads then its dg and du stores, or all sixteen loads first."""
    loads = [f"LDG.E.64.STRONG.GPU R{40 + 2 * k}, desc[UR4][R{10 + k}.64]" for k in range(16)]
    stores = [f"STG.E.64 desc[UR4][R{60 + k}.64], R{40 + 2 * k}" for k in range(16)]
    if batched:
        epilogue = loads + stores
    else:
        epilogue = [
            line
            for k in range(8)
            for line in (*loads[2 * k : 2 * k + 2], *stores[2 * k : 2 * k + 2])
        ]
    start = 0x100 + 16 * len(_producer_sass(False).splitlines())
    tail = "\n".join(f"  /*{start + 16 * n:04x}*/ {line} ;" for n, line in enumerate(epilogue))
    return _producer_sass(False) + "\n" + tail


@pytest.mark.parametrize("batched", [True, False])
def test_count_sass_finds_an_epilogue_loading_a_row_at_a_time(batched):
    name = "_ZN7megamoe7kernels20weight_stream_kernelILi3ELi32EEEvNS_18WeightStreamParamsE"
    (counts,) = cv.count_sass({name: _epilogue_sass(batched)}).values()
    assert counts[:4] == (0, 0, 0, 16.0 if batched else 2.0)


@pytest.mark.parametrize(
    "pretty,short",
    [
        (
            "void megamoe::kernels::grouped_gemm_kernel<128, 256, (megamoe::Epilogue)1>"
            "(megamoe::GroupedGemmParams)",
            "grouped_gemm_kernel<128, 256, (megamoe::Epilogue)1>",
        ),
        ("megamoe::kernels::route_plan_count<int>(P)", "route_plan_count<int>"),
        ("_Z7offsetsv", "_Z7offsetsv"),
    ],
)
def test_short_name(pretty, short):
    assert cv.short_name(pretty) == short


def test_absolute_checks():
    rows = [
        row(),
        row(symbol="_Zspill", spill_stores=8),
        row(symbol="_Zlocal", local_memory_instructions=3),
        row(symbol="_Znohgmma", hgmma_instructions=0),
        row(variant="pool", family="pool_gather", symbol="_Zpool", hgmma_instructions=0),
        row(symbol="_Znosass", local_memory_instructions=None, hgmma_instructions=None),
        row(variant="ws", family="weight_stream", symbol="_Zws", producer_loads_read_in_step=0),
        row(variant="ws", family="weight_stream", symbol="_Zwait", producer_loads_read_in_step=8),
        row(variant="ws", family="weight_stream", symbol="_Zbatch", epilogue_loads_per_round=16.0),
        row(variant="ws", family="weight_stream", symbol="_Zrows", epilogue_loads_per_round=2.0),
    ]
    failures = cv.check_absolute(rows, ["gemm_v", "pool", "empty_v", "ws"])
    assert len(failures) == 6
    assert "empty_v: defines no kernel" in failures[0]
    assert "_Zspill<1> spills registers (8 B stored, 0 B loaded)" in failures[1]
    assert "_Zlocal<1> has 3 LDL/STL instructions" in failures[2]
    assert "_Znohgmma<1> issues no HGMMA" in failures[3]
    assert "_Zwait<1>: its producer waits for its scale loads too soon (8:" in failures[4]
    assert "_Zrows<1>: its epilogue issues 2.0 loads per round" in failures[5]


def test_baseline_comparison():
    baseline = {
        "kernels": [
            row(symbol="_Za"),
            row(symbol="_Zb"),
            row(symbol="_Zc", smem=1024),
            row(symbol="_Zd", stack=0),
            row(symbol="_Zgone"),
        ]
    }
    rows = [
        row(symbol="_Za", registers=108),  # within the tolerance of 8
        row(symbol="_Zb", registers=109),  # one past it
        row(symbol="_Zc", smem=1040),
        row(symbol="_Zd", stack=16),
        row(symbol="_Znew"),
    ]
    failures, notes = cv.compare_to_baseline(rows, baseline, tolerance=8)
    assert failures == [
        "gemm_v: _Zb<1> uses 109 registers, baseline 100 (tolerance +8)",
        "gemm_v: _Zc<1> smem grew from 1024 to 1040 bytes",
        "gemm_v: _Zd<1> stack grew from 0 to 16 bytes",
        "gemm_v: _Znew<1> is not in the baseline (new kernel: record it with --update-baseline)",
    ]
    assert "gemm_v: _Za<1> registers 100 -> 108" in notes
    assert any("_Zgone is in the baseline but was not built" in n for n in notes)
    # Fewer resources never fail; they are reported so the baseline can be tightened.
    better = [row(symbol=s, registers=90, smem=0) for s in ("_Za", "_Zb", "_Zc", "_Zd")]
    failures, notes = cv.compare_to_baseline(better, baseline, tolerance=0)
    assert failures == [] and "gemm_v: _Zc<1> smem 1024 -> 0 bytes" in notes


def test_compare_sass_names_every_kernel_that_differs():
    reference = [
        row(symbol="_Za", sass_sha256="aa"),
        row(symbol="_Zb", sass_sha256="bb"),
        row(symbol="_Zgone", sass_sha256="gg"),
    ]
    rows = [
        row(symbol="_Za", sass_sha256="aa"),  # the same
        row(symbol="_Zb", sass_sha256="b2"),  # changed
        row(symbol="_Znew", sass_sha256="nn"),  # only in this run
    ]
    assert cv.compare_sass(rows, reference) == [
        "gemm_v: _Zb<1>: SASS differs from the reference run's",
        "gemm_v: _Znew<1>: not built by the reference run",
        "gemm_v: _Zgone<1> built by the reference run only",
    ]
    assert cv.same_sass_count(rows, reference) == 1
    assert cv.compare_sass(rows[:1], reference[:1]) == []
    # A run without SASS (no cuobjdump, or no listing for the kernel) vouches for nothing,
    # even against another run without it.
    (failure,) = cv.compare_sass([row(symbol="_Za", sass_sha256=None)], reference[:1])
    assert failure.startswith("gemm_v: _Za<1>: no SASS digest in one of the runs")
    both_missing = [row(symbol="_Za", sass_sha256=None)]
    assert len(cv.compare_sass(both_missing, both_missing)) == 1
    assert cv.same_sass_count(both_missing, both_missing) == 0


def test_baseline_document_round_trip(tmp_path):
    rows = [row(symbol="_Zb"), row(symbol="_Za", variant="a_v")]
    doc = cv.baseline_document(rows, {"nvcc": "release 13.0"}, 8)
    assert [k["symbol"] for k in doc["kernels"]] == ["_Za", "_Zb"]
    assert "family" not in doc["kernels"][0] and doc["register_tolerance"] == 8
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(doc))
    assert cv.load_baseline(path) == doc
    with pytest.raises(FileNotFoundError, match="--update-baseline"):
        cv.load_baseline(tmp_path / "missing.json")
    path.write_text(json.dumps({**doc, "schema": 99}))
    with pytest.raises(ValueError, match="expected schema 1"):
        cv.load_baseline(path)


def test_cache_key_follows_included_headers_only(tmp_path):
    kernels, generated = tmp_path / "kernels", tmp_path / "generated"
    kernels.mkdir()
    generated.mkdir()
    (kernels / "family.cuh").write_text('#include "family_params.h"\n#include <cute/tensor.hpp>\n')
    (kernels / "family_params.h").write_text("struct P {};\n")
    (kernels / "other.cuh").write_text("// another family\n")
    source = generated / "variant_x.cu"
    source.write_text('#include "family.cuh"\n')
    dirs = [kernels, generated]
    assert cv.local_headers(source, dirs) == sorted(
        [(kernels / "family.cuh").resolve(), (kernels / "family_params.h").resolve()]
    )
    toolchain = {"nvcc": "release 13.0", "cutlass": "4.2.0.0", "flags": "-O3"}
    key = cv.cache_key(source, dirs, toolchain)
    (kernels / "other.cuh").write_text("// changed, but not included\n")
    assert cv.cache_key(source, dirs, toolchain) == key
    (kernels / "family_params.h").write_text("struct P { int x; };\n")
    changed = cv.cache_key(source, dirs, toolchain)
    assert changed != key
    assert cv.cache_key(source, dirs, {**toolchain, "nvcc": "release 13.1"}) != changed


def test_committed_baseline_covers_the_registry_and_passes_the_absolute_checks():
    baseline = cv.load_baseline(cv.DEFAULT_BASELINE)
    registry = tomllib.loads(cv.REGISTRY.read_text())["variant"]
    families = {v["name"]: v["family"] for v in registry}
    recorded = {k["variant"] for k in baseline["kernels"]}
    missing = sorted(set(families) - recorded)
    assert not missing, f"variants without a baseline entry (run --update-baseline): {missing}"
    rows = [
        {**k, "family": families[k["variant"]]}
        for k in baseline["kernels"]
        if k["variant"] in families
    ]
    assert cv.check_absolute(rows, list(families)) == []
    assert all(k["hgmma_instructions"] is not None for k in baseline["kernels"])
    assert baseline["register_tolerance"] == cv.DEFAULT_REGISTER_TOLERANCE
