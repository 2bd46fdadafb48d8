"""The `sparrow` command: a thin typer layer over the importable stages in `sparrow.stages`."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer  # noqa: E402

from . import (  # noqa: E402
    calibrate,
    cost,
    distill,
    models,
    plan,
    profile,
    prompts,
    report,
    reward,
    rollout,  # noqa: E402
    sql,
    train,
)
from .command import Command, Group  # noqa: E402
from .console import StdoutFailed, console, drop_stream, writing_stdout  # noqa: E402
from .errors import stopped  # noqa: E402
from .messages import forget_stage_messages, print_stage_messages, say_error  # noqa: E402
from .output import write_out  # noqa: E402
from .parser_errors import parser_errors  # noqa: E402


class Sparrow(Group):
    """The `sparrow` command: its subcommands run with `main`'s rules for stdout and for Ctrl-C (or
    SIGTERM, entry.Terminated), also while their options are read (an input spooled from a slow pipe) and
    outside a command's own handling (`errors.friendly_errors`). A command line that does not parse (an
    unknown command or option, a bad value, a missing option) is one "error: ..." line
    (`parser_errors.parser_errors`), here where click raises it, before typer would draw its box."""

    def make_context(self, *args, **kwargs):
        try:  # reading the command line imports more (typer's own coercion): click would exit 130 silently
            with parser_errors():
                return super().make_context(*args, **kwargs)
        except KeyboardInterrupt as e:
            stopped(getattr(e, "signum", signal.SIGINT))

    def invoke(self, ctx):
        try:
            with parser_errors(), _this_command_only():  # the subcommand's name, then its command line
                return super().invoke(ctx)
        except BrokenPipeError:  # main's rule; what a command prints comes after what it writes
            drop_stream(sys.stdout)
            return None
        except StdoutFailed as e:
            say_error(str(e))
            sys.exit(2)
        except KeyboardInterrupt as e:  # click would exit 130 without a word
            stopped(getattr(e, "signum", signal.SIGINT))


@contextmanager
def _this_command_only() -> Iterator[None]:
    """-q, and the stage messages already said, hold for the command that was given them: lifted at its
    end, however it ends (a refused command line included, where click closes no context), so that the next
    command in a process speaks, its stages' notes included."""
    try:
        yield
    finally:
        console.quiet = False
        forget_stage_messages()


app = typer.Typer(
    name="sparrow",
    cls=Sparrow,
    help="Sparse-attention rollouts for RLVR with the sparse-to-dense mismatch kept in check. "
    "Stages read and write Parquet artifacts; chain them in shell pipelines and query them with "
    "`sparrow sql`.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from sparrow.schemas.provenance import sparrow_version  # what every written file records

        write_out(f"sparrow {sparrow_version()}\n")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print Sparrow's version and exit.")) -> None:
    """Sparse-attention rollouts for RLVR with the sparse-to-dense mismatch kept in check. Stages read and
    write Parquet artifacts; chain them in shell pipelines and query them with `sparrow sql`."""


# Each command with the one line `sparrow --help` lists it by (fitting 80 columns); its own --help says
# the rest.
COMMANDS = {
    "models": (models.models, "List the model presets and their shapes."),
    "prompts": (prompts.prompts, "Generate prompts with verifiable answers."),
    "sql": (sql.sql, "Query a run's artifacts with read-only, bounded SQL."),
    "profile": (profile.profile, "Measure the sparse-to-dense mismatch per token."),
    "calibrate-threshold": (calibrate.calibrate_threshold,
                            "Find the critical tail threshold from past runs."),
    "fit-cost": (cost.fit_cost, "Time the decode step and fit the cost model."),
    "plan-schedule": (plan.plan_schedule, "Plan the cheapest schedule above the tail threshold."),
    "rollout": (rollout.rollout, "Sample with sparse attention or a compressed KV cache."),
    "reward": (reward.reward, "Score completions with task scorers or your reward."),
    "train": (train.train, "GRPO on sparse rollouts with rollout correction."),
    "distill": (distill.distill, "Distill a LoRA for the sparse actor toward dense."),
    "report": (report.report, "Draw a run directory's figures (PNG and HTML)."),
}
for _name, (_command, _summary) in COMMANDS.items():
    app.command(_name, cls=Command, short_help=_summary)(_command)
print_stage_messages()


def main() -> None:
    """Run `sparrow`. A reader that stops early (`| head`, `| true`) is not a failure: the command carries
    on to its end and exits 0, and says nothing of it on stderr. Every command writes its artifacts before
    it prints, so a closed stdout never costs a file: the consoles (console.MessageConsole.on_broken_pipe)
    and the plain writers (output.write_out) send the rest of the output to /dev/null, and
    `Sparrow.invoke` does so for any other write, ending the command there. Any other failure to write
    stdout (a full disk, an I/O error, a closed stdout) is one "error: cannot write stdout (...)" line and
    exit 2 (console.writing_stdout), also for --help and --version and for what is still buffered at the
    end. Ctrl-C is one line and exit 130, SIGTERM one line and exit 143 (entry.main, which also covers the
    imports)."""
    try:
        app()
    except StdoutFailed as e:  # --help, --version: written while the command line is read
        _stdout_failed(e)
    except SystemExit as e:
        _flush_stdout()
        raise SystemExit(e.code) from None
    _flush_stdout()


def _flush_stdout() -> None:
    """What a command left buffered on stdout, written before Python's own flush at exit could fail on it
    with a traceback-like report and exit 120."""
    if sys.stdout is None:  # closed from the start: a command that printed has said so already
        return
    try:
        with writing_stdout():
            sys.stdout.flush()
    except BrokenPipeError:
        drop_stream(sys.stdout)
    except StdoutFailed as e:
        _stdout_failed(e)


def _stdout_failed(error: StdoutFailed) -> None:
    say_error(str(error))
    sys.exit(2)

