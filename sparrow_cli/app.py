"""The `sparrow` command: a thin typer layer over the importable stages in `sparrow.stages`."""

from __future__ import annotations

import os
import sys

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
from .common import Command, Group, drop_stream  # noqa: E402
from .output import write_out  # noqa: E402


class Sparrow(Group):
    """The `sparrow` command: its subcommands run with `main`'s rule for a reader that stops early."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # main's rule; what a command prints comes after what it writes
            drop_stream(sys.stdout)
            return None


app = typer.Typer(
    name="sparrow",
    cls=Sparrow,
    help="Sparse-attention rollouts for RLVR with the sparse-to-dense mismatch kept in check. "
    "Stages read and write Parquet artifacts; chain them in shell pipelines and query them with "
    "`sparrow sql`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("sparrow-rl")
        except PackageNotFoundError:  # run from a source tree that was never installed
            number = "unknown (not installed)"
        write_out(f"sparrow {number}\n")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print Sparrow's version and exit.")) -> None:
    """Sparse-attention rollouts for RLVR with the sparse-to-dense mismatch kept in check. Stages read and
    write Parquet artifacts; chain them in shell pipelines and query them with `sparrow sql`."""


COMMANDS = {"models": models.models, "prompts": prompts.prompts, "sql": sql.sql, "profile": profile.profile,
            "calibrate-threshold": calibrate.calibrate_threshold, "fit-cost": cost.fit_cost,
            "plan-schedule": plan.plan_schedule, "rollout": rollout.rollout, "reward": reward.reward,
            "train": train.train, "distill": distill.distill, "report": report.report}
for _name, _command in COMMANDS.items():
    app.command(_name, cls=Command)(_command)


def main() -> None:
    """Run `sparrow`. A reader that stops early (`| head`, `| true`) is not a failure: the command carries
    on to its end and exits 0, and says nothing of it on stderr. Every command writes its artifacts before
    it prints, so a closed stdout never costs a file: the consoles (common.MessageConsole.on_broken_pipe)
    and the plain writers (output.write_out) send the rest of the output to /dev/null, and
    `Sparrow.invoke` does so for any other write, ending the command there."""
    app()
