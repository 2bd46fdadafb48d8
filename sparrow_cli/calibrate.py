"""`sparrow calibrate-threshold`: the critical tail threshold from past runs, or the prior."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer

from sparrow.stages.core.definitions import TAIL_QUANTILE

from .console import console
from .errors import UsageError, friendly_errors, stage_errors
from .messages import fail, note, warn
from .options import finite, given_path, output_path
from .output import emit, format_option, resolve_format
from .paths import check_output, force_option, input_path, output_help
from .progress import counting

MAX_BOOTSTRAP = 100_000  # draws; each holds a statistic per run, and the intervals' ends have long settled


def run_path(value: str) -> Path:
    """typer parser of a run directory (--runs and what follows it): an empty path is refused as one, not
    read as the working directory, before any work."""
    if not value.strip():
        fail("--runs has an empty path; give run directories")
    return Path(value)


@friendly_errors
def calibrate_threshold(
    profile: Path = typer.Option(..., "--profile", callback=input_path, parser=given_path("--profile"),
                                 help="A mismatch artifact (sparrow profile)."),
    runs: list[Path] = typer.Option([], "--runs", parser=run_path, help="Run directories, each with a "
                                    "metrics and a schedule artifact: --runs a b c, --runs sweep/runs/*, or "
                                    "the flag repeated."),
    more_runs: list[Path] = typer.Argument(None, metavar="[RUN_DIR]...", show_default=False, parser=run_path,
                                           help="More run directories (what follows --runs a)."),
    quantile: float = typer.Option(TAIL_QUANTILE, "--quantile", callback=finite,
                                   help="Tail quantile of alpha per bin."),
    window: int = typer.Option(5, "--window", help="Steps of smoothing for the detectors."),
    reward_drop: float = typer.Option(0.5, "--reward-drop", callback=finite,
                                      help="Collapsed if the final reward < (1 - this) x best."),
    grad_norm_factor: float = typer.Option(10.0, "--grad-norm-factor", callback=finite,
                                           help="Collapsed if grad norm > this x its early median."),
    mismatch_kl_limit: float = typer.Option(0.05, "--mismatch-kl-limit", callback=finite,
                                            help="Warn when the smoothed mismatch KL exceeds it (a "
                                            "diagnostic: never a collapse reason)."),
    truncation_limit: float = typer.Option(
        0.5, "--truncation-limit", callback=finite,
        help="A run collapsed if its smoothed truncation rate (samples cut at --max-new-tokens) ends above "
             "this, having risen at least 0.25 over its first window's mean (a rate high from the start says "
             "nothing about training)."),
    repetition_limit: float = typer.Option(
        0.5, "--repetition-limit", callback=finite,
        help="A run collapsed if its smoothed repetition rate (samples in which fewer than half of the "
             "4-grams are distinct) ends above this, having risen at least 0.25 over its first window's "
             "mean."),
    entropy_factor: float = typer.Option(3.0, "--entropy-factor", callback=finite,
                                         help="Collapsed if entropy ends above this x its start."),
    reward_margin: float = typer.Option(0.1, "--reward-margin", callback=finite,
                                        help="Collapsed if the final reward, plus the run's step-0 sampler "
                                        "gap (dense minus sparse sampled reward before any update), is "
                                        "below the dense run of the same configuration and seed by more "
                                        "than this or the dense runs' seed spread, whichever is larger."),
    eval_margin: float = typer.Option(0.1, "--eval-margin", callback=finite,
                                      help="Collapsed if the last dense eval accuracy is below the run's "
                                      "own at step 0 by more than this, or below the dense run's by more "
                                      "than this or the seed spread, whichever is larger."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="Bootstrap draws of the profile's prompts (and "
                                  "of the tokens within each) for the intervals, at most 100,000."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap draws (recorded in the artifact's "
                             "metadata and printed with the interval), to see how much the interval moves "
                             "with it."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the threshold artifact"),
                                parser=output_path()),
    force: bool = force_option(),
    format: str = format_option(),
) -> None:
    """Label each run stable or collapsed by what training did (its dense eval against its own start,
    its own curves, and the dense run of the same configuration and seed when one is among --runs; a
    sampler gap present at step 0 never counts), relate that to each run's tail statistic under its
    schedule, and write the critical threshold: the midpoint of the identified set (highest collapsed
    tail, lowest stable tail) with a 95% interval over the bootstrap draws of the profile's prompts in which
    the runs separate (--seed draws them; the share that separate is printed). The
    same test on the mean of alpha and on the share of the KV read, and the labels under other margins,
    are printed beside it. Without runs, or when the runs do not separate (as measured, or in most
    draws), the calibration shipped for the profile's model is written if there is one, else the
    published prior 0.86, marked as such, its lower and upper null (its published range 0.85-0.90 is no
    interval); the prior is a rule on the 0.05 quantile, so at another --quantile nothing stands in and
    the command refuses."""
    from sparrow.schemas import artifact_metadata, check_artifact, input_name, read_columns, write_artifact
    from sparrow.stages.calibrate import (
        Detectors,
        ProfileTokens,
        calibrate,
        check_run_models,
        few_prompts_warning,
        label_runs,
        margin_sensitivity,
        read_runs,
        threshold_table,
    )

    fmt = resolve_format(format)
    if not 0 < quantile < 1:
        raise UsageError(f"--quantile must be in (0, 1), got {quantile}")
    if not 1 <= bootstrap <= MAX_BOOTSTRAP:
        raise UsageError(f"--bootstrap must be from 1 to {MAX_BOOTSTRAP:,} (draws of the profile's prompts), "
                         f"got {bootstrap}")
    if seed < 0:
        raise UsageError(f"--seed must be at least 0 (numpy seeds the bootstrap with it), got {seed}")
    for flag, value in (("--reward-margin", reward_margin), ("--eval-margin", eval_margin)):
        if not 0 <= value <= 1:
            raise UsageError(f"{flag} must be in [0, 1] (a reward or accuracy gap), got {value}")
    check_detectors(window, reward_drop, grad_norm_factor, mismatch_kl_limit, truncation_limit,
                    repetition_limit, entropy_factor)
    check_output(output, "threshold", force, inputs={"--profile": profile,
                                                     "--runs": run_artifacts([*runs, *(more_runs or [])])})
    given = [*runs, *(more_runs or [])]
    # the profile's tokens are needed only to score runs; without any, it is checked a batch at a time
    mismatch = read_columns(profile, "mismatch", ProfileTokens.COLUMNS) if given else None
    tokens_profiled = mismatch.num_rows if mismatch is not None else check_artifact(profile, "mismatch")
    if tokens_profiled == 0:
        raise UsageError(f"{profile}: the mismatch profile has no tokens")
    det = Detectors(window=window, reward_drop=reward_drop, grad_norm_factor=grad_norm_factor,
                    mismatch_kl_limit=mismatch_kl_limit, truncation_limit=truncation_limit,
                    repetition_limit=repetition_limit, entropy_factor=entropy_factor,
                    reward_margin=reward_margin, eval_margin=eval_margin)
    runs, repeated = distinct_runs(given)
    for path in repeated:
        note(f"{path} was given more than once (the same run directory); counted once")
    loaded = read_runs(runs)  # all validated before writing
    check_run_models(loaded, artifact_metadata(profile).get("model"), input_name(profile))
    try:
        tokens = ProfileTokens.from_table(mismatch) if mismatch is not None else None
    except ValueError as e:
        raise UsageError(f"{profile}: {e}") from None
    results = label_runs(loaded, tokens, quantile, det, input_name(profile)) if tokens is not None else []
    model = artifact_metadata(profile).get("model")
    few = few_prompts_warning(tokens, input_name(profile)) if results else None
    if few:
        warn(few)
    with stage_errors(), counting("bootstrap (draws of the profile's prompts)") as progress:
        # no threshold to write: the prior stands in at the 0.05 quantile only
        cal = calibrate(results, quantile, bootstrap, seed, model=model, tokens=tokens, progress=progress)
    sensitivity = margin_sensitivity(loaded, results, det) if results else []
    per_run = [{"run": str(Path(r.name).absolute()), "tail": r.tail, "mean": r.mean, "kv_read": r.kv_read,
                "collapsed": r.collapsed,
                "reasons": r.reasons, "notes": r.notes, "warnings": r.warnings, "reference": r.reference,
                "sampler_gap": r.sampler_gap, "eval_change": r.eval_change, "reward_gap": r.reward_gap,
                "seed": r.seed, "correction": r.correction} for r in results]
    # the model and profile it was calibrated on: plan-schedule refuses it for another model
    meta = {**cal.provenance, "model": model, "profile": input_name(profile), "runs": json.dumps(per_run),
            "bootstrap": bootstrap if results else None, "bootstrap_seed": seed if results else None,
            "mean_threshold": cal.mean_threshold, "mean_note": cal.mean_note or None,
            "separations": json.dumps([asdict(s) for s in cal.separations]) if cal.separations else None,
            "margin_sensitivity": json.dumps(sensitivity) if sensitivity else None}
    write_artifact(threshold_table(cal, quantile), output, "threshold", metadata=meta)
    interval = f" [{cal.lower:.4f}, {cal.upper:.4f}]" if cal.lower is not None else ""
    console.print(f"threshold {cal.threshold:.4f}{interval} ({cal.source}): {cal.note}", highlight=False)
    if results:
        console.print(cal.mean_note, highlight=False)
    for sep in cal.separations[2:]:
        console.print(sep.line(), highlight=False)
    for line in sensitivity:
        console.print(line, highlight=False)
    console.print(f"wrote {output}")
    if results:  # the runs are the data, as the artifact's `runs` holds them; the threshold is in it too
        print_runs(results, fmt)
    else:  # no runs to show: the data is the threshold row itself, as the artifact holds it
        row = threshold_table(cal, quantile)
        emit(tuple(row), [[v[0] for v in row.values()]], fmt, title="threshold",
             left=("source", "note"))


def print_runs(results, fmt: str) -> None:
    """One row per run, by tail: its label and the collapse reasons behind it (none for a stable run),
    apart from its notes (what could not be compared, which profiled budget stood in) and its mismatch
    warnings, each list joined by "; " and kept apart in the artifact's `runs` metadata too."""
    rows = [[r.name, r.tail, r.mean, r.kv_read, r.sampler_gap, r.eval_change,
             "collapsed" if r.collapsed else "stable", "; ".join(r.reasons), "; ".join(r.notes),
             "; ".join(r.warnings)]
            for r in sorted(results, key=lambda r: r.tail)]
    emit(("run", "tail", "mean_alpha", "kv_read", "sampler_gap", "eval_change", "label", "reasons", "notes",
          "warnings"), rows, fmt, title="runs", left=("run", "label", "reasons", "notes", "warnings"))


# (flag, lowest, highest, what the value is); None: unbounded on that side
DETECTOR_RANGES = (("--window", 1, None, "steps of smoothing"),
                   ("--reward-drop", 0, 1, "a share of the best reward"),
                   ("--grad-norm-factor", 1, None, "a multiple of the early median grad norm"),
                   ("--mismatch-kl-limit", 0, None, "a KL divergence"),
                   ("--truncation-limit", 0, 1, "a rate"),
                   ("--repetition-limit", 0, 1, "a rate"),
                   ("--entropy-factor", 1, None, "a multiple of the starting entropy"))


def run_artifacts(runs: list[Path]) -> list[Path]:
    """The metrics and schedule artifacts in the run directories: what calibrating reads of them, which
    -o may not replace (a threshold written beside them may)."""
    from sparrow.schemas import ArtifactError, artifact_kind

    found = []
    for path in (p for run in runs if run.is_dir() for p in sorted(run.glob("*.parquet"))):
        try:
            if artifact_kind(path) in ("metrics", "schedule"):
                found.append(path)
        except ArtifactError:  # not an artifact: reading the runs says so
            continue
    return found


def check_detectors(*values: float) -> None:
    """Each detector flag (in DETECTOR_RANGES' order) in its range, one sentence otherwise, before any
    work. A factor below 1 would call a run collapsed for staying where it started, so factors start at 1."""
    for (flag, low, high, what), value in zip(DETECTOR_RANGES, values, strict=True):
        if high is None and value < low:
            raise UsageError(f"{flag} must be at least {low} ({what}), got {value}")
        if high is not None and not low <= value <= high:
            raise UsageError(f"{flag} must be in [{low}, {high}] ({what}), got {value}")


def distinct_runs(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(runs, repeated): each run directory once, by its resolved path (a run given twice, or by two
    names, would count as two runs), in the order first given; and the later mentions that were dropped."""
    seen: set[Path] = set()
    runs, repeated = [], []
    for path in paths:
        key = path.resolve()
        (repeated if key in seen else runs).append(path)
        seen.add(key)
    return runs, repeated
