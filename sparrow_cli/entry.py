"""The `sparrow` console script (pyproject's [project.scripts]). It imports nothing heavy before its
handlers are in place, so that Ctrl-C while the CLI is still importing numpy, pyarrow or torch is the same
one line and exit 130 as during a command (common.stopped), never a traceback. The line is written here
without rich, which may not be imported yet."""

from __future__ import annotations

import os
import sys

INTERRUPTED = "interrupted; nothing half-written was left behind"


def main() -> None:
    """Run `sparrow` (app.main) with Ctrl-C at any moment, the imports included, as one line and exit 130."""
    try:
        _occupy_closed_streams()
        from .app import main as run

        run()
    except KeyboardInterrupt:
        interrupted()


def interrupted() -> None:
    """Say that Ctrl-C stopped the command and exit 130 (never returns); a second Ctrl-C meanwhile ends it
    at once. Nothing here imports typing or more: the CLI may not have imported anything yet."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        sys.stderr.write(INTERRUPTED + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed or gone: the exit status still says it
        pass
    sys.exit(130)


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
