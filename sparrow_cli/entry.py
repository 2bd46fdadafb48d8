"""The `sparrow` console script (pyproject's [project.scripts]). It imports nothing heavy before its
handlers are in place, so that Ctrl-C or SIGTERM while the CLI is still importing numpy, pyarrow or torch
is the same one line and exit 130 or 143 as during a command (errors.stopped), never a traceback nor a
silent end. The line is written here without rich, which may not be imported yet.

SIGTERM (what a scheduler sends to cancel a job) takes Ctrl-C's path from the start: `Terminated`, a
KeyboardInterrupt that names its signal, so that every handler of Ctrl-C on the way (app.Sparrow,
errors.friendly_errors) says "terminated" and exits 143. A command replaces this handler with its own
while it runs (errors.sigterm_as_interrupt) and puts it back after.

A thread that code run in this process started and never ends (a user's reward function's) would keep
Python from exiting after the command has written everything and said so: where such threads are alive
when the command ends, a watchdog exits with the command's status once they have had LINGER_SECONDS to
finish, saying which one it left. Python's own exit (its thread joins and atexit handlers) runs as ever
where they finish in time."""

from __future__ import annotations

import os
import sys

NOTHING_LEFT = "nothing half-written was left behind"
LINGER_SECONDS = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be; `signum` names it (its args stay empty: a stage's own
    KeyboardInterrupt says there what it kept, errors.friendly_errors)."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


def main() -> None:
    """Run `sparrow` (app.main) with Ctrl-C and SIGTERM at any moment, the imports included, as one line
    and exit 130 or 143."""
    try:
        _occupy_closed_streams()
        _terminate_as_interrupt()
        from .app import main as run

        run()
    except KeyboardInterrupt as e:
        interrupted(getattr(e, "signum", None))
    except SystemExit as e:
        _watch_lingering_threads(e.code)
        raise
    _watch_lingering_threads(0)


def _watch_lingering_threads(code: object, linger: float = LINGER_SECONDS) -> None:
    """Where threads other than daemons outlive the command, a daemon that ends the process with `code`
    after `linger` seconds, naming the first thread still running (module docstring). Ctrl-C and SIGTERM
    meanwhile end it at once: the command is over."""
    import threading

    def left() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t is not threading.main_thread() and not t.daemon and t.is_alive()]

    if not left():
        return
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    status = 0 if code is None else code if isinstance(code, int) else 1

    def watch() -> None:
        import time

        time.sleep(linger)
        still = left()
        if not still:
            return
        try:
            sys.stdout.flush()
        except (AttributeError, OSError, ValueError):
            pass
        try:
            sys.stderr.write(f"warning: a thread started during the command ({still[0].name}) was still "
                             f"running {linger:.0f} s after it ended; exiting without it\n")
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        os._exit(status)

    threading.Thread(target=watch, name="sparrow-exit-watchdog", daemon=True).start()


def _terminate_as_interrupt() -> None:
    """SIGTERM raises `Terminated`, unless whoever started us ignores it."""
    import signal

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame) -> None:
    raise Terminated(signum)


def interrupted(signum: int | None = None) -> None:
    """Say that Ctrl-C (None, SIGINT) or SIGTERM stopped the command and exit 128 + the signal (never
    returns); the same signal again meanwhile ends it at once. Nothing here imports typing or more: the
    CLI may not have imported anything yet."""
    import signal

    signum = signal.SIGINT if signum is None else signum
    signal.signal(signum, signal.SIG_DFL)
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    try:
        sys.stderr.write(f"{what}; {NOTHING_LEFT}\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed or gone: the exit status still says it
        pass
    sys.exit(128 + signum)


def _occupy_closed_streams() -> None:
    """Open /dev/null on a closed stdin, stdout or stderr (`>&-`), so that no file the command opens takes
    its descriptor and receives what a child process writes there. Python already took it as closed
    (sys.stdout is None), which the CLI then reports as such."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)


if __name__ == "__main__":
    main()
