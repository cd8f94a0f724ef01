"""megamoe.testing.sanitizer on the CPU: report parser, command line, tool lookup, CLI.

The canned reports follow compute-sanitizer's documented text format (CUDA 12/13:
``at kernel+0xOFF in file:line``; line-wrapped racecheck analysis records; device
frames) and the older cuda-memcheck one (``at 0xOFF in file:line:kernel``). A fake
compute-sanitizer (a small Python script) drives the whole run path without a GPU.
"""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from megamoe.testing import sanitizer
from megamoe.testing.sanitizer import (
    ERROR_EXITCODES,
    OWN_KERNELS_ONLY,
    TOOLS,
    Finding,
    is_other_librarys_kernel,
    kernel_display_name,
    parse_report,
)

GEMM = (
    "void megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>"
    "(megamoe::GroupedGemmParams)"
)
GATHER = "void megamoe::kernels::pool_gather_rows<4>(megamoe::PoolGatherParams)"


def _report(body: str) -> str:
    """Every line of ``body`` with compute-sanitizer's 9-character prefix."""
    lines = textwrap.dedent(body).strip("\n").splitlines()
    return "\n".join("=========" + (" " + line if line else "") for line in lines) + "\n"


MEMCHECK = _report(
    f"""
    COMPUTE-SANITIZER
    Invalid __global__ write of size 4 bytes
        at {GEMM}+0x1a30 in /src/megamoe/kernels/grouped_gemm.cuh:412
        by thread (128,0,0) in block (3,0,0)
        Address 0x7f3a2c001000 is out of bounds
        and is 1 bytes after the nearest allocation at 0x7f3a2c000000 of size 4,095 bytes
        Device Frame: {GEMM}+0x1a30 in /src/megamoe/kernels/grouped_gemm.cuh:412

    Invalid __global__ write of size 4 bytes
        at {GEMM}+0x1a30 in /src/megamoe/kernels/grouped_gemm.cuh:412
        by thread (129,0,0) in block (3,0,0)
        Address 0x7f3a2c001004 is out of bounds
        and is 5 bytes after the nearest allocation at 0x7f3a2c000000 of size 4,095 bytes

    Invalid __shared__ read of size 16 bytes
        at megamoe::kernels::load_row(const uint4 *)+0x90 in pool_gather.cuh:88
        by thread (5,0,0) in block (0,0,0)
        Address 0x10400 is out of bounds
        Device Frame: megamoe::kernels::load_row(const uint4 *)+0x90 in pool_gather.cuh:88
        Device Frame: {GATHER}+0x3c0 in pool_gather.cuh:120

    Invalid __global__ read of size 2 bytes
        at unaligned_kernel():0x160 in memcheck_demo.cu:6
        by thread (0,0,0) in block (0,0,0)
        Address 0x7f6510c00001 is misaligned

    Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
        Saved host backtrace up to driver entry point at error
            Host Frame: [0x2774ec]
                   in /lib/x86_64-linux-gnu/libcuda.so.1

    Target application returned an error
    ERROR SUMMARY: 5 errors
    """  # noqa: E501
)

# cuda-memcheck era: "at 0xOFF in file:line:function" and "Device Frame:f (f : 0xOFF)".
MEMCHECK_OLD = _report(
    """
    CUDA-MEMCHECK
    Invalid __global__ read of size 8
        at 0x000000c8 in /home/user/src/my_helper.cuh:75:void vector_projection<double>(double*, int)
        by thread (9,0,0) in block (0,0,0)
        Address 0x000370e8 is out of bounds
        Device Frame:void vector_projection<double>(double*, int) (void vector_projection<double>(double*, int) : 0xc8)

    Invalid __local__ write of size 4
        at 0x00000028 in kernel_without_lineinfo(int*)
        by thread (1,0,0) in block (0,0,0)
        Address 0x00fffd0c is out of bounds

    Malloc/Free error encountered : Double free
        at 0x79d8
        by thread (0,0,0) in block (0,0,0)
        Address 0x400aff920

    ERROR SUMMARY: 3 errors
    """  # noqa: E501
)

# Analysis reports: one wrapped over several lines (long names), one on a line, one warning.
RACECHECK = _report(
    f"""
    COMPUTE-SANITIZER
    Error: Race reported between Write access at
        {GEMM}+0x2b40 in /src/megamoe/kernels/grouped_gemm.cuh:301
        and Read access at
        {GEMM}+0x2c10 in /src/megamoe/kernels/grouped_gemm.cuh:318 [4096 hazards]
        and Write access at
        {GEMM}+0x2b40 in /src/megamoe/kernels/grouped_gemm.cuh:301 [12 hazards]

    Error: Race reported between Read access at race_kernel(float *)+0x90 in race.cu:14 and Write access at race_kernel(float *)+0xa0 in race.cu:15 [32 hazards]

    Warning: Race reported between Write access at warp_sum(int *)+0x50 in sum.cu:8
        and Read access at warp_sum(int *)+0x60 in sum.cu:9 [4 hazards]

    RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
    """  # noqa: E501
)

# The layer's racecheck run with the adapters' cuBLAS GEMMs: records inside an nvjet
# kernel (cuBLAS's) beside one in a megamoe kernel.
NVJET = "nvjet_sm90_tss_64x32_64x16_1x4_h_bz_NTT"
RACECHECK_WITH_CUBLAS = _report(
    f"""
    COMPUTE-SANITIZER
    Error: Race reported between Write access at {NVJET}+0x1f70
        and Read access at {NVJET}+0x2a30 [16 hazards]

    Error: Race reported between Write access at {GEMM}+0x2b40 in /src/megamoe/kernels/grouped_gemm.cuh:301
        and Read access at {GEMM}+0x2c10 in /src/megamoe/kernels/grouped_gemm.cuh:318 [8 hazards]

    Warning: Race reported between Write access at {NVJET}+0x1f80
        and Read access at {NVJET}+0x2a40 [2 hazards]

    RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
    """  # noqa: E501
)

RACECHECK_HAZARD = _report(
    """
    COMPUTE-SANITIZER
    ERROR: Potential WAW hazard detected at __shared__ 0x0 in block (0,0,0) :
        Write Thread (0,0,0) at WAW()+0x2f0 in raceWAW.cu:20
        Write Thread (1,0,0) at WAW()+0x2f0 in raceWAW.cu:20
        Current Value : 1, Incoming Value : 2

    WARN: Potential RAW hazard detected at __shared__ 0x4 in block (0,0,0) :
        Write Thread (31,0,0) at 0x00000070 in raceRAW.cu:18:RAW(void)
        Read Thread (0,0,0) at 0x00000090 in raceRAW.cu:19:RAW(void)

    RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
    """
)

INITCHECK = _report(
    f"""
    COMPUTE-SANITIZER
    Uninitialized __global__ memory read of size 16 bytes
        at {GATHER}+0x2a0 in pool_gather.cuh:97
        by thread (0,0,0) in block (2,0,0)
        Address 0x7f3a2c000100

    Uninitialized __global__ memory read of size 16 bytes
        at {GATHER}+0x2a0 in pool_gather.cuh:97
        by thread (1,0,0) in block (2,0,0)
        Address 0x7f3a2c000110

    Uninitialized __shared__ memory read of size 4 bytes
        at KernelSharedError()+0x1a0 in uninitialized_shared.cu:7
        by thread (0,0,0) in block (0,0,0)
        Address 0x0

    Unused __global__ memory in allocation 0x7fed9f400000 of size 100 bytes
        Not written 80 bytes at offset 0x14 (0x7fed9f400014)
        80% of allocation were unused.

    ERROR SUMMARY: 3 errors
    """
)

SYNCCHECK = _report(
    """
    COMPUTE-SANITIZER
    Barrier error detected. Divergent thread(s) in block.
        at route_plan_offsets<int>(megamoe::RoutePlanParams<int>)+0x15520 in route_plan.cuh:140
        by thread (128,0,0) in block (0,0,0)

    Barrier error detected. Divergent thread(s) in warp
        at 0x00000130 in divergence.cu:61:threadDivergence(float *)
        by thread (37,0,0) in block (0,0,0)

    Barrier error detected. Invalid arguments
        at bad_mask(int *)+0x40 in mask.cu:12
        by thread (3,0,0) in block (0,0,0)

    Warpgroup MMA sequence error detected. Warps of the warpgroup issued different wgmma instructions.
        at mma_kernel()+0x880 in mma.cu:30
        by thread (64,0,0) in block (0,0,0)

    ERROR SUMMARY: 4 errors
    """  # noqa: E501
)

LEAKS = _report(
    """
    COMPUTE-SANITIZER
    Leaked 64 bytes at 0x400200200
        Saved host backtrace up to driver entry point at cudaMalloc time
            Host Frame: cudaMalloc [0x527bb] in app

    LEAK SUMMARY: 64 bytes leaked in 1 allocations
    ERROR SUMMARY: 1 error
    """
)

CLEAN = _report(
    """
    COMPUTE-SANITIZER
    ERROR SUMMARY: 0 errors
    """
)

CLEAN_RACECHECK = _report(
    """
    COMPUTE-SANITIZER
    RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
    """
)


# ------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name,expected",
    [
        (GEMM, "megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>"),
        ("RAW()", "RAW"),
        ("kernel_name+0x15520", "kernel_name"),
        ("void vector_projection<double>(double*, int)", "vector_projection<double>"),
        ("(anonymous namespace)::helper(int (*)(int))", "(anonymous namespace)::helper"),
        ("plain", "plain"),
    ],
)
def test_kernel_display_name(name: str, expected: str) -> None:
    assert kernel_display_name(name) == expected


# ------------------------------------------------------------------------ parser


def test_memcheck_summary_per_kernel() -> None:
    report = parse_report(MEMCHECK)
    assert report.error_summary == 5
    assert report.errors == 5 and report.warnings == 0 and report.complete
    assert report.summary() == {
        "<host>": {"CUDA API error cudaErrorLaunchFailure in cudaStreamSynchronize": 1},
        "megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>": {
            "Invalid __global__ write": 2
        },
        # The fault is in an inlined device function; the kernel is its last frame.
        "megamoe::kernels::pool_gather_rows<4>": {"Invalid __shared__ read": 1},
        "unaligned_kernel": {"Invalid __global__ read": 1},
    }
    gemm = report.findings[0]
    assert gemm.location == "/src/megamoe/kernels/grouped_gemm.cuh:412"
    assert "by thread (128,0,0) in block (3,0,0)" in gemm.text
    shared = report.findings[2]
    assert shared.function == "megamoe::kernels::load_row(const uint4 *)"
    assert "Target application returned an error" in report.notes


def test_memcheck_old_format() -> None:
    report = parse_report(MEMCHECK_OLD)
    assert report.errors == 3
    assert report.summary() == {
        "<unattributed>": {"Malloc/Free error: Double free": 1},
        "kernel_without_lineinfo": {"Invalid __local__ write": 1},
        "vector_projection<double>": {"Invalid __global__ read": 1},
    }
    first = report.findings[0]
    assert first.location == "/home/user/src/my_helper.cuh:75"
    assert first.function == "void vector_projection<double>(double*, int)"


def test_racecheck_analysis_records() -> None:
    report = parse_report(RACECHECK)
    assert report.racecheck_summary == {"displayed": 3, "errors": 2, "warnings": 1}
    assert report.errors == 2 and report.warnings == 1
    assert report.summary() == {
        "megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>": {
            "Race reported between Write and Read access": 1
        },
        "race_kernel": {"Race reported between Read and Write access": 1},
        "warp_sum": {"Race reported between Write and Read access (warning)": 1},
    }
    wrapped = report.findings[0]
    assert wrapped.hazards == 4096 + 12
    assert wrapped.location == "/src/megamoe/kernels/grouped_gemm.cuh:301"
    assert [f.severity for f in report.findings] == ["error", "error", "warning"]
    assert report.summary(include_warnings=False).keys() == {
        "megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>",
        "race_kernel",
    }


@pytest.mark.parametrize(
    "kernel,other",
    [
        (NVJET, True),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", True),
        ("cublasLt::splitKreduce_kernel<32, 16, int, float>", True),
        ("at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", True),
        ("cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<int>>", True),
        ("megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>", False),
        # Inlined CUTLASS/CuTe code of ours, or a kernel of no known library, counts.
        ("cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_RS<>::fma", False),
        ("cutlass::device_kernel<megamoe::Gemm>", False),
        ("race_kernel", False),
        ("<unattributed>", False),
        ("<host>", False),
    ],
)
def test_other_librarys_kernels(kernel: str, other: bool) -> None:
    assert is_other_librarys_kernel(kernel) is other


def test_racecheck_judges_own_kernels_only() -> None:
    """Under racecheck (OWN_KERNELS_ONLY) cuBLAS's records are listed, not counted;
    every other tool counts them."""
    assert sorted(OWN_KERNELS_ONLY) == ["racecheck"]
    counted = parse_report(RACECHECK_WITH_CUBLAS)
    assert counted.errors == 2 and counted.warnings == 1 and counted.not_judged == []
    own = parse_report(RACECHECK_WITH_CUBLAS, own_kernels_only=True)
    assert own.errors == 1 and own.warnings == 0
    assert [f.kernel for f in own.not_judged] == [NVJET, NVJET]
    assert own.summary() == counted.summary()  # every record stays in the table
    table = own.format_summary()
    assert f"| `{NVJET}` | Race reported between Write and Read access | 1 |" in table
    assert f"not judged: 2 record(s) in other libraries' kernels (`{NVJET}`)" in table
    data = own.to_dict()
    assert data["errors"] == 1 and data["not_judged"] == 2 and data["own_kernels_only"]
    assert len(data["findings"]) == 3
    # Only cuBLAS's records: nothing to count.
    only_cublas = RACECHECK_WITH_CUBLAS.replace(GEMM, NVJET)
    assert parse_report(only_cublas, own_kernels_only=True).errors == 0
    # Records past --print-limit: their kernels are unknown, so none is left out. The
    # summary counts the displayed records; the tool says how many it did not print.
    past_limit = RACECHECK_WITH_CUBLAS.replace(GEMM, NVJET).replace(
        "RACECHECK SUMMARY",
        "ERROR SUMMARY: 7 errors were not printed. Use --print-limit option to adjust "
        "the number of printed errors\n========= RACECHECK SUMMARY",
    )
    unprinted = parse_report(past_limit, own_kernels_only=True)
    assert unprinted.unprinted == 7 and unprinted.errors == 2 + 7
    assert unprinted.to_dict()["unprinted"] == 7
    # Nothing is left out, so nothing is listed as left out.
    assert unprinted.not_judged == [] and "not judged" not in unprinted.format_summary()
    # Every process prints its own summary (--target-processes all): they add up, and a
    # later clean process does not hide an earlier one's records.
    two = parse_report(RACECHECK_WITH_CUBLAS + CLEAN_RACECHECK, own_kernels_only=True)
    assert two.racecheck_summary == {"displayed": 3, "errors": 2, "warnings": 1}
    assert two.errors == 1
    memcheck_twice = parse_report(MEMCHECK + CLEAN)
    assert memcheck_twice.error_summary == 5 and memcheck_twice.errors == 5


def test_racecheck_hazard_records() -> None:
    report = parse_report(RACECHECK_HAZARD)
    assert report.errors == 1 and report.warnings == 1
    assert report.summary() == {
        "RAW": {"Potential RAW hazard (warning)": 1},
        "WAW": {"Potential WAW hazard": 1},
    }
    assert report.findings[1].location == "raceRAW.cu:18"


def test_initcheck_records() -> None:
    report = parse_report(INITCHECK)
    assert report.errors == 3 and report.warnings == 1
    assert report.summary() == {
        "<host>": {"Unused __global__ memory (warning)": 1},
        "KernelSharedError": {"Uninitialized __shared__ memory read": 1},
        "megamoe::kernels::pool_gather_rows<4>": {"Uninitialized __global__ memory read": 2},
    }


def test_synccheck_records() -> None:
    report = parse_report(SYNCCHECK)
    assert report.errors == 4
    assert report.summary() == {
        "bad_mask": {"Barrier error: Invalid arguments": 1},
        "mma_kernel": {
            "Warpgroup MMA sequence error: Warps of the warpgroup issued different "
            "wgmma instructions": 1
        },
        "route_plan_offsets<int>": {"Barrier error: Divergent thread(s) in block": 1},
        "threadDivergence": {"Barrier error: Divergent thread(s) in warp": 1},
    }


def test_leaks_and_clean_reports() -> None:
    leaks = parse_report(LEAKS)
    assert leaks.errors == 1 and leaks.summary() == {"<host>": {"Leaked allocation": 1}}
    assert leaks.leak_summary == "LEAK SUMMARY: 64 bytes leaked in 1 allocations"
    for text in (CLEAN, CLEAN_RACECHECK):
        clean = parse_report(text)
        assert clean.errors == 0 and clean.findings == [] and clean.complete
        assert "| (none) | | 0 |" in clean.format_summary()


def test_summary_counts_past_the_print_limit() -> None:
    # The tool stops printing records at --print-limit but its summary counts all, then
    # says how many it did not print (a second "ERROR SUMMARY" line, not the total).
    text = MEMCHECK.replace(
        "ERROR SUMMARY: 5 errors",
        "ERROR SUMMARY: 1234 errors\n========= ERROR SUMMARY: 1229 errors were not printed. "
        "Use --print-limit option to adjust the number of printed errors",
    )
    assert parse_report(text).errors == 1234 and parse_report(text).error_summary == 1234


def test_application_output_is_ignored_and_missing_summary_is_incomplete() -> None:
    mixed = "collected 3 items\n" + MEMCHECK.split("========= Target")[0] + "3 passed\n"
    report = parse_report(mixed)
    assert len(report.findings) == 5 and report.error_summary is None
    assert not report.complete and report.errors == 5  # the API error counts too
    assert "stopped early" in report.format_summary()
    assert parse_report("").errors == 0 and not parse_report("").complete


def test_format_summary_and_json() -> None:
    report = parse_report(MEMCHECK)
    table = report.format_summary()
    assert (
        "| `megamoe::kernels::grouped_gemm_kernel<128, 128, (megamoe::Epilogue)1>` "
        "| Invalid __global__ write | 2 |" in table
    )
    assert "errors: 5, warnings: 0 (ERROR SUMMARY: 5)" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["errors"] == 5 and len(data["findings"]) == 5
    assert Finding(**data["findings"][0]) == report.findings[0]


# -------------------------------------------------------------- command and lookup


def test_exit_codes_are_distinct_and_outside_pytest_codes() -> None:
    codes = [ERROR_EXITCODES[tool] for tool in TOOLS]
    assert len(set(codes)) == len(TOOLS)
    assert all(code > 5 and code not in (124, 125, 126, 127) for code in codes)


@pytest.mark.parametrize("tool", TOOLS)
def test_command_and_environment(tool: str, tmp_path: Path) -> None:
    log = tmp_path / f"{tool}.log"
    command = sanitizer.sanitizer_command(
        tool, ["python", "-m", "pytest", "x"], executable="/cs", log_file=log
    )
    # racecheck keeps the target's exit status (its verdict leaves cuBLAS's records out).
    exitcode = [] if tool in OWN_KERNELS_ONLY else ["--error-exitcode", str(ERROR_EXITCODES[tool])]
    assert command[: 5 + len(exitcode)] == [
        "/cs",
        "--tool",
        tool,
        *exitcode,
        "--log-file",
        str(log),
    ]
    assert ("--error-exitcode" in command) == (tool != "racecheck")
    assert command[-4:] == ["python", "-m", "pytest", "x"]
    for option, value in [
        ("--report-api-errors", "no"),
        ("--show-backtrace", "device"),
        ("--destroy-on-device-error", "kernel"),
        ("--check-exit-code", "no"),
        ("--target-processes", "all"),
    ]:
        assert command[command.index(option) + 1] == value
    if tool == "memcheck":
        assert command[command.index("--padding") + 1] == "4096"
    env = sanitizer.sanitizer_env(tool, {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
        "MEGAMOE_SANITIZER_TOOL": tool,
    }


def test_command_rejects_bad_tool_and_empty_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tool: expected one of"):
        sanitizer.sanitizer_command("helgrind", ["x"], executable="/cs", log_file=tmp_path)
    with pytest.raises(ValueError, match="target: expected a command"):
        sanitizer.sanitizer_command("memcheck", [], executable="/cs", log_file=tmp_path)


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _no_pathfinder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make cuda.pathfinder find nothing (the CPU machine may have the wheels)."""
    import cuda.pathfinder as pathfinder

    monkeypatch.setattr(pathfinder, "find_nvidia_binary_utility", lambda name: None)


def test_find_prefers_override_then_pathfinder_then_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("cuda.pathfinder")
    import cuda.pathfinder as pathfinder

    monkeypatch.setenv("MEGAMOE_COMPUTE_SANITIZER", "/opt/cs")
    assert sanitizer.find_compute_sanitizer() == "/opt/cs"
    monkeypatch.delenv("MEGAMOE_COMPUTE_SANITIZER")
    wheel = str(tmp_path / "wheel" / "compute-sanitizer")
    monkeypatch.setattr(pathfinder, "find_nvidia_binary_utility", lambda name: wheel)
    assert sanitizer.find_compute_sanitizer() == wheel
    _no_pathfinder(monkeypatch)
    on_path = _executable(tmp_path / "compute-sanitizer")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert sanitizer.find_compute_sanitizer() == str(on_path)


def test_find_falls_back_to_the_toolkit_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("cuda.pathfinder")
    monkeypatch.delenv("MEGAMOE_COMPUTE_SANITIZER", raising=False)
    _no_pathfinder(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sanitizer, "DEFAULT_TOOLKIT_BIN", tmp_path)
    assert sanitizer.find_compute_sanitizer() is None
    found = _executable(tmp_path / "compute-sanitizer")
    assert sanitizer.find_compute_sanitizer() == str(found)


# ------------------------------------------------------- runs with a fake sanitizer

# Stands in for compute-sanitizer: records its arguments and environment, writes the
# canned report chosen by FAKE_REPORT to --log-file, runs the target, and exits like
# the tool (--error-exitcode, where given, when the report has errors, else the
# target's status).
FAKE = """\
#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
code = int(args[args.index("--error-exitcode") + 1]) if "--error-exitcode" in args else None
target = args[args.index("--report-api-errors") + 2:]
while target and target[0].startswith("--"):
    target = target[2:]
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps({{"args": args, "tool_env": os.environ.get("MEGAMOE_SANITIZER_TOOL"),
        "caching": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}}) + "\\n")
report = open(os.environ["FAKE_REPORT"]).read()
with open(log, "w") as f:
    f.write(report)
status = subprocess.run(target).returncode
bad = "ERROR SUMMARY: 0 errors" not in report and "(0 errors," not in report
sys.exit(code if bad and code is not None else status)
"""


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A fake compute-sanitizer; returns (set_report, records)."""
    script = _executable(tmp_path / "fake-sanitizer", FAKE.format(python=sys.executable))
    record = tmp_path / "record.jsonl"
    report = tmp_path / "report.txt"
    monkeypatch.setenv("MEGAMOE_COMPUTE_SANITIZER", str(script))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_REPORT", str(report))
    # The nested pytest runs need none of the installed plugins: start them fast.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    def set_report(text: str) -> None:
        report.write_text(text)

    def records() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()]

    return set_report, records


def test_run_reports_errors_by_exit_code_and_summary(fake, tmp_path: Path) -> None:
    set_report, records = fake
    set_report(MEMCHECK)
    result = sanitizer.run("memcheck", [sys.executable, "-c", "pass"], log_file=tmp_path / "m.log")
    assert result.returncode == ERROR_EXITCODES["memcheck"]
    assert result.found_errors and not result.clean and not result.app_failed
    assert result.report.errors == 5 and result.verdict() == "5 error(s)"
    (call,) = records()
    assert call["tool_env"] == "memcheck" and call["caching"] == "1"
    assert call["args"][:2] == ["--tool", "memcheck"]


def test_racecheck_run_with_cublas_records_only_is_clean(fake, tmp_path: Path) -> None:
    """racecheck's run keeps pytest's exit status; records only in cuBLAS's kernels leave
    it clean, one in ours fails it, and a failing test is still a failure."""
    set_report, records = fake
    set_report(RACECHECK_WITH_CUBLAS.replace(GEMM, NVJET))
    ok = sanitizer.run("racecheck", [sys.executable, "-c", "pass"], log_file=tmp_path / "a.log")
    assert ok.returncode == 0 and ok.clean and ok.verdict() == "clean"
    assert len(ok.report.not_judged) == 3
    assert "--error-exitcode" not in records()[0]["args"]
    failing = sanitizer.run(
        "racecheck", [sys.executable, "-c", "raise SystemExit(1)"], log_file=tmp_path / "b.log"
    )
    assert failing.verdict() == "target failed (exit 1)" and not failing.clean
    set_report(RACECHECK_WITH_CUBLAS)
    ours = sanitizer.run("racecheck", [sys.executable, "-c", "pass"], log_file=tmp_path / "c.log")
    assert ours.returncode == 0 and ours.found_errors and ours.verdict() == "1 error(s)"


def test_run_clean_and_target_failure(fake, tmp_path: Path) -> None:
    set_report, _ = fake
    set_report(CLEAN)
    ok = sanitizer.run("initcheck", [sys.executable, "-c", "pass"], log_file=tmp_path / "a.log")
    assert ok.clean and ok.verdict() == "clean" and ok.returncode == 0
    failing = sanitizer.run(
        "initcheck", [sys.executable, "-c", "raise SystemExit(1)"], log_file=tmp_path / "b.log"
    )
    assert failing.app_failed and not failing.found_errors and not failing.clean
    assert failing.verdict() == "target failed (exit 1)"


def test_a_pytest_run_that_skipped_every_test_is_not_clean(fake, tmp_path: Path) -> None:
    """No GPU or no compiled module: every test skips, the tool sees no kernel and
    reports 0 errors; that run checked nothing, so it is not clean."""
    set_report, _ = fake
    set_report(CLEAN)
    tests = tmp_path / "test_cases.py"
    tests.write_text(
        "import pytest\n\n@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n"
    )
    skipped = sanitizer.run_pytest("memcheck", [str(tests)], log_file=tmp_path / "s.log")
    assert skipped.returncode == 0 and skipped.tests_ran == 0
    assert not skipped.clean and skipped.verdict() == "no test ran (every test skipped)"
    # A caller's own --junit-xml does not hide the skips (pytest keeps the last one).
    own = sanitizer.run_pytest(
        "memcheck", [str(tests), f"--junit-xml={tmp_path / 'own.xml'}"], log_file=tmp_path / "o.log"
    )
    assert own.tests_ran == 0 and not own.clean
    tests.write_text("def test_ran():\n    pass\n")
    ran = sanitizer.run_pytest("memcheck", [str(tests)], log_file=tmp_path / "r.log")
    assert ran.tests_ran == 1 and ran.clean and ran.verdict() == "clean"


def test_run_timeout_kills_the_target(fake, tmp_path: Path) -> None:
    set_report, _ = fake
    set_report(CLEAN)
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    result = sanitizer.run("synccheck", slow, log_file=tmp_path / "t.log", timeout=1.0)
    assert result.timed_out and result.returncode == 124 and not result.clean
    assert result.seconds < 30


@pytest.mark.parametrize(
    "returncode,text,verdict",
    [
        (0, CLEAN, "clean"),
        (1, CLEAN, "target failed (exit 1)"),
        # The error exit code with a complete, error-free report: only the target failed.
        (86, CLEAN, "target failed (exit 86)"),
        # The error exit code and no summary line: the tool was cut short; trust the code.
        (86, "", "0 error(s)"),
        (0, MEMCHECK, "5 error(s)"),
        (0, "", "incomplete report"),
    ],
)
def test_run_classification(returncode: int, text: str, verdict: str) -> None:
    run = sanitizer.SanitizerRun(
        "memcheck", ["cs"], returncode, parse_report(text), Path("m.log"), 1.0
    )
    assert run.verdict() == verdict
    assert run.clean == (verdict == "clean")
    assert run.found_errors == verdict.endswith("error(s)")
    assert run.app_failed == verdict.startswith("target failed")


def test_run_without_a_sanitizer_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sanitizer, "find_compute_sanitizer", lambda: None)
    with pytest.raises(FileNotFoundError, match="MEGAMOE_COMPUTE_SANITIZER"):
        sanitizer.run("memcheck", ["true"])
    assert sanitizer.main(["--tool", "memcheck"]) == 2


def _selection(tmp_path: Path, body: str) -> Path:
    test = tmp_path / "sel" / "test_sel.py"
    test.parent.mkdir()
    test.write_text(body)
    return test


def test_cli_single_tool(fake, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    set_report, records = fake
    set_report(RACECHECK)
    test = _selection(tmp_path, "def test_ok():\n    pass\n")
    out = tmp_path / "out"
    code = sanitizer.main(["--tool", "racecheck", "--out", str(out), "-q", str(test)])
    assert code == ERROR_EXITCODES["racecheck"]
    printed = capsys.readouterr().out
    assert "== racecheck: 2 error(s)" in printed
    assert "| `race_kernel` | Race reported between Read and Write access | 1 |" in printed
    saved = json.loads((out / "racecheck.json").read_text())
    assert saved["errors"] == 2 and saved["warnings"] == 1 and not saved["clean"]
    assert (out / "racecheck.log").read_text() == RACECHECK
    (call,) = records()
    assert call["args"][-4] == "no:cacheprovider" and call["args"][-3:-1] == ["-q", str(test)]
    assert call["args"][-1].startswith("--junit-xml=")  # the count of tests that ran (last:
    # pytest keeps the last --junit-xml given)


def test_cli_all_tools_and_pass_through_after_double_dash(
    fake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    set_report, records = fake
    set_report(CLEAN + CLEAN_RACECHECK)
    test = _selection(tmp_path, "def test_ok():\n    pass\n")
    out = tmp_path / "out"
    code = sanitizer.main(["--tool", "all", "--out", str(out), "--", str(test), "-k", "ok"])
    assert code == 0
    assert [c["tool_env"] for c in records()] == list(TOOLS)
    assert all(c["args"][-4:-1] == [str(test), "-k", "ok"] for c in records())
    table = capsys.readouterr().out
    for tool in TOOLS:
        assert f"| {tool} | 0 | 0 | 0 | clean |" in table
        assert (out / f"{tool}.json").is_file()


def test_cli_all_tools_fails_when_one_fails(fake, tmp_path: Path) -> None:
    set_report, _ = fake
    set_report(SYNCCHECK)
    test = _selection(tmp_path, "def test_ok():\n    pass\n")
    assert sanitizer.main(["--tool", "all", "--out", str(tmp_path / "o"), str(test)]) == 1


def test_cli_pytest_failure_is_passed_on(fake, tmp_path: Path) -> None:
    set_report, _ = fake
    set_report(CLEAN)
    test = _selection(tmp_path, "def test_bad():\n    assert False\n")
    assert sanitizer.main(["--tool", "memcheck", "--out", str(tmp_path / "o"), str(test)]) == 1


def test_cli_print_command_and_default_selection(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = sanitizer.main(
        [
            "--tool",
            "initcheck",
            "--sanitizer",
            "/cs",
            "--out",
            str(tmp_path),
            "--sanitizer-arg=--num-cuda-barriers=64",
            "--print-command",
            "-k",
            "gemm",
        ]
    )
    assert code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("/cs --tool initcheck --error-exitcode 88 --log-file ")
    assert "--num-cuda-barriers=64" in line
    # "-k gemm" selects nothing by itself: the default selection is added.
    assert line.endswith("-p no:cacheprovider -k gemm tests/sanitizer")


def test_an_option_value_that_names_a_path_is_not_a_selection(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-k tests`` from the repository root: "tests" exists as a folder, so it passed for
    a selection, no default was added, and pytest ran the whole suite under the tool."""
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path)
    code = sanitizer.main(["--sanitizer", "/cs", "--print-command", "-k", "tests"])
    assert code == 0
    assert capsys.readouterr().out.strip().endswith("-k tests tests/sanitizer")
    code = sanitizer.main(["--sanitizer", "/cs", "--print-command", "-k", "x", "tests"])
    assert code == 0
    assert capsys.readouterr().out.strip().endswith("-k x tests")
    # --pyargs is a flag: the name after it is the selection (a review: it was taken as
    # the flag's value and the default tests/sanitizer added, widening the run).
    for name in ("tests", "megamoe.testing"):  # a folder here, and a module name
        code = sanitizer.main(["--sanitizer", "/cs", "--print-command", "--pyargs", name])
        assert code == 0
        assert capsys.readouterr().out.strip().endswith(f"--pyargs {name}")
