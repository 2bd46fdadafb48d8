"""SIGINT and SIGTERM held back while a few steps that must not be cut in two run (the renames that put a
new folder in place, torch's import, whose C++ ends the process when a signal handler raises inside it).

The Python handlers are swapped for ones that only note the signal, and the first noted one is sent
again when the block ends, to whatever handler is then in place. Blocking the signals with
pthread_sigmask would not do: the kernel hands a process's signal to any thread that does not block it
(a progress bar's, a reward pool's), and Python then runs the handler in the main thread all the same.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held_signals() -> Iterator[None]:
    """The block runs to its end whatever SIGINT or SIGTERM comes; the first to come is delivered after.
    Outside the main thread (where Python cannot set handlers) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in HELD
                if signal.getsignal(s) not in (signal.SIG_IGN, None)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if noted:
            os.kill(os.getpid(), noted[0])
