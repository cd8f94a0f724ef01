"""Focused cases for compute-sanitizer (DESIGN §6 ``sanitizer``).

Run them with ``python -m megamoe.testing.sanitizer --tool <tool>`` (or ``nox -s
sanitizer``); plain pytest runs them too, as a quick functional check. Every case is
GPU-only (``gpu`` marker, skipped cleanly by tests/conftest.py elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _synchronize_after_each_case() -> Iterator[None]:
    """Finish every launch inside its own test, so a report is attributed to it."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
