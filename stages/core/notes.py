"""A stage's note to the user: one line, through the `sparrow` logger where something takes it.

The CLI prints the logger's INFO records as "note: ..." once per command (--quiet drops them); a script
using the stages with no handler still hears each note once per process, on stderr.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SAID: set[str] = set()  # the notes already printed to stderr by this process
_muted = 0


@contextmanager
def muted() -> Iterator[None]:
    """Notes dropped while it lasts: for a look at inputs that the work reads again, and says, later."""
    global _muted
    _muted += 1
    try:
        yield
    finally:
        _muted -= 1


def note(message: str) -> None:
    if _muted:
        return
    logger = logging.getLogger("sparrow")
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message)
    elif message not in _SAID:
        _SAID.add(message)
        print(f"note: {message}", file=sys.stderr, flush=True)
