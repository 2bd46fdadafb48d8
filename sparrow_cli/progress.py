"""Progress on stderr: live bars where stderr is a terminal that redraws, whole lines anywhere else.

A log, a pipe or a dumb terminal never gets a line cut to 80 columns or drawn over with carriage returns
(`live_progress`, `log_line`): it gets the first update, at most one line every few seconds, and the last
(LogProgress), one per phase (PhaseProgress). Work that counts nothing for minutes (a training step, a
teacher-forced batch) still gets a line of life every HEARTBEAT_SECONDS, from a thread of its own
(Heartbeat, BeatingPhases). --quiet silences all of it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .console import console


def live_progress() -> bool:
    """Whether progress shows as live bars on stderr (`disable=not live_progress()` of every bar) rather
    than as whole lines (`log_line`): only where stderr is a terminal that redraws (MessageConsole.redraws).
    A log, a pipe or a dumb terminal gets the lines, whatever FORCE_COLOR says, so that no line is cut to 80
    columns, left stale, or drawn over and over with carriage returns."""
    return console.redraws and not console.quiet


_logged = {"at": time.monotonic()}  # when the last progress line was printed (Heartbeat's silence)


def log_line(text: str) -> None:
    """A progress line for a log: printed whole where progress is not live (`live_progress`: a log, a pipe,
    a dumb terminal), nothing where the bar shows it."""
    if not live_progress():
        _logged["at"] = time.monotonic()
        console.print(text, highlight=False, markup=False, soft_wrap=True)


HEARTBEAT_SECONDS = 30.0


class Heartbeat:
    """A log's sign of life during long work that reports no progress of its own (a training step's
    rollout, update or eval): while `doing` names the work, a line saying what runs and for how long
    whenever no progress line (`log_line`) was printed for `every` seconds, counted from the heartbeat's
    start at the earliest. A thread of its own keeps the time, since the work gives no callback until it
    ends; where progress is live (a bar with its clock) there is none. The work and its start are one
    value (`state`), stored and read at once, so that a line never times one phase from another's start."""

    def __init__(self, every: float | None = None):
        self.every = HEARTBEAT_SECONDS if every is None else every
        self.state: tuple[str | None, float] = (None, time.monotonic())  # what runs, since when
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def doing(self, what: str | None) -> None:
        """The work that runs from now on (None: nothing worth a line)."""
        self.state = (what, time.monotonic())

    def __enter__(self) -> Heartbeat:
        _logged["at"] = time.monotonic()  # the silence is counted from here, not from the last line before
        if not live_progress():
            self._thread = threading.Thread(target=self._beat, name="sparrow-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(min(self.every, 1.0)):
            (what, since), now = self.state, time.monotonic()
            if what is not None and now - _logged["at"] >= self.every:
                log_line(f"{what} ... ({now - since:.0f} s so far)")


@contextlib.contextmanager
def working(what: str) -> Iterator[None]:
    """Long work that counts nothing (a user's reward function over every completion): a spinner with its
    clock where progress is live, else a Heartbeat's line every HEARTBEAT_SECONDS of it."""
    if not live_progress():
        with Heartbeat() as beat:
            beat.doing(what)
            yield
        return
    with Progress(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), console=console, transient=True,
                  redirect_stdout=False, redirect_stderr=False):
        yield


ETA_AFTER_SECONDS = 5.0  # a rate measured over less time says little about what is left


class LogProgress:
    """Progress of long work as whole lines where progress is not live (`live_progress`): the first update,
    then at most one line every `every` seconds, and the last one. A line past ETA_AFTER_SECONDS also says
    how long the rest takes at the rate so far, as the live bar's time-remaining column does, unless the
    caller's `info` says it (`eta` False: a rollout's bound from its tokens). With `after`, nothing before
    that many seconds: work that is usually quick says nothing when it is."""

    def __init__(self, what: str, every: float = 10.0, eta: bool = True, after: float = 0.0):
        self.what, self.every, self.last, self.eta, self.after = what, every, None, eta, after
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, info: str = "") -> None:
        now = time.monotonic()
        if now - self.start < self.after:
            return
        if self.last is not None and done < total and now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        left = _left(elapsed, done, total) if self.eta else ""
        log_line(f"{self.what}: {done}/{total}{f', {info}' if info else ''} ({elapsed:.0f} s{left})")


def _left(elapsed: float, done: int, total: int) -> str:
    """', about N s left' at the rate so far; "" before ETA_AFTER_SECONDS, before any work or after all."""
    if elapsed < ETA_AFTER_SECONDS or not 0 < done < total:
        return ""
    left = elapsed * (total - done) / done
    return f", about {left:.0f} s left" if left < 120 else f", about {left / 60:.0f} min left"


@contextlib.contextmanager
def counting(what: str, after: float = ETA_AFTER_SECONDS) -> Iterator[Callable[[int, int], None]]:
    """A (done, total) callback for the length of the block: a bar with the time left on a terminal,
    LogProgress's lines in a log once it has taken `after` seconds (quick work says nothing there)."""
    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=not live_progress()) as bar:
        task, log = bar.add_task(what, total=None), LogProgress(what, after=after)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            log(done, total)
        yield update


def say_loading(model: str, device: str) -> None:
    """The line that says the model is loading (seconds to minutes, with nothing else to show)."""
    console.print(f"loading model {model} on {device} ...", highlight=False, markup=False)


class PhaseProgress:
    """(phase, done, total) progress on stderr: one bar per phase on a terminal (in `bar`), whole lines in a
    log (LogProgress). Each phase shows as soon as it starts (0 of its total), not at its first batch. A
    phase that counts tokens (sampling) shows them and their rate since its first count, as a rollout's
    bar does: its samples may all finish at the end."""

    def __init__(self, bar, labels: dict[str, str] | None = None):
        self.bar, self.labels = bar, labels or {}
        self.tasks: dict[str, object] = {}
        self.logs: dict[str, LogProgress] = {}
        self.origins: dict[str, tuple[float, int]] = {}  # a phase's first token count and its time

    def __call__(self, phase: str, done: int, total: int, tokens: int | None = None) -> None:
        if phase not in self.tasks:
            label = self.labels.get(phase, phase)
            self.tasks[phase] = self.bar.add_task(label, total=total, info="")
            self.logs[phase] = LogProgress(label)
        info = "" if tokens is None else self._tokens(phase, tokens)
        self.bar.update(self.tasks[phase], completed=done, total=total, info=info)
        self.logs[phase](done, total, info)

    def _tokens(self, phase: str, tokens: int) -> str:
        """"1,024 tokens, 85.3 tok/s": the rate counts the tokens after the phase's first count."""
        now = time.perf_counter()
        start, before = self.origins.setdefault(phase, (now, tokens))
        rate = f", {(tokens - before) / (now - start):,.1f} tok/s" if now > start and tokens > before else ""
        return f"{tokens:,} tokens{rate}"


# a teacher-forced batch of long sequences can take minutes, its count moving only when it ends: a log
# hears that the phase still runs at least this often
PHASE_BEAT_SECONDS = 10.0


class BeatingPhases:
    """PhaseProgress that also names the running phase to a Heartbeat, so that a log hears of a phase whose
    count moves only when a whole batch ends (teacher-forced scoring): `scoring (sequences) ... (40 s so
    far)` whenever no progress line was printed for the heartbeat's seconds, timed from the phase's start."""

    def __init__(self, phases: PhaseProgress, beat: Heartbeat):
        self.phases, self.beat, self.running = phases, beat, None

    def __call__(self, phase: str, done: int, total: int, tokens: int | None = None) -> None:
        self.phases(phase, done, total, tokens)
        if done >= total:
            self.running = None
            self.beat.doing(None)
        elif phase != self.running:
            self.running = phase
            self.beat.doing(self.phases.labels.get(phase, phase))

    def doing(self, phase: str | None) -> None:
        """A phase that reports no count of its own (None: nothing worth a line)."""
        self.running = phase
        self.beat.doing(None if phase is None else self.phases.labels.get(phase, phase))
