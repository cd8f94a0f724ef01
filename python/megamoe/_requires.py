"""What megamoe needs installed beside it, checked when it is imported, so that a
missing dependency is named with what to do instead of a bare ModuleNotFoundError from
deep inside the package."""

import importlib.util

if importlib.util.find_spec("torch") is None:  # a wheel installed with --no-deps, say
    raise ImportError(
        "megamoe needs PyTorch >= 2.11: install the torch your trainer pins first (e.g. "
        "pip install torch==2.13.0), then megamoe"
    )
