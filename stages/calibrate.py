"""`calibrate-threshold`: relate the stability of past runs to their tail mismatch.

Runs are labelled stable or collapsed by what training did (their dense held-out accuracy against
their own start and their dense reference, their own curves, and their reward once the sampler's own
step-0 gap is added back), never by their mismatch, so that the threshold fitted to the labels is not
circular. The threshold is the midpoint of the identified set (the gap between the highest collapsed
and the lowest stable tail) with a bootstrap interval over the profile's prompts and their tokens; the
mean of alpha and the share of the KV read get the same test beside it. Where the runs do not separate,
the shipped calibration or the prior. docs/calibration.md gives the rules.

Every statistic's verdict reads one way (Separation.line), in the threshold's note, the mean's and the KV
read's lines and each margin's alike: `tails: no separation, no run collapsed`, or its boundary and
identified set; no parenthesis inside another, so that a line can be found by what it says.

The published prior is a rule on the per-bin 5th percentile (PRIOR_QUANTILE): at any other quantile it is
refused, never applied, and a threshold must be given or calibrated. Its published range (0.85-0.90) is no
confidence interval, so a prior's `lower` and `upper` are null and the range is said as a range.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .core.definitions import PRIOR_QUANTILE, PRIOR_THRESHOLD, TAIL_QUANTILE
from .core.schedule import Schedule, ScheduleError
from .train.detectors import Detectors, InitialEval, collapse_reasons, metric, mismatch_warnings

PRIOR_RANGE = (0.85, 0.90)  # the published 'between 0.85 and 0.90': a range, not an interval
PRIOR_NOTE = "published prior (Sparrow, arXiv 2606.08446): keep the per-bin 5th percentile above 0.86"


def range_words(low: float, high: float) -> str:
    """A published range as one, never as an interval: none was published."""
    return f"published range {low:.2f}-{high:.2f} (no confidence interval was published)"


PRIOR_RANGE_NOTE = range_words(*PRIOR_RANGE)


@dataclass(frozen=True)
class ProfileTokens:
    """A mismatch profile as one row per profiled token: alpha at every profiled budget [n, m], with the
    token's prompt, position and bin, so that any schedule's per-token alpha is a lookup, and a
    bootstrap over prompts (and tokens within a prompt) is an index array."""

    budgets: np.ndarray  # [m] profiled budgets, increasing
    alpha: np.ndarray  # [n, m]
    prompt: np.ndarray  # [n] prompt index
    position: np.ndarray  # [n] cache length when the token was produced
    bins: np.ndarray  # [n]

    COLUMNS: ClassVar[tuple[str, ...]] = ("prompt_id", "sample", "position", "bin", "budget", "alpha")

    @classmethod
    def from_table(cls, mismatch: pa.Table) -> ProfileTokens:
        """From a mismatch table with (at least) COLUMNS: its rows sorted once, by budget, then prompt, sample
        and position, on integer keys."""
        budget = mismatch.column("budget").to_numpy()
        budgets, per_budget = np.unique(budget, return_counts=True)
        if not len(budgets):
            raise ValueError("the mismatch profile has no tokens")
        keys = np.stack([_sorted_codes(mismatch.column("prompt_id")), mismatch.column("sample").to_numpy(),
                         mismatch.column("position").to_numpy()])  # [3, rows]
        order = np.lexsort((keys[2], keys[1], keys[0], budget))
        n = int(per_budget[0])
        keys = keys[:, order].reshape(3, len(budgets), n) if (per_budget == n).all() else None
        if keys is None or (keys != keys[:, :1]).any():
            raise ValueError("the mismatch profile does not score the same tokens at every budget")
        alpha = mismatch.column("alpha").to_numpy().astype(float)[order].reshape(len(budgets), n).T
        first = order[:n]  # the rows of the smallest budget, in the shared order
        return cls(budgets.astype(np.int64), alpha, keys[0, 0], mismatch.column("position").to_numpy()[first],
                   mismatch.column("bin").to_numpy()[first])

    def below_profiled(self, schedule: Schedule) -> list[int]:
        """The budgets `schedule` gives profiled tokens that are below every profiled budget: no profiled
        budget bounds their alpha from below."""
        want = schedule.budgets_at(self.position)
        return sorted(set(want[(want > 0) & (want < self.budgets[0])].tolist()))

    def at(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(alpha, kv_read, notes) per token at `schedule`'s budget for its position. A budget that was not
        profiled reads its alpha at the largest profiled budget below it (a lower bound on its alpha, a
        larger budget never being worse), and a note says so; its kv_read stays its own (min(1, budget /
        position): the share of the cache the run read). Dense tokens have alpha 1 and read the whole
        cache. A budget below every profiled one has no lower bound and is refused (ArtifactError)."""
        from sparrow.schemas import ArtifactError

        want = schedule.budgets_at(self.position)
        if below := self.below_profiled(schedule):
            raise ArtifactError(f"budgets {below} are below every profiled budget "
                                f"({', '.join(map(str, self.budgets.tolist()))}), so no profiled budget "
                                "bounds their alpha from below")
        col = np.clip(np.searchsorted(self.budgets, want, "right") - 1, 0, None)
        stand_in = {b: int(self.budgets[np.searchsorted(self.budgets, b, "right") - 1])
                    for b in sorted(set(want[(want > 0) & ~np.isin(want, self.budgets)].tolist()))}
        notes = [f"budget {b} not profiled: its tail and mean alpha are budget {below}'s (the next profiled "
                 f"below, a lower bound), its KV read is budget {b}'s" for b, below in stand_in.items()]
        alpha = np.where(want == 0, 1.0, self.alpha[np.arange(len(want)), col])
        kv_read = np.where(want == 0, 1.0, np.minimum(1.0, want / np.maximum(self.position, 1)))
        return alpha, kv_read, notes

    @property
    def num_prompts(self) -> int:
        """The distinct prompts the bootstrap draws from."""
        return int(self.prompt.max()) + 1 if len(self.prompt) else 0

    def resample(self, rng: np.random.Generator) -> np.ndarray:
        """Token indices of one bootstrap draw: prompts with replacement, then tokens within each drawn
        prompt with replacement."""
        order = np.argsort(self.prompt, kind="stable")
        counts = np.bincount(self.prompt)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        drawn = rng.integers(0, len(counts), len(counts))
        sizes = counts[drawn]
        within = (rng.random(int(sizes.sum())) * np.repeat(sizes, sizes)).astype(int)
        return order[np.repeat(starts[drawn], sizes) + within]


def tail_of(alpha: np.ndarray, bins: np.ndarray, quantile: float) -> float:
    """The min over position bins of the q-quantile of alpha."""
    return float(min(np.quantile(alpha[bins == b], quantile) for b in np.unique(bins)))


def run_statistics(mismatch: pa.Table | ProfileTokens, schedule: Schedule, quantile: float = TAIL_QUANTILE
                   ) -> tuple[float, float, list[str]]:
    """(tail, mean, notes): the min over bins of the q-quantile of alpha, and the mean of alpha, each
    profiled token scored at its schedule budget (ProfileTokens.at)."""
    tokens = mismatch if isinstance(mismatch, ProfileTokens) else ProfileTokens.from_table(mismatch)
    alpha, _, notes = tokens.at(schedule)
    if bool((schedule.budgets_at(tokens.position) == 0).all()):
        notes = notes + ["the schedule is dense wherever the profile has tokens"]
    return tail_of(alpha, tokens.bins, quantile), float(alpha.mean()), notes


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
                      det: Detectors = Detectors(), sampler_gap: float | None = None) -> list[str]:
    """Why a run did worse than its dense reference (the dense run of its configuration and seed),
    compared at the run's last step, beyond the seed spread of `dense_runs` (all seeds): its dense eval
    accuracy, and its training reward once the sampler's own step-0 gap (`sampler_gap`: dense minus
    sparse sampled reward before any update) is added back, so that a gap present before training did
    anything is never counted. Without a step-0 gap the reward is not compared."""
    last, reasons = pc.max(metrics.column("step")).as_py(), []
    checks = [("eval accuracy", last_eval, det.eval_margin, 0.0)]
    if sampler_gap is not None:
        checks.insert(0, ("reward", final_reward, det.reward_margin, sampler_gap))
    for name, value, floor, gap in checks:
        mine, ref = value(metrics, last, det), value(reference, last, det)
        if mine is None or ref is None:
            continue
        finals = [f for d in dense_runs if (f := value(d, last, det)) is not None]
        spread = max(finals) - min(finals) if len(finals) > 1 else 0.0
        margin = max(floor, spread)
        if mine + gap < ref - margin:
            shown = f"{mine:.3f} + step-0 sampler gap {gap:.3f}" if name == "reward" else f"{mine:.3f}"
            reasons.append(f"{name} {shown} below the dense run's {ref:.3f} (seed {seed}) by more than "
                           f"{margin:.3f} (seed spread {spread:.3f}, floor {floor:g})")
    return reasons


def _sorted_codes(values: pa.ChunkedArray) -> np.ndarray:
    """Each value's index among the sorted distinct values (np.unique's inverse), without a Python string
    per row: a profile has millions of tokens and a few hundred prompts."""
    encoded = pc.dictionary_encode(values.combine_chunks())
    rank = np.empty(len(encoded.dictionary), dtype=np.int64)
    rank[np.argsort(encoded.dictionary.to_numpy(zero_copy_only=False), kind="stable")] = np.arange(len(rank))
    return rank[encoded.indices.to_numpy(zero_copy_only=False)]


@dataclass
class RunResult:
    name: str  # the run directory as given (two runs may share a folder name)
    tail: float
    reasons: list[str]  # each names the rule that fired; [] = stable
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mean: float = float("nan")
    reference: str | None = None  # the dense run it was compared with
    kv_read: float = float("nan")  # mean share of the cache each profiled token reads at its budget
    schedule: Schedule | None = None
    sampler_gap: float | None = None  # step 0: dense minus the run's sampler's sampled eval reward
    eval_change: float | None = None  # last dense eval accuracy minus step 0's
    reward_gap: float | None = None  # the dense reference's final reward minus this run's
    seed: int | None = None
    correction: str | None = None

    @property
    def collapsed(self) -> bool:
        return bool(self.reasons)


@dataclass
class Separation:
    """How one run statistic (tail, mean alpha, KV read) relates to the labels."""

    what: str
    point: float | None  # midpoint of the identified set; None: the runs do not separate
    identified: tuple[float, float] | None  # (highest collapsed, lowest stable) when they separate
    lower: float | None  # 95% bootstrap interval of the midpoint over the draws in which the runs separate
    upper: float | None
    separating_share: float | None  # the share of bootstrap draws in which the runs separate
    note: str
    seed: int | None = None  # of the bootstrap draws

    def line(self) -> str:
        """`what: verdict`, the one form of every statistic's line: `tails: no separation, no run
        collapsed`, or its boundary, identified set and interval."""
        if self.point is None:
            return f"{self.what}: no separation, {self.note}"
        interval = (f", 95% interval {self.lower:.4f}-{self.upper:.4f} over the bootstrap draws in which "
                    f"the runs separate, {self.separating_share:.0%} of them"
                    if self.lower is not None else "")
        return (f"{self.what}: boundary {self.point:.4f}, identified set [{self.identified[0]:.4f}, "
                f"{self.identified[1]:.4f}]{interval}; {self.note}")


@dataclass
class Calibration:
    threshold: float
    lower: float | None
    upper: float | None
    source: str  # "prior" | "calibrated"
    note: str
    runs: list[RunResult]
    mean_threshold: float | None = None  # the same boundary on the mean of alpha; None: no separation
    mean_note: str = ""  # the mean's line (Separation.line)
    provenance: dict = field(default_factory=dict)  # a shipped calibration's metadata (model, task, runs)
    separations: list[Separation] = field(default_factory=list)  # tail, mean alpha, KV read


def boundary(stats: np.ndarray, collapsed: np.ndarray) -> float | None:
    """Midpoint of the gap between collapsed and stable statistics; None if they do not separate."""
    if collapsed.all() or not collapsed.any():
        return None
    hi_c, lo_s = stats[collapsed].max(), stats[~collapsed].min()
    return None if hi_c >= lo_s else float((hi_c + lo_s) / 2)


MIN_SEPARATING_SHARE = 0.5  # calibrated only if the runs separate in at least this share of the draws


def separation(stats: np.ndarray, draws: np.ndarray | None, collapsed: np.ndarray, what: str,
               seed: int | None = None) -> Separation:
    """The boundary of one statistic at the profile as measured, and over bootstrap `draws` [n_boot, runs]
    of the statistic (None: no profile to resample; `seed`: what drew them), the labels held fixed. The
    interval is the 2.5-97.5% quantiles of the boundaries of the draws in which the runs separate (a
    draw that does not separate has no boundary), so it is conditional on separating; the share of such
    draws is reported beside it."""
    point = boundary(stats, collapsed)
    n_c, n_s = int(collapsed.sum()), int((~collapsed).sum())
    if point is None:
        why = ("all runs collapsed" if n_s == 0 else "no run collapsed" if n_c == 0
               else f"collapsed runs up to {stats[collapsed].max():.4f} overlap stable runs from "
                    f"{stats[~collapsed].min():.4f}")
        return Separation(what, None, None, None, None, None, why)
    identified = (float(stats[collapsed].max()), float(stats[~collapsed].min()))
    note = (f"{n_c} collapsed run{'s' * (n_c > 1)} <= {identified[0]:.4f}, {n_s} stable run{'s' * (n_s > 1)} "
            f">= {identified[1]:.4f}")
    if draws is None:
        return Separation(what, point, identified, None, None, None, note + "; no profile to resample")
    boots = [b for d in draws if (b := boundary(d, collapsed)) is not None]
    share = len(boots) / len(draws)
    lower, upper = (np.quantile(boots, [0.025, 0.975]) if boots else (np.nan, np.nan))
    return Separation(what, point, identified, float(lower), float(upper), share,
                      note + f"; {len(draws)} bootstrap draws from seed {seed} over the profile's prompts "
                      "and their tokens", seed)


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
    interval: tuple[float, float] | None = None  # a calibration's 95% bootstrap interval
    published_range: tuple[float, float] | None = None  # the prior's stated range (no interval)

    @classmethod
    def prior(cls, quantile: float) -> ResolvedThreshold:
        """The published prior, refused at a quantile it is not stated on (check_prior_quantile)."""
        check_prior_quantile(quantile)
        return cls(PRIOR_THRESHOLD, quantile, "published prior", PRIOR_NOTE, published_range=PRIOR_RANGE)

    @property
    def source(self) -> str:
        """Origin and provenance on one line (for an artifact's metadata), the origin said once where the
        provenance opens with it (the published prior's)."""
        if not self.provenance or self.provenance.startswith(self.origin):
            return self.provenance or self.origin
        return f"{self.origin} ({self.provenance})"

    @property
    def short(self) -> str:
        """The value to 3 significant digits with its origin, for a legend or a one-line summary."""
        return f"{self.value:.3g} ({self.origin})"

    def lines(self, width: int = 100) -> list[str]:
        """A readable account for a terminal: the value and origin, then the interval and the provenance
        wrapped and indented, then a prior's published range."""
        import textwrap

        out = [f"threshold {self.value:.3g} on the {self.quantile:g} quantile of alpha: {self.origin}"]
        if self.interval is not None and None not in self.interval:
            out.append(f"  95% interval {self.interval[0]:.3g}-{self.interval[1]:.3g}")
        told = self.provenance.removeprefix(self.origin).strip() if (
            self.provenance.startswith(self.origin)) else self.provenance  # the origin is on the first line
        if told:
            out += textwrap.wrap(told, width, initial_indent="  ", subsequent_indent="    ")
        if self.published_range is not None:
            out.append(f"  {range_words(*self.published_range)}")
        return out


def resolve_threshold(threshold: float | None, threshold_file: Path | None, quantile: float | None,
                      model: str | None = None) -> ResolvedThreshold:
    """The one threshold rule every command follows: given, else from a threshold artifact, else the
    calibration shipped for `model` (a preset name) at this quantile, else the published prior. A
    quantile of None is the artifact's, else the default. Refusals are one-sentence ScheduleErrors."""
    from sparrow.schemas import input_name, read_artifact

    from .core.schedule import check_quantile, check_threshold

    if threshold_file is not None:
        given = input_name(threshold_file)  # `-` for stdin, never the spooled copy that is gone at exit
        rows = read_artifact(threshold_file, "threshold").to_pylist()
        if len(rows) != 1:
            raise ScheduleError(f"{given} has {len(rows)} rows, expected one threshold")
        row = rows[0]
        if quantile is not None and abs(quantile - row["quantile"]) > 1e-12:
            raise ScheduleError(f"--quantile {quantile:g} differs from the quantile {row['quantile']:g} "
                                f"that {given} was calibrated at")
        if row["source"] == "prior":
            if abs(row["quantile"] - PRIOR_QUANTILE) > 1e-12:
                raise ScheduleError(f"{given} holds the published prior {row['threshold']:g} under the "
                                    f"{row['quantile']:g} quantile, but the prior is a threshold on the "
                                    f"{PRIOR_QUANTILE:g} quantile of alpha only; give a threshold for the "
                                    f"{row['quantile']:g} quantile")
            resolved = ResolvedThreshold(row["threshold"], row["quantile"], f"prior, {given}", PRIOR_NOTE,
                                         published_range=PRIOR_RANGE)
        else:
            resolved = ResolvedThreshold(row["threshold"], row["quantile"], f"{row['source']}, {given}",
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
            check_quantile(quantile)  # a quantile out of range is refused as such, not as the prior's
            resolved = ResolvedThreshold.prior(quantile)
    check_threshold(resolved.value)
    check_quantile(resolved.quantile)
    return resolved


def check_prior_quantile(quantile: float) -> None:
    """The published prior is a threshold on the PRIOR_QUANTILE of alpha: at another quantile it is
    refused in one sentence (ScheduleError), never applied."""
    if abs(quantile - PRIOR_QUANTILE) > 1e-12:
        raise ScheduleError(f"the published prior {PRIOR_THRESHOLD:g} is a threshold on the "
                            f"{PRIOR_QUANTILE:g} quantile of alpha, not on the {quantile:g} quantile; give "
                            f"--threshold for the {quantile:g} quantile")


def fallback(model: str | None, quantile: float, why: str, runs: list[RunResult]) -> Calibration:
    """Where the runs do not calibrate: the model's shipped calibration at `quantile`, else the published
    prior, which exists at PRIOR_QUANTILE only: at another quantile nothing stands in, and the refusal
    (ScheduleError) says why the runs did not calibrate. The prior's lower and upper are null: its range
    was published, no interval."""
    if (shipped := shipped_threshold(model, quantile)) is not None:
        return replace(shipped, note=f"{shipped.note}; {why}", runs=runs)
    if abs(quantile - PRIOR_QUANTILE) > 1e-12:
        raise ScheduleError(f"--quantile {quantile:g}: the runs do not calibrate a threshold ({why}), and "
                            f"the published prior {PRIOR_THRESHOLD:g} stands in only at the "
                            f"{PRIOR_QUANTILE:g} quantile of alpha; give runs whose tails separate, or "
                            f"--quantile {PRIOR_QUANTILE:g}")
    return Calibration(PRIOR_THRESHOLD, None, None, "prior", f"{PRIOR_NOTE}; {PRIOR_RANGE_NOTE}; {why}",
                       runs)


def bootstrap_statistics(runs: list[RunResult], tokens: ProfileTokens, quantile: float, n_boot: int,
                         seed: int, progress: Callable[[int, int], None] | None = None
                         ) -> dict[str, np.ndarray]:
    """[n_boot, runs] of each statistic (tail, mean, kv_read) over draws of the profile's prompts and
    their tokens (ProfileTokens.resample); runs that share a schedule share their values. `progress`
    hears (draws done, n_boot)."""
    per_schedule: dict[Schedule, tuple[np.ndarray, np.ndarray]] = {}
    for r in runs:
        if r.schedule not in per_schedule:
            alpha, kv, _ = tokens.at(r.schedule)
            per_schedule[r.schedule] = (alpha, kv)
    rng = np.random.default_rng(seed)
    out = {k: np.empty((n_boot, len(runs))) for k in ("tail", "mean", "kv_read")}
    for i in range(n_boot):
        idx = tokens.resample(rng)
        values = {s: (tail_of(a[idx], tokens.bins[idx], quantile), a[idx].mean(), kv[idx].mean())
                  for s, (a, kv) in per_schedule.items()}
        for j, r in enumerate(runs):
            out["tail"][i, j], out["mean"][i, j], out["kv_read"][i, j] = values[r.schedule]
        if progress is not None:
            progress(i + 1, n_boot)
    return out


def calibrate(runs: list[RunResult], quantile: float = TAIL_QUANTILE, n_boot: int = 2000,
              seed: int = 0, model: str | None = None, tokens: ProfileTokens | None = None,
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """The threshold from the runs' tails, with the identified set and a bootstrap interval over the
    profile's prompts (`tokens`; none without it), and the same boundary on the mean of alpha and on
    the share of the KV read, so that one sees which of them separates stable from collapsed runs. A
    threshold is calibrated only where the tails separate the runs and do so in at least half the
    draws; otherwise the shipped calibration or the prior, saying why."""
    if not runs:
        return fallback(model, quantile, "no runs given", [])
    collapsed = np.array([r.collapsed for r in runs])
    draws = (bootstrap_statistics(runs, tokens, quantile, n_boot, seed, progress)
             if tokens is not None and n_boot > 0 and all(r.schedule is not None for r in runs) else None)
    seps = [separation(np.array([getattr(r, key) for r in runs]), None if draws is None else draws[key],
                       collapsed, what, seed)
            for key, what in (("tail", "tails"), ("mean", "mean alpha"), ("kv_read", "KV read"))]
    tail, mean = seps[0], seps[1]
    if tail.point is None:
        cal = fallback(model, quantile, tail.line(), runs)
    elif tail.separating_share is not None and tail.separating_share < MIN_SEPARATING_SHARE:
        cal = fallback(model, quantile, f"{tail.what}: separation as measured, but in only "
                       f"{tail.separating_share:.0%} of the bootstrap draws over prompts", runs)
    else:
        cal = Calibration(tail.point, tail.lower, tail.upper, "calibrated", tail.line(), runs)
    return replace(cal, mean_threshold=mean.point, mean_note=mean.line(), separations=seps)


def margin_sensitivity(loaded: list[LoadedRun], results: list[RunResult], det: Detectors,
                       margins: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2)) -> list[str]:
    """One line per margin (reward and eval margins both set to it): how many of the runs (`results`,
    labelled from `loaded` in the same order) collapse, and whether their tails separate them, and where.
    Only the labels change with the margin; the tails are the results'."""
    tails = np.array([r.tail for r in results])
    lines = []
    for m in margins:
        at = replace(det, reward_margin=m, eval_margin=m)
        collapsed = np.array([bool(judge(run, loaded, at).reasons) for run in loaded])
        sep = separation(tails, None, collapsed, "tails")
        verdict = (f"{sep.what}: identified set [{sep.identified[0]:.4f}, {sep.identified[1]:.4f}]"
                   if sep.point is not None else sep.line())
        lines.append(f"margin {m:g}: {int(collapsed.sum())} of {len(loaded)} runs collapsed; {verdict}")
    return lines


def _run_files(run_dir: Path) -> tuple[Path, Path]:
    from sparrow.schemas import ArtifactError, artifact_kind

    if run_dir.exists() and not run_dir.is_dir():
        raise ArtifactError(f"{run_dir} is a file, not a run directory (a directory with a metrics and a "
                            "schedule artifact)")
    if not run_dir.is_dir():
        raise ArtifactError(f"{run_dir}: run directory does not exist")
    files = {p: artifact_kind(p) for p in sorted(run_dir.glob("*.parquet"))}
    metrics = [p for p, k in files.items() if k == "metrics"]
    schedules = [p for p, k in files.items() if k == "schedule"]
    if len(metrics) == 1:
        _check_sparse_rollouts(run_dir, metrics[0])
    if len(metrics) != 1 or len(schedules) != 1:
        raise ArtifactError(f"{run_dir}: a run directory needs exactly one metrics and one schedule "
                            f"artifact, found {len(metrics)} and {len(schedules)}")
    return metrics[0], schedules[0]


def _check_sparse_rollouts(run_dir: Path, metrics: Path) -> None:
    """A run is labelled by what its sparse rollouts did to training: a run that rolled out with KV
    compression (eviction) or with --speculate (the dense policy's exact samples) has no block top-k
    rollouts whose tail its stability could speak for, so it is refused in one sentence."""
    from sparrow.schemas import ArtifactError, artifact_metadata

    try:
        config = json.loads(artifact_metadata(metrics).get("config") or "{}")
    except ValueError:
        return  # read_runs reads it again, as a run without a configuration
    if not isinstance(config, dict):
        return
    sparsity = config.get("sparsity", "")
    if str(sparsity).split(":", 1)[0] in ("snapkv", "rkv"):
        raise ArtifactError(f"{run_dir}: the run rolled out with KV compression ({sparsity}); "
                            "calibrate-threshold fits block top-k's tail threshold, which eviction runs "
                            "do not inform")
    if config.get("speculate"):
        raise ArtifactError(f"{run_dir}: the run rolled out with --speculate {config['speculate']}, the "
                            "dense policy's exact samples; calibrate-threshold fits block top-k's tail "
                            "threshold, which speculative runs do not inform (their sparse attention only "
                            "drafted)")


REFERENCE_FREE = {"sparsity", "schedule_sha256", "correction", "distill_sparse", "distill_rank",
                  "distill_alpha", "distill_lr_ratio", "distill_kl_coef", "steps", "checkpoint_every",
                  "eval_every", "device", "random_weights", "gradient_checkpointing", "threads",
                  "speculate"}  # a --speculate run itself is refused (_check_sparse_rollouts)


def _config_key(config: dict, with_seed: bool) -> str:
    """What a dense reference must share with a run: the whole configuration but the sampler and the
    options that do not change what is learned (and, for the seed spread, the seed)."""
    from dataclasses import fields

    from .train.config import TrainConfig

    drop = REFERENCE_FREE | (set() if with_seed else {"seed"})
    # an option a run's version did not have yet takes its default (a run written before it was added)
    defaults = {f.name: f.default for f in fields(TrainConfig) if not callable(f.default_factory)}
    full = {k: v for k, v in defaults.items() if k in config or isinstance(v, (int, float, str, bool))}
    full.update(config)
    return json.dumps({k: v for k, v in full.items() if k not in drop}, sort_keys=True, default=str)


@dataclass
class LoadedRun:
    """A run directory read and checked: its metrics, schedule, configuration and step-0 eval."""

    name: str
    metrics: pa.Table
    schedule: Schedule
    config: dict
    initial: InitialEval | None


def read_runs(run_dirs: list[Path]) -> list[LoadedRun]:
    """Every run directory read and checked (before any is labelled)."""
    from sparrow.schemas import ArtifactError, artifact_metadata, read_artifact

    loaded = []
    for run_dir in run_dirs:
        metrics_path, schedule_path = _run_files(run_dir)
        table = read_artifact(metrics_path, "metrics")
        if table.num_rows == 0:
            raise ArtifactError(f"{metrics_path}: the metrics artifact has no steps")
        meta = artifact_metadata(metrics_path)
        try:
            config = json.loads(meta.get("config") or "{}")
        except ValueError:
            config = {}
        loaded.append(LoadedRun(str(run_dir), table, Schedule.from_artifact(schedule_path), config,
                                InitialEval.from_metadata(meta)))
    return loaded


def check_run_models(loaded: list[LoadedRun], profiled: object, profile: str = "the profile") -> None:
    """Every run trained the model the profile measured (its config's model against the profile's
    metadata, by name: a preset's, or a checkpoint's folder or file name, since a run records the path it
    was given, relative or not): a run of another model scored on this profile's tails would be labelled
    against a mismatch it never had. A run or a profile that records no model is taken as the other's
    (ArtifactError)."""
    from sparrow.schemas import ArtifactError

    from .model.names import same_model

    if not profiled:
        return
    for run in loaded:
        trained = run.config.get("model")
        if not same_model(trained, str(profiled)):
            raise ArtifactError(f"{run.name} trained {trained} (its metrics' config), but {profile} was "
                                f"measured on {profiled}; give runs and a profile of one model")


@dataclass
class Verdict:
    """What training did to a run: the reasons it collapsed ([] = stable), the dense run it was compared
    with, the reward gap to it (dense minus this run, final smoothed rewards) and notes."""

    reasons: list[str]
    reference: str | None = None
    reward_gap: float | None = None
    notes: list[str] = field(default_factory=list)


def judge(run: LoadedRun, loaded: list[LoadedRun], det: Detectors) -> Verdict:
    """`run` by its own curves and dense eval against its start, and, when a dense run of its
    configuration and seed is among `loaded`, against that run (reference_reasons)."""
    start = run.initial.accuracy if run.initial else None
    verdict = Verdict(collapse_reasons(run.metrics, det, start_eval=start))
    if not run.config or run.config.get("sparsity") == "dense":
        return verdict
    dense = [d for d in loaded if d.config.get("sparsity") == "dense"]
    same = [d for d in dense if _config_key(d.config, True) == _config_key(run.config, True)]
    if not same:
        return verdict
    seeds = [d.metrics for d in dense if _config_key(d.config, False) == _config_key(run.config, False)]
    gap = run.initial.sampler_gap if run.initial else None
    verdict.reference = same[0].name
    verdict.reasons += reference_reasons(run.metrics, same[0].metrics, seeds, run.config.get("seed", 0), det,
                                         gap)
    last = pc.max(run.metrics.column("step")).as_py()
    mine, ref = final_reward(run.metrics, last, det), final_reward(same[0].metrics, last, det)
    verdict.reward_gap = None if mine is None or ref is None else ref - mine
    if gap is None:
        verdict.notes.append("no step-0 sampler reward logged: the reward is not compared with the dense "
                             "run's")
    return verdict


def check_profiled(loaded: list[LoadedRun], tokens: ProfileTokens, profile: str = "the profile") -> None:
    """Every run's budgets have a profiled budget at or below them (ProfileTokens.at reads a budget not
    profiled at the next profiled one below, a lower bound on its alpha); a run with a budget below every
    profiled one has no such bound, so it is refused in one sentence (ArtifactError) before any run is
    labelled, rather than given a larger budget's, optimistic, tail."""
    from sparrow.schemas import ArtifactError

    for run in loaded:
        if below := tokens.below_profiled(run.schedule):
            many = len(below) > 1
            raise ArtifactError(
                f"{run.name}: its schedule's budget{'s' * many} {', '.join(map(str, below))} "
                f"{'are' if many else 'is'} below every budget {profile} profiled "
                f"({', '.join(map(str, tokens.budgets.tolist()))}), so no profiled budget bounds its tail "
                f"from below; profile budget {below[0]} (sparrow profile --budgets) or leave the run out")


MIN_BOOTSTRAP_PROMPTS = 5  # fewer prompts cannot support a bootstrap over prompts


def few_prompts_warning(tokens: ProfileTokens, profile: str = "the profile") -> str | None:
    """A warning when the profile has fewer than MIN_BOOTSTRAP_PROMPTS prompts: a bootstrap over so few
    prompts has so few distinct draws that its interval says little about the sampling error."""
    n = tokens.num_prompts
    if n >= MIN_BOOTSTRAP_PROMPTS:
        return None
    return (f"{profile} has {n} prompt{'s' * (n != 1)}, fewer than {MIN_BOOTSTRAP_PROMPTS}: a bootstrap over "
            "so few prompts cannot say how the tail varies between prompts, so read its intervals as "
            "rough; profile more prompts (sparrow prompts --n)")


def label_runs(loaded: list[LoadedRun], tokens: ProfileTokens, quantile: float, det: Detectors,
               profile: str = "the profile") -> list[RunResult]:
    """Labels (judge), statistics and outcomes of every run, in order; every run's budgets checked against
    the profiled ones first (check_profiled)."""
    check_profiled(loaded, tokens, profile)
    results = []
    for run in loaded:
        alpha, kv_read, notes = tokens.at(run.schedule)
        verdict = judge(run, loaded, det)
        start = run.initial.accuracy if run.initial else None
        last_acc = last_eval(run.metrics, pc.max(run.metrics.column("step")).as_py(), det)
        results.append(RunResult(
            run.name, tail_of(alpha, tokens.bins, quantile), verdict.reasons, notes + verdict.notes,
            mismatch_warnings(run.metrics, det), float(alpha.mean()), verdict.reference,
            float(kv_read.mean()), run.schedule, run.initial.sampler_gap if run.initial else None,
            None if start is None or last_acc is None else last_acc - start, verdict.reward_gap,
            run.config.get("seed"), run.config.get("correction")))
    return results


def load_runs(run_dirs: list[Path], mismatch: pa.Table, quantile: float, det: Detectors
              ) -> list[RunResult]:
    """Run directories -> labels, statistics and outcomes (read_runs, then label_runs)."""
    return label_runs(read_runs(run_dirs), ProfileTokens.from_table(mismatch), quantile, det)


def threshold_table(cal: Calibration, quantile: float) -> dict[str, list]:
    return {
        "threshold": [cal.threshold], "lower": [cal.lower], "upper": [cal.upper],
        "quantile": [quantile], "source": [cal.source], "n_runs": [len(cal.runs)],
        "n_collapsed": [sum(r.collapsed for r in cal.runs)], "note": [cal.note],
    }
