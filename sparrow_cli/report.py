"""`sparrow report`: PNG figures and one HTML page for a run directory."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import UsageError, console, friendly_errors


@friendly_errors
def report(
    run: Path = typer.Argument(..., help="A run directory (artifacts, and training runs in subdirectories)."),
    output: Path = typer.Option(None, "-o", "--output", help="Folder for the figures (default RUN/report)."),
) -> None:
    """Draw what the run directory holds: tail and mean alpha per bin and budget against the threshold,
    the schedule (against the published one for Qwen3 presets), the cost model against measured steps,
    rollout lengths and rewards, and each training run's curves with its collapse steps."""
    from sparrow.stages.report import build_report

    if not run.is_dir():
        raise UsageError(f"{run}: no such run directory")
    try:
        page, figures = build_report(run, output, progress=lambda what: console.print(what, highlight=False,
                                                                                     markup=False))
    except ValueError as e:
        raise UsageError(str(e)) from None
    for f in figures:
        said = "".join(f"; {s}" for s in f.said)
        console.print(f"  {f.file}: {f.title} ({f.points} points{said})", highlight=False, markup=False)
    console.print(f"report: {page}")
    print(page)
