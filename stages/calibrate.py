"""`calibrate-threshold`: relate the stability of past runs to their tail mismatch.

Runs are labelled stable or collapsed by what training did (their own curves and their dense
reference), never by their mismatch, so that the threshold fitted to the labels is not circular; the
threshold is the midpoint of the gap between collapsed and stable tails, with a bootstrap interval, or
the shipped calibration or the prior when the runs do not separate. docs/calibration.md gives the rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .core.definitions import PRIOR_THRESHOLD, TAIL_QUANTILE
from .core.schedule import Schedule
from .train.detectors import Detectors, collapse_reasons, metric, mismatch_warnings

PRIOR_RANGE = (0.85, 0.90)  # the published 'between 0.85 and 0.90'
PRIOR_NOTE = "published prior (Sparrow, arXiv 2606.08446): keep the per-bin 5th percentile above 0.86"


def run_statistics(mismatch: pa.Table, schedule: Schedule, quantile: float = TAIL_QUANTILE
                   ) -> tuple[float, float, list[str]]:
    """(tail, mean, notes): the min over bins of the q-quantile of alpha, and the mean of alpha, each
    token scored at its schedule budget.

    A scheduled budget that was not profiled uses the largest profiled budget below it (a lower
    bound on its tail); dense positions count as alpha = 1."""
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
        return 1.0, 1.0, notes + ["the schedule is dense wherever the profile has tokens"]
    tails = [np.quantile(alpha[bins == b], quantile) for b in np.unique(bins)]
    # dense tokens (one per profiled token position at dense) count as alpha = 1 in the mean
    dense_tokens = int((want == 0).sum()) // max(1, len(profiled))
    mean = (float(alpha.sum()) + dense_tokens) / (len(alpha) + dense_tokens)
    return float(min(tails)), mean, notes


def run_tail(mismatch: pa.Table, schedule: Schedule, quantile: float = TAIL_QUANTILE
             ) -> tuple[float, list[str]]:
    """Min over bins of the q-quantile of alpha, each token at its schedule budget (run_statistics)."""
    tail, _, notes = run_statistics(mismatch, schedule, quantile)
    return tail, notes


def _upto(metrics: pa.Table, step: int) -> pa.Table:
    return metrics.filter(pc.less_equal(metrics.column("step"), step))


def final_reward(metrics: pa.Table, step: int, det: Detectors) -> float | None:
    """The smoothed reward at `step` (the mean of the last `window` steps up to it)."""
    r = metric(_upto(metrics, step).sort_by("step"), "reward_mean")
    return None if r is None else float(r[-det.window:].mean())


def last_eval(metrics: pa.Table, step: int, det: Detectors) -> float | None:
    e = metric(_upto(metrics, step).sort_by("step"), "eval_accuracy")
    return None if e is None else float(e[-1])


def reference_reasons(metrics: pa.Table, reference: pa.Table, dense_runs: list[pa.Table], seed: int,
                      det: Detectors = Detectors()) -> list[str]:
    """Why a run did worse than its dense reference (the dense run of its configuration and seed),
    compared at the run's last step, beyond the seed spread of `dense_runs` (all seeds)."""
    last, reasons = pc.max(metrics.column("step")).as_py(), []
    for name, value, floor in (("reward", final_reward, det.reward_margin),
                               ("eval accuracy", last_eval, det.eval_margin)):
        mine, ref = value(metrics, last, det), value(reference, last, det)
        if mine is None or ref is None:
            continue
        finals = [f for d in dense_runs if (f := value(d, last, det)) is not None]
        spread = max(finals) - min(finals) if len(finals) > 1 else 0.0
        if mine < ref - max(floor, spread):
            reasons.append(f"{name} {mine:.3f} below the dense run's {ref:.3f} (seed {seed}) by more than "
                           f"{max(floor, spread):.3f} (seed spread {spread:.3f}, floor {floor:g})")
    return reasons


@dataclass
class RunResult:
    name: str  # the run directory as given (two runs may share a folder name)
    tail: float
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mean: float = float("nan")
    reference: str | None = None  # the dense run it was compared with

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
    mean_threshold: float | None = None  # the same boundary on the mean of alpha; None: no separation
    mean_note: str = ""
    provenance: dict = field(default_factory=dict)  # a shipped calibration's metadata (model, task, runs)


def boundary(stats: np.ndarray, collapsed: np.ndarray) -> float | None:
    """Midpoint of the gap between collapsed and stable statistics; None if they do not separate."""
    if collapsed.all() or not collapsed.any():
        return None
    hi_c, lo_s = stats[collapsed].max(), stats[~collapsed].min()
    return None if hi_c >= lo_s else float((hi_c + lo_s) / 2)


def fit(stats: np.ndarray, collapsed: np.ndarray, what: str, n_boot: int, seed: int
        ) -> tuple[float | None, float, float, str]:
    """(boundary or None, lower, upper, note) of one statistic over the runs, bootstrapped over runs."""
    point = boundary(stats, collapsed)
    if point is None:
        why = ("all runs collapsed" if collapsed.all() else "no run collapsed" if not collapsed.any()
               else f"collapsed and stable runs overlap in {what} (collapsed up to "
                    f"{stats[collapsed].max():.4f}, stable from {stats[~collapsed].min():.4f})")
        return None, float("nan"), float("nan"), why
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(stats), len(stats))
        if (b := boundary(stats[idx], collapsed[idx])) is not None:
            boots.append(b)
    lower, upper = np.quantile(boots, [0.025, 0.975]) if boots else (point, point)
    note = (f"{collapsed.sum()} collapsed runs have {what} <= {stats[collapsed].max():.4f}, "
            f"{(~collapsed).sum()} stable runs >= {stats[~collapsed].min():.4f}; bootstrap 95% interval "
            f"over runs ({len(boots)} resamples)")
    return point, float(lower), float(upper), note


SHIPPED = Path(__file__).parent / "data"  # threshold-<model>.parquet, written by bench/threshold_sweep.py


def shipped_threshold(model: str | None, quantile: float) -> Calibration | None:
    """The calibration shipped for `model` (a preset name, not a checkpoint that happens to share it), if
    one was made at this quantile."""
    from sparrow.schemas import artifact_metadata, read_artifact

    from .model.presets import PRESETS

    if not model or model.lower() not in PRESETS:
        return None
    path = SHIPPED / f"threshold-{model.lower()}.parquet"
    if not path.is_file():
        return None
    row = read_artifact(path, "threshold").to_pylist()[0]
    if abs(row["quantile"] - quantile) > 1e-12:
        return None
    meta = artifact_metadata(path)
    return Calibration(row["threshold"], row["lower"], row["upper"], "calibrated",
                       f"shipped calibration for {model} ({meta.get('provenance', 'no provenance')})", [],
                       provenance=meta)


@dataclass(frozen=True)
class ResolvedThreshold:
    """The threshold a command uses, with the quantile it applies to and where it came from."""

    value: float
    quantile: float
    origin: str  # short: "given", "published prior", "shipped calibration for M", "calibrated, FILE"
    provenance: str = ""  # how it was made, possibly long (a shipped calibration's sweep)
    interval: tuple[float, float] | None = None

    @property
    def source(self) -> str:
        """Origin and provenance on one line (for an artifact's metadata)."""
        return f"{self.origin} ({self.provenance})" if self.provenance else self.origin

    @property
    def short(self) -> str:
        """The value to 3 significant digits with its origin, for a legend or a one-line summary."""
        return f"{self.value:.3g} ({self.origin})"

    def lines(self, width: int = 100) -> list[str]:
        """A readable account for a terminal: the value and origin, then the interval and the provenance
        wrapped and indented."""
        import textwrap

        out = [f"threshold {self.value:.3g} on the {self.quantile:g} quantile of alpha: {self.origin}"]
        if self.interval is not None and None not in self.interval:
            out.append(f"  95% interval {self.interval[0]:.3g}-{self.interval[1]:.3g}")
        if self.provenance:
            out += textwrap.wrap(self.provenance, width, initial_indent="  ", subsequent_indent="    ")
        return out


def resolve_threshold(threshold: float | None, threshold_file: Path | None, quantile: float | None,
                      model: str | None = None) -> ResolvedThreshold:
    """The one threshold rule every command follows: given, else from a threshold artifact, else the
    calibration shipped for `model` (a preset name) at this quantile, else the published prior. A
    quantile of None is the artifact's, else the default. Refusals are one-sentence ScheduleErrors."""
    from sparrow.schemas import read_artifact

    from .core.schedule import ScheduleError, check_quantile, check_threshold

    if threshold_file is not None:
        rows = read_artifact(threshold_file, "threshold").to_pylist()
        if len(rows) != 1:
            raise ScheduleError(f"{threshold_file} has {len(rows)} rows, expected one threshold")
        row = rows[0]
        if quantile is not None and abs(quantile - row["quantile"]) > 1e-12:
            raise ScheduleError(f"--quantile {quantile:g} differs from the quantile {row['quantile']:g} "
                                f"that {threshold_file} was calibrated at")
        resolved = ResolvedThreshold(row["threshold"], row["quantile"], f"{row['source']}, {threshold_file}",
                                     interval=(row["lower"], row["upper"]))
    else:
        quantile = TAIL_QUANTILE if quantile is None else quantile
        shipped = None if threshold is not None else shipped_threshold(model, quantile)
        if threshold is not None:
            resolved = ResolvedThreshold(threshold, quantile, "given")
        elif shipped is not None:
            resolved = ResolvedThreshold(shipped.threshold, quantile, f"shipped calibration for {model}",
                                         shipped.provenance.get("provenance", "no provenance"),
                                         (shipped.lower, shipped.upper))
        else:
            resolved = ResolvedThreshold(PRIOR_THRESHOLD, quantile, "published prior", PRIOR_NOTE,
                                         PRIOR_RANGE)
    check_threshold(resolved.value)
    check_quantile(resolved.quantile)
    return resolved


def fallback(model: str | None, quantile: float, why: str, runs: list[RunResult]) -> Calibration:
    """Where the runs do not calibrate: the model's shipped calibration, else the published prior."""
    if (shipped := shipped_threshold(model, quantile)) is not None:
        return replace(shipped, note=f"{shipped.note}; the given runs do not calibrate: {why}", runs=runs)
    return Calibration(PRIOR_THRESHOLD, *PRIOR_RANGE, "prior", f"{PRIOR_NOTE} ({why})", runs)


def calibrate(runs: list[RunResult], quantile: float = TAIL_QUANTILE, n_boot: int = 2000,
              seed: int = 0, model: str | None = None) -> Calibration:
    """The threshold from the runs' tails (and, beside it, the boundary their means would give)."""
    if not runs:
        return fallback(model, quantile, "no runs given", [])
    collapsed = np.array([r.collapsed for r in runs])
    point, lower, upper, note = fit(np.array([r.tail for r in runs]), collapsed, "tails", n_boot, seed)
    m_point, m_lower, m_upper, m_note = fit(np.array([r.mean for r in runs]), collapsed, "mean alpha",
                                            n_boot, seed)
    mean_note = (f"The mean of alpha separates the runs too: boundary {m_point:.4f} "
                 f"[{m_lower:.4f}, {m_upper:.4f}] ({m_note})" if m_point is not None
                 else f"The mean of alpha does not separate the runs: {m_note}")
    cal = (Calibration(point, lower, upper, "calibrated", note, runs) if point is not None
           else fallback(model, quantile, note, runs))
    return replace(cal, mean_threshold=m_point, mean_note=mean_note)


def _run_files(run_dir: Path) -> tuple[Path, Path]:
    from sparrow.schemas import ArtifactError, artifact_kind

    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir}: run directory does not exist")
    files = {p: artifact_kind(p) for p in sorted(run_dir.glob("*.parquet"))}
    metrics = [p for p, k in files.items() if k == "metrics"]
    schedules = [p for p, k in files.items() if k == "schedule"]
    if len(metrics) == 1 and not schedules:
        from sparrow.schemas import artifact_metadata

        sparsity = json.loads(artifact_metadata(metrics[0]).get("config") or "{}").get("sparsity", "")
        if str(sparsity).split(":", 1)[0] in ("snapkv", "rkv"):
            raise ArtifactError(f"{run_dir}: the run rolled out with KV compression ({sparsity}); "
                                "calibrate-threshold fits block top-k's tail threshold, which eviction runs "
                                "do not inform")
    if len(metrics) != 1 or len(schedules) != 1:
        raise ArtifactError(f"{run_dir}: a run directory needs exactly one metrics and one schedule "
                            f"artifact, found {len(metrics)} and {len(schedules)}")
    return metrics[0], schedules[0]


REFERENCE_FREE = {"sparsity", "schedule_sha256", "correction", "distill_sparse", "distill_rank",
                  "distill_alpha", "distill_lr_ratio", "distill_kl_coef", "steps", "checkpoint_every",
                  "eval_every", "device", "random_weights", "gradient_checkpointing"}


def _config_key(config: dict, with_seed: bool) -> str:
    """What a dense reference must share with a run: the whole configuration but the sampler and the
    options that do not change what is learned (and, for the seed spread, the seed)."""
    drop = REFERENCE_FREE | (set() if with_seed else {"seed"})
    return json.dumps({k: v for k, v in config.items() if k not in drop}, sort_keys=True)


def load_runs(run_dirs: list[Path], mismatch: pa.Table, quantile: float, det: Detectors
              ) -> list[RunResult]:
    """Run directories -> labels, tails and means; each sparse run is also judged against the dense run
    of its configuration and seed among `run_dirs`, when there is one. Every directory is read and
    checked before any is labelled."""
    from sparrow.schemas import ArtifactError, artifact_metadata, read_artifact

    loaded = []
    for run_dir in run_dirs:
        metrics_path, schedule_path = _run_files(run_dir)
        table = read_artifact(metrics_path, "metrics")
        if table.num_rows == 0:
            raise ArtifactError(f"{metrics_path}: the metrics artifact has no steps")
        try:
            config = json.loads(artifact_metadata(metrics_path).get("config") or "{}")
        except ValueError:
            config = {}
        loaded.append((run_dir, table, Schedule.from_artifact(schedule_path), config))
    dense = [(d, t, c) for d, t, _, c in loaded if c.get("sparsity") == "dense"]
    results = []
    for run_dir, table, schedule, config in loaded:
        tail, mean, notes = run_statistics(mismatch, schedule, quantile)
        reasons, reference = collapse_reasons(table, det), None
        if config and config.get("sparsity") != "dense":
            same = [(d, t) for d, t, c in dense if _config_key(c, True) == _config_key(config, True)]
            seeds = [t for _, t, c in dense if _config_key(c, False) == _config_key(config, False)]
            if same:
                reference = str(same[0][0])
                reasons += reference_reasons(table, same[0][1], seeds, config.get("seed", 0), det)
        results.append(RunResult(str(run_dir), tail, reasons, notes, mismatch_warnings(table, det), mean,
                                 reference))
    return results


def threshold_table(cal: Calibration, quantile: float) -> dict[str, list]:
    return {
        "threshold": [cal.threshold], "lower": [cal.lower], "upper": [cal.upper],
        "quantile": [quantile], "source": [cal.source], "n_runs": [len(cal.runs)],
        "n_collapsed": [sum(r.collapsed for r in cal.runs)], "note": [cal.note],
    }
