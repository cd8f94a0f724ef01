#!/usr/bin/env python3
"""Integration pins (ci/pins.toml): load, check, pick the host pin, print the CI matrix.

python3 ci/pins.py --check            # schema + digest pins (nox -s lint runs it)
python3 ci/pins.py --host             # the CI host pin's name (not $MEGAMOE_PIN)
python3 ci/pins.py --get PIN FIELD    # one field (lists joined by spaces)
python3 ci/pins.py --matrix           # GitHub Actions matrix (JSON) of pin x arch
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

PINS = Path(__file__).with_name("pins.toml")
ARCHES = ("x86_64", "aarch64")
DIGEST = re.compile(r"^\S+@sha256:[0-9a-f]{64}$")
FIELDS = {
    "name": str,
    "python": str,
    "torch": str,
    "torch_local": str,
    "cuda": str,
    "cuda_runtime": str,
    "arches": list,
    "base_image": str,
    "host": bool,
}


@dataclass(frozen=True)
class Pin:
    name: str
    python: str
    torch: str
    torch_local: str
    cuda: str
    cuda_runtime: str
    arches: tuple[str, ...]
    base_image: str
    host: bool

    @property
    def cp(self) -> str:
        """The wheel's interpreter tag, e.g. cp311."""
        return "cp" + self.python.replace(".", "")


def problems(raw: dict) -> list[str]:
    found = []
    pins = raw.get("pin", [])
    if not pins:
        found.append("no [[pin]] entries")
    names = set()
    for i, pin in enumerate(pins):
        where = f"pin[{i}] {pin.get('name', '?')}"
        for field, kind in FIELDS.items():
            if not isinstance(pin.get(field), kind):
                found.append(f"{where}: {field} missing or not {kind.__name__}")
        if extra := set(pin) - set(FIELDS):
            found.append(f"{where}: unknown fields {sorted(extra)}")
        if pin.get("name") in names:
            found.append(f"{where}: duplicate name")
        names.add(pin.get("name"))
        if not re.fullmatch(r"3\.\d+", str(pin.get("python"))):
            found.append(f"{where}: python must be X.Y")
        if not re.fullmatch(r"\d+\.\d+", str(pin.get("cuda"))):
            found.append(f"{where}: cuda must be X.Y")
        if not str(pin.get("cuda_runtime", "")).startswith(str(pin.get("cuda")) + "."):
            found.append(f"{where}: cuda_runtime must be a {pin.get('cuda')}.x release")
        if not set(pin.get("arches") or ["?"]) <= set(ARCHES):
            found.append(f"{where}: arches must be within {ARCHES}")
        if not DIGEST.match(str(pin.get("base_image"))):
            found.append(f"{where}: base_image is not pinned by digest (@sha256:<64 hex>)")
    if sum(bool(p.get("host")) for p in pins) != 1:
        found.append("exactly one pin must have host = true")
    return found


def load(path: Path = PINS) -> list[Pin]:
    raw = tomllib.loads(path.read_text())
    if found := problems(raw):
        raise SystemExit(f"{path}: " + "; ".join(found))
    return [Pin(**{**p, "arches": tuple(p["arches"])}) for p in raw["pin"]]


def ci_host() -> Pin:
    """The pin CI's own machine runs (``.ci/run``, its locks): the ``host = true`` pin,
    whatever $MEGAMOE_PIN says (an image sets it to the image's pin)."""
    return next(p for p in load() if p.host)


def get(name: str) -> Pin:
    """A pin by name; ``host`` is $MEGAMOE_PIN (set in the images) or the host = true pin."""
    pins = load()
    if name == "host" and os.environ.get("MEGAMOE_PIN"):
        name = os.environ["MEGAMOE_PIN"]
    if name == "host":
        return next(p for p in pins if p.host)
    for pin in pins:
        if pin.name == name:
            return pin
    raise SystemExit(f"no pin named {name!r} in {PINS} (have {[p.name for p in pins]})")


def matrix() -> dict:
    include = []
    for pin in load():
        for arch in pin.arches:
            runner = "ubuntu-24.04" if arch == "x86_64" else "ubuntu-24.04-arm"
            include.append(
                {
                    "pin": pin.name,
                    "python": pin.python,
                    "arch": arch,
                    "runner": runner,
                    "base_image": pin.base_image,
                }
            )
    return {"include": include}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true")
    group.add_argument("--host", action="store_true")
    group.add_argument("--get", nargs=2, metavar=("PIN", "FIELD"))
    group.add_argument("--matrix", action="store_true")
    args = parser.parse_args()
    if args.check:
        raw = tomllib.loads(PINS.read_text())
        found = problems(raw)
        for issue in found:
            print(f"{PINS}: {issue}", file=sys.stderr)
        print(f"pins: {len(raw.get('pin', []))} pins checked, {len(found)} problems")
        return 1 if found else 0
    if args.host:  # the pin whose nox lock .ci/run and the README install
        print(ci_host().name)
    elif args.get:
        value = getattr(get(args.get[0]), args.get[1])
        print(" ".join(value) if isinstance(value, tuple) else value)
    else:
        print(json.dumps(matrix()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
