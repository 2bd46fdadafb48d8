"""`sparrow report`: the figures a person wants from a run directory, as PNGs and one HTML page.

Whatever the directory holds decides the figures (every artifact and training run in it is drawn);
each PNG says in itself what it shows, and the HTML page embeds them so it can travel alone.
docs/report.md lists the figures.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas import VERSION, ArtifactError, artifact_metadata
from sparrow.schemas.footer import artifact_parts, footer_number, kind_version, parquet_batches, read_schema
from sparrow.schemas.io import check_artifact, process_alive, write_bytes
from sparrow.schemas.signals import held_signals

from ..calibrate import ResolvedThreshold, resolve_threshold
from ..core.schedule import MIN_TOKENS
from .artifact_figures import (
    TailLine,
    calibration_figure,
    cost_figure,
    distill_figure,
    rewards_figure,
    rollouts_figure,
    schedule_figure,
    tail_figure,
)
from .canvas import Figure, pyplot
from .collect import (
    DRAWN,
    Steps,
    adapter_pairs,
    figure_name,
    find_artifacts,
    find_calibrations,
    find_curves,
    find_runs,
    find_steps,
    note_inside_runs,
    run_label,
)
from .page import html_page, listed_figures, remove_stale
from .training_figures import train_mismatch_figure, training_figure

__all__ = ["Figure", "build_report"]


def build_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Path, list[Figure]]:
    """Write the figures and a self-contained index.html for `run_dir` into `out_dir` (default
    RUN/report)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    out = Path(out_dir) if out_dir else run_dir / "report"
    plt, note = pyplot(), progress or (lambda _: None)
    skipped: list[str] = []
    runs = find_runs(run_dir)
    kinds = find_artifacts(run_dir, skipped, runs)
    note_inside_runs(run_dir, runs, skipped)
    steps = find_steps(run_dir, runs, kinds, skipped)
    curves = find_curves(runs, skipped)
    calibrations = find_calibrations(kinds, skipped)
    kinds, curves = _check_artifacts(kinds, curves, steps, skipped)
    calibrations = [p for p in calibrations if p in kinds.get("threshold", [])]
    if not (curves or calibrations or any(s.files for s in steps.values())
            or any(kinds.get(k) for k in DRAWN)):
        raise ValueError(f"{run_dir} holds nothing to plot (no mismatch, schedule, cost, rollouts, "
                         "rewards, calibrated threshold or training run"
                         + (f"; not drawn: {'; '.join(skipped)}{_others(run_dir)}" if skipped
                            else f"; {_holdings(run_dir)}") + ")")
    for why in skipped:
        note(f"not drawn: {why}")
    thresholds = {p: _tail_line(kinds, p, note) for p in kinds.get("mismatch", [])}
    with _removed_if_stopped(out), _drawing_folder(out) as drawn:
        figures = _draw_all(run_dir, drawn, plt, note, kinds, thresholds, calibrations, runs, curves, steps)
        with held_signals():  # the figures, the page and the stale figures' removal: all or none
            before = listed_figures(out)
            for f in figures:
                os.replace(drawn / f.file, out / f.file)
            page = html_page(run_dir, out, figures, skipped)  # a name that is not UTF-8 as \x escapes
            write_bytes(out / "index.html", page.encode(errors="backslashreplace"))
            remove_stale(out, before - {f.file for f in figures})
    return out / "index.html", figures


def _draw_all(run_dir: Path, out: Path, plt, note: Callable[[str], None], kinds: dict[str, list[Path]],
              thresholds: dict, calibrations: list[Path], runs: list[Path], curves: list[Path],
              steps: dict[Path, Steps]) -> list[Figure]:
    """Every figure of the run directory, drawn into `out`."""
    draw = {"mismatch": ("tail", lambda p, n: tail_figure(p, n, thresholds[p], out, plt)),
            "schedule": ("schedule", lambda p, n: schedule_figure(p, n, out, plt)),
            "cost": ("cost", lambda p, n: cost_figure(p, n, out, plt)),
            "rollouts": ("rollouts", lambda p, n: rollouts_figure(p, n, out, plt)),
            "rewards": ("rewards", lambda p, n: rewards_figure(p, n, out, plt))}
    figures: list[Figure] = []
    for kind, (stem, figure) in draw.items():
        paths = kinds.get(kind, [])
        for path in paths:
            note(f"drawing {kind} {path.name}")
            figures.append(figure(path, figure_name(stem, path, len(paths) > 1, run_dir)))
        if kind == "mismatch":
            for plain, adapted in adapter_pairs(paths):
                note(f"drawing mismatch {plain.name} against {adapted.name}")
                figures.append(distill_figure(plain, adapted, _pair_name(plain.parent, run_dir),
                                              thresholds[adapted], out, plt))
    for path in calibrations:
        many = len(kinds["threshold"]) > 1
        fig_ = calibration_figure(path, figure_name("calibration", path, many, run_dir), out, plt)
        if fig_ is not None:
            note(f"drawing calibration {path.name}")
            figures.append(fig_)
    for run in runs:
        if run in curves or (run in steps and steps[run].files):
            note(f"drawing training run {run_label(run, run_dir)}")
        if run in curves:
            figures.append(training_figure(run, run_label(run, run_dir), out, plt))
        if run in steps and (per_bin := train_mismatch_figure(steps[run], out, plt)) is not None:
            figures.append(per_bin)
    for key, series in steps.items():
        if key in runs or not series.files:
            continue
        note(f"drawing train_mismatch {series.where}")
        if (per_bin := train_mismatch_figure(series, out, plt)) is not None:
            figures.append(per_bin)
    return figures


@contextmanager
def _drawing_folder(out: Path) -> Iterator[Path]:
    """A hidden folder in `out` that the figures are drawn into, so that a report stopped while it draws
    leaves the previous one as it was (its page and the PNGs beside it agree); removed after, and one that
    a killed report left is removed by the next."""
    for stale in out.glob(".drawing-*"):
        pid = stale.name.removeprefix(".drawing-")
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = out / f".drawing-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    try:
        yield folder
    except ArtifactError as e:  # a figure that could not be written: named where it was going
        raise ArtifactError(str(e).replace(str(folder), str(out))) from None
    except OSError as e:
        raise ArtifactError(f"cannot write {out} ({e.strerror or e})") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pair_name(folder: Path, run_dir: Path) -> str:
    """The figure of a folder's profiles without and with an adapter: `tail-adapter-<folder>.png`."""
    return f"tail-adapter-{'-'.join(folder.relative_to(run_dir).parts) or run_dir.name}.png"


@contextmanager
def _removed_if_stopped(out: Path) -> Iterator[None]:
    """`out`, made if missing; a folder made here is removed whole if the report stops before its page is
    written, so a rerun never finds a half-made folder it would take for someone else's. (In a folder that
    was there, the figures are drawn aside, `_drawing_folder`, so a stopped report keeps the previous page
    and its figures.)"""
    made = out  # the outermost folder made here: `out`, or a missing folder above it
    while not made.parent.exists() and made.parent != made:
        made = made.parent
    fresh = not made.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _check_artifacts(kinds: dict[str, list[Path]], curves: list[Path], steps: dict[Path, Steps],
                     skipped: list[str]) -> tuple[dict[str, list[Path]], list[Path]]:
    """Every artifact to draw read against its schema before any figure is written; the artifacts and the
    runs with curves that remain. A file that cannot be read at all (a damaged data page, which the footer
    check cannot see) or has another schema version is left out with its `skipped` line, as a truncated
    one is, so that one damaged file does not keep the rest from being drawn, and so is one whose footer
    records a number the figures read as something else (bin_width 'wide'); a bad value in its rows (a NaN
    alpha) refuses the report with the one sentence every command gives."""
    kept = {kind: [p for p in paths if kind == "train_mismatch"
                   or (_readable(p, kind, skipped) and _numbers_read(p, kind, skipped))]
            for kind, paths in kinds.items()}  # train_mismatch: read file by file, as `steps`
    for series in steps.values():
        good = [f for f in series.files
                if _readable(f, "train_mismatch", skipped) and _numbers_read(f, "train_mismatch", skipped)]
        series.left_out += len(series.files) - len(good)
        series.files = good
    curves = [run for run in curves
              if _readable(run / "metrics.parquet", "metrics", skipped, f"the training curves of {run}")]
    return kept, curves


def _readable(path: Path, kind: str, skipped: list[str], what: str | None = None) -> bool:
    """Whether `path` reads as a `kind` artifact. When it does not because its bytes are unreadable or its
    schema version is not this Sparrow's, the sentence every command gives goes to `skipped` (as
    "`what` (sentence)" when `what` is given); any other refusal (a value outside its range) is raised."""
    try:
        check_artifact(path, kind)
        return True
    except ArtifactError as e:
        if not any(_unreadable(f) for f in (artifact_parts(path) if path.is_dir() else [path])):
            raise
        skipped.append(f"{what} ({e})" if what else str(e))
        return False


FOOTER_NUMBERS = {"mismatch": ("bin_width",), "train_mismatch": ("bin_width",),
                  "schedule": ("bin_width", "threshold", "quantile", "min_tokens")}  # what the figures read


def _numbers_read(path: Path, kind: str, skipped: list[str]) -> bool:
    """Whether the numbers the figures read of `path`'s footer (FOOTER_NUMBERS) are numbers of their kind;
    when one is not, the sentence naming the file and the key goes to `skipped`, as for a damaged file."""
    try:
        meta = artifact_metadata(path)
        for key in FOOTER_NUMBERS.get(kind, ()):
            footer_number(meta, key, path)
    except ArtifactError as e:
        skipped.append(str(e))
        return False
    return True


def _unreadable(path: Path) -> bool:
    """A Parquet file whose footer names another schema version than this Sparrow's (or none), or whose
    data pyarrow cannot read."""
    if kind_version(read_schema(path))[1] != VERSION:
        return True
    try:
        for _ in parquet_batches(path):  # every column of every row, a batch at a time
            pass
    except ArtifactError:
        return True
    return False


@dataclass(frozen=True)
class Planned:
    """A folder's schedule that records the threshold it was planned at."""

    path: Path
    threshold: ResolvedThreshold
    min_tokens: int  # its --min-tokens (the planner's default where it records none)
    profile: str | None  # the profile it was planned from, as it records it


def _tail_line(kinds: dict[str, list[Path]], mismatch: Path, note: Callable[[str], None]) -> TailLine:
    """What a profile's tail is drawn against: the folder's threshold artifact, else the threshold, quantile
    and --min-tokens of a schedule in the folder (so that the tail figure and the schedule beside it tell
    one story): one planned from this very profile first, else the first; a warning names the schedules
    when they were planned at different thresholds. Else, by the rule every command follows, the
    calibration shipped for the profile's model, else the prior."""
    model = artifact_metadata(mismatch).get("model")
    planned = [p for p in map(planned_schedule, kinds.get("schedule", [])) if p is not None]
    if files := kinds.get("threshold"):
        line = TailLine(resolve_threshold(None, files[0], None, model))
        if other := [p for p in planned if abs(p.threshold.value - line.threshold.value) > 1e-12]:
            each = ", ".join(f"{p.path.name} at {p.threshold.value:g}" for p in other)
            note(f"warning: the tail of {mismatch.name} is drawn against {files[0].name}'s threshold "
                 f"{line.threshold.value:g}, but the folder's schedules were planned at another ({each}): "
                 "their budgets answer to that one")
        return line
    if not planned:
        return TailLine(resolve_threshold(None, None, None, model))
    chosen = next((p for p in planned if _same_path(p.profile, mismatch)), planned[0])
    if len({(p.threshold.value, p.threshold.quantile) for p in planned}) > 1:
        each = "; ".join(f"{p.path.name}: {p.threshold.value:g} at quantile {p.threshold.quantile:g}"
                         for p in planned)
        why = "planned from it" if _same_path(chosen.profile, mismatch) else "the first"
        note(f"warning: the folder's schedules were planned at different thresholds ({each}); the tail of "
             f"{mismatch.name} is drawn against {chosen.path.name}'s ({why})")
    return TailLine(chosen.threshold, chosen.min_tokens)


def _same_path(recorded: str | None, path: Path) -> bool:
    """Whether a path an artifact records names `path` (symlinks followed)."""
    return recorded is not None and Path(recorded).resolve() == path.resolve()


def planned_schedule(schedule: Path) -> Planned | None:
    """The threshold and quantile a plan-schedule schedule records in its metadata, with where it came
    from, its --min-tokens and its profile; None for a schedule that records none (a draft schedule, a
    training run's sampler) or records them out of range."""
    meta = artifact_metadata(schedule)
    value, quantile, min_tokens = meta.get("threshold"), meta.get("quantile"), meta.get("min_tokens")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 1
               for v in (value, quantile)):
        return None
    if not (isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens >= 1):
        min_tokens = MIN_TOKENS
    profile = meta.get("profile")
    threshold = ResolvedThreshold(float(value), float(quantile), f"{schedule.name} was planned at it",
                                  str(meta.get("threshold_source") or ""))
    return Planned(schedule, threshold, min_tokens, profile if isinstance(profile, str) else None)


def _others(run_dir: Path, shown: int = 8) -> str:
    """"; it also holds x.csv, which is not Parquet": the files a report never reads, beside the Parquet
    files it could not draw."""
    names = [p.name for p in sorted(run_dir.iterdir())
             if not p.name.startswith(".") and not p.is_dir() and p.suffix != ".parquet"]
    if not names:
        return ""
    verb = "is" if len(names) == 1 else "are"
    return f"; it also holds {_few(names, shown)}, which {verb} not Parquet"


def _holdings(run_dir: Path, shown: int = 8) -> str:
    """What a folder holds, in a few names (folders end in /)."""
    names = [p.name + ("/" if p.is_dir() else "") for p in sorted(run_dir.iterdir())
             if not p.name.startswith(".")]
    return f"it holds {_few(names, shown)}" if names else "it is empty"


def _few(names: list[str], shown: int) -> str:
    """The first `shown` names, and how many there are in all where there are more."""
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
