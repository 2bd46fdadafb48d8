"""Output and input paths on the command line, checked before any work.

Every command that writes checks its output location with `check_output` (or `check_output_dir`) before
any work: the rule itself is `sparrow.schemas.locations`; here it becomes one sentence that says how
to force it, and `-o -` hands stdout to the artifact (tables and summaries then go to stderr). A file
output is then held (`hold_output`: a lock beside it) until the command ends, so a second command writing
it on this machine is refused at once instead of replacing the first one's result when it ends. An input
of `-` or a FIFO is read whole first, since Parquet is read from its footer; stdin on a terminal or
closed is refused at once, never waited on."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from .console import is_terminal, take_stdout
from .errors import UsageError
from .messages import fail

FORCE_HELP = ("Replace an existing output that is not an artifact of the kind this command writes (a "
              "directory of other files is never replaced).")


def force_option(help: str = FORCE_HELP):
    return typer.Option(False, "--force/--no-force", help=help)


def output_help(what: str) -> str:
    """The help of an artifact's -o: what it is, stdout, and the overwrite rule."""
    return (f"Where to write {what} (- = stdout, as Parquet). An existing file is replaced only if it is "
            "an artifact of the same kind (or --force); a symlink is written through.")


def check_output(path: Path | None, kind: str | None, force: bool, flag: str = "-o",
                 parts: bool = False, inputs: dict[str, object] | None = None) -> None:
    """The output location rule (sparrow.schemas.locations) before any work, as one sentence; `inputs`
    (flag -> the path it reads, a list of paths, or None where not given) are files the output may not
    replace, even forced."""
    from sparrow.schemas import OutputRefused
    from sparrow.schemas import check_output as check
    from sparrow.schemas.locations import UnusableOutput, is_stdio

    if path is None:
        return
    if is_stdio(path) and sys.stdout is None:
        raise UsageError(f"{flag} - writes Parquet to stdout, which is closed here; give a file path, or "
                         "redirect stdout to a file or a pipe")
    if is_stdio(path) and is_terminal(sys.stdout):
        raise UsageError(f"{flag} - writes Parquet to stdout, which is a terminal here; redirect it to a "
                         "file or a pipe")
    try:
        check(path, kind, force, parts, inputs)
    except OutputRefused as e:
        raise UsageError(f"{flag} {e}; pass --force to replace it, or choose another path") from None
    except UnusableOutput as e:
        raise UsageError(f"{flag} {e}") from None
    if is_stdio(path):
        take_stdout()
    else:
        _hold(path, flag)


def _hold(path: Path, flag: str) -> None:
    """The output held by this command until it ends (`errors.friendly_errors` lets go of it)."""
    from sparrow.schemas.locations import FolderBusy, hold_output

    try:
        hold_output(path, "sparrow command", f"another {flag}")
    except FolderBusy as e:
        raise UsageError(f"{flag} {e}") from None


def check_output_dir(path: Path, what: str, ours: Callable[[Path], bool], force: bool,
                     replaceable: Callable[[Path], bool] = lambda d: False, flag: str = "-o",
                     inputs: dict[str, object] | None = None, forced: str = "replace it") -> Path:
    """The rule for a directory output (a run, an adapter, a report folder); the directory written.
    `inputs` as `check_output`'s: the directory may neither be one nor hold one. `forced` says what
    --force does to the directory."""
    from sparrow.schemas import OutputRefused
    from sparrow.schemas import check_output_dir as check
    from sparrow.schemas.locations import UnusableOutput

    try:
        return check(path, what, ours, replaceable, force, inputs)
    except OutputRefused as e:
        raise UsageError(f"{flag} {e}; pass --force to {forced}, or choose another directory") from None
    except UnusableOutput as e:
        raise UsageError(f"{flag} {e}") from None


def input_path(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """typer callback of an artifact input: `-` is stdin, and stdin or a FIFO (such as /dev/stdin in a
    pipe) is read whole first, since Parquet is read by seeking to its footer. Stdin on a terminal (a
    forgotten pipe or `<`) would wait for typing forever, so it is refused at once, as `-o -` to a
    terminal is; so is a closed stdin."""
    from sparrow.schemas import ArtifactError, spool_input

    if value is None or ctx.resilient_parsing:
        return value
    flag = param.opts[0] if param.opts else param.name
    check_input_stream(value, flag)
    try:
        return spool_input(value, flag)
    except ArtifactError as e:
        fail(str(e))


def check_input_stream(path: Path, flag: str) -> None:
    """`-` with stdin closed or on a terminal, or a path that is a terminal (/dev/stdin, /dev/tty): one
    sentence, before anything waits on it."""
    from sparrow.schemas.locations import is_stdio

    if is_stdio(path):
        if sys.stdin is None:
            fail(f"{flag} - reads stdin, which is closed here; pipe or redirect a Parquet or JSONL file "
                 "into it, or give a file path")
        if is_terminal(sys.stdin):
            fail(f"{flag} - reads a Parquet or JSONL file from stdin, which is a terminal here; pipe or "
                 "redirect a file into it, or give a file path")
    elif _is_terminal_device(path):
        fail(f"{flag} {path} is a terminal, not a Parquet or JSONL file; pipe or redirect a file into "
             f"stdin, or give a file path")


def _is_terminal_device(path: Path) -> bool:
    """Whether `path` is a character device that is a terminal (opened without waiting or becoming this
    process's controlling terminal); False for anything that cannot be opened so."""
    import stat

    try:
        if not stat.S_ISCHR(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.isatty(fd)
    finally:
        os.close(fd)
