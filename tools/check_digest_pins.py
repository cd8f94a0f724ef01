#!/usr/bin/env python3
"""Fail if a Dockerfile's base image is not pinned by digest.

Every ``FROM`` must name an image ``@sha256:<64 hex>`` or a build arg whose default
is such a reference (``ARG BASE_IMAGE=repo@sha256:...`` then ``FROM ${BASE_IMAGE}``),
or an earlier build stage. Tags alone drift; digests reproduce.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def problems(path: Path) -> list[str]:
    args: dict[str, str] = {}
    stages: set[str] = set()
    found = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if m := re.match(r"ARG\s+(\w+)(?:=(\S+))?", line, re.IGNORECASE):
            args[m[1]] = (m[2] or "").strip("\"'")
        elif m := re.match(
            r"FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE
        ):
            image = m[1]
            if ref := re.fullmatch(r"\$\{?(\w+)\}?", image):
                image = args.get(ref[1], "")
            if image not in stages and image != "scratch" and not DIGEST.search(image):
                found.append(f"{path}:{number}: FROM {m[1]} is not pinned by digest")
            if m[2]:
                stages.add(m[2])
    return found


def main(paths: list[str]) -> int:
    if not paths or any(p.startswith("-") for p in paths):
        # No Dockerfile (an empty glob) would pass as "0 checked", an option as a path.
        print(f"usage: {Path(sys.argv[0]).name} DOCKERFILE...", file=sys.stderr)
        return 2
    issues = [issue for p in paths for issue in problems(Path(p))]
    for issue in issues:
        print(issue, file=sys.stderr)
    print(f"digest pins: {len(paths)} Dockerfiles checked, {len(issues)} problems")
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
