"""The `sparrow` console script (pyproject's [project.scripts]). It imports nothing heavy before its
handlers are in place, so that Ctrl-C or SIGTERM while the CLI is still importing numpy, pyarrow or torch
is the same one line and exit 130 or 143 as during a command (errors.stopped), never a traceback nor a
silent end. The line is written here without rich, which may not be imported yet.

SIGTERM (what a scheduler sends to cancel a job) takes Ctrl-C's path from the start: `Terminated`, a
KeyboardInterrupt that names its signal, so that every handler of Ctrl-C on the way (app.Sparrow,
errors.friendly_errors) says "terminated" and exits 143. A command replaces this handler with its own
while it runs (errors.sigterm_as_interrupt) and puts it back after.

Importing torch runs C++ that calls back into Python, and an exception raised there by a signal handler
ends the process in std::terminate (a core dump, exit 134): the import holds SIGINT and SIGTERM back
(`_hold_signals_while_torch_imports`), so a Ctrl-C in the first seconds is delivered when it is done.

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
        _hold_signals_while_torch_imports()
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
    meanwhile end it at once with the command's status: the command is over, and a scheduler that stops
    a finished job must not count it failed."""
    import threading

    def left() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t is not threading.main_thread() and not t.daemon and t.is_alive()]

    if not left():
        return
    import signal

    status = 0 if code is None else code if isinstance(code, int) else 1
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda *_: os._exit(status))

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


class _HeldImport:
    """A module's loader whose exec_module runs with SIGINT and SIGTERM held back (delivered after)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        from sparrow.schemas.signals import held_signals

        module.__spec__.loader = module.__loader__ = self.loader  # torch sees its own loader
        with held_signals():
            self.loader.exec_module(module)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class _TorchFinder:
    """Finds torch as the path finder does, its loader held (`_HeldImport`); any other module, or a torch
    it does not find, it leaves to the finders after it. (It stays in sys.meta_path: taking itself out
    while the import system walks the list would skip the finder after it.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HeldImport(spec.loader)
        return spec


def _hold_signals_while_torch_imports() -> None:
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, _TorchFinder())


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
