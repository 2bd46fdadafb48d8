"""Shared CLI plumbing: one-sentence errors, consoles, option parsing helpers, output locations.

Every command that writes checks its output location with `check_output` (or `check_output_dir`) before
any work: the rule itself is `sparrow.schemas.locations`; here it becomes one sentence that says how
to force it, and `-o -` hands stdout to the artifact (tables and summaries then go to stderr)."""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

try:  # typer 0.2x parses with a copy of click of its own
    from typer._click.exceptions import NoSuchOption
    from typer._click.exceptions import UsageError as ParserError
except ImportError:
    from click.exceptions import NoSuchOption
    from click.exceptions import UsageError as ParserError

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


class LogProgress:
    """Progress of long work as whole lines where progress is not live (`live_progress`): the first update,
    then at most one line every `every` seconds, and the last one."""

    def __init__(self, what: str, every: float = 10.0):
        self.what, self.every, self.last = what, every, None
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, info: str = "") -> None:
        now = time.monotonic()
        if self.last is not None and done < total and now - self.last < self.every:
            return
        self.last = now
        log_line(f"{self.what}: {done}/{total}{f', {info}' if info else ''} ({now - self.start:.0f} s)")


def say_loading(model: str, device: str) -> None:
    """The line that says the model is loading (seconds to minutes, with nothing else to show)."""
    console.print(f"loading model {model} on {device} ...", highlight=False, markup=False)


class PhaseProgress:
    """(phase, done, total) progress on stderr: one bar per phase on a terminal (in `bar`), whole lines in a
    log (LogProgress). Each phase shows as soon as it starts (0 of its total), not at its first batch."""

    def __init__(self, bar, labels: dict[str, str] | None = None):
        self.bar, self.labels = bar, labels or {}
        self.tasks: dict[str, object] = {}
        self.logs: dict[str, LogProgress] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            label = self.labels.get(phase, phase)
            self.tasks[phase] = self.bar.add_task(label, total=total, info="")
            self.logs[phase] = LogProgress(label)
        self.bar.update(self.tasks[phase], completed=done, total=total)
        self.logs[phase](done, total)


# a teacher-forced batch of long sequences can take minutes, its count moving only when it ends: a log
# hears that the phase still runs at least this often
PHASE_BEAT_SECONDS = 10.0


class BeatingPhases:
    """PhaseProgress that also names the running phase to a Heartbeat, so that a log hears of a phase whose
    count moves only when a whole batch ends (teacher-forced scoring): `scoring (sequences) ... (40 s so
    far)` whenever no progress line was printed for the heartbeat's seconds, timed from the phase's start."""

    def __init__(self, phases: PhaseProgress, beat: Heartbeat):
        self.phases, self.beat, self.running = phases, beat, None

    def __call__(self, phase: str, done: int, total: int) -> None:
        self.phases(phase, done, total)
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


def _bare_flags(params: list) -> list:
    """Flags take no value: --help shows no value placeholder (such as <bool>) beside them."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


# The other names of an idea's option (vLLM's, verl's or TRL's, and Sparrow's older ones), keyed by the name
# that every command with the idea declares. docs/commands.md, "Option names", lists them.
ALIASES: dict[str, tuple[str, ...]] = {
    "--max-num-seqs": ("--max-batch", "--batch-size", "--batch"),
    "--samples": ("--num-generations",),
    "--max-new-tokens": ("--max-completion-length", "--max-tokens"),
    "--output": ("--output-dir",),
    "--lr": ("--learning-rate",),
    "--kl-coef": ("--beta",),
    "--eager": ("--enforce-eager",),
    "--speculate": ("--num-speculative-tokens",),
    "--ppo-epochs": ("--num-iterations",),
    "--loss-agg": ("--loss-type",),
    "--epsilon-high": ("--clip-ratio-high",),
}


def take_aliases(params: list) -> dict:
    """Each option named in ALIASES -> its other names, taken out of its declared names (so that --help
    shows the option under its one name, the others in a last sentence of its help): every command with
    the idea answers to all of them, except a name that already names another of its options (distill's
    --batch-size, its trajectories per step, stays that); a switch answers only to the aliases it declares
    (fit-cost's and plan-schedule's --speculate switches are another idea than a token count)."""
    taken = {name for param in params for name in (*param.opts, *getattr(param, "secondary_opts", ()))}
    aliases = {}
    for param in params:
        primary = next((n for n in param.opts if n in ALIASES), None)
        if primary is None:
            continue
        names = [a for a in ALIASES[primary] if a in param.opts or (a not in taken and not param.is_flag)]
        if not names:
            continue
        param.opts = [n for n in param.opts if n not in names]
        param.help = f"{param.help or ''} Also {', '.join(names)}.".lstrip()
        aliases[param] = names
    return aliases


class Command(TyperCommand):
    """A subcommand whose --help shows flags without a value placeholder, whose options answer to their
    names in ALIASES (`take_aliases`), and which takes -q/--quiet (`quiet_option`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = take_aliases(self.params)
        self.params.append(quiet_option())

    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        with parsing(ctx):
            return super().parse_args(ctx, args)

    def make_parser(self, ctx):
        parser = super().make_parser(ctx)
        for param, names in self.aliases.items():
            if param.is_flag:  # an alias of a switch takes no value
                parser.add_option(obj=param, opts=names, dest=param.name, action="store_const", const=True)
            else:
                parser.add_option(obj=param, opts=names, dest=param.name,
                                  action="append" if param.multiple else "store", nargs=param.nargs)
        return parser

    def format_help(self, ctx, formatter) -> None:
        with writing_stdout(), whole_help_cells():  # a full disk or a closed stdout: one sentence
            super().format_help(ctx, formatter)


@functools.cache
def quiet_option():
    """-q/--quiet: stderr holds only warnings and errors (no progress, notes or summary) for this command;
    stdout's data and the files written are the same. Built as typer builds any option, then shared."""
    probe = typer.Typer()

    @probe.command()
    def _quiet(quiet: bool = typer.Option(
            False, "--quiet/--no-quiet", "-q", is_eager=True, expose_value=False, callback=_be_quiet,
            help="Print only warnings and errors on stderr: no progress, notes or summary (stdout's data "
                 "and the files written are the same).")) -> None:
        """Never run: only its option is taken."""

    return typer.main.get_command(probe).params[0]


def _be_quiet(ctx, param, value: bool) -> None:
    """Quiet from here to the command's end (`Sparrow.invoke` lifts it, also after a refused command line)."""
    if value:
        console.quiet = True


class Group(TyperGroup):
    """The `sparrow` command itself, its flags (--version, --help) shown as its subcommands' are."""

    def get_params(self, ctx) -> list:
        return _bare_flags(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        with parsing(ctx):
            return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter) -> None:
        with writing_stdout(), whole_help_cells():
            super().format_help(ctx, formatter)


@contextmanager
def parsing(ctx) -> Iterator[None]:
    """Reading `ctx`'s command line: an error of click's parser that names no command (an option without
    its value, a flag given one) is `ctx`'s, so that its line says whose --help to read (`parser_message`)."""
    try:
        yield
    except ParserError as e:
        if e.ctx is None:
            e.ctx, e.cmd = ctx, ctx.command
        raise


# ---------------------------------------------------------------- --help's options, never cut

HELP_MIN_WIDTH = 30  # the least width an option's help gets beside its names; narrower, it goes below them
PANEL_FRAME = 4  # an options panel's border and padding, both sides


@contextmanager
def whole_help_cells() -> Iterator[None]:
    """typer's --help, its panels laid out so that nothing in them is cut: typer's own tables cut option
    names, types, defaults and long words of help to "..." wherever their columns do not fit (80 columns, a
    pipe, a log). typer prints each panel with one `console.print`, where its table is laid out first: the
    options by `whole_cells`, the commands with their descriptions folded (`folded`).

    The panel printers are typer's private functions: one that a typer release renamed, or that it calls
    another way, or a table of another shape, is left to typer's own layout, so that --help never fails."""
    from typer import rich_utils

    layouts = {"_print_options_panel": whole_cells, "_print_commands_panel": folded}
    typer_panels = {name: panel for name in layouts if callable(panel := getattr(rich_utils, name, None))}
    for name, panel in typer_panels.items():
        setattr(rich_utils, name, functools.partial(_laid_out, panel, layouts[name]))
    try:
        yield
    finally:
        for name, panel in typer_panels.items():
            setattr(rich_utils, name, panel)


def _laid_out(typer_panel: Callable, layout: Callable, *args, **kwargs) -> None:
    if isinstance(kwargs.get("console"), Console):
        kwargs["console"] = _LayoutConsole(kwargs["console"], layout)
    typer_panel(*args, **kwargs)


class _LayoutConsole:
    """The console a help panel is printed on: its table laid out by `layout` first; anything else asked
    of it is the console's."""

    def __init__(self, console: Console, layout: Callable):
        self.console, self.layout = console, layout

    def print(self, panel, *args, **kwargs) -> None:
        from rich.panel import Panel
        from rich.table import Table

        if isinstance(panel, Panel) and isinstance(panel.renderable, Table):
            panel.renderable = self.layout(panel.renderable, self.console)
        self.console.print(panel, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.console, name)


def folded(table, console: Console):
    """A table whose cells fold a word wider than their column onto the next line, never cut it."""
    for column in table.columns:
        column.overflow = "fold"
    return table


def whole_cells(table, console: Console):
    """typer's options table (the required mark where any option is required, the names, the negative
    names, the type, the help) laid out so that nothing in it is cut: the names and the type each on one
    line beside a help column of at least HELP_MIN_WIDTH (and its longest word), which wraps; where the
    console is too narrow for that, each option's names and type on a line of their own, its help indented
    below. A help word wider than the space it has (a long path) folds onto the next line. A table of
    another shape than typer's 6 or 7 columns is left as it is."""
    from rich.measure import Measurement

    if len(table.columns) not in (6, 7):
        return table
    cells = [list(column.cells) for column in table.columns]
    for help_cell in cells[-1]:
        for item in getattr(help_cell, "renderables", ()):
            if isinstance(item, Text):
                item.overflow = "fold"
    options = console.options
    widest = [max((Measurement.get(console, options, c).maximum for c in column), default=0)
              for column in cells[:-1]]
    help_words = max((Measurement.get(console, options, item).minimum
                      for cell in cells[-1] for item in getattr(cell, "renderables", ())), default=0)
    room = console.width - PANEL_FRAME - sum(w + 2 for w in widest) - 2  # 2: each column's padding
    if room >= max(HELP_MIN_WIDTH, help_words):
        for column in table.columns[:-1]:
            column.no_wrap, column.overflow = True, "fold"  # only the help column gives way
        return table
    return _stacked(list(zip(*cells)), marked=len(table.columns) == 7)


def _stacked(rows: list[tuple], marked: bool):
    """Each option as a line of its names and type (`* --name, -n / --no-name <type>`), its help below."""
    from rich.padding import Padding
    from rich.table import Table

    grid = Table.grid(expand=True)
    grid.add_column(overflow="fold")
    for *names, kind, help_cell in rows:
        texts = [Text(c) if isinstance(c, str) else c for c in (*names, kind)]
        mark = texts.pop(0) if marked else Text()
        groups = [Text(", ").join([t for t in group if t.plain]) for group in (texts[0:2], texts[2:4])]
        line = Text(" ").join([t for t in (mark, Text(" / ").join([g for g in groups if g.plain]), texts[4])
                               if t.plain])
        grid.add_row(line)
        grid.add_row(Padding(help_cell, (0, 0, 0, 4)))
    return grid


class UsageError(ValueError):
    """Bad input found before any work starts."""


@contextmanager
def parser_errors() -> Iterator[None]:
    """A command line that click cannot parse (an unknown command or option, a value of the wrong type, a
    missing option or argument) as one "error: ..." line and exit 2, as every other refusal: typer would
    draw the usage, a hint and a box of 5 or more lines, cut at 80 columns in a log, without "error:". A
    bare `sparrow` has printed its help already."""
    try:
        yield
    except ParserError as e:
        if type(e).__name__ != "NoArgsIsHelpError":  # click 8.2's; typer prints nothing more of it either
            say_error(parser_message(e))
        sys.exit(e.exit_code)


def parser_message(error: ParserError) -> str:
    """click's message in the style of Sparrow's own (a lower-case start, no closing full stop), an
    unknown option's hint our own (`option_hint`), and where to read the command's options."""
    if isinstance(error, NoSuchOption):
        hint = option_hint(error.option_name, error.ctx)
        message = f"No such option: {error.option_name}" + (f". {hint}" if hint else "")
    else:
        message = error.format_message()
    message = message.strip().rstrip(".")
    message = message[:1].lower() + message[1:]
    ctx = error.ctx
    if ctx is not None and ctx.help_option_names:
        message += f" (try '{ctx.command_path} {ctx.help_option_names[0]}')"
    return message


@dataclass(frozen=True)
class ForeignName:
    """An option name of another tool for an idea Sparrow names otherwise."""

    ours: str  # Sparrow's option for the idea
    theirs: str  # whose name it is, as the help cites it
    flag: bool = False  # a switch, so that only a switch of ours answers for it
    unlike: tuple[str, str] | None = None  # (an option, how ours differs on the commands that have it)


_STEPS = ("--ppo-epochs", "which counts steps of rollouts, each of --ppo-epochs optimizer updates")
# What a vLLM, TRL or verl user types, for the commands that do not accept it as an alias (ALIASES). A
# hint names our option only where the command has it; a name listed here never gets a look-alike hint.
FOREIGN_NAMES: dict[str, ForeignName] = {
    "--n": ForeignName("--samples", "vLLM's n"),
    "--num-return-sequences": ForeignName("--samples", "transformers' num_return_sequences"),
    "--enforce-eager": ForeignName("--eager", "vLLM's enforce_eager", flag=True),
    "--num-speculative-tokens": ForeignName("--speculate", "vLLM's num_speculative_tokens"),
    "--num-iterations": ForeignName("--ppo-epochs", "TRL's num_iterations"),
    "--loss-type": ForeignName("--loss-agg", "TRL's loss_type"),
    "--loss-agg-mode": ForeignName("--loss-agg", "verl's loss_agg_mode"),
    "--clip-ratio-low": ForeignName("--epsilon", "verl's clip_ratio_low"),
    "--clip-ratio-high": ForeignName("--epsilon-high", "verl's clip_ratio_high"),
    "--kl-loss-coef": ForeignName("--kl-coef", "verl's kl_loss_coef"),
    "--grad-clip": ForeignName("--max-grad-norm", "verl's grad_clip"),
    "--lora-r": ForeignName("--lora-rank", "TRL's lora_r"),
    "--max-steps": ForeignName("--steps", "TRL's max_steps", unlike=_STEPS),
    "--total-training-steps": ForeignName("--steps", "verl's total_training_steps"),
    "--save-steps": ForeignName("--checkpoint-every", "TRL's save_steps", unlike=_STEPS),
    "--save-freq": ForeignName("--checkpoint-every", "verl's save_freq"),
    "--eval-steps": ForeignName("--eval-every", "TRL's eval_steps", unlike=_STEPS),
    "--test-freq": ForeignName("--eval-every", "verl's test_freq"),
    "--vllm-gpu-memory-utilization": ForeignName("--gpu-memory-utilization",
                                                 "TRL's vllm_gpu_memory_utilization"),
}
HINT_SIMILARITY = 0.8  # of the names without their dashes: a typo (--sampels), not a neighbour (--n, --dense)


def option_hint(typed: str, ctx) -> str | None:
    """What to say of an unknown option: our name for another tool's (FOREIGN_NAMES, also spelt with
    underscores), else the command's options that look like a typo of it. click's own suggestions (difflib
    at 0.6 on the whole names) point a vLLM user's --n at --dense and --quiet at --budget."""
    options = _option_names(ctx)
    name = typed.replace("_", "-")
    foreign = FOREIGN_NAMES.get(name)
    if foreign is not None:
        ours = options.get(foreign.ours)
        if ours is None or bool(getattr(ours, "is_flag", False)) != foreign.flag:
            return None
        if foreign.unlike is not None and foreign.unlike[0] in options:
            return f"Sparrow's nearest to {foreign.theirs} is {foreign.ours}, {foreign.unlike[1]}"
        return f"Sparrow's name for {foreign.theirs} is {foreign.ours}"
    if name in options:  # --top_p
        return f"Did you mean {name}?"
    if not name.startswith("--"):
        return None
    longs = {option[2:]: option for option in options if option.startswith("--")}
    close = difflib.get_close_matches(name[2:], longs, n=3, cutoff=HINT_SIMILARITY)
    return f"Did you mean {' or '.join(longs[c] for c in close)}?" if close else None


def _option_names(ctx) -> dict:
    """Every option name of `ctx`'s command, its aliases (ALIASES) and --no- forms included -> its option."""
    if ctx is None:
        return {}
    command = ctx.command
    names = {}
    for param in command.get_params(ctx):
        for name in (*param.opts, *getattr(param, "secondary_opts", ())):
            names[name] = param
    for param, aliases in getattr(command, "aliases", {}).items():
        names.update(dict.fromkeys(aliases, param))
    return names


def fail(message: str, code: int = 2) -> NoReturn:
    say_error(message)
    raise typer.Exit(code)


def say_error(message: str) -> None:
    """The one "error: ..." line on stderr, every spooled input named as the user gave it."""
    from sparrow.schemas.locations import name_inputs

    # as Text: the message quotes user input (a path, a spec, a prompt) that no markup may touch
    _always(Text.assemble(("error:", "bold red"), " ", printable(name_inputs(message))))


def warn(message: str) -> None:
    """A warning on stderr, one line, its text (which may quote user input) printed as written but for its
    control characters (`printable`); --quiet keeps it."""
    _always(Text.assemble(("warning:", "yellow"), " ", printable(message)))


class StageMessages(logging.Handler):
    """What stages say through the `sparrow` logger: INFO as a note, WARNING and above as a warning, so that
    --quiet treats them as it treats the CLI's own."""

    def emit(self, record: logging.LogRecord) -> None:
        (warn if record.levelno >= logging.WARNING else note)(record.getMessage())


def print_stage_messages() -> None:
    """Send the `sparrow` logger's records to stderr as notes and warnings (`StageMessages`), once."""
    logger = logging.getLogger("sparrow")
    if not any(isinstance(h, StageMessages) for h in logger.handlers):
        logger.addHandler(StageMessages())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _always(text: Text) -> None:
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


def friendly_errors(fn: Callable) -> Callable:
    """Turn the project's input errors into one clear line and a non-zero exit."""
    from sparrow.schemas import ArtifactError
    from sparrow.stages.core.prompt_set import PromptError
    from sparrow.stages.engine.memory import PoolTooSmall
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.tasks.base import RewardError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _stdout["taken"] = False
        terminated: list[int] = []
        try:
            with sigterm_as_interrupt(terminated):
                return fn(*args, **kwargs)
        except (UsageError, ArtifactError, ModelSpecError, PromptError, PoolTooSmall, RewardError,
                StdoutFailed, KeyError) as e:
            fail(str(e.args[0]) if e.args else str(e))
        except KeyboardInterrupt as e:  # a stage may say what it kept and how to go on
            said = str(e.args[0]) if e.args else NOTHING_LEFT
            # a stage may stop on a signal itself (sql's query watch) and name it; else the handler's record
            stopped(getattr(e, "signum", signal.SIGTERM if terminated else signal.SIGINT), said)
        finally:
            _stdout["taken"] = False  # per command (several run in one process under tests)

    return wrapper


NOTHING_LEFT = "nothing half-written was left behind"


def stopped(signum: int = signal.SIGINT, said: str = NOTHING_LEFT) -> NoReturn:
    """The one line of a command stopped by a signal (`said`: what it kept and how to go on), and exit
    128 + the signal, as the shell reports a signal's end."""
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    _always(Text(f"{what}; {said}", style="yellow"))  # --quiet keeps it: what was kept, how to go on
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


DEVICE_HELP = ("cpu or cuda (cuda:0 is cuda; for another GPU, select it with CUDA_VISIBLE_DEVICES, e.g. "
               "CUDA_VISIBLE_DEVICES=1 with --device cuda).")


def parse_device(value: str) -> str:
    """typer parser of every --device: cpu or cuda in any case, cuda:0 as cuda. The engine runs on the
    current CUDA device (its kernels and CUDA graphs launch there), so another index is refused in one
    sentence that says how to pick that GPU instead."""
    device = value.strip().lower()
    kind, colon, index = device.partition(":")
    if kind == "cuda" and colon and index.isdigit():
        if int(index) == 0:
            return "cuda"
        fail(f"--device {value}: Sparrow runs on the first visible GPU only; select GPU {int(index)} with "
             f"CUDA_VISIBLE_DEVICES={int(index)} and pass --device cuda")
    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda (or cuda:0), got {value!r}")
    return device


def check_device(device: str, remote: bool = False) -> None:
    """--device (already `parse_device`'s cpu or cuda) with CUDA present here, unless the work runs on a
    Ray cluster (`remote`); one sentence otherwise, before any work. Shared by every command with
    --device."""
    import torch

    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (or cuda:0), got {device!r}")
    if device == "cuda" and not remote and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was given but no CUDA device is available")


RAW_PROMPTS_HELP = ("Tokenize text prompts (a prompt file with text but no token ids, e.g. from DuckDB or "
                    "JSONL) as they are; by default they go through the model's chat template as one user "
                    "message, as `sparrow prompts` formats them.")


def raw_prompts_option():
    return typer.Option(False, "--raw-prompts/--no-raw-prompts", help=RAW_PROMPTS_HELP)


def warn_first_token_stops(lengths: list[int], max_new_tokens: int, raw_prompts: bool) -> None:
    """Most samples ending at their first token (an immediate EOS, where more were allowed) usually means
    prompts the model does not read as a question: say so on stderr."""
    short = sum(n <= 1 for n in lengths)
    if max_new_tokens > 1 and lengths and short > len(lengths) / 2:
        hint = ("they were tokenized without the chat template (--raw-prompts)" if raw_prompts else
                "check that the prompts are what the model expects (text prompts go through its chat "
                "template)")
        warn(f"{short} of {len(lengths)} samples ended at their first token; {hint}")


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag} is empty")
    return values


# ---------------------------------------------------------------- output locations and inputs

FORCE_HELP = ("Replace an existing output that is not an artifact of the kind this command writes (a "
              "directory of other files is never replaced).")
_stdout = {"taken": False}


def force_option():
    return typer.Option(False, "--force/--no-force", help=FORCE_HELP)


def output_help(what: str) -> str:
    """The help of an artifact's -o: what it is, stdout, and the overwrite rule."""
    return (f"Where to write {what} (- = stdout, as Parquet). An existing file is replaced only if it is "
            "an artifact of the same kind (or --force); a symlink is written through.")


def stdout_taken() -> bool:
    """Whether `-o -` made stdout the artifact's: tables and summaries then go to stderr."""
    return _stdout["taken"]


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
    _stdout["taken"] = _stdout["taken"] or is_stdio(path)


def check_output_dir(path: Path, what: str, ours: Callable[[Path], bool], force: bool,
                     replaceable: Callable[[Path], bool] = lambda d: False, flag: str = "-o",
                     inputs: dict[str, object] | None = None) -> Path:
    """The rule for a directory output (a run, an adapter, a report folder); the directory written.
    `inputs` as `check_output`'s: the directory may neither be one nor hold one."""
    from sparrow.schemas import OutputRefused
    from sparrow.schemas import check_output_dir as check
    from sparrow.schemas.locations import UnusableOutput

    try:
        return check(path, what, ours, replaceable, force, inputs)
    except OutputRefused as e:
        raise UsageError(f"{flag} {e}; pass --force to replace it, or choose another directory") from None
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
