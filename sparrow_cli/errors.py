"""How a command ends when it does not finish: bad input is one sentence and exit 2, a signal one line
and exit 128 + the signal, never a traceback.

`friendly_errors` wraps every command: the project's input errors (UsageError, which the CLI raises before
any work starts and before any output is touched, and the stages' own) become `error: ...`; Ctrl-C and
SIGTERM (what schedulers send to stop a job) take the same path, and the line says what was kept."""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from rich.text import Text

from .console import StdoutFailed, free_stdout
from .messages import fail, say_always


class UsageError(ValueError):
    """Bad input found before any work starts."""


def friendly_errors(fn: Callable) -> Callable:
    """Turn the project's input errors into one clear line and a non-zero exit."""
    from sparrow.schemas import ArtifactError
    from sparrow.schemas.locations import release_all
    from sparrow.stages.backends.ray_pool import WorkersFailed
    from sparrow.stages.core.prompt_set import PromptError
    from sparrow.stages.engine.memory import PoolTooSmall
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.tasks.base import RewardError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        free_stdout()
        terminated: list[int] = []
        try:
            with sigterm_as_interrupt(terminated):
                return fn(*args, **kwargs)
        except (UsageError, ArtifactError, ModelSpecError, PromptError, PoolTooSmall, RewardError,
                StdoutFailed, WorkersFailed, KeyError) as e:
            fail(str(e.args[0]) if e.args else str(e))
        except KeyboardInterrupt as e:  # a stage may say what it kept and how to go on
            said = str(e.args[0]) if e.args else NOTHING_LEFT
            # a stage may stop on a signal itself (sql's query watch) and name it; else the handler's record
            stopped(getattr(e, "signum", signal.SIGTERM if terminated else signal.SIGINT), said)
        finally:
            free_stdout()
            release_all()  # the outputs and folders the command held

    return wrapper


NOTHING_LEFT = "nothing half-written was left behind"


def stopped(signum: int = signal.SIGINT, said: str = NOTHING_LEFT) -> NoReturn:
    """The one line of a command stopped by a signal (`said`: what it kept and how to go on), and exit
    128 + the signal, as the shell reports a signal's end."""
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    say_always(Text(f"{what}; {said}", style="yellow"))  # --quiet keeps it: what was kept, how to go on
    sys.exit(128 + signum)


@contextmanager
def sigterm_as_interrupt(received: list[int]) -> Iterator[None]:
    """SIGTERM, what schedulers (Slurm, Kubernetes) send to stop a job, takes SIGINT's path: the SIGINT
    handler in place runs, else (SIGINT ignored, as in a shell's background job) KeyboardInterrupt.
    `received` records it. A training step defers this handler itself until its writes end, whatever
    SIGINT's is (stages/train/run_dir.py: interrupts_deferred). Only in the main thread, where Python runs
    signal handlers. A SIGTERM the parent ignores (`trap '' TERM`) stays ignored, as at start-up (entry)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def handler(signum: int, frame) -> None:
        received.append(signum)
        on_interrupt = signal.getsignal(signal.SIGINT)
        if not callable(on_interrupt):  # SIGINT ignored (a background job): still stop
            raise KeyboardInterrupt
        on_interrupt(signal.SIGINT, frame)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def stage_errors() -> Iterator[None]:
    """The stages' own input errors, as the CLI's one-sentence usage errors."""
    from sparrow.stages.core.schedule import ScheduleError
    from sparrow.stages.cost import CostError

    try:
        yield
    except (CostError, ScheduleError) as e:
        raise UsageError(str(e)) from None
