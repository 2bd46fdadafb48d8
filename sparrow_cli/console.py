"""The two consoles and stdout: messages and progress on stderr (`console`), data alone on stdout (`out`).

User text prints as written: a console's markup is only the CLI's own style tags (MessageConsole). Off a
terminal a console has no width, so nothing in a log or a pipe is cut or wrapped. A reader that stops
early (`| head`) is not a failure; any other failure to write stdout is StdoutFailed, one sentence and
exit 2, while a stderr that cannot be written loses its messages, never the run. `-o -` hands stdout to
the artifact (`take_stdout`), and tables and summaries then go to stderr."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console, ConsoleDimensions
from rich.text import Text

OWN_STYLES = frozenset({"bold", "bold red", "dim", "green", "yellow", "/"})
_TAG = re.compile(r"(\\*)\[([a-z#/@][^[]*?)]")  # rich's markup tag, with the backslashes before it


class MessageConsole(Console):
    """A console that prints user text as written. Its markup is only the CLI's own style tags
    (OWN_STYLES: `[bold red]error:[/]`, `[yellow]warning:[/]`, ...); any other bracketed text (a path, a
    prompt's `[INST]`, an extra such as `.[vllm]`) prints as it is, and `:name:` never becomes an emoji.
    The rule lives here, not at each call site, so a message that quotes a path or a spec is verbatim
    without escaping it. A tag already escaped (an odd number of backslashes, as rich's `escape` writes)
    is left as it is; text that must be verbatim even where it spells an own tag is printed as `Text`."""

    def render_str(self, text: str, *, emoji: bool | None = None, markup: bool | None = None,
                   **kwargs) -> Text:
        if markup or (markup is None and self._markup):
            text = _TAG.sub(_literal_unless_own, text)
        return super().render_str(text, emoji=False, markup=markup, **kwargs)

    @property
    def size(self) -> ConsoleDimensions:
        """A terminal's own size; anywhere else (a pipe, a file, a log) no width at all, so that nothing
        printed there is cut or wrapped to a width that no reader has: a table is as wide as its cells."""
        size = super().size
        return size if self.on_terminal else ConsoleDimensions(UNBOUNDED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    @property
    def on_terminal(self) -> bool:
        """Whether this console writes to a terminal: its file's own isatty, or `force_terminal` where the
        console was made with one (a test's terminal in a string). Rich's `is_terminal` also says yes to
        FORCE_COLOR (any value, 0 too) and TTY_COMPATIBLE=1, which here only colour the text: a log stays a
        log, its lines whole."""
        if self._force_terminal is not None:
            return self._force_terminal
        return is_terminal(self.file)

    @property
    def redraws(self) -> bool:
        """Whether a live display (a progress bar) redraws in place here: rich's rule for `is_interactive`
        (TTY_INTERACTIVE=0 or 1 if set, else not a dumb terminal: TERM dumb or unknown, as Emacs' shell and
        some web consoles set, where rich's Live never refreshes) on `on_terminal`. Read here each time, as
        rich fixes `is_interactive` when the console is made, from its own `is_terminal`."""
        if not self.on_terminal:
            return False
        forced = self._environ.get("TTY_INTERACTIVE")
        if forced in ("0", "1"):
            return forced == "1"
        return self._environ.get("TERM", "").lower() not in ("dumb", "unknown")

    def on_broken_pipe(self) -> None:
        """The reader stopped early (`| head`): what this console prints from now on goes nowhere, and the
        command carries on to its end (a reader that stops early is not a failure; app.main)."""
        drop_stream(self.file)

    def _check_buffer(self) -> None:
        """Stdout's console fails as every stdout writer does (`writing_stdout`): a full disk, an I/O error
        or a closed stdout is StdoutFailed, never a traceback nor a table silently dropped. A stderr that
        cannot be written (a log on a full disk) is as one whose reader is gone: messages go nowhere and
        the command carries on, since losing a run for a progress line would be worse."""
        if self.stderr:
            try:
                return super()._check_buffer()
            except OSError:
                self.on_broken_pipe()
                return None
        if self._file is not None:
            return super()._check_buffer()
        with writing_stdout():
            super()._check_buffer()


UNBOUNDED_WIDTH = 100_000  # the width of a console that is not a terminal: wider than any table


def drop_stream(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null: its reader is gone, so what is still buffered or
    written later (also Python's flush at exit) goes nowhere instead of failing again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # not a real file (under a test runner): nothing to redirect
        pass


class StdoutFailed(Exception):
    """Writing stdout failed other than by its reader stopping early: a full disk, an I/O error, a closed
    stdout. The command ends with one sentence and exit 2 (`friendly_errors`, app.Sparrow, app.main); what
    it wrote to files before is whole, since every artifact is written before anything is printed."""


def stdout_failed(error: OSError | None = None) -> StdoutFailed:
    """The StdoutFailed of `error` (None: stdout is closed). Stdout is pointed at /dev/null first, so that
    what is still buffered does not fail again when Python flushes it at exit."""
    if sys.stdout is not None:
        drop_stream(sys.stdout)
    reason = "it is closed" if error is None else error.strerror or first_words(error)
    return StdoutFailed(f"cannot write stdout ({reason})")


def first_words(error: BaseException) -> str:
    """An exception's first line, for a message that quotes it."""
    return (str(error).splitlines() or [type(error).__name__])[0]


@contextmanager
def writing_stdout() -> Iterator[None]:
    """A block that writes stdout: a reader that stops early (BrokenPipeError) passes through to the
    caller's rule (a reader that stops early is not a failure; app.main); any other OSError, or a closed
    stdout, is StdoutFailed."""
    if sys.stdout is None:
        raise stdout_failed()
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        raise stdout_failed(e) from None


def is_terminal(stream) -> bool:
    """Whether `stream` (sys.stdin, sys.stdout) is a terminal; a closed one (None) is not."""
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # a stream whose file descriptor is gone
        return False


def _literal_unless_own(tag: re.Match) -> str:
    slashes, name = tag.group(1), tag.group(2)
    if len(slashes) % 2 or name in OWN_STYLES:
        return tag.group(0)
    return "\\" * (2 * len(slashes) + 1) + f"[{name}]"  # rich prints the backslashes, then the tag


console = MessageConsole(stderr=True, soft_wrap=True)  # messages and progress; stdout holds only data
# (soft_wrap: a message is never broken inside a path, so logs stay greppable)
out = MessageConsole()


_stdout = {"taken": False}  # whether `-o -` made stdout an artifact's, for the command that runs


def stdout_taken() -> bool:
    """Whether `-o -` made stdout the artifact's: tables and summaries then go to stderr."""
    return _stdout["taken"]


def take_stdout() -> None:
    """`-o -` makes stdout the artifact's until the command ends (`free_stdout`)."""
    _stdout["taken"] = True


def free_stdout() -> None:
    """Stdout is nobody's artifact: a command starts and ends so (several run in one process under tests)."""
    _stdout["taken"] = False
