"""Package exports imported on first use (PEP 562), so that a light submodule does not pull torch and the
engine into a command that only needs it, such as `sparrow --help`."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A package's module `__getattr__`: `exports` maps each name to the submodule (relative) defining it."""
    def getattr_(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    return getattr_
