"""Call a sandboxed program's function from the host: the program only ever hands back data.

A program is judged here, in the host process, never inside the sandbox: everything in the sandbox is
the program's to change (the server that loads it included), so nothing it says there about its tests
is believed. The sandbox runs `SERVER`: it loads the program (`solution.py`), points the program's
stdout at stderr, keeps a copy of the original stdout as its answer channel, then answers one request
per stdin line, `[seq, seconds, args]`, by calling the function with those arguments under a SIGALRM of
`seconds` and writing `[seq, "returned", value]` or `[seq, "raised", exception name]`. Arguments and
values cross as plain data (`values.py`), decoded here into built-in types only.

So a program can do no more than any function can: for each call the host makes, return a value (which
the host's own test code compares), raise, or not answer. Calling or patching the server, writing fake
lines to any descriptor, exiting early or hanging all come down to one of these: a line that is not
the answer to the pending request is ignored, and a run that ends or stops answering before the host's
tests are done is over (`RunOver`), which the tasks score 0. An exception's name is the program's to
choose (a class named `passed` or `_Timeout`, or a server it rewrote), so it is display text only
(`Raised.name`): whether a call ran out of its time is the host's clock's to say (`Raised.timed_out`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from . import values
from .sandbox import Outcome, Running, Sandbox

GRACE = 0.5  # seconds the host waits past a call's own alarm before it gives up on the run
VALUES = Path(values.__file__).read_text()

SERVER = """\
import json, os, runpy, signal, sys
import values as _values
_answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
_here = os.path.dirname(os.path.abspath(__file__))
_fn = runpy.run_path(os.path.join(_here, "solution.py"), run_name="solution").get({name!r})
for _line in sys.stdin:
    _seq, _seconds, _args = json.loads(_line)
    try:
        signal.setitimer(signal.ITIMER_REAL, _seconds)
        _answer = [_seq, "returned", _values.encode(_fn(*_values.decode(_args)))]
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as _e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _answer = [_seq, "raised", type(_e).__name__]
    _answers.write(json.dumps(_answer) + "\\n")
    _answers.flush()
"""

T = TypeVar("T")


class RunOver(BaseException):  # not an Exception: test code's `except Exception` must not swallow it
    """The program ended, or stopped answering, before the tests were done. `status`: "timeout",
    "output_limit", or "ended" (it exited or closed its answer channel)."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


class Raised(Exception):
    """The program's function raised or returned no plain data. `name`: the class name the program gave,
    display text only, never a verdict; `timed_out`: by the host's clock, the call's time was up when the
    answer came (an alarm in the sandbox never fires early) or before the call was made."""

    def __init__(self, name: str, timed_out: bool = False):
        super().__init__(name)
        self.name = name
        self.timed_out = timed_out


class Remote:
    """The host's handle on the program's function: call it like the function. Each test first sets its
    time (`begin`); every call of the test shares it."""

    def __init__(self, running: Running):
        self.running = running
        self.seq = 0
        self.until = time.monotonic()

    def begin(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def __call__(self, *args: Any) -> Any:
        left = self.until - time.monotonic()
        if left <= 0:
            raise Raised("no time left", timed_out=True)
        self.seq += 1
        request = json.dumps([self.seq, left, values.encode(list(args))]).encode() + b"\n"
        if not self.running.send(request, self.until + GRACE):
            raise RunOver(self._why())
        while True:
            line = self.running.line(self.until + GRACE)
            if line is None:
                raise RunOver(self._why())
            answer = _answer(line, self.seq)
            if answer is not None:
                break
        kind, value = answer
        if kind == "raised":
            raise Raised(value, timed_out=time.monotonic() >= self.until)
        return value

    def _why(self) -> str:
        if self.running.status != "running":
            return self.running.status
        return "ended" if not self.running.stdout_open else "timeout"


def _answer(line: bytes, seq: int) -> tuple[str, Any] | None:
    """("returned", value) or ("raised", name) when `line` answers request `seq`, else None."""
    try:
        got, kind, payload = json.loads(line)
    except (ValueError, TypeError, RecursionError):
        return None
    if type(got) is not int or got != seq or kind not in ("returned", "raised"):
        return None
    if kind == "raised":
        return kind, payload if type(payload) is str else "Exception"
    try:
        return kind, values.decode(payload)
    except (ValueError, TypeError, RecursionError):
        return "raised", "NotPlainData"


def call_tests(sandbox: Sandbox, code: str, name: str,
               tests: Callable[[Remote], T]) -> tuple[T | None, Outcome]:
    """Start `code` in `sandbox` serving function `name`, run `tests(remote)` here against it, and end the
    run. Returns the tests' result (None when the run was over before they were done) and how it ran."""
    files = {"main.py": SERVER.format(name=name), "values.py": VALUES, "solution.py": code}
    with sandbox.start(files) as running:
        try:
            result = tests(Remote(running))
        except RunOver as over:
            return None, (running.finish() if over.status == "ended" else running.stop(over.status))
        return result, running.finish()
