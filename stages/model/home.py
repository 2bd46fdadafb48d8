"""Where Sparrow keeps what it builds once: converted checkpoints and tokenizers ($SPARROW_HOME)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .config import ModelSpecError


def sparrow_home() -> Path:
    return Path(os.environ.get("SPARROW_HOME") or Path.home() / ".cache" / "sparrow")


@contextmanager
def building(what: str, folder: Path) -> Iterator[None]:
    """A block that builds `what` into `folder` under $SPARROW_HOME: an OSError there (a read-only or full
    home) is one sentence naming the folder and the variable that moves it."""
    try:
        yield
    except OSError as e:
        raise ModelSpecError(f"cannot build {what} in {folder} ({e.strerror or e}); set SPARROW_HOME to a "
                             "writable folder (a home that already holds it may be read-only)") from None
