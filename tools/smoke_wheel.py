#!/usr/bin/env python3
"""Smoke-test a built wheel: install it into a fresh venv and load the module.

Checks that the compiled module loads without a GPU and without torch (it is
torch-free by design: DLPack in, stream as an int), that its variant table matches
the registry shipped beside it, and that the wheel holds sm_90a device code.

    python3 tools/smoke_wheel.py WHEEL                # this machine's arch, in a venv
    python3 tools/smoke_wheel.py --root ROOT WHEEL    # another arch's Debian root (as
                                                      # root; qemu-user via binfmt_misc)

With ``--root`` the wheel is unpacked under ``ROOT/tmp`` (a wheel install is an unzip;
the root has no pip) and the check runs as ``chroot ROOT python3``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

# Loads megamoe/_C*.so by path: importing the package would import torch.
CHECK = """
import importlib.machinery, importlib.util, pathlib, platform, site, sys, tomllib
dirs = sys.argv[1:] or site.getsitepackages()
package = next(pathlib.Path(p) / "megamoe" for p in dirs if (pathlib.Path(p) / "megamoe").is_dir())
path = str(next(package.glob("_C*.so")))
loader = importlib.machinery.ExtensionFileLoader("megamoe._C", path)
C = importlib.util.module_from_spec(importlib.util.spec_from_loader("megamoe._C", loader))
loader.exec_module(C)
names = [v["name"] for v in tomllib.loads((package / "variants.toml").read_text())["variant"]]
assert list(C.variant_names()) == names, (C.variant_names(), names)
print("megamoe._C OK on", platform.machine(), "Python", platform.python_version(), ":",
      len(names), "variants, CUDA runtime", C.cuda_runtime_version())
"""


def main(wheel: str, root: str | None = None) -> int:
    path = Path(wheel)
    with zipfile.ZipFile(path) as archive:
        module = [n for n in archive.namelist() if n.startswith("megamoe/_C")]
        if len(module) != 1:
            print(f"{path.name}: expected one megamoe/_C module, found {module}")
            return 1
        if b"sm_90a" not in archive.read(module[0]):
            print(f"{path.name}: {module[0]} holds no sm_90a code")
            return 1
    if root is not None:
        return smoke_in_root(path, Path(root))
    with tempfile.TemporaryDirectory() as tmp:
        venv.create(tmp, with_pip=True, system_site_packages=False)
        python = str(Path(tmp) / "bin" / "python")
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(path)], check=True)
        subprocess.run([python, "-c", CHECK], check=True, cwd=tmp)
    return 0


def smoke_in_root(path: Path, root: Path) -> int:
    """Unpack into ROOT/tmp and import there with the root's own python3 (chroot)."""
    chroot = shutil.which("chroot")
    if chroot is None or not (root / "usr" / "bin" / "python3").exists():
        print(f"{root}: not a root with python3 (or no chroot here)")
        return 1
    with tempfile.TemporaryDirectory(dir=root / "tmp", prefix="megamoe-smoke-") as tmp:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(tmp)
        inside = "/" + str(Path(tmp).relative_to(root))
        subprocess.run(
            [chroot, str(root), "/usr/bin/python3", "-I", "-c", CHECK, inside],
            check=True,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--root", help="smoke-test inside this (other-arch) root")
    args = parser.parse_args()
    sys.exit(main(args.wheel, args.root))
