"""The bench CLI (``python -m megamoe.bench``); see :mod:`megamoe.bench.cli`."""

from .cli import main

__all__ = ["main"]
