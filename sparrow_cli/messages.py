"""The lines a command says on stderr: `error: ...`, `warning: ...`, `note: ...`, each one line.

Text a message quotes (a path, a spec, an artifact's metadata) prints as written but for its control
characters, escaped (`printable`), so that no file name clears the terminal or forges a line of its own.
Errors and warnings print under --quiet too (`say_always`); notes do not. What stages log through the
`sparrow` logger takes the same path (`print_stage_messages`). `fail` is the error line and an exit."""

from __future__ import annotations

import logging
import re
from typing import NoReturn

import typer
from rich.text import Text

from .console import console


def fail(message: str, code: int = 2) -> NoReturn:
    say_error(message)
    raise typer.Exit(code)


def say_error(message: str) -> None:
    """The one "error: ..." line on stderr, every spooled input named as the user gave it."""
    from sparrow.schemas.locations import name_inputs

    # as Text: the message quotes user input (a path, a spec, a prompt) that no markup may touch
    say_always(Text.assemble(("error:", "bold red"), " ", printable(name_inputs(message))))


def warn(message: str) -> None:
    """A warning on stderr, one line, its text (which may quote user input) printed as written but for its
    control characters (`printable`); --quiet keeps it."""
    say_always(Text.assemble(("warning:", "yellow"), " ", printable(message)))


class StageMessages(logging.Handler):
    """What stages say through the `sparrow` logger: INFO as a note, WARNING and above as a warning, so that
    --quiet treats them as it treats the CLI's own. Each message once per command (train reads its prompts
    more than once); `forget_stage_messages` starts the next command afresh, so a note that one command's
    --quiet dropped is still said by the next."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.said:
            self.said.add(message)
            (warn if record.levelno >= logging.WARNING else note)(message)


def forget_stage_messages() -> None:
    """A command has ended: the next one says the stages' messages again."""
    for handler in logging.getLogger("sparrow").handlers:
        if isinstance(handler, StageMessages):
            handler.said.clear()


def print_stage_messages() -> None:
    """Send the `sparrow` logger's records to stderr as notes and warnings (`StageMessages`), once."""
    logger = logging.getLogger("sparrow")
    if not any(isinstance(h, StageMessages) for h in logger.handlers):
        logger.addHandler(StageMessages())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def say_always(text: Text) -> None:
    """`text` on stderr, --quiet or not: an error or a warning is never silenced."""
    quiet, console.quiet = console.quiet, False
    try:
        console.print(text, soft_wrap=True)
    finally:
        console.quiet = quiet


def note(message: str) -> None:
    """A note on stderr, one line, as `warn` prints: something the user may not expect that changes nothing
    they asked for."""
    console.print(Text.assemble(("note:", "yellow"), " ", printable(message)), soft_wrap=True)


CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
ESCAPES = {"\n": "\\n", "\r": "\\r"}


def printable(text: str) -> str:
    """`text` with its control characters escaped (`\\n`, `\\r`, `\\x1b`; a tab stays): a message quotes
    what no one checked (a run's file names, an artifact's metadata, the bytes DuckDB quotes from a damaged
    file), where an escape sequence would clear or retitle the terminal and a newline would start a line
    of its own, such as a forged "warning: ..."."""
    return CONTROL.sub(lambda m: ESCAPES.get(m[0], f"\\x{ord(m[0]):02x}"), text)
