"""What megamoe checks of its environment at import (python/megamoe/_requires.py)."""

import importlib
import importlib.metadata
import re

import pytest


def test_an_older_torch_is_named_at_import(monkeypatch):
    """The wheel's only torch bound is a lower one (the compiled module does not link
    torch): an older torch is refused at import with what to do, not met later as an
    AttributeError from an API it lacks."""
    import megamoe._requires as requires

    real = importlib.metadata.version
    for found, refused in (("2.10.1+cu128", True), ("2.11.0", False), ("2.14.1", False)):
        monkeypatch.setattr(
            importlib.metadata,
            "version",
            lambda name, v=found: v if name == "torch" else real(name),
        )
        if refused:
            message = rf"needs PyTorch >= 2.11, found {re.escape(found)}:"
            with pytest.raises(ImportError, match=message):
                importlib.reload(requires)
        else:
            importlib.reload(requires)
