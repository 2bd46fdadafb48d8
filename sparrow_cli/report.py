"""`sparrow report`: PNG figures and one HTML page for a run directory."""

from __future__ import annotations

from pathlib import Path

import typer

from .console import console
from .errors import UsageError, friendly_errors
from .messages import printable
from .options import output_path
from .paths import check_output_dir, force_option


def report_folder(folder: Path) -> bool:
    """A folder that `sparrow report` wrote (its index.html names it)."""
    page = folder / "index.html"
    return page.is_file() and "Sparrow report" in page.read_text(errors="replace")[:2000]


@friendly_errors
def report(
    run: Path | None = typer.Argument(None, metavar="RUN", show_default=False, help="A run directory "
                                      "(artifacts, and training runs in subdirectories); or --run RUN."),
    run_option: Path | None = typer.Option(None, "--run", show_default=False, help="The run directory, as "
                                           "`sparrow sql --run` takes it (instead of the argument)."),
    output: Path = typer.Option(None, "-o", "--output", help="Folder for the figures (default RUN/report). A "
                                "folder that holds something else than a report is written into only with "
                                "--force (then only files of the report's names are replaced).",
                                parser=output_path("a folder", folder=True)),
    force: bool = force_option("Write the report's files into a folder that holds other files (those are "
                               "kept; files of the report's names are replaced)."),
) -> None:
    """Draw what the run directory holds: tail and mean alpha per bin and budget against the threshold,
    the schedule (against the published one for Qwen3 presets), the cost model against measured steps,
    rollout lengths and rewards, rewards scored by `sparrow reward`, and each training run's curves with
    its collapse steps."""
    from sparrow.stages.report import build_report

    run = _run_dir(run, run_option)
    if run.exists() and not run.is_dir():
        raise UsageError(f"{run} is a file, not a run directory (report draws the artifacts of a directory)")
    if not run.is_dir():
        raise UsageError(f"{run}: no such run directory")
    check_output_dir(output or run / "report", "a Sparrow report folder", force=force, ours=report_folder,
                     replaceable=lambda d: True, forced="write the report's files into it (its other files "
                     "are kept)")
    try:
        page, figures = build_report(run, output, progress=_note)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for f in figures:
        said = "".join(f"; {s}" for s in f.said)
        _note(f"  {f.file}: {f.title} ({f.points} point{'s' * (f.points != 1)}{said})")
    _note(f"report: {page}")
    print(page)


def _run_dir(argument: Path | None, option: Path | None) -> Path:
    """The run directory, given as the argument or as --run (once)."""
    if argument is not None and option is not None and argument != option:
        raise UsageError(f"the run directory was given twice, as {argument} and as --run {option}; give it "
                         "once")
    run = argument if argument is not None else option
    if run is None:
        raise UsageError("give the run directory to draw: sparrow report RUN (or --run RUN)")
    return run


def _note(text: str) -> None:
    """A line of progress or of the summary on stderr; the names it quotes come from the run's files, so
    their control characters are escaped (`printable`)."""
    console.print(printable(text), highlight=False, markup=False)
