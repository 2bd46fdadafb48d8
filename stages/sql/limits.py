"""The bounds of one query while it runs: memory (DuckDB's limit and the process's data size), disk
(DuckDB's spill folder), wall time (a timer interrupts DuckDB) and SIGINT/SIGTERM (a thread watching
Python's wakeup fd interrupts DuckDB, which may not hand back to Python until then). Each ends the query
with one sentence."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

DEFAULT_TIMEOUT = 300.0
MAX_TIMEOUT = 365 * 24 * 3600  # a year: the timer takes no later moment than the C library's time_t
DEFAULT_MEMORY = "25%"
SPILL_PER_MEMORY = 2  # the default spill: twice the memory limit ...
SPILL_DISK_SHARE = 0.25  # ... and at most this share of the temporary directory's free disk


class QueryError(ValueError):
    """A query refused, or stopped at one of its limits; the message is one sentence."""


class QueryLimit(QueryError):
    """A query stopped at its memory or time limit."""


class Stopped(KeyboardInterrupt):
    """The query was stopped by a signal (SIGINT or SIGTERM); `signum` says which."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


@dataclass(frozen=True)
class Limits:
    """What one query may take: `memory` bytes in all (DuckDB's working memory, half of it, plus the
    result on its way out), `seconds` of wall time (None: no limit) and `spill` bytes of disk in its
    spill folder (None: `default_spill`)."""

    memory: int = field(default_factory=lambda: parse_memory(DEFAULT_MEMORY))
    seconds: float | None = DEFAULT_TIMEOUT
    spill: int | None = None

    def __post_init__(self) -> None:
        if self.seconds is not None and not 0 <= self.seconds <= MAX_TIMEOUT:  # nan too
            raise ValueError(f"a query's time limit must be from 0 to {MAX_TIMEOUT:,} seconds (a year), "
                             f"got {self.seconds:g}")

    def spill_bytes(self) -> int:
        return self.spill if self.spill is not None else default_spill(self.memory)


def default_spill(memory: int) -> int:
    """The disk a query may spill to: SPILL_PER_MEMORY times its memory limit, at most SPILL_DISK_SHARE of
    the free disk where the spill folder goes (the temporary directory), which other jobs share; at least
    16MiB."""
    try:
        free = shutil.disk_usage(tempfile.gettempdir()).free
    except OSError:
        free = SPILL_PER_MEMORY * memory
    return max(min(SPILL_PER_MEMORY * memory, int(SPILL_DISK_SHARE * free)), 2**24)


def parse_memory(text: str) -> int:
    """Bytes from "4GB", "512MiB", "1.5GB" (B, KB, MB, GB, TB powers of 1000; KiB, MiB, GiB, TiB of
    1024) or "25%" of this machine's memory; ValueError with one sentence otherwise. A size above the
    machine's memory is refused, as a share above 100% is: a limit the machine cannot give bounds nothing."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%|[kmgt]i?b|b)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"must be a size such as 4GB, 512MiB or 25% (of this machine's memory), got "
                         f"{text!r}")
    number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"must be a share of this machine's memory in (0, 100]%, got {text!r}")
        size = number / 100 * machine_memory()
    else:
        power = "bkmgt".index(unit[0])
        size = number * (1024 if "i" in unit else 1000) ** power
        if size > (total := machine_memory()):
            raise ValueError(f"must be at most this machine's memory ({memory_text(total)}), got {text!r}")
    if size < 2**24:
        raise ValueError(f"must be at least 16MiB, got {text!r}")
    return int(size)


def machine_memory() -> int:
    """This machine's memory in bytes, or its container's where that is less."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def memory_text(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


class Guard:
    """The time, memory and signal bounds of one query while it runs."""

    def __init__(self, con: duckdb.DuckDBPyConnection, limits: Limits):
        self.con, self.limits = con, limits
        self.timed_out = threading.Event()
        self.signum: int | None = None  # the first SIGINT or SIGTERM
        self.raised = False

    def expire(self) -> None:
        self.timed_out.set()
        self.con.interrupt()

    def stop(self, signum: int, frame: object) -> None:
        """The Python handler (main thread, between two bytecodes)."""
        self.signum = self.signum or signum
        if not self.raised:  # a second signal while stopping waits for the first to finish
            self.raised = True
            raise Stopped(self.signum)

    def signalled(self, signum: int) -> None:
        """The watcher thread: DuckDB may not hand back to Python, where `stop` runs, until interrupted."""
        self.signum = self.signum or signum
        self.con.interrupt()

    def check(self) -> None:
        if self.timed_out.is_set():
            raise QueryLimit(self.timeout_message())

    def timeout_message(self) -> str:
        return (f"the query ran past its time limit of {self.limits.seconds:g} s and was stopped (raise it "
                f"with --timeout)")

    def spill_message(self) -> str:
        return (f"the query spilled more than its disk limit of {memory_text(self.limits.spill_bytes())} to "
                f"its temporary folder and was stopped (the limit is {SPILL_PER_MEMORY} times "
                f"--memory-limit, at most {SPILL_DISK_SHARE:.0%} of the free disk: raise --memory-limit, or "
                f"let SQL aggregate more)")

    def memory_message(self) -> str:
        return (f"the query needed more memory than its limit of {memory_text(self.limits.memory)} and was "
                f"stopped (raise it with --memory-limit, or let SQL aggregate more)")


@contextmanager
def guarded(con: duckdb.DuckDBPyConnection, limits: Limits, seconds: float | None = None) -> Iterator[Guard]:
    """The query under `limits`; its timer runs `seconds` when given (what is left of `limits.seconds`, which
    the messages name), else `limits.seconds`."""
    guard = Guard(con, limits)
    seconds = limits.seconds if seconds is None else seconds
    timer = threading.Timer(seconds, guard.expire) if seconds else None
    handlers = _install_stop(guard)
    try:
        with _signal_watch(guard, tuple(handlers)), _memory_bound(limits.memory):
            if timer:
                timer.daemon = True
                timer.start()
            yield guard
    finally:
        if timer:
            timer.cancel()
        for signum, previous in handlers.items():
            signal.signal(signum, previous)


def _install_stop(guard: Guard) -> dict[int, object]:
    """SIGINT and SIGTERM stop the query (main thread only: Python's signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) in (signal.SIG_IGN, None):  # as a background job: left ignored
            continue
        handlers[signum] = signal.signal(signum, guard.stop)
    return handlers


@contextmanager
def _signal_watch(guard: Guard, signums: tuple[int, ...]) -> Iterator[None]:
    """A thread that learns of `signums` through Python's wakeup fd, which is written even while the main
    thread is inside DuckDB, and tells `guard`."""
    if not signums:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while data := reader.recv(64):
            for signum in data:
                if signum in signums:
                    guard.signalled(signum)

    watcher = threading.Thread(target=watch, name="sparrow-sql-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.close()  # the watcher reads the end of the stream and returns
        watcher.join()
        reader.close()


@contextmanager
def _memory_bound(budget: int) -> Iterator[None]:
    """The process may take `budget` more bytes of data than it holds now, while the block runs, so that
    what DuckDB does not count (a huge string) or the result on its way out fails with MemoryError rather
    than meet the OOM killer. Linux only (elsewhere DuckDB's own limit is the bound)."""
    try:
        import resource

        used = _data_bytes()
    except (ImportError, OSError, ValueError):
        yield
        return
    import numpy  # noqa: F401  (imported lazily by pyarrow, and BLAS aborts when it cannot allocate)
    import pyarrow.parquet  # noqa: F401

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    bound = used + budget if hard == resource.RLIM_INFINITY else min(hard, used + budget)
    if soft != resource.RLIM_INFINITY:
        bound = min(bound, soft)
    resource.setrlimit(resource.RLIMIT_DATA, (bound, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _data_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    m = re.search(r"^VmData:\s+(\d+)\s+kB", status, flags=re.MULTILINE)
    if m is None:
        raise ValueError("no VmData")
    return int(m.group(1)) * 1024
