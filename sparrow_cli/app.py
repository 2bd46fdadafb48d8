"""The `sparrow` command: a thin typer layer over the importable stages in `sparrow.stages`."""

from __future__ import annotations

import os

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
from .common import Command, Group  # noqa: E402

app = typer.Typer(
    name="sparrow",
    cls=Group,
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
        print(f"sparrow {number}")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print Sparrow's version and exit.")) -> None:
    """Sparse-attention rollouts for RLVR with the sparse-to-dense mismatch kept in check. Stages read and
    write Parquet artifacts; chain them in shell pipelines and query them with `sparrow sql`."""


app.command("models", cls=Command)(models.models)
app.command("prompts", cls=Command)(prompts.prompts)
app.command("sql", cls=Command)(sql.sql)
app.command("profile", cls=Command)(profile.profile)
app.command("calibrate-threshold", cls=Command)(calibrate.calibrate_threshold)
app.command("fit-cost", cls=Command)(cost.fit_cost)
app.command("plan-schedule", cls=Command)(plan.plan_schedule)
app.command("rollout", cls=Command)(rollout.rollout)
app.command("reward", cls=Command)(reward.reward)
app.command("train", cls=Command)(train.train)
app.command("distill", cls=Command)(distill.distill)
app.command("report", cls=Command)(report.report)


def main() -> None:
    app()
