"""Modules that moved: the old name answers with the new module's attributes and a
DeprecationWarning naming where they live now."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_to(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old`` that forwards to ``new``."""

    def __getattr__(name: str) -> Any:
        warnings.warn(f"{old}.{name} is deprecated; import it from {new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
