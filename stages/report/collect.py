"""What a run directory holds to draw: its artifacts by kind, its training runs, their per-step mismatch, and
what is left out (each with why, for the page's "Not drawn" list). Only footers are read here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas import ArtifactError, artifact_metadata
from sparrow.schemas.artifacts import KEY_META
from sparrow.schemas.footer import artifact_parts, file_json, kind_version, read_schema
from sparrow.schemas.locations import command_output

from ..sql.views import Provenance, escaped, file_metadata, not_regular, not_utf8

DRAWN = ("mismatch", "schedule", "cost", "rollouts", "rewards")

FIGURED = (*DRAWN, "threshold", "train_mismatch")  # threshold: when calibrated on runs

NO_FIGURE = {"metrics": "a 'metrics' artifact is drawn only as a training run's metrics.parquet"}
COMPLETIONS = "a training run's sampled completions, text that no figure draws; `sparrow sql` reads them"


@dataclass
class Steps:
    """The per-step mismatch files of a training run (or of a train_mismatch artifact) that passed the
    footer check, drawn as one figure; `left_out` counts those that did not (each listed as not drawn)."""

    where: str  # the folder, as the caption names it
    name: str  # the figure's file
    files: list[Path]
    left_out: int = 0


def step_names(run: Path) -> list[Path]:
    """A training run's per-step mismatch files, by name (`sparrow train` writes mismatch/step=N.parquet)."""
    folder = run / "mismatch"
    return sorted(folder.glob("step=*.parquet")) if folder.is_dir() else []


def is_run(folder: Path) -> bool:
    """A training run: a metrics.parquet or per-step mismatch files (a run whose metrics are missing still
    has its mismatch to draw)."""
    return (folder / "metrics.parquet").exists() or bool(step_names(folder))


RUN_DEPTH = 2  # runs in a subdirectory, or in a subdirectory's subdirectory (a sweep's folder of runs)


def find_runs(run_dir: Path) -> list[Path]:
    """The training runs: `run_dir` itself, then those in its subdirectories down to RUN_DEPTH, in name
    order; a run's own folders are not searched."""
    runs = [run_dir] if is_run(run_dir) else []

    def visit(folder: Path, depth: int) -> None:
        for p in sorted(folder.iterdir()):
            if not p.is_dir() or p.name.startswith("."):
                continue
            if is_run(p):
                runs.append(p)
            elif depth > 1:
                visit(p, depth - 1)

    visit(run_dir, RUN_DEPTH)
    return runs


def run_label(run: Path, run_dir: Path) -> str:
    """A run as the report names it: its path under `run_dir` (`sweep/dense`), or the folder's name."""
    return escaped(Path(*run.relative_to(run_dir).parts)) if run != run_dir else escaped(Path(run_dir.name))


def find_artifacts(folder: Path, skipped: list[str], runs: list[Path]) -> dict[str, list[Path]]:
    """Every artifact directly in `folder` by kind, in name order: files, and directories of parts that are
    not training runs (nor the run's own files when `folder` is one). What cannot be read as an artifact,
    or has no figure, goes to `skipped`, with why."""
    own = set(runs)
    if folder in runs:
        own.add(folder / "metrics.parquet")
        if step_names(folder):
            own.add(folder / "mismatch")
        if (folder / "completions").is_dir():
            own.add(folder / "completions")
            skipped.append(f"{folder / 'completions'} ({COMPLETIONS})")
    out: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p in own:
            continue
        if p.is_dir() and not any(c.suffix == ".parquet" for c in p.iterdir()):
            if not any(r.is_relative_to(p) for r in runs) and _deeper_parquet(p):
                skipped.append(f"{p} (its Parquet files lie in its subfolders, below what the report reads; "
                               f"`sparrow report` on the folder that holds them draws them)")
            continue
        if not p.is_dir() and p.suffix != ".parquet":
            continue
        if p.is_dir() and command_output(p):
            skipped.append(f"{p} (a Sparrow command's output folder, not an artifact's parts: a training run "
                           "that has logged no step yet, say; `sparrow report` draws it once it has)")
            continue
        if why := unreadable(p):
            skipped.append(why)
            continue
        for kind, path in kinds_of(p, skipped):
            if kind in FIGURED:
                out.setdefault(kind, []).append(path)
            else:
                skipped.append(f"{path} ({NO_FIGURE.get(kind, f'a {kind!r} artifact has no figure')})")
    return out


def unreadable(p: Path) -> str | None:
    """Why the report cannot read the file or folder of parts `p`, or None: a FIFO (reading it could
    block), a broken link, or a name that DuckDB cannot be given."""
    return (None if p.is_dir() else not_regular(p)) or not_utf8(p, use="draw")


def _holds_parquet(p: Path) -> bool:
    """A Parquet file, or a folder with Parquet files in it."""
    return p.suffix == ".parquet" or (p.is_dir() and any(c.suffix == ".parquet" for c in p.iterdir()))


def _deeper_parquet(folder: Path) -> bool:
    """Parquet files one or two folders below `folder`."""
    return any(folder.glob("*/*.parquet")) or any(folder.glob("*/*/*.parquet"))


def note_inside_runs(run_dir: Path, runs: list[Path], skipped: list[str]) -> None:
    """A subdirectory run is drawn by its metrics and mismatch; its other Parquet files and folders (its
    schedule, say) are named in `skipped`, one line per run, with the command that draws them."""
    for run in runs:
        if run == run_dir:
            continue
        own = {run / "metrics.parquet", run / "mismatch", run / "completions"}
        other = [p.name for p in sorted(run.iterdir())
                 if not p.name.startswith(".") and p not in own and _holds_parquet(p)]
        if other:
            what = run / other[0] if len(other) == 1 else f"{', '.join(other)} in {run}"
            skipped.append(f"{what} (inside the training run {run_label(run, run_dir)}; "
                           f"`sparrow report {run}` draws {'them' if len(other) > 1 else 'it'})")
        if (run / "completions").is_dir():
            skipped.append(f"{run / 'completions'} ({COMPLETIONS})")


def checked_steps(files: list[Path], skipped: list[str]) -> tuple[list[Path], int]:
    """The files that pass the footer check every command runs (a regular, whole Parquet file of kind
    train_mismatch), and how many did not: each of those goes to `skipped`, so that a run killed in
    the middle of writing a step still has its other steps drawn."""
    good: list[Path] = []
    for f in files:
        if why := unreadable(f):
            skipped.append(why)
            continue
        try:
            kind = kind_version(read_schema(f))[0]
        except ArtifactError as e:
            skipped.append(str(e))
            continue
        if kind != "train_mismatch":
            what = f"a {kind!r} artifact" if kind else "a Parquet file without Sparrow artifact metadata"
            skipped.append(f"{f} is {what}, not a training step's 'train_mismatch'")
            continue
        good.append(f)
    return good, len(files) - len(good)


def find_steps(run_dir: Path, runs: list[Path], kinds: dict[str, list[Path]], skipped: list[str]
               ) -> dict[Path, Steps]:
    """Each run's per-step mismatch, then each train_mismatch artifact outside a run (the files directly in
    `run_dir` as one), keyed by what they belong to."""
    out: dict[Path, Steps] = {}
    for run in runs:
        if names := step_names(run):
            label = run_label(run, run_dir)
            out[run] = Steps(f"{label}/mismatch", f"train-mismatch-{label.replace('/', '-')}.png",
                             *checked_steps(names, skipped))
    loose = [p for p in kinds.get("train_mismatch", []) if p.parent == run_dir and not p.is_dir()]
    if loose:  # keyed and named apart from `run_dir` itself, which may be a run
        name = f"train-mismatch-{run_dir.name}{'-files' if run_dir in out else ''}.png"
        out[run_dir / "*"] = Steps(run_dir.name, name, loose)
    for path in kinds.get("train_mismatch", []):
        if path not in loose:
            files = artifact_parts(path) if path.is_dir() else [path]
            where = str(path.relative_to(run_dir))
            out[path] = Steps(where, figure_name("train-mismatch", path, True, run_dir), files)
    return out


def find_curves(runs: list[Path], skipped: list[str]) -> list[Path]:
    """The runs whose training curves can be drawn: a metrics.parquet that passes the footer check. The
    others are named in `skipped` (their per-step mismatch is drawn all the same)."""
    out: list[Path] = []
    for run in runs:
        metrics = run / "metrics.parquet"
        why = f"{metrics} does not exist" if not os.path.lexists(metrics) else not_regular(metrics)
        if why is None:
            try:
                kind = kind_version(read_schema(metrics))[0]
                why = None if kind == "metrics" else f"{metrics} is not a 'metrics' artifact"
            except ArtifactError as e:
                why = str(e)
        if why is None:
            out.append(run)
        else:
            skipped.append(f"the training curves of {run} ({why})")
    return out


RUN_KEYS = ("tail", "mean", "collapsed")  # what the calibration figure draws of each run


def calibrated_runs(threshold: Path) -> list[dict]:
    """The runs a threshold artifact was calibrated on; none for the prior or a shipped calibration.
    ArtifactError naming the file when its metadata's 'runs' is not a JSON list of such runs."""
    try:
        runs = file_json(artifact_metadata(threshold).get("runs") or "[]")
    except (TypeError, ValueError):
        runs = None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and all(k in r for k in RUN_KEYS)
                                             for r in runs):
        raise ArtifactError(f"{threshold} has a 'runs' entry in its '{KEY_META}' metadata that is not a "
                            f"JSON list of calibrated runs (each with {', '.join(RUN_KEYS)})")
    return runs


def find_calibrations(kinds: dict[str, list[Path]], skipped: list[str]) -> list[Path]:
    """The threshold artifacts that have a figure (those calibrated on runs). One without runs that no tail
    figure uses (the tail figures use the first) is named in `skipped`."""
    thresholds = kinds.get("threshold", [])
    used = thresholds[0] if thresholds and kinds.get("mismatch") else None
    out: list[Path] = []
    for path in thresholds:
        try:
            runs = calibrated_runs(path)
        except ArtifactError as e:
            skipped.append(str(e))
            continue
        if runs:
            out.append(path)
        elif path != used:
            skipped.append(f"{path} (a 'threshold' artifact without calibrated runs has no figure of its own"
                           + (f", and the tail figures use {used}" if used else "") + ")")
    return out


def kinds_of(path: Path, skipped: list[str]) -> list[tuple[str, Path]]:
    """(kind, artifact) of a Parquet file or of a directory of them. A directory whose files share a kind
    and a provenance (`sql`'s Provenance: model, sampler, adapter, ...) is one artifact of parts (a
    `--workers` output); one whose files share only the kind holds several artifacts, each drawn on its
    own (distill's profiles before and after its adapter: pooled, the curve would be neither's); one of
    several kinds is not one artifact and is skipped whole, in one line, so that the rest is drawn."""
    files = artifact_parts(path) if path.is_dir() else [path]
    found: list[tuple[str | None, Provenance, Path]] = []
    try:
        for f in files:
            if why := not_regular(f):
                raise ArtifactError(why)
            schema = read_schema(f)
            found.append((kind_version(schema)[0], Provenance.of(file_metadata(schema, f)), f))
    except ArtifactError as e:
        skipped.append(f"{path} ({e})" if path.is_dir() else str(e))
        return []
    kinds = {k for k, _, _ in found}
    if len(kinds) > 1:
        named = ", ".join(sorted(k or "no artifact metadata" for k in kinds))
        skipped.append(f"{path} holds files of several kinds ({named}), not the parts of one artifact")
        return []
    kind = found[0][0]
    if kind is None:
        skipped.append(f"{path} {'holds Parquet files' if path.is_dir() else 'is a Parquet file'} without "
                       "Sparrow artifact metadata")
        return []
    if path.is_dir() and len({p for _, p, _ in found}) > 1:  # the profile without an adapter first
        return [(kind, f) for _, _, f in sorted(found, key=lambda x: x[1].adapter is not None)]
    return [(kind, path)]


def adapter_pairs(profiles: list[Path]) -> list[tuple[Path, Path]]:
    """(without, with) of the profiles of one folder that `sparrow distill` scored without and with its
    adapter: a folder whose profiles are one that records an `adapter` and one that records the `actor` but
    no adapter (its before.parquet and after.parquet)."""
    by_folder: dict[Path, list[Path]] = {}
    for p in profiles:
        by_folder.setdefault(p.parent, []).append(p)
    pairs = []
    for files in by_folder.values():
        metas = [artifact_metadata(f) for f in files]
        adapted = [f for f, m in zip(files, metas) if m.get("adapter")]
        plain = [f for f, m in zip(files, metas) if m.get("actor") and not m.get("adapter")]
        if len(files) == 2 and len(adapted) == 1 and len(plain) == 1:
            pairs.append((plain[0], adapted[0]))
    return pairs


def figure_name(kind: str, path: Path, many: bool, run_dir: Path) -> str:
    """The figure's file: `tail.png` for the one profile, `tail-<file>.png` for each of several, where a
    file inside a directory is named with it (`tail-mismatch-before.png`), so that no two collide."""
    if not many:
        return f"{kind}.png"
    return f"{kind}-{'-'.join(path.relative_to(run_dir).with_suffix('').parts)}.png"
