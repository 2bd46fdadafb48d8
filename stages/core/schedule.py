"""Sparsity schedules: the budget as a non-decreasing, piecewise-constant function of position.

`Schedule.budget_at(cache_len)` is the one place where a position becomes a budget; the generator,
the teacher-forced scorer and the rollout engine all call it with the cache length at which the
token is produced (so the decode step whose query sits at position t uses `budget_at(t + 1)`).
Budget 0 means dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Schedule:
    bin_starts: tuple[int, ...]  # first position of each bin, increasing, starting at 0
    budgets: tuple[int, ...]  # budget per bin (0 = dense)
    page_size: int = 16

    def budget_at(self, cache_len: int) -> int:
        i = int(np.searchsorted(self.bin_starts, cache_len, side="right")) - 1
        return self.budgets[max(i, 0)]

    def budgets_at(self, cache_lens: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.bin_starts), cache_lens, side="right") - 1
        return np.asarray(self.budgets)[np.clip(idx, 0, None)]

    @classmethod
    def constant(cls, budget: int, page_size: int = 16) -> Schedule:
        return cls((0,), (budget,), page_size)

    @classmethod
    def from_artifact(cls, path: str | Path) -> Schedule:
        """A schedule artifact; one with no rows is refused here, where every stage reads schedules, since
        `budget_at` has no bin to answer from (an ArtifactError: the one sentence the CLI prints)."""
        from sparrow.schemas import ArtifactError, artifact_metadata, read_artifact

        table = read_artifact(path, "schedule").sort_by("bin")
        if table.num_rows == 0:
            raise ArtifactError(f"{path} is a schedule with no bins, so it gives no budget at any position; "
                                "plan one with `sparrow plan-schedule`")
        meta = artifact_metadata(table)
        budgets = [0 if b is None else int(b) for b in table.column("budget").to_pylist()]
        starts = [int(s) for s in table.column("bin_start").to_pylist()]
        return cls(tuple(starts), tuple(budgets), _page_size(meta.get("page_size", 16), path))


def _page_size(value: object, path: str | Path) -> int:
    """The page size a schedule's metadata records, a positive whole number; ArtifactError otherwise."""
    from sparrow.schemas import ArtifactError

    try:
        size = int(value) if not isinstance(value, bool) and float(value) == int(value) else 0
    except (TypeError, ValueError, OverflowError):
        size = 0
    if size < 1:
        raise ArtifactError(f"{path}: the schedule's metadata gives page_size {value!r}, expected a positive "
                            "whole number of tokens (plan-schedule writes the profile's page size)")
    return size


# ---------------------------------------------------------------- the planner
#
# A `TailProfile` is the tail statistic (q-quantile of alpha) per position bin and candidate budget,
# non-decreasing in the budget. It comes from a measured `mismatch` artifact (`measured_profile`: the
# candidates are the profiled budgets alone, so every tail a plan reports was measured) or, for the Qwen3
# presets, from the published schedules (`reference_profiles.reference_profile`: every page count, on a
# curve built to give the published budgets at the published thresholds).
# `plan` picks, per bin, the smallest candidate budget whose tail is at or above the threshold; the
# smallest is the cheapest, because a step's cost grows with its budget. Budgets are then made
# non-decreasing across bins (a running maximum), so a bin never gets less than the one before. Given the
# cost of each bin's decode steps (`BinCost`), the plan is the cheapest over the whole rollout instead
# (`_cheapest`): where a budget almost covers the cache, scoring its pages costs more than it saves, and a
# dense bin (and every later one), or a budget that covers the bin and is priced as dense there, can be
# cheaper; the choice is among the budgets the plain rule takes, those that cover a bin, and dense, so it
# is never dearer than the plain plan or than dense.
# A bin where no candidate reaches the threshold is dense (alpha = 1 exactly), and so is every later
# bin. A measured bin with fewer than `min_tokens` tokens has no trustworthy tail: it keeps the
# budget of the bin before it (leading thin bins take the first well-measured bin's budget); both
# cases are reported in `Plan.notes`.

DENSE = np.iinfo(np.int32).max  # sorts above every budget while planning; 0 in a Schedule
# (bin, budgets [k], 0 = dense) -> [k] seconds of the rollout's decode steps in that bin under each budget
BinCost = Callable[[int, np.ndarray], np.ndarray]
MIN_TOKENS = 50  # the fewest tokens a measured bin needs for its tail to be trusted (--min-tokens)


class ScheduleError(ValueError):
    """Input the planner cannot use (a profile that does not cover a bin, a bad threshold, ...)."""


@dataclass(frozen=True)
class TailProfile:
    bin_starts: np.ndarray  # [n] first position of each bin
    bin_width: int
    candidates: np.ndarray  # [m] candidate budgets, increasing multiples of the page size
    tail: np.ndarray  # [n, m] tail statistic, non-decreasing along the budget axis
    quantile: float
    source: str  # "reference:qwen3-4b" or the mismatch file
    page_size: int = 16
    thin: np.ndarray | None = None  # [n] bool: too few tokens to trust (measured profiles)
    tokens: np.ndarray | None = None  # [n] tokens per bin (measured profiles)
    threshold_range: tuple[float, float] | None = None  # thresholds the profile is built from
    min_tokens: int | None = None  # the fewest tokens a measured bin needs to be trusted
    measured: np.ndarray | None = None  # [n, m] a measured profile's tails before the running max: reported

    @property
    def num_bins(self) -> int:
        return len(self.bin_starts)


@dataclass
class Plan:
    schedule: Schedule
    bin_width: int
    tails: list[float | None]  # tail at the chosen budget (1.0 for dense, None for thin bins)
    threshold: float
    quantile: float
    source: str
    notes: list[str] = field(default_factory=list)
    plain_budgets: tuple[int, ...] = ()  # the smallest reaching budgets before a cost prices them (0: dense)

    @property
    def num_bins(self) -> int:
        return len(self.schedule.budgets)

    def bin_end(self, i: int) -> int | None:
        return None if i == self.num_bins - 1 else self.schedule.bin_starts[i + 1]


def plan(profile: TailProfile, threshold: float, bin_cost: BinCost | None = None) -> Plan:
    """The cheapest non-decreasing schedule whose tail is at or above `threshold` in every bin; with
    `bin_cost`, the cheapest by that cost (the section's comment above)."""
    check_threshold(threshold)
    n = profile.num_bins
    thin = profile.thin if profile.thin is not None else np.zeros(n, dtype=bool)
    if thin.all():
        most = int(profile.tokens.max()) if profile.tokens is not None else 0
        needed = profile.min_tokens or MIN_TOKENS
        raise ScheduleError(f"{profile.source}: no bin has the --min-tokens {needed} "
                            f"tokens a tail needs (the most in one bin is {most}); profile more samples or "
                            "longer generations, or lower --min-tokens")
    feasible = profile.tail >= threshold
    first = np.where(feasible.any(axis=1), profile.candidates[feasible.argmax(axis=1)], DENSE)
    notes = []
    if profile.threshold_range and not (
            profile.threshold_range[0] <= threshold <= profile.threshold_range[1]):
        lo, hi = profile.threshold_range
        notes.append(f"threshold {threshold:g} is outside the published range [{lo:g}, {hi:g}], "
                     "so the reference profile extrapolates")
    budgets = np.zeros(n, dtype=np.int64)
    current = None
    for i in range(n):
        if thin[i]:
            budgets[i] = current if current is not None else -1
            continue
        current = max(current or 0, int(first[i]))
        budgets[i] = current
    trusted = int(np.argmin(thin))
    budgets[budgets < 0] = budgets[trusted]  # leading thin bins
    plain = tuple(0 if b == DENSE else int(b) for b in budgets)
    if bin_cost is not None:
        cheapest = _cheapest(profile, feasible, thin, budgets, bin_cost)
        _note_costlier(notes, profile, budgets, cheapest, threshold)
        budgets = cheapest
    few = f"fewer tokens than --min-tokens{f' ({profile.min_tokens})' if profile.min_tokens else ''}"
    _note_bins(notes, np.flatnonzero(thin[:trusted]), profile,
               f"{few}, so it takes the budget of bin {trusted}, the first bin with enough",
               f"{few}, so they take the budget of bin {trusted}, the first bin with enough")
    _note_bins(notes, trusted + np.flatnonzero(thin[trusted:]), profile,
               f"{few}, so it keeps the budget of the bin before it",
               f"{few}, so each keeps the budget of the bin before it")
    dense = np.flatnonzero((first == DENSE) & ~thin)
    reach = f"no profiled budget reaches a tail of {threshold:g}, so"
    _note_bins(notes, dense, profile, f"{reach} it is dense, and so is every later bin",
               f"{reach} they are dense, and so is every later bin")
    tails = _reported_tails(profile, budgets, thin)
    _note_bins(notes, np.flatnonzero([t is not None and t < threshold for t in tails]), profile,
               f"its measured tail at the budget it keeps from the bin before is below {threshold:g}, "
               "although a smaller profiled budget's reaches it (a larger budget is taken as no worse)",
               f"their measured tails at the budget each keeps from the bin before are below {threshold:g}, "
               "although a smaller profiled budget's reaches it (a larger budget is taken as no worse)")
    schedule = Schedule(tuple(int(s) for s in profile.bin_starts),
                        tuple(0 if b == DENSE else int(b) for b in budgets), profile.page_size)
    return Plan(schedule, profile.bin_width, tails, threshold, profile.quantile, profile.source, notes, plain)


def _cheapest(profile: TailProfile, feasible: np.ndarray, thin: np.ndarray, plain: np.ndarray,
              bin_cost: BinCost) -> np.ndarray:
    """[n] the non-decreasing budgets of least total `bin_cost` whose tails reach the threshold (`feasible`
    [n, m]), among the options: the plain plan's budgets, for each bin the smallest candidate that covers
    it (at least the next bin's start), and dense. A thin bin keeps the budget of the trusted bin it
    follows (leading ones the first trusted bin's), as in the plain plan, so each trusted bin decides for
    its group. Among plans of equal cost the smallest budgets win, so the plain plan stands wherever the
    cost grows with the budget."""
    covers = [profile.candidates[np.searchsorted(profile.candidates, start)]
              for start in profile.bin_starts[1:] if start <= profile.candidates[-1]]
    options = np.unique(np.concatenate([plain[plain != DENSE], np.asarray(covers, dtype=np.int64), [DENSE]]))
    allowed = np.zeros((profile.num_bins, len(options)), dtype=bool)
    allowed[:, -1] = True  # dense: alpha is 1
    for k, budget in enumerate(options[:-1]):
        allowed[:, k] = feasible[:, np.searchsorted(profile.candidates, budget)]
    groups = _trusted_groups(thin)
    priced = np.where(options == DENSE, 0, options)
    costs = [sum(np.asarray(bin_cost(i, priced), dtype=np.float64) for i in members) for _, members in groups]
    # best[g][k]: the least cost of groups g.. with group g at option k or above; value[g][k]: at k exactly
    best = np.zeros((len(groups) + 1, len(options)))
    value = np.full((len(groups), len(options)), np.inf)
    for g in range(len(groups) - 1, -1, -1):
        lead = groups[g][0]
        value[g] = np.where(allowed[lead], costs[g] + best[g + 1], np.inf)
        best[g] = np.minimum.accumulate(value[g][::-1])[::-1]
    budgets = plain.copy()
    k = 0
    for g, (_, members) in enumerate(groups):
        least = best[g][k]
        k += int(np.argmax(value[g][k:] <= least + 1e-9 * max(abs(least), 1e-12)))
        budgets[members] = options[k]
    return budgets


def _trusted_groups(thin: np.ndarray) -> list[tuple[int, list[int]]]:
    """Each trusted bin with the thin bins that take its budget: those after it up to the next trusted
    bin, and for the first, the leading ones too."""
    groups: list[tuple[int, list[int]]] = []
    for i in range(len(thin)):
        if not thin[i]:
            groups.append((i, [i]))
        elif groups:
            groups[-1][1].append(i)
    leading = list(range(groups[0][0]))
    groups[0] = (groups[0][0], leading + groups[0][1])
    return groups


def _note_costlier(notes: list[str], profile: TailProfile, plain: np.ndarray, cheapest: np.ndarray,
                   threshold: float) -> None:
    """Say where the cheapest plan takes more than the smallest budget that reaches the threshold."""
    differ = np.flatnonzero(plain != cheapest)
    dense = differ[cheapest[differ] == DENSE]
    larger = differ[cheapest[differ] != DENSE]
    why = (f"the cost model prices the steps of the smaller budgets that reach {threshold:g} there (and "
           "in later bins, as a schedule never decreases) above")
    _note_bins(notes, dense, profile, f"{why} dense ones, so it is dense", f"{why} dense ones, so they "
               "are dense")
    _note_bins(notes, larger, profile, f"{why} this larger budget's", f"{why} these larger budgets'")


def _reported_tails(profile: TailProfile, budgets: np.ndarray, thin: np.ndarray) -> list[float | None]:
    """The tail of each bin at its chosen budget: None for a thin bin, 1.0 for a dense one, else the
    measured tail at that budget (a measured profile's, before the running max over budgets), or the
    reference profile's curve."""
    values = profile.tail if profile.measured is None else profile.measured
    tails: list[float | None] = []
    for i, b in enumerate(budgets):
        if thin[i]:
            tails.append(None)
        elif b == DENSE:
            tails.append(1.0)
        else:
            tails.append(float(values[i, np.searchsorted(profile.candidates, b)]))
    return tails


def bin_span(starts, i: int) -> str:
    """Bin `i`'s positions as the schedule's table gives them: "start-end" (the end is the next bin's start,
    itself not in the bin), or "start+" for the last bin, which is open to the end of the context."""
    return f"{starts[i]}-{starts[i + 1]}" if i + 1 < len(starts) else f"{starts[i]}+"


def _note_bins(notes: list[str], bins: np.ndarray, profile: TailProfile, one: str, many: str) -> None:
    if len(bins):
        shown = ", ".join(f"{i} ({bin_span(profile.bin_starts, i)})" for i in bins[:8])
        more = f" and {len(bins) - 8} more" if len(bins) > 8 else ""
        notes.append(f"bin{'s' * (len(bins) > 1)} {shown}{more}: {one if len(bins) == 1 else many}")


def check_threshold(threshold: float) -> None:
    if not 0 < threshold < 1:
        raise ScheduleError(f"the threshold must be in (0, 1), got {threshold:.15g}")


def measured_profile(mismatch, quantile: float, bin_width: int, num_bins: int, source: str,
                     page_size: int = 16, min_tokens: int = MIN_TOKENS) -> TailProfile:
    """Tails from a `mismatch` table: the q-quantile of alpha per bin (position // bin_width) and
    profiled budget, the same quantile DuckDB's quantile_cont (and `sparrow profile`) computes.

    The candidate budgets are the profiled ones alone: a budget the profile never scored has no measured
    tail, and a tail guessed between two profiled budgets can err either way, so a plan never schedules
    one. A larger budget is never worse: the planner chooses on the running maximum of the tails from
    the smallest to the largest budget (sampling noise can make a larger budget look slightly worse than
    a smaller one, which the planner must not exploit), and reports the tail measured at the budget it
    chose (`measured`).
    """
    import duckdb

    check_quantile(quantile)
    con = duckdb.connect()
    con.register("mismatch", mismatch)
    rows = con.execute(
        """SELECT position // ? AS bin, budget, count(*) AS tokens,
                  quantile_cont(alpha::DOUBLE, ?) AS tail
           FROM mismatch GROUP BY ALL ORDER BY bin, budget""", [bin_width, quantile]).fetchall()
    if not rows:
        raise ScheduleError(f"{source}: the mismatch profile has no tokens")
    measured = np.array(sorted({r[1] for r in rows}), dtype=np.int64)
    bad = [int(b) for b in measured if b % page_size or b < 3 * page_size]
    if bad:
        raise ScheduleError(f"{source}: budget {bad[0]} is not a multiple of the page size {page_size} "
                            "of at least three pages")
    _check_even(rows, source)
    last = max(r[0] for r in rows)
    if num_bins > last + 1:
        raise ScheduleError(
            f"{source} covers positions up to bin {last} (< {(last + 1) * bin_width} tokens) but the "
            f"schedule needs bins up to {num_bins - 1}; bins {last + 1}-{num_bins - 1} are missing, so "
            "profile longer generations or lower --gen-len")
    tails = np.full((num_bins, len(measured)), np.nan)
    tokens = np.zeros(num_bins, dtype=np.int64)
    for b, budget, count, tail in rows:
        if b < num_bins:
            tails[b, np.searchsorted(measured, budget)] = tail
            tokens[b] = max(tokens[b], count)
    monotone = np.fmax.accumulate(np.nan_to_num(tails, nan=-np.inf), axis=1)
    thin = (tokens < min_tokens) | ~np.isfinite(monotone).all(axis=1)
    monotone = np.where(np.isfinite(monotone), monotone, 0.0)
    return TailProfile(np.arange(num_bins) * bin_width, bin_width, measured, monotone, quantile,
                       source, page_size, thin, tokens, min_tokens=min_tokens,
                       measured=np.where(np.isnan(tails), monotone, tails))


def _check_even(rows: list[tuple], source: str) -> None:
    """A profile scores every token at every budget: a bin whose budgets hold different token counts has
    lost rows (a file filtered by budget and something else, or cut short), and tails compared across its
    budgets would be of different tokens. ScheduleError naming the bin and two budgets."""
    counts: dict[int, dict[int, int]] = {}
    for b, budget, count, _ in rows:
        counts.setdefault(int(b), {})[int(budget)] = int(count)
    for b, by_budget in sorted(counts.items()):
        if len(set(by_budget.values())) > 1:
            most, least = max(by_budget, key=by_budget.get), min(by_budget, key=by_budget.get)
            raise ScheduleError(f"{source}: bin {b} holds {by_budget[most]} tokens at budget {most} but "
                                f"{by_budget[least]} at budget {least}, where a profile scores every token "
                                "at every budget, so rows are missing (a filtered or truncated file?); "
                                "profile again, or keep the same tokens at every budget")


def check_quantile(quantile: float) -> None:
    if not 0 < quantile < 1:
        raise ScheduleError(f"the tail quantile must be in (0, 1), got {quantile:.15g}")


# ---------------------------------------------------------------- outputs


def mid_contexts(plan_: Plan) -> np.ndarray:
    """A representative cache length per bin (its middle) for per-bin step costs."""
    return np.asarray(plan_.schedule.bin_starts) + plan_.bin_width // 2


def schedule_table(plan_: Plan, step_seconds: np.ndarray | None = None):
    """The `schedule` artifact's rows; `step_seconds` = predicted decode-step time per bin."""
    import pyarrow as pa

    n = plan_.num_bins
    seconds = pa.nulls(n, pa.float64()) if step_seconds is None else pa.array(step_seconds, pa.float64())
    return pa.table({
        "bin": pa.array(range(n), pa.int32()),
        "bin_start": pa.array(plan_.schedule.bin_starts, pa.int64()),
        "bin_end": pa.array([plan_.bin_end(i) for i in range(n)], pa.int64()),
        "budget": pa.array([b or None for b in plan_.schedule.budgets], pa.int32()),
        "tail": pa.array(plan_.tails, pa.float64()),
        "predicted_step_seconds": seconds,
    })


def export_json(plan_: Plan, model: str, extra: dict | None = None) -> dict:
    """A plain, engine-neutral JSON form (null budget = dense)."""
    bins = [{"bin": i, "start": plan_.schedule.bin_starts[i], "end": plan_.bin_end(i),
             "budget": plan_.schedule.budgets[i] or None, "tail": plan_.tails[i]}
            for i in range(plan_.num_bins)]
    return {"model": model, "page_size": plan_.schedule.page_size, "threshold": plan_.threshold,
            "quantile": plan_.quantile, "source": plan_.source, "bins": bins, **(extra or {})}


# The Sparrow release's SGLang (Infini-AI-Lab/Sparrow, vortex_torch/vortex_torch/indexer/utils_sglang.py,
# read 2026-11) runs a named schedule: 20 top-k page counts (pages beyond the sink and the two most recent),
# one per 2,000-token bin, chosen by the request's cached 16-token blocks: below 125, 250, ..., 2375, and
# from 2375 on; the budget in blocks is the count plus the reserved ones (vortex_block_reserved_bos + _eos),
# and a request with no more blocks than that attends densely. verl hands SGLang its settings through
# actor_rollout_ref.rollout.engine_kwargs.sglang (the release's examples/grpo_trainer/example_math.sh).
VORTEX_BINS = 20
VORTEX_BIN_BLOCKS = 125
VORTEX_BLOCK = 16


def export_sglang_vortex(plan_: Plan, context: int, name: str, reserved_pages: int = 3,
                         dense_layers: tuple[int, ...] = (0, 1)) -> dict:
    """The release's form of a plan: the schedule's 20 page counts under `name` (the entry its
    `_SCHEDULE_POLICY_VALUES` table takes) and the SGLang engine kwargs that run it (also as verl overrides).
    A release bin takes the largest budget of the schedule bins its cache lengths meet (a cache of block
    length k holds 16k - 15 to 16k tokens), so it is never sparser than planned; a dense bin takes enough
    pages to cover the model's whole context."""
    page = plan_.schedule.page_size
    if page != VORTEX_BLOCK:
        raise ScheduleError(f"the release's named schedules assume pages of {VORTEX_BLOCK} tokens; this "
                            f"plan's pages have {page}")
    starts = np.asarray(plan_.schedule.bin_starts)
    ends = np.append(starts[1:], np.iinfo(np.int64).max)
    budgets = np.asarray(plan_.schedule.budgets)
    dense_pages = -(-context // page) - reserved_pages
    bin_tokens = VORTEX_BIN_BLOCKS * page
    values = []
    for j in range(VORTEX_BINS):
        lo = max(bin_tokens * j - page + 1, 0)  # the cache lengths of blocks 125j .. 125(j+1) - 1
        hi = bin_tokens * (j + 1) - page if j < VORTEX_BINS - 1 else np.iinfo(np.int64).max
        hit = budgets[(starts <= hi) & (ends > lo)]
        values.append(dense_pages if (hit == 0).any() else int(hit.max()) // page - reserved_pages)
    sglang = {"enable_vortex_sparsity": True, "vortex_module_name": "block_sparse_attention",
              "attention_backend": "flashinfer", "page_size": page, "vortex_block_size": page,
              "vortex_block_reserved_bos": 1, "vortex_block_reserved_eos": reserved_pages - 1,
              "vortex_layers_skip": list(dense_layers), "vortex_schedule_policy": name,
              "disable_overlap_schedule": True, "disable_cuda_graph": False}  # the release's key block
    return {"vortex_schedule_policy": name, "num_selected_pages": values, "page_size": page,
            "bin_tokens": bin_tokens, "reserved_pages": reserved_pages, "engine_kwargs": {"sglang": sglang},
            "verl_overrides": [f"+actor_rollout_ref.rollout.engine_kwargs.sglang.{k}={_hydra(v)}"
                               for k, v in sglang.items()]}


def _hydra(value) -> str:
    """A value as a Hydra command-line override writes it (the release's example scripts' style)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return f"'{value}'" if isinstance(value, str) else str(value)
