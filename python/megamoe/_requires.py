"""What megamoe needs installed beside it, checked when it is imported, so that a
missing dependency is named with what to do instead of a bare ModuleNotFoundError from
deep inside the package."""

import importlib.metadata
import importlib.util
import re

_TORCH_NEEDED = (2, 11)
_HOW = "install the torch your trainer pins first (e.g. pip install torch==2.13.0), then megamoe"

if importlib.util.find_spec("torch") is None:  # a wheel installed with --no-deps, say
    raise ImportError(f"megamoe needs PyTorch >= 2.11: {_HOW}")
try:
    _torch_version = importlib.metadata.version("torch")
except importlib.metadata.PackageNotFoundError:  # a source build of torch on the path
    _torch_version = None
if _torch_version is not None:
    _release = re.match(r"(\d+)\.(\d+)", _torch_version)
    if _release and tuple(int(p) for p in _release.groups()) < _TORCH_NEEDED:
        raise ImportError(f"megamoe needs PyTorch >= 2.11, found {_torch_version}: {_HOW}")
