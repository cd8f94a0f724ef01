#!/usr/bin/env python3
"""Smoke-test a built wheel: install it into a fresh venv and load the module.

Checks that the compiled module loads without a GPU and without torch (it is
torch-free by design: DLPack in, stream as an int), that its variant table matches
the registry shipped beside it, and that the wheel holds sm_90a device code.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

# Loads megamoe/_C*.so by path: importing the package would import torch.
CHECK = """
import importlib.machinery, importlib.util, pathlib, site, tomllib
package = next(pathlib.Path(p) / "megamoe" for p in site.getsitepackages()
               if (pathlib.Path(p) / "megamoe").is_dir())
path = str(next(package.glob("_C*.so")))
loader = importlib.machinery.ExtensionFileLoader("megamoe._C", path)
C = importlib.util.module_from_spec(importlib.util.spec_from_loader("megamoe._C", loader))
loader.exec_module(C)
names = [v["name"] for v in tomllib.loads((package / "variants.toml").read_text())["variant"]]
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
