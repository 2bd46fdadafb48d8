"""Where Sparrow keeps what it builds once: converted checkpoints and tokenizers ($SPARROW_HOME)."""

from __future__ import annotations

import os
from pathlib import Path


def sparrow_home() -> Path:
    return Path(os.environ.get("SPARROW_HOME") or Path.home() / ".cache" / "sparrow")
