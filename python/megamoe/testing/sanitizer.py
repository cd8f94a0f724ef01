"""compute-sanitizer over focused pytest selections, with a per-kernel summary.

``python -m megamoe.testing.sanitizer --tool memcheck [pytest args]`` runs pytest
(default selection: ``tests/sanitizer``) under one compute-sanitizer tool — or all
four with ``--tool all`` — and prints which kernels reported which errors.

- compute-sanitizer is found through ``cuda.pathfinder`` (NVIDIA wheels, conda,
  ``CUDA_PATH``/``CUDA_HOME``, the toolkit that owns the loaded ``libcudart``), then
  ``PATH``, then ``/usr/local/cuda/bin``; ``MEGAMOE_COMPUTE_SANITIZER`` overrides all.
- Every run sets ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: with torch's caching allocator
  a tensor is a slice of a larger cached block, so an overrun into the slack of that
  block is invisible to memcheck and initcheck.
- Each tool's errors give its own exit status (``ERROR_EXITCODES``), distinct from
  pytest's 0-5, so a CI log says which tool found errors, and a test failure is never
  mistaken for a sanitizer error or the other way round: the tool's
  ``--error-exitcode``, or for racecheck, which judges megamoe's kernels only
  (``OWN_KERNELS_ONLY``), the wrapper's own status from the parsed report.
- The report goes to a log file (``--log-file``), not the terminal, so pytest's own
  output cannot interleave with it; :func:`parse_report` turns it into
  :class:`Finding` records and a ``kernel -> {error kind: count}`` summary.

The parser understands the documented text formats of compute-sanitizer (CUDA 11 to
13) and of its predecessor cuda-memcheck: memcheck access errors, hardware
exceptions, malloc/free and leak errors, CUDA API errors; racecheck analysis and
hazard reports; initcheck uninitialized accesses; synccheck barrier and wgmma errors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "ERROR_EXITCODES",
    "OWN_KERNELS_ONLY",
    "TOOLS",
    "Finding",
    "Report",
    "SanitizerRun",
    "find_compute_sanitizer",
    "is_other_librarys_kernel",
    "kernel_display_name",
    "main",
    "parse_report",
    "run",
    "run_pytest",
    "sanitizer_command",
    "sanitizer_env",
]

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")

#: The exit status of a run that found errors, per tool (the tool's ``--error-exitcode``,
#: or for :data:`OWN_KERNELS_ONLY` the CLI's): outside pytest's exit codes (0-5) and
#: different per tool, so the exit status alone says which check failed.
ERROR_EXITCODES: dict[str, int] = {
    "memcheck": 86,
    "racecheck": 87,
    "initcheck": 88,
    "synccheck": 89,
}

#: Tools whose verdict leaves out records in other libraries' kernels (the kernels of
#: :data:`OTHER_LIBRARY_KERNEL`). racecheck judges shared-memory hazards between the
#: threads of one block of one kernel, so a record inside cuBLAS's or torch's own kernel
#: (the adapters' GEMMs) is that library's code, whatever inputs we hand it: it is listed
#: in the summary and the JSON, not counted. These tools run without
#: ``--error-exitcode`` (the exit status stays the target's) and their verdict comes
#: from the parsed report. The other tools count every record: a bad input of ours can
#: make torch's kernel read out of bounds or read unwritten memory.
OWN_KERNELS_ONLY: frozenset[str] = frozenset({"racecheck"})

#: Kernels of the libraries torch runs (display names, :func:`kernel_display_name`):
#: cuBLAS's Hopper GEMMs (``nvjet_*``, ``sm90_xmma_*``, ``cublas*``) and torch's own
#: (``at::native::*``, its CUTLASS grouped GEMM ``cutlass::device_kernel<at::...>``).
#: A closed list: a record in any other kernel counts, so an unknown library's kernel
#: fails the run until someone names it here.
OTHER_LIBRARY_KERNEL = re.compile(
    r"^(?:nvjet_|sm\d+_xmma_|cublas|at::native::|cutlass::device_kernel<at::)"
)

#: Tool options beyond the defaults, with the reason for each.
TOOL_OPTIONS: dict[str, tuple[str, ...]] = {
    # Leaks: torch keeps its CUDA context, cuBLAS handles and workspaces until exit, so
    # a leak check reports the framework, not us. Padding: without it an overrun that
    # lands in the next allocation (cudaMalloc packs them back to back) goes unseen;
    # 4 KiB of padding after every allocation catches overruns up to a page.
    "memcheck": ("--leak-check", "no", "--padding", "4096"),
    # Analysis reports (one record per racing pair of source locations) rather than
    # one record per racing byte.
    "racecheck": ("--racecheck-report", "analysis"),
    "initcheck": (),
    "synccheck": (),
}

#: Options of every tool, with the reason for each.
COMMON_OPTIONS: tuple[str, ...] = (
    # Follow child processes too (pytest-xdist workers, a launcher script).
    "--target-processes",
    "all",
    # Enough records to see every distinct failing kernel; the ERROR SUMMARY still
    # counts past the limit.
    "--print-limit",
    "1000",
    # Device frames name the kernel around an inlined device function; host frames
    # would only repeat the Python interpreter's stack for every record.
    "--show-backtrace",
    "device",
    # API errors: CUDA 13 reports the driver's own entry-point probes
    # (cuGetProcAddress) and torch's expected failures as errors. Our launchers check
    # every CUDA call and raise, which fails the test, so nothing is lost.
    "--report-api-errors",
    "no",
    # A memory or barrier error stops the faulting kernel, not the CUDA context: the
    # tests after it still run, so one run lists every failing kernel.
    "--destroy-on-device-error",
    "kernel",
    # pytest's own exit status is reported as such, not as a sanitizer error.
    "--check-exit-code",
    "no",
)

#: Set in the environment of a sanitized run (value: the tool), so a test can tell.
UNDER_SANITIZER_ENV = "MEGAMOE_SANITIZER_TOOL"
#: Overrides the compute-sanitizer executable.
EXECUTABLE_ENV = "MEGAMOE_COMPUTE_SANITIZER"
DEFAULT_TOOLKIT_BIN = Path("/usr/local/cuda/bin")
DEFAULT_SELECTION = "tests/sanitizer"
#: Exit status recorded for a run stopped by ``timeout`` (as coreutils' timeout).
TIMEOUT_EXITCODE = 124

_PREFIX = re.compile(r"^=========(?: (?P<body>.*))?$")
_SEVERITY = r"(?:(?P<severity>ERROR|Error|WARNING|Warning|WARN|INFO|Info):\s*)?"
_HEADERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("race", re.compile(rf"^{_SEVERITY}Race reported between\b")),
    ("hazard", re.compile(rf"^{_SEVERITY}Potential (?P<hazard>WAW|WAR|RAW) hazard detected\b")),
    (
        "access",
        re.compile(r"^(?P<what>(?:Potential )?[Ii]nvalid (?:__\w+__ )?\w+)(?: of size \d+)?"),
    ),
    ("uninit", re.compile(r"^(?P<what>Uninitialized (?:__\w+__ )?(?:memory )?\w+)")),
    ("unused", re.compile(r"^(?P<what>Unused (?:__\w+__ )?memory)\b")),
    ("barrier", re.compile(r"^Barrier error detected\.?\s*(?P<what>.*?)\.?$")),
    ("wgmma", re.compile(r"^Warpgroup MMA sequence error detected\.?\s*(?P<what>.*?)\.?$")),
    ("malloc", re.compile(r"^Malloc/Free error encountered\s*:?\s*(?P<what>.*?)\.?$")),
    ("api", re.compile(r"^Program hit (?P<error>\S+).*? on CUDA API call to (?P<api>\w+)")),
    ("leak", re.compile(r"^Leaked \d+ bytes\b")),
    ("host_access", re.compile(r"^(?P<what>Host API [\w ]*?error)\b")),
    ("deadlock", re.compile(r"^Deadlock detected\b")),
    (
        "hardware",
        re.compile(
            r"^(?P<what>(?:Warp |Lane |Device )?(?:Illegal (?:Address|Instruction)"
            r"|Misaligned (?:Address|PC|Shared or Local Address)"
            r"|Out-of-range (?:Address|Shared or Local Address)"
            r"|Invalid (?:PC|Address Space)|Hardware Stack Overflow|User Stack Overflow"
            r"|MMU Fault|Assert(?:ion)?(?: failed)?|Hardware Exception))\b"
        ),
    ),
)
# Anchored: past --print-limit the tool adds "ERROR SUMMARY: N errors were not printed",
# which is not the total.
_ERROR_SUMMARY = re.compile(r"^ERROR SUMMARY: (?P<n>\d+) errors?\s*$")
_RACE_SUMMARY = re.compile(
    r"^RACECHECK SUMMARY: (?P<shown>\d+) hazards? displayed "
    r"\((?P<errors>\d+) errors?, (?P<warnings>\d+) warnings?\)"
)
_LEAK_SUMMARY = re.compile(r"^LEAK SUMMARY: .*")
# Past --print-limit: "ERROR SUMMARY: 1229 errors were not printed. Use --print-limit ...".
_NOT_PRINTED = re.compile(r"\b(?P<n>\d+) (?:errors?|hazards?|records?) (?:were|was) not printed")
_BACKTRACE = re.compile(r"^(?:Saved host backtrace|Host Frame|Device Frame)")
_ACCESS = re.compile(
    r"(?P<access>Read|Write) access at (?P<site>.+?)"
    r"(?=\s+and (?:Read|Write) access at |\s*\[\d+ hazards?\]|$)"
)
_HAZARD_COUNT = re.compile(r"\[(\d+) hazards?\]")
_THREAD_SITE = re.compile(r"^(?:Read|Write) Thread \([\d, ]+\) at (?P<site>.+)$")
_OLD_SITE = re.compile(r"^0x[0-9a-fA-F]+(?: in (?P<rest>.+))?$")
_OLD_LOCATION = re.compile(r"^(?P<loc>.+?:\d+):(?P<func>.+)$")
_NEW_SITE = re.compile(r"^(?P<func>.+?)(?:[+:]0x[0-9a-fA-F]+)?(?: in (?P<loc>\S.*))?$")
_OLD_FRAME_TAIL = re.compile(r"\s+\(.* : 0x[0-9a-fA-F]+\)$")

SEVERITIES = {"error": "error", "warning": "warning", "warn": "warning", "info": "info"}
HOST = "<host>"
UNATTRIBUTED = "<unattributed>"


@dataclass(frozen=True)
class Finding:
    """One record of a compute-sanitizer report.

    ``kernel`` is the kernel's display name (:func:`kernel_display_name`) or ``<host>``
    for host-side records (API errors, leaks); ``function`` is where the faulting
    instruction is (a device function inlined into or called by the kernel);
    ``location`` is ``file:line`` when the code has line information; ``hazards`` is
    racecheck's hazard count (1 for other records).
    """

    kind: str
    kernel: str
    severity: str = "error"
    function: str | None = None
    location: str | None = None
    hazards: int = 1
    text: str = ""


def is_other_librarys_kernel(kernel: str) -> bool:
    """Whether a display name is one of :data:`OTHER_LIBRARY_KERNEL`'s (cuBLAS, torch)."""
    return OTHER_LIBRARY_KERNEL.match(kernel) is not None


@dataclass
class Report:
    """A parsed compute-sanitizer report.

    With ``own_kernels_only`` (the tools of :data:`OWN_KERNELS_ONLY`) the records in
    other libraries' kernels are kept in ``findings`` and the summary but left out of
    :attr:`errors` and :attr:`warnings` (:attr:`not_judged` lists them).
    """

    findings: list[Finding] = field(default_factory=list)
    error_summary: int | None = None
    racecheck_summary: dict[str, int] | None = None
    leak_summary: str | None = None
    notes: list[str] = field(default_factory=list)
    own_kernels_only: bool = False
    #: Records the tool counted but did not print (past ``--print-limit``).
    unprinted: int = 0

    def _tool_total(self, severity: str) -> int:
        """The tool's own count of ``severity`` records (its summaries)."""
        race = self.racecheck_summary or {}
        if severity == "error":
            return max(self.error_summary or 0, race.get("errors", 0))
        return race.get("warnings", 0) if severity == "warning" else 0

    def _excludes(self, severity: str) -> bool:
        """Whether ``severity`` records in other libraries' kernels are left out: with
        ``own_kernels_only`` and every record printed. Past ``--print-limit`` (a "not
        printed" line, or a tool total above the parsed records) the unprinted records'
        kernels are unknown, so nothing is left out."""
        parsed = sum(1 for f in self.findings if f.severity == severity)
        return self.own_kernels_only and not self.unprinted and self._tool_total(severity) <= parsed

    def judged(self, finding: Finding) -> bool:
        """Whether ``finding`` counts towards the verdict."""
        return not (self._excludes(finding.severity) and is_other_librarys_kernel(finding.kernel))

    @property
    def not_judged(self) -> list[Finding]:
        """The records left out of the counts (other libraries' kernels)."""
        return [f for f in self.findings if not self.judged(f)]

    def _count(self, severity: str) -> int:
        """The tool's total for ``severity`` or the parsed records (plus the unprinted
        errors), the larger; or, where :meth:`_excludes`, the judged records."""
        parsed = [f for f in self.findings if f.severity == severity]
        if self._excludes(severity):
            return sum(1 for f in parsed if self.judged(f))
        unprinted = self.unprinted if severity == "error" else 0
        return max(self._tool_total(severity), len(parsed) + unprinted)

    @property
    def errors(self) -> int:
        """Errors the tool found: the largest of its own totals and the parsed records
        (less those :meth:`judged` leaves out).

        The ERROR SUMMARY also counts records past ``--print-limit``; racecheck reports
        its own summary; taking the largest never reports 0 when anything was seen.
        """
        return self._count("error")

    @property
    def warnings(self) -> int:
        return self._count("warning")

    @property
    def complete(self) -> bool:
        """Whether the tool printed its final summary (it did not die mid-run)."""
        return self.error_summary is not None or self.racecheck_summary is not None

    def summary(self, *, include_warnings: bool = True) -> dict[str, dict[str, int]]:
        """``kernel -> {kind: number of records}``; warning kinds end in ``(warning)``."""
        table: dict[str, dict[str, int]] = {}
        for finding in self.findings:
            if finding.severity == "info" or (
                finding.severity == "warning" and not include_warnings
            ):
                continue
            kind = finding.kind + (" (warning)" if finding.severity == "warning" else "")
            per_kernel = table.setdefault(finding.kernel, {})
            per_kernel[kind] = per_kernel.get(kind, 0) + 1
        return dict(sorted(table.items()))

    def format_summary(self) -> str:
        """A Markdown table of :meth:`summary` plus the totals line."""
        lines = ["| kernel | kind | records |", "|---|---|---|"]
        for kernel, kinds in self.summary().items():
            for kind, count in sorted(kinds.items()):
                lines.append(f"| `{kernel}` | {kind} | {count} |")
        if len(lines) == 2:
            lines.append("| (none) | | 0 |")
        totals = f"errors: {self.errors}, warnings: {self.warnings}"
        if self.error_summary is not None:
            totals += f" (ERROR SUMMARY: {self.error_summary})"
        if not self.complete:
            totals += " — no summary line: the tool or the process stopped early"
        if left_out := self.not_judged:
            kernels = ", ".join(f"`{k}`" for k in sorted({f.kernel for f in left_out}))
            totals += (
                f"\nnot judged: {len(left_out)} record(s) in other libraries' kernels "
                f"({kernels}); this tool judges megamoe's kernels only"
            )
        return "\n".join([*lines, "", totals])

    def to_dict(self, max_findings: int = 200) -> dict:
        return {
            "errors": self.errors,
            "warnings": self.warnings,
            "error_summary": self.error_summary,
            "racecheck_summary": self.racecheck_summary,
            "leak_summary": self.leak_summary,
            "complete": self.complete,
            "own_kernels_only": self.own_kernels_only,
            "not_judged": len(self.not_judged),
            "unprinted": self.unprinted,
            "summary": self.summary(),
            "findings": [asdict(f) for f in self.findings[:max_findings]],
            "notes": self.notes,
        }


def kernel_display_name(name: str) -> str:
    """A demangled function name without return type, parameter list or offset.

    ``void megamoe::kernels::k<128, (megamoe::Epilogue)0>(megamoe::Params)`` ->
    ``megamoe::kernels::k<128, (megamoe::Epilogue)0>``; template arguments stay, since
    they tell the variants apart.
    """
    name = name.strip()
    name = re.sub(r"[+:]0x[0-9a-fA-F]+$", "", name).strip()
    name = name.removeprefix("void ")
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += name[i] == ")"
            depth -= name[i] == "("
            if depth == 0:
                name = name[:i]
                break
    return name.strip() or UNATTRIBUTED


def _parse_site(text: str) -> tuple[str | None, str | None]:
    """``(function, file:line)`` of a site, in any of the report formats.

    ``kernel(int *)+0x70 in file.cu:6`` (compute-sanitizer), ``kernel():0x70 in
    file.cu:6`` (its manual), ``kernel+0x70`` (no line info), ``0x70 in
    /path/file.cu:6:kernel(int*)`` and ``0x70 in kernel(int*)`` (cuda-memcheck and
    early compute-sanitizer), ``0x79d8`` (a bare PC: no function).
    """
    text = text.strip()
    if old := _OLD_SITE.match(text):
        rest = old.group("rest")
        if rest is None:
            return None, None
        if located := _OLD_LOCATION.match(rest):
            return located.group("func").strip(), located.group("loc")
        return rest.strip(), None
    new = _NEW_SITE.match(text)
    if new is None:  # pragma: no cover - the pattern matches any non-empty text
        return text, None
    return new.group("func").strip(), new.group("loc")


def _strip_prefix(line: str) -> str | None:
    """The body of a report line, ``""`` for a separator, None for a non-report line."""
    match = _PREFIX.match(line.rstrip("\r\n"))
    if match is None:
        return None
    return (match.group("body") or "").strip()


def _severity(match: re.Match[str], default: str = "error") -> str:
    word = match.groupdict().get("severity")
    return SEVERITIES[word.lower()] if word else default


def _finish(header: str, kind_tag: str, match: re.Match[str], body: list[str]) -> Finding:
    """Build a :class:`Finding` from a record's header and continuation lines."""
    text = "\n".join([header, *body])
    details = [line for line in body if not _BACKTRACE.match(line)]
    frames = [line for line in body if line.startswith("Device Frame:")]
    function = location = None
    severity = "error"
    hazards = 1
    if kind_tag == "race":
        severity = _severity(match)
        joined = " ".join([header, *details])
        accesses = [(m.group("access"), m.group("site")) for m in _ACCESS.finditer(joined)]
        if accesses:
            function, location = _parse_site(accesses[0][1])
        kinds = [a for a, _ in accesses]
        kind = "Race reported between " + " and ".join(dict.fromkeys(kinds or ["?"])) + " access"
        hazards = sum(int(n) for n in _HAZARD_COUNT.findall(joined)) or 1
    else:
        if kind_tag == "hazard":
            severity = _severity(match)
            kind = f"Potential {match.group('hazard')} hazard"
            sites = [m.group("site") for line in details if (m := _THREAD_SITE.match(line))]
        else:
            sites = [line[3:] for line in details if line.startswith("at ")]
            kind = _kind(kind_tag, match, header)
            if kind_tag == "unused":
                severity = "warning"
        if sites:
            function, location = _parse_site(sites[0])
    kernel = function
    if frames:
        # Innermost frame first: the last device frame is the kernel itself.
        frame = _OLD_FRAME_TAIL.sub("", frames[-1].removeprefix("Device Frame:").strip())
        kernel = _parse_site(frame)[0] or kernel
    if kernel is None:
        kernel = HOST if kind_tag in ("api", "leak", "host_access", "unused") else UNATTRIBUTED
    else:
        kernel = kernel_display_name(kernel)
    return Finding(
        kind=kind,
        kernel=kernel,
        severity=severity,
        function=function,
        location=location,
        hazards=hazards,
        text=text,
    )


def _kind(kind_tag: str, match: re.Match[str], header: str) -> str:
    """The error kind of a non-race record, without sizes, addresses or counts."""
    if kind_tag in ("access", "uninit", "unused", "host_access", "hardware"):
        return match.group("what").strip()
    if kind_tag == "barrier":
        return "Barrier error" + (f": {match.group('what')}" if match.group("what") else "")
    if kind_tag == "wgmma":
        what = match.group("what")
        return "Warpgroup MMA sequence error" + (f": {what}" if what else "")
    if kind_tag == "malloc":
        what = match.group("what")
        return "Malloc/Free error" + (f": {what}" if what else "")
    if kind_tag == "api":
        return f"CUDA API error {match.group('error')} in {match.group('api')}"
    if kind_tag == "leak":
        return "Leaked allocation"
    if kind_tag == "deadlock":
        return "Deadlock"
    return header  # pragma: no cover - every tag is handled above


def parse_report(text: str, *, own_kernels_only: bool = False) -> Report:
    """Parse compute-sanitizer (or cuda-memcheck) text output into a :class:`Report`.

    Lines without the ``=========`` prefix (the application's own output, when the
    report was not written to a log file) are ignored. A record starts at a known
    header line and takes every following line up to an empty ``=========`` line, a
    summary line or the next header; lines outside records become ``notes``. Summaries
    add up: with ``--target-processes all`` every process prints its own.
    ``own_kernels_only``: see :class:`Report`.
    """
    report = Report(own_kernels_only=own_kernels_only)
    current: tuple[str, str, re.Match[str], list[str]] | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            report.findings.append(_finish(*current))
            current = None

    for raw in text.splitlines():
        body = _strip_prefix(raw)
        if body is None:
            continue
        if not body:
            close()
            continue
        if m := _NOT_PRINTED.search(body):
            report.unprinted += int(m.group("n"))
        if m := _ERROR_SUMMARY.match(body):
            close()
            report.error_summary = (report.error_summary or 0) + int(m.group("n"))
            continue
        if m := _RACE_SUMMARY.match(body):
            close()
            race = report.racecheck_summary or {"displayed": 0, "errors": 0, "warnings": 0}
            for key, group in (
                ("displayed", "shown"),
                ("errors", "errors"),
                ("warnings", "warnings"),
            ):
                race[key] += int(m.group(group))
            report.racecheck_summary = race
            continue
        if _LEAK_SUMMARY.match(body):
            close()
            report.leak_summary = body
            continue
        for tag, pattern in _HEADERS:
            if m := pattern.match(body):
                close()
                current = (body, tag, m, [])
                break
        else:
            if current is not None:
                current[3].append(body)
            elif body not in ("COMPUTE-SANITIZER", "CUDA-MEMCHECK"):
                report.notes.append(body)
    close()
    return report


@dataclass
class SanitizerRun:
    """One sanitized process: its command, exit status and parsed report."""

    tool: str
    command: list[str]
    returncode: int
    report: Report
    log_file: Path
    seconds: float
    timed_out: bool = False
    #: Tests the target ran (not skipped), where it is pytest; None where unknown.
    tests_ran: int | None = None

    @property
    def error_exitcode(self) -> int:
        return ERROR_EXITCODES[self.tool]

    @property
    def found_errors(self) -> bool:
        """The tool reported errors: in its report, or by its exit code when the report
        is cut short (the tool's summary line missing)."""
        if self.report.errors > 0:
            return True
        return self.returncode == self.error_exitcode and not self.report.complete

    @property
    def app_failed(self) -> bool:
        """The target itself failed (e.g. a pytest failure) and the tool found nothing."""
        return self.returncode != 0 and not self.found_errors

    @property
    def clean(self) -> bool:
        """No error from the tool, the target passed, the report is complete, and the
        target ran something (a pytest run whose every test skipped checked nothing)."""
        ran = self.tests_ran is None or self.tests_ran > 0
        return self.returncode == 0 and self.report.errors == 0 and self.report.complete and ran

    def verdict(self) -> str:
        if self.timed_out:
            return "timed out"
        if self.found_errors:
            return f"{self.report.errors} error(s)"
        if self.app_failed:
            return f"target failed (exit {self.returncode})"
        if not self.report.complete:
            return "incomplete report"
        if self.tests_ran == 0:
            return "no test ran (every test skipped)"
        return "clean"

    def to_dict(self) -> dict:
        return {
            "tool": self.tool,
            "command": self.command,
            "returncode": self.returncode,
            "error_exitcode": self.error_exitcode,
            "clean": self.clean,
            "verdict": self.verdict(),
            "seconds": round(self.seconds, 1),
            "timed_out": self.timed_out,
            "tests_ran": self.tests_ran,
            "log_file": str(self.log_file),
            **self.report.to_dict(),
        }


def find_compute_sanitizer() -> str | None:
    """The compute-sanitizer executable, or None.

    Order: ``$MEGAMOE_COMPUTE_SANITIZER``; ``cuda.pathfinder`` (NVIDIA wheels, conda,
    ``CUDA_PATH``/``CUDA_HOME``, the toolkit of the loaded cudart); ``PATH``;
    ``/usr/local/cuda/bin``.
    """
    override = os.environ.get(EXECUTABLE_ENV)
    if override:
        return override
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("compute-sanitizer")
    except Exception:  # no cuda-python, or a version without this utility: look elsewhere
        found = None
    if found:
        return found
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    default = DEFAULT_TOOLKIT_BIN / "compute-sanitizer"
    return str(default) if default.is_file() and os.access(default, os.X_OK) else None


def _check_tool(tool: str) -> None:
    if tool not in TOOLS:
        raise ValueError(f"tool: expected one of {list(TOOLS)}, got {tool!r}")


def sanitizer_command(
    tool: str,
    target: Sequence[str],
    *,
    executable: str,
    log_file: Path,
    extra_options: Sequence[str] = (),
) -> list[str]:
    """The compute-sanitizer command line that runs ``target`` under ``tool``."""
    _check_tool(tool)
    if not target:
        raise ValueError("target: expected a command to run, got an empty one")
    # Tools that leave other libraries' records out keep the target's exit status.
    exitcode = () if tool in OWN_KERNELS_ONLY else ("--error-exitcode", str(ERROR_EXITCODES[tool]))
    return [
        executable,
        "--tool",
        tool,
        *exitcode,
        "--log-file",
        str(log_file),
        *COMMON_OPTIONS,
        *TOOL_OPTIONS[tool],
        *extra_options,
        *target,
    ]


def sanitizer_env(tool: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a sanitized run: ``base`` (default ``os.environ``) plus ours."""
    _check_tool(tool)
    env = dict(os.environ if base is None else base)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env[UNDER_SANITIZER_ENV] = tool
    return env


def run(
    tool: str,
    target: Sequence[str],
    *,
    executable: str | None = None,
    log_file: Path | None = None,
    extra_options: Sequence[str] = (),
    timeout: float | None = None,
    cwd: Path | None = None,
) -> SanitizerRun:
    """Run ``target`` under compute-sanitizer ``tool``; the target's output passes through.

    Raises ``FileNotFoundError`` if compute-sanitizer is not found. Past ``timeout``
    seconds the tool and its target are killed and the run has ``timed_out`` set.
    """
    executable = executable or find_compute_sanitizer()
    if executable is None:
        raise FileNotFoundError(
            "compute-sanitizer not found (cuda.pathfinder, PATH, /usr/local/cuda/bin): "
            f"install the CUDA toolkit or set {EXECUTABLE_ENV}"
        )
    if log_file is None:
        log_file = Path(tempfile.mkdtemp(prefix="megamoe-sanitizer-")) / f"{tool}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.unlink(missing_ok=True)
    command = sanitizer_command(
        tool, target, executable=executable, log_file=log_file, extra_options=extra_options
    )
    started = time.perf_counter()
    # A session of its own, so a timeout can stop the tool and the target it started.
    process = subprocess.Popen(command, env=sanitizer_env(tool), cwd=cwd, start_new_session=True)
    timed_out = False
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        returncode = TIMEOUT_EXITCODE
    seconds = time.perf_counter() - started
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    report = parse_report(text, own_kernels_only=tool in OWN_KERNELS_ONLY)
    return SanitizerRun(tool, command, returncode, report, log_file, seconds, timed_out)


def run_pytest(tool: str, pytest_args: Sequence[str], **kwargs) -> SanitizerRun:
    """:func:`run` on ``python -m pytest -p no:cacheprovider *pytest_args``, with the
    count of tests that ran (not skipped) from pytest's JUnit report: a run that skipped
    every test (no GPU, no compiled module) is not clean."""
    junit = Path(tempfile.mkdtemp(prefix="megamoe-sanitizer-")) / "pytest.xml"
    # The wrapper's report last: pytest keeps the last --junit-xml given, and a caller's
    # own would leave this one unwritten (an all-skipped run would then pass as clean).
    target = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args,
        f"--junit-xml={junit}",
    ]  # fmt: skip
    result = run(tool, target, **kwargs)
    ran = tests_ran(junit)
    # No report from a pytest run that finished: nothing is known to have run.
    result.tests_ran = 0 if ran is None and not result.timed_out else ran
    return result


def tests_ran(junit_xml: Path) -> int | None:
    """Tests run and not skipped in a pytest JUnit report (None if there is none)."""
    try:
        root = ElementTree.parse(junit_xml).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Wrapper options before ``--``, everything after it goes to pytest untouched."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


#: pytest options whose value is the next argument (``-k tests`` selects no path).
_PYTEST_VALUE_OPTIONS = frozenset(
    {"-k", "-m", "-p", "-c", "-o", "-W", "-n", "--deselect", "--ignore", "--ignore-glob",
     "--rootdir", "--basetemp", "--junit-xml", "--confcutdir", "--durations", "--maxfail",
     "--timeout", "--override-ini"}
)  # fmt: skip


def _has_selection(args: Sequence[str]) -> bool:
    """Whether pytest arguments name tests (a path or node id), other than as the value
    of an option."""
    after_option = False
    pyargs = "--pyargs" in args  # names are then modules or packages, not paths
    for arg in args:
        named = not after_option and not arg.startswith("-")
        if named and (pyargs or Path(arg.split("::", 1)[0]).exists()):
            return True
        after_option = arg in _PYTEST_VALUE_OPTIONS
    return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.testing.sanitizer",
        description="Run pytest under compute-sanitizer and summarise errors per kernel. "
        "Arguments the wrapper does not know (and all after `--`) go to pytest; "
        f"the default selection is {DEFAULT_SELECTION}.",
        allow_abbrev=False,
    )
    parser.add_argument("--tool", choices=[*TOOLS, "all"], default="memcheck")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for <tool>.log and <tool>.json (default: a new temporary folder)",
    )
    parser.add_argument("--sanitizer", default=None, help="compute-sanitizer executable")
    parser.add_argument(
        "--sanitizer-arg",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra compute-sanitizer option, e.g. --sanitizer-arg=--num-cuda-barriers=64",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per tool run")
    parser.add_argument(
        "--print-command", action="store_true", help="print the command lines and exit"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Exit status: 0 when every run is clean; with one tool, its
    :data:`ERROR_EXITCODES` entry when it found errors, else pytest's status; with
    ``all``, 1."""
    own, after = _split_argv(sys.argv[1:] if argv is None else argv)
    args, unknown = _parser().parse_known_args(own)
    pytest_args = [*unknown, *after]
    if not _has_selection(pytest_args):
        pytest_args.append(DEFAULT_SELECTION)
    tools = list(TOOLS) if args.tool == "all" else [args.tool]
    executable = args.sanitizer or find_compute_sanitizer()
    out = args.out or Path(tempfile.mkdtemp(prefix="megamoe-sanitizer-"))
    if args.print_command:
        target = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
        for tool in tools:
            command = sanitizer_command(
                tool,
                target,
                executable=executable or "compute-sanitizer",
                log_file=out / f"{tool}.log",
                extra_options=args.sanitizer_arg,
            )
            print(" ".join(command))
        return 0
    if executable is None:
        print(
            "compute-sanitizer not found (cuda.pathfinder, PATH, /usr/local/cuda/bin): "
            f"install the CUDA toolkit or set {EXECUTABLE_ENV}",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for tool in tools:
        print(f"== {tool}: {executable} over pytest {' '.join(pytest_args)}", flush=True)
        result = run_pytest(
            tool,
            pytest_args,
            executable=executable,
            log_file=out / f"{tool}.log",
            extra_options=args.sanitizer_arg,
            timeout=args.timeout,
        )
        (out / f"{tool}.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"\n== {tool}: {result.verdict()} in {result.seconds:.0f} s (log {result.log_file})")
        print(result.report.format_summary(), flush=True)
        runs.append(result)
    if len(runs) > 1:
        print("\n| tool | exit | errors | warnings | verdict | seconds |")
        print("|---|---|---|---|---|---|")
        for r in runs:
            print(
                f"| {r.tool} | {r.returncode} | {r.report.errors} | {r.report.warnings} "
                f"| {r.verdict()} | {r.seconds:.0f} |"
            )
    failed = [r for r in runs if not r.clean]
    if not failed:
        return 0
    if len(runs) > 1:
        return 1
    only = failed[0]
    if only.found_errors:
        return only.error_exitcode
    return only.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
