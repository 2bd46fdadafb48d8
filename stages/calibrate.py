"""`calibrate-threshold`: relate the stability of past runs to their tail mismatch.

Each run directory holds a `metrics` artifact (one row per training step) and the `schedule` it
trained with. Detectors label a run collapsed, with reasons, by what training did (reward, gradient
norm, entropy, truncation or repetition surge) over the whole run: the same function labels a run in
`sparrow train` (each step's row holds the reasons for the history up to it; the run's label is its
last row's) and here. Mismatch KL is a diagnostic and a warning, never a reason: the threshold is
fitted to the labels, so a label made of mismatch would make the calibration circular. Each run's tail
statistic is the
minimum over position bins of the q-quantile of alpha, where every profiled token is scored at the
budget the run's schedule gave its position. The critical threshold is the midpoint of the gap
between the highest collapsed tail and the lowest stable tail, with a bootstrap interval over runs.
When there are no runs, only one kind, or the kinds overlap, the published prior (0.86) is returned
and marked as such: a threshold is never invented from data that does not separate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .definitions import PRIOR_THRESHOLD, TAIL_QUANTILE
from .schedule import Schedule

PRIOR_RANGE = (0.85, 0.90)  # the published 'between 0.85 and 0.90'
PRIOR_NOTE = "published prior (Sparrow, arXiv 2606.08446): keep the per-bin 5th percentile above 0.86"


@dataclass(frozen=True)
class Detectors:
    """Collapse detectors; each fires on the smoothed per-step metrics (window `window` steps)."""

    window: int = 5
    reward_drop: float = 0.5  # final reward below (1 - reward_drop) x best reward
    grad_norm_factor: float = 10.0  # grad norm above factor x median of the first window
    mismatch_kl_limit: float = 0.05  # smoothed mismatch KL above this: a warning, not a collapse
    truncation_limit: float = 0.5  # final truncation rate above this, having risen by `surge`
    repetition_limit: float = 0.5  # final repetition rate above this, having risen by `surge`
    surge: float = 0.25  # rise over the first window's mean: a rate that was high from the start (a tight
    # --max-new-tokens cap truncates every sample) says nothing about training
    entropy_factor: float = 3.0  # final entropy above factor x initial entropy


def _smooth(x: np.ndarray, w: int) -> np.ndarray:
    if len(x) < w:
        return np.array([x.mean()]) if len(x) else x
    return np.convolve(x, np.ones(w) / w, mode="valid")


def _col(metrics: pa.Table, name: str) -> np.ndarray | None:
    if name not in metrics.column_names:
        return None
    x = metrics.column(name).to_numpy(zero_copy_only=False).astype(float)
    x = x[~np.isnan(x)]
    return x if len(x) else None


def collapse_reasons(metrics: pa.Table, det: Detectors = Detectors()) -> list[str]:
    """Why a run collapsed ([] = stable)."""
    metrics = metrics.sort_by("step")
    w, reasons = det.window, []
    if (r := _col(metrics, "reward_mean")) is not None:
        s = _smooth(r, w)
        best, final = s.max(), s[-1]
        if best > 0 and final < (1 - det.reward_drop) * best:
            reasons.append(f"reward fell from {best:.3f} to {final:.3f}")
    if (g := _col(metrics, "grad_norm")) is not None and len(g) > w:
        base = np.median(g[:w])
        if base > 0 and g.max() > det.grad_norm_factor * base:
            reasons.append(f"gradient norm exploded to {g.max():.3g} ({g.max() / base:.0f}x)")
    for name, limit in (("truncation", det.truncation_limit), ("repetition", det.repetition_limit)):
        if (x := _col(metrics, f"{name}_rate")) is not None:
            first, last = x[:w].mean(), _smooth(x, w)[-1]
            if last > limit and last - first >= det.surge:
                reasons.append(f"{name} rate rose from {first:.2f} to {last:.2f}")
    if (e := _col(metrics, "entropy")) is not None and len(e) > w:
        first, last = e[:w].mean(), _smooth(e, w)[-1]
        if first > 0 and last > det.entropy_factor * first:
            reasons.append(f"entropy blew up from {first:.3g} to {last:.3g}")
    return reasons


def mismatch_warnings(metrics: pa.Table, det: Detectors = Detectors()) -> list[str]:
    """Diagnostics that do not label a run: the smoothed mismatch KL above its warning level."""
    if (k := _col(metrics.sort_by("step"), "mismatch_kl")) is not None:
        peak = _smooth(k, det.window).max()
        if peak > det.mismatch_kl_limit:
            return [f"mismatch KL reached {peak:.3g} (smoothed; warning level {det.mismatch_kl_limit:g}, "
                    "a diagnostic, not a collapse)"]
    return []


def run_tail(mismatch: pa.Table, schedule: Schedule, quantile: float = TAIL_QUANTILE
             ) -> tuple[float, list[str]]:
    """Min over bins of the q-quantile of alpha, each token at its schedule budget.

    A scheduled budget that was not profiled uses the largest profiled budget below it (a lower
    bound on its tail); dense positions count as alpha = 1. Returns (tail, notes)."""
    profiled = np.array(sorted(set(pc.unique(mismatch.column("budget")).to_pylist())))
    notes = []
    position = mismatch.column("position").to_numpy()
    want = schedule.budgets_at(position)
    use = np.where(want == 0, 0, profiled[np.clip(np.searchsorted(profiled, want, "right") - 1, 0, None)])
    missing = sorted(set(want[(want > 0) & (want < profiled[0])].tolist()))
    if missing:
        notes.append(f"budgets {missing} are below every profiled budget; used {profiled[0]}")
    substituted = sorted(set(want[(want > 0) & ~np.isin(want, profiled)].tolist()) - set(missing))
    if substituted:
        notes.append(f"budgets {substituted} not profiled; used the next profiled budget below")
    keep = mismatch.column("budget").to_numpy() == use
    alpha = mismatch.column("alpha").to_numpy()[keep]
    bins = mismatch.column("bin").to_numpy()[keep]
    if not len(alpha):
        return 1.0, notes + ["the schedule is dense wherever the profile has tokens"]
    tails = [np.quantile(alpha[bins == b], quantile) for b in np.unique(bins)]
    return float(min(tails)), notes


@dataclass
class RunResult:
    name: str  # the run directory as given (two runs may share a folder name)
    tail: float
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def collapsed(self) -> bool:
        return bool(self.reasons)


@dataclass
class Calibration:
    threshold: float
    lower: float | None
    upper: float | None
    source: str  # "prior" | "calibrated"
    note: str
    runs: list[RunResult]


def boundary(tails: np.ndarray, collapsed: np.ndarray) -> float | None:
    """Midpoint of the gap between collapsed and stable tails; None if they do not separate."""
    if collapsed.all() or not collapsed.any():
        return None
    hi_c, lo_s = tails[collapsed].max(), tails[~collapsed].min()
    return None if hi_c >= lo_s else float((hi_c + lo_s) / 2)


def calibrate(runs: list[RunResult], quantile: float = TAIL_QUANTILE, n_boot: int = 2000,
              seed: int = 0) -> Calibration:
    if not runs:
        return Calibration(PRIOR_THRESHOLD, *PRIOR_RANGE, "prior", PRIOR_NOTE + " (no runs given)", [])
    tails = np.array([r.tail for r in runs])
    collapsed = np.array([r.collapsed for r in runs])
    point = boundary(tails, collapsed)
    if point is None:
        why = ("all runs collapsed" if collapsed.all() else "no run collapsed"
               if not collapsed.any() else "collapsed and stable runs overlap in tail")
        return Calibration(PRIOR_THRESHOLD, *PRIOR_RANGE, "prior", f"{PRIOR_NOTE} ({why})", runs)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(runs), len(runs))
        b = boundary(tails[idx], collapsed[idx])
        if b is not None:
            boots.append(b)
    lower, upper = np.quantile(boots, [0.025, 0.975]) if boots else (point, point)
    gap = (tails[collapsed].max(), tails[~collapsed].min())
    note = (f"{collapsed.sum()} collapsed runs have tails <= {gap[0]:.4f}, {(~collapsed).sum()} stable "
            f"runs >= {gap[1]:.4f}; bootstrap 95% interval over runs ({len(boots)} resamples)")
    return Calibration(point, float(lower), float(upper), "calibrated", note, runs)


def load_run(run_dir: Path, mismatch: pa.Table, quantile: float, det: Detectors) -> RunResult:
    """A run directory -> its label and tail (reads its metrics and schedule artifacts)."""
    from sparrow.schemas import ArtifactError, artifact_kind, read_artifact

    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir}: run directory does not exist")
    files = {p: artifact_kind(p) for p in sorted(run_dir.glob("*.parquet"))}
    metrics = [p for p, k in files.items() if k == "metrics"]
    schedules = [p for p, k in files.items() if k == "schedule"]
    if len(metrics) != 1 or len(schedules) != 1:
        raise ArtifactError(f"{run_dir}: a run directory needs exactly one metrics and one schedule "
                            f"artifact, found {len(metrics)} and {len(schedules)}")
    table = read_artifact(metrics[0], "metrics")
    if table.num_rows == 0:
        raise ArtifactError(f"{metrics[0]}: the metrics artifact has no steps")
    tail, notes = run_tail(mismatch, Schedule.from_artifact(schedules[0]), quantile)
    return RunResult(str(run_dir), tail, collapse_reasons(table, det), notes, mismatch_warnings(table, det))


def threshold_table(cal: Calibration, quantile: float) -> dict[str, list]:
    return {
        "threshold": [cal.threshold], "lower": [cal.lower], "upper": [cal.upper],
        "quantile": [quantile], "source": [cal.source], "n_runs": [len(cal.runs)],
        "n_collapsed": [sum(r.collapsed for r in cal.runs)], "note": [cal.note],
    }
