#!/usr/bin/env python3
"""Smoke-test a built wheel: install it into a fresh venv and import the module.

Checks that the compiled module loads without a GPU, that its variant table matches
the registry shipped beside it, and that the wheel holds sm_90a device code.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

CHECK = """
import megamoe._C as C
from megamoe.registry import registry
names = [v.name for v in registry().variants]
assert list(C.variant_names()) == names, (C.variant_names(), names)
print("megamoe._C OK:", len(names), "variants, CUDA runtime", C.cuda_runtime_version())
"""


def main(wheel: str) -> int:
    path = Path(wheel)
    with zipfile.ZipFile(path) as archive:
        module = [n for n in archive.namelist() if n.startswith("megamoe/_C")]
        if len(module) != 1:
            print(f"{path.name}: expected one megamoe/_C module, found {module}")
            return 1
        if b"sm_90a" not in archive.read(module[0]):
            print(f"{path.name}: {module[0]} holds no sm_90a code")
            return 1
    with tempfile.TemporaryDirectory() as tmp:
        venv.create(tmp, with_pip=True, system_site_packages=False)
        python = str(Path(tmp) / "bin" / "python")
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(path)], check=True)
        subprocess.run([python, "-c", CHECK], check=True, cwd=tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
