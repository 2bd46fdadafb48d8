"""`sparrow report`: PNG figures and one HTML page for a run directory."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import UsageError, check_output_dir, console, force_option, friendly_errors
from .options import output_path


def report_folder(folder: Path) -> bool:
    """A folder that `sparrow report` wrote (its index.html names it)."""
    page = folder / "index.html"
    return page.is_file() and "Sparrow report" in page.read_text(errors="replace")[:2000]


@friendly_errors
def report(
    run: Path = typer.Argument(..., help="A run directory (artifacts, and training runs in subdirectories)."),
    output: Path = typer.Option(None, "-o", "--output", help="Folder for the figures (default RUN/report). A "
                                "folder that holds something else than a report is written into only with "
                                "--force (then only files of the report's names are replaced).",
                                parser=output_path("a folder", folder=True)),
    force: bool = force_option(),
) -> None:
    """Draw what the run directory holds: tail and mean alpha per bin and budget against the threshold,
    the schedule (against the published one for Qwen3 presets), the cost model against measured steps,
    rollout lengths and rewards, and each training run's curves with its collapse steps."""
    from sparrow.stages.report import build_report

    if run.exists() and not run.is_dir():
        raise UsageError(f"{run} is a file, not a run directory (report draws the artifacts of a directory)")
    if not run.is_dir():
        raise UsageError(f"{run}: no such run directory")
    check_output_dir(output or run / "report", "a Sparrow report folder", force=force, ours=report_folder,
                     replaceable=lambda d: True)
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
