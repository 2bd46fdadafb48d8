"""The `plan-schedule` stage: resolve the model's shape, the threshold (given, calibrated or the prior),
the cost model (measured or a hardware preset) and the tail profile (measured, or the reference profile
of a published schedule); plan the per-bin budgets, or one KV budget for an eviction policy; write the
schedule artifact and its export.

Torch-free for presets, so planning for a Qwen3 preset starts in a fraction of a second. Every refusal is
a ScheduleError (or CostError) whose message is one sentence.

A measured profile's bin width is the one its metadata records (`sparrow.meta` bin_width), or --bin-width,
which re-bins its tokens by position. A profile that records none (saved again by pandas, DuckDB or polars,
which drop the footer) has it inferred from its `bin` column (`profile_bin_width`): `bin == position // w`
on every row bounds w from both sides, per bin, by its first and last position, so one bounded scan gives
every width the rows fit. Of those, `sparrow profile`'s default (512) is taken where it fits, else the
smallest multiple of the page size, else the smallest: a narrower bin starts the next, denser budget
earlier, never later, than the profile's did (schedules never decrease). A `bin` column no width fits is
refused. The width and where it came from are a
note of the plan when the metadata does not give it. Its page size needs no such care: Sparrow profiles at
one page size (PAGE_SIZE), and a budget that is not a multiple of it is refused by the planner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from sparrow.schemas import artifact_metadata, check_artifact, input_name, read_artifact
from sparrow.schemas.footer import footer_number
from sparrow.schemas.io import column_reader

from .calibrate import ResolvedThreshold, resolve_threshold
from .core.definitions import DEFAULT_BIN_WIDTH, PAGE_SIZE
from .core.published_schedules import (
    PUBLISHED_SPEEDUP_THRESHOLD,
    PUBLISHED_SPEEDUPS,
    REFERENCE_GEN_LEN,
    published_models,
)
from .core.reference_profiles import QUANTILE, REFERENCE_PREFIX, reference_profile
from .core.schedule import (
    MIN_TOKENS,
    BinCost,
    Plan,
    Schedule,
    ScheduleError,
    TailProfile,
    check_quantile,
    check_threshold,
    export_json,
    export_sglang_vortex,
    measured_profile,
    mid_contexts,
    plan,
    schedule_table,
)
from .cost import (
    CostModel,
    SpeedupScope,
    analytic,
    extrapolation_warning,
    fitted_range,
    load_cost,
    underdetermined_warning,
)
from .model.names import model_name, same_model
from .model.presets import PRESETS, get_preset
from .speculative_plan import SpeculativePlan, format_speedup, mean_alpha, plan_speculation


def model_shape(spec: str):
    """(ModelConfig, name); presets resolve without importing torch, so planning starts fast."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()].config, spec.lower()
    from .model.loading import resolve_config  # torch, only for a checkpoint

    return resolve_config(spec), model_name(spec)


@dataclass(frozen=True)
class Lengths:
    """The prompt and generation lengths a plan's speedup is predicted for, and what they are: given,
    the published generation length, or the means over a measured profile's trajectories."""

    prompt_len: int
    gen_len: int
    trajectories: int = 0  # of a measured profile whose means they are (0: given or the reference's)

    def describe(self, batch: int) -> str:
        what = f"{self.gen_len} generated tokens after a {self.prompt_len}-token prompt"
        if self.trajectories:
            what += f" (the means over the profile's {self.trajectories} trajectories)"
        return f"{what}, batch {batch}"


ProfileRows = Callable[[], pa.RecordBatchReader]  # a checked profile's columns, read again per query
PROFILE_COLUMNS = ("prompt_id", "sample", "position", "budget", "alpha", "alpha_draft")  # what plans read


def profile_rows(profile: Path) -> ProfileRows:
    """A mismatch profile, checked, as a maker of readers of the columns plans use: each query streams the
    artifact a bounded batch at a time, so planning holds DuckDB's aggregates, not the profile."""
    if check_artifact(profile, "mismatch") == 0:
        raise ScheduleError(f"{profile}: the mismatch profile has no tokens")
    return lambda: column_reader(profile, "mismatch", PROFILE_COLUMNS)


@dataclass(frozen=True)
class BinWidth:
    """A profile's bin width in tokens, and where it came from: `recorded` (its metadata), `given`
    (--bin-width) or `inferred` (its `bin` column: any of `low`..`high` fits it, high None for unbounded)."""

    width: int
    origin: str  # recorded | given | inferred
    low: int = 0
    high: int | None = None

    @property
    def note(self) -> str | None:
        """The one line a plan says of its width where the profile's metadata does not give it."""
        if self.origin == "given":
            return f"bins of {self.width} tokens (--bin-width)"
        if self.origin != "inferred":
            return None
        if self.high == self.low:
            return (f"bins of {self.width} tokens, inferred from the profile's bin column (it records no bin "
                    "width; give --bin-width to re-bin it)")
        fits = f"{self.low} to {self.high}" if self.high is not None else f"any from {self.low}"
        return (f"bins of {self.width} tokens, inferred from the profile's bin column, which widths {fits} "
                "fit (it records no bin width; give --bin-width to re-bin it)")


BinSpan = tuple[int, int, int]  # a bin's number, and the first and last position of its rows


def profile_bin_width(profile: Path, given: int | None = None,
                      spans: Iterable[BinSpan] | None = None) -> BinWidth:
    """The bin width of a mismatch profile (module docstring): --bin-width `given`, else its metadata's,
    else inferred from its `bin` column, from `spans` when the caller has them (per bin, or finer), else
    from a scan of the checked profile's positions and bins. ScheduleError when no width fits the rows;
    ArtifactError naming the file when the width it records is not a positive whole number."""
    meta = artifact_metadata(profile)
    if given is not None:  # a recorded value that is no width is not read: --bin-width replaces it
        recorded = meta.get("bin_width")
        same = isinstance(recorded, int | float) and not isinstance(recorded, bool) and recorded == given
        return BinWidth(given, "recorded" if same else "given")
    recorded = footer_number(meta, "bin_width", profile)
    if recorded is not None:
        return BinWidth(recorded, "recorded")
    return inferred_bin_width(bin_spans(profile) if spans is None else spans, profile)


def bin_spans(profile: Path) -> list[BinSpan]:
    """Per bin of a checked mismatch profile, its first and last position: one streamed aggregate."""
    import duckdb

    con = duckdb.connect()
    con.register("mismatch", column_reader(profile, "mismatch", ("position", "bin")))
    return con.execute("SELECT bin, min(position), max(position) FROM mismatch GROUP BY bin").fetchall()


def inferred_bin_width(spans: Iterable[BinSpan], profile: Path | str) -> BinWidth:
    """A w with bin == position // w for the rows `spans` sums up: bin b's positions must lie in
    [b*w, (b+1)*w), so w > last // (b+1) and, past bin 0, w <= first // b. Of the widths that fit,
    DEFAULT_BIN_WIDTH, else the smallest multiple of PAGE_SIZE, else the smallest (`_preferred_width`)."""
    low, high, low_at, high_at = 1, None, None, None
    for b, first, last in spans:
        if last // (b + 1) + 1 > low:
            low, low_at = last // (b + 1) + 1, (b, last)
        if b > 0 and (high is None or first // b < high):
            high, high_at = first // b, (b, first)
    if high is not None and low > high:
        said = f"bin {high_at[0]} starts at position {high_at[1]}"
        said += f" but bin {low_at[0]} reaches position {low_at[1]}" if low_at else ""
        raise ScheduleError(f"{profile} records no bin width (no Sparrow metadata) and its 'bin' column is "
                            f"not position // w for any width w ({said}); give --bin-width to bin its tokens "
                            "by position")
    return BinWidth(_preferred_width(low, high), "inferred", low, high)


def _preferred_width(low: int, high: int | None) -> int:
    """Of the widths in [low, high] (high None: no bound), sparrow profile's default, else the smallest
    multiple of the page size, else the smallest."""
    fits = (lambda w: low <= w and (high is None or w <= high))
    if fits(DEFAULT_BIN_WIDTH):
        return DEFAULT_BIN_WIDTH
    paged = -(-low // PAGE_SIZE) * PAGE_SIZE
    return paged if fits(paged) else low


def half_up(mean: float) -> int:
    """A mean shown as a count, rounded half up (18.5 -> 19), not to the even neighbour as round() does."""
    return int(np.floor(float(mean) + 0.5))


def profile_name(source: str) -> str:
    """A plan's profile as a schedule records it: the reference profile by its name (`reference:M`), a
    measured one by the path the user gave, absolute (input_name)."""
    return source if source.startswith(REFERENCE_PREFIX) else input_name(source)


def trajectory_lengths(mismatch) -> tuple[list[int], list[int]]:
    """Per trajectory (prompt_id, sample) of a mismatch table or reader: its prompt length (the position of
    its first generated token) and its generated tokens (its distinct positions)."""
    import duckdb

    con = duckdb.connect()
    con.register("mismatch", mismatch)
    rows = con.execute("SELECT min(position), max(position) - min(position) + 1 FROM mismatch "
                       "GROUP BY prompt_id, sample").fetchall()
    return [r[0] for r in rows], [r[1] for r in rows]


def check_context(lengths: Lengths, prompt_given: bool, gen_given: bool, context: int) -> None:
    """The lengths a speedup is priced at must fit the model's context; the sentence names where each
    number came from: its flag, the measured profile's means, or the published generation length."""
    if lengths.prompt_len + lengths.gen_len <= context:
        return
    p, g, n = lengths.prompt_len, lengths.gen_len, lengths.trajectories
    if n and not (prompt_given or gen_given):
        over = f"the profile's trajectories (a mean prompt of {p} + a mean of {g} generated tokens, over {n})"
        raise ScheduleError(f"{over} exceed the model's context of {context}; give --prompt-len and "
                            "--gen-len that fit it")
    means = f" (over its {n} trajectories)"
    parts = []
    if prompt_given:
        parts.append(f"--prompt-len {p}")
    elif n:
        parts.append(f"the profile's mean prompt of {p} tokens{means}")
    if gen_given:
        parts.append(f"--gen-len {g}")
    else:
        parts.append(f"the profile's mean of {g} generated tokens{means}" if n
                     else f"the published generation length of {g} tokens")
    raise ScheduleError(f"{' + '.join(parts)} exceeds the model's context of {context}; give --prompt-len "
                        "and --gen-len that fit it")


def load_profile(name: str, profile: Path | None, quantile: float, bin_width: int | None,
                 prompt_len: int | None, gen_len: int | None, min_tokens: int, context: int
                 ) -> tuple[TailProfile, Lengths, ProfileRows | None, BinWidth | None]:
    """The tail profile, and the prompt and generation lengths it is planned for: given, else for a
    measured profile the means over its trajectories (every profiled bin is planned), else 0 and the
    published generation length; and a measured profile's rows, checked once (`profile_rows`), and its
    bin width (`profile_bin_width`). Lengths beyond the model's `context` are refused before the tails are
    read."""
    given = prompt_len is not None, gen_len is not None
    if profile is None:
        tails = reference_profile(name)
        if tails is None:
            raise ScheduleError(
                f"{name} has no reference profile (published schedules exist only for "
                f"{', '.join(published_models())}), so run `sparrow profile --model {name} ...` first "
                "and pass its output with --profile")
        if abs(quantile - QUANTILE) > 1e-12:
            raise ScheduleError(f"the reference profile is the published {QUANTILE:g} quantile of alpha; "
                                f"--quantile {quantile:g} needs a measured --profile")
        if bin_width is not None and bin_width != tails.bin_width:
            raise ScheduleError(f"the reference profile has {tails.bin_width}-token bins; --bin-width "
                                f"{bin_width} needs a measured --profile")
        lengths = Lengths(prompt_len or 0, gen_len or REFERENCE_GEN_LEN)
        check_context(lengths, *given, context)
        return tails, lengths, None, None
    if all(given):
        check_context(Lengths(prompt_len, gen_len), *given, context)
    rows = profile_rows(profile)
    meta = artifact_metadata(profile)
    if meta.get("kv_compression"):
        raise ScheduleError(f"{profile} profiles {meta['kv_compression']} eviction budgets, which "
                            "`plan_eviction` plans (one KV budget), not a per-bin schedule")
    width = profile_bin_width(profile, bin_width)
    prompts, generated = trajectory_lengths(rows())
    lengths = Lengths(half_up(np.mean(prompts)) if prompt_len is None else prompt_len,
                      half_up(np.mean(generated)) if gen_len is None else gen_len,
                      0 if all(given) else len(prompts))
    if gen_len is None and lengths.gen_len < 2:
        mean = float(np.mean(generated))
        raise ScheduleError(f"{profile}: its {len(generated)} trajectories average {mean:.3g} generated "
                            f"token{'s' * (mean != 1)} each, and a rollout's first token "
                            "comes from the dense prefill, so there is no decode step to price; give "
                            "--gen-len (at least 2)")
    check_context(lengths, *given, context)
    profiled = max(p + g - 1 for p, g in zip(prompts, generated, strict=True))  # the last scored position
    last = max(profiled, lengths.prompt_len + lengths.gen_len - 1)
    tails = measured_profile(rows(), quantile, width.width, last // width.width + 1, str(profile),
                             int(meta.get("page_size", PAGE_SIZE)), min_tokens)
    beyond = int(tails.candidates.max())
    if beyond > context:
        raise ScheduleError(f"{profile} holds budget {beyond}, beyond the model's context of {context} "
                            "tokens, which a rollout refuses (a budget that covers the whole context is "
                            "dense attention); profile again with --budgets within the context, or drop its "
                            "rows")
    return tails, lengths, rows, width


@dataclass
class PlanRequest:
    """What `plan-schedule` plans from: the model, the threshold, the cost and the tail profile (None:
    the defaults that `resolve_threshold` and `load_profile` document; the cost: the h100 preset)."""

    model: str
    profile: Path | None = None
    threshold: float | None = None
    threshold_file: Path | None = None
    quantile: float | None = None
    cost: Path | None = None
    hardware: str | None = None
    gen_len: int | None = None
    prompt_len: int | None = None
    batch: int = 64
    bin_width: int | None = None
    min_tokens: int = MIN_TOKENS
    allow_model_mismatch: bool = False
    sweep: list[float] = field(default_factory=list)  # thresholds of the stability-speed frontier
    export: str | None = None  # json | sglang-vortex
    # also plan exact speculative rollouts (speculative_plan.py); -o then writes its drafts, even where no K
    # is predicted to beat dense (they were asked for; the artifact's notes and the CLI's warning say so)
    speculate: bool = False


@dataclass
class FrontierPoint:
    threshold: float
    speedup: float
    mean_budget: float | None  # over the sparse bins
    dense_bins: int


@dataclass
class PlannedSchedule:
    """A plan with its predicted speedup (of the whole rollout or of decode alone, as `scope` says; the
    frontier's and the drafts' speedups alike), mid-bin step times, frontier and export form."""

    plan: Plan
    cost_source: str
    threshold: ResolvedThreshold
    lengths: Lengths
    batch: int
    speedup: float
    sparse_s: np.ndarray  # per bin, at its middle context
    dense_s: np.ndarray
    frontier: list[FrontierPoint]
    exported: dict | list | None
    speculative: SpeculativePlan | None = None
    warnings: list[str] = field(default_factory=list)  # one sentence each, said once
    scope: SpeedupScope = SpeedupScope(0.0, 0)
    decode_speedup: float = 0.0  # of decode alone, prefill excluded

    def speedup_fields(self) -> dict:
        """The predicted speedup and what it is for, under the keys of the schedule artifact's metadata,
        its --export json and the -f json document."""
        return {"predicted_speedup": self.speedup, "speedup_scope": self.scope.name,
                "predicted_decode_speedup": self.decode_speedup, "prefill_seconds": self.scope.prefill_s,
                "gen_len": self.lengths.gen_len, "prompt_len": self.lengths.prompt_len, "batch": self.batch,
                "cost": self.cost_source}


def check_profile_model(profile: Path, model: str) -> None:
    """A schedule planned from one model's mismatch, labelled with another model, would be trusted for a
    model it says nothing about: refused (the CLI's --allow-model-mismatch skips this check)."""
    measured = artifact_metadata(profile).get("model")
    if not same_model(measured, model):
        raise ScheduleError(f"--profile {profile} was measured on {measured} (its metadata), not on --model "
                            f"{model}; plan with --model {measured}, or pass --allow-model-mismatch to plan "
                            f"for {model} from it")


def check_threshold_model(threshold_file: Path, resolved: ResolvedThreshold, model: str) -> None:
    """A threshold calibrated on one model's runs says as little about another model as its profile does:
    a calibrated --threshold-file whose metadata names another model is refused as a --profile of another
    model is (--allow-model-mismatch skips this check). The published prior (source `prior`) is no model's
    calibration, and an artifact that records no model is accepted as it is."""
    calibrated_on = artifact_metadata(threshold_file).get("model")
    if resolved.origin.startswith("calibrated") and not same_model(calibrated_on, model):
        raise ScheduleError(f"--threshold-file {input_name(threshold_file)} was calibrated on "
                            f"{calibrated_on} (its metadata), not on --model {model}; calibrate it from a "
                            f"profile of {model}, or pass --allow-model-mismatch to plan for {model} with it")


def plan_schedule(req: PlanRequest, output: Path | None = None, export_to: Path | None = None
                  ) -> PlannedSchedule:
    """Plan `req`; write the schedule artifact to `output` and the export form to `export_to`."""
    cfg, name = model_shape(req.model)
    resolved = resolve_threshold(req.threshold, req.threshold_file, req.quantile, req.model)
    threshold = resolved.value
    for t in req.sweep:
        check_threshold(t)
    if req.profile is not None and not req.allow_model_mismatch:
        check_profile_model(req.profile, req.model)
    if req.threshold_file is not None and not req.allow_model_mismatch:
        check_threshold_model(req.threshold_file, resolved, req.model)
    cost_model = load_cost(req.cost, cfg) if req.cost is not None else analytic(cfg, req.hardware or "h100")
    measured = read_artifact(req.cost, "cost") if req.cost is not None else None
    tails, lengths, rows, width = load_profile(name, req.profile, resolved.quantile, req.bin_width,
                                               req.prompt_len, req.gen_len, req.min_tokens,
                                               cfg.max_position_embeddings)
    prompt_len, gen_len = lengths.prompt_len, lengths.gen_len
    bin_cost = rollout_bin_cost(cost_model, tails.bin_starts, req.batch, prompt_len, gen_len)
    result = plan(tails, threshold, bin_cost)
    if width is not None and width.note:
        result.notes.insert(0, width.note)
    scope = SpeedupScope.of(cost_model, req.batch, prompt_len)
    speedup = cost_model.speedup(result.schedule.budgets_at, gen_len, req.batch, prompt_len, scope.prefill)
    frontier = [frontier_point(plan(tails, t, bin_cost), t, cost_model, gen_len, req.batch, prompt_len,
                               scope.prefill) for t in req.sweep]
    mids = mid_contexts(result)
    sparse_s = cost_model.step_seconds(req.batch, mids, result.schedule.budgets_at(mids))
    planned = PlannedSchedule(result, cost_model.source, resolved, lengths, req.batch, speedup,
                              sparse_s, cost_model.step_seconds(req.batch, mids, 0), frontier, None,
                              scope=scope, decode_speedup=cost_model.speedup(
                                  result.schedule.budgets_at, gen_len, req.batch, prompt_len))
    planned.warnings += _cost_warnings(req.cost, measured, cost_model, req.batch, lengths)
    planned.warnings += _plan_warnings(req, planned)
    if req.speculate:
        planned.speculative = _plan_speculation(req, cost_model, tails, lengths, scope, rows)
    if req.export == "json":
        planned.exported = _export_json(planned, name)
    elif req.export == "sglang-vortex":
        planned.exported = export_sglang_vortex(result, cfg.max_position_embeddings,
                                                 f"sparrow-{name}-{threshold:.3g}")
    if output is not None:
        _write_schedule(planned, output, name, json.dumps(cfg.to_dict()), req.min_tokens)
    if export_to is not None and planned.exported is not None:
        from sparrow.schemas.io import write_bytes

        write_bytes(export_to, (export_text(planned.exported, req.export) + "\n").encode())
    return planned


def _cost_warnings(cost: Path | None, measured, cost_model: CostModel, batch: int, lengths: Lengths
                   ) -> list[str]:
    """A measured cost model's warnings: lengths beyond what it was fitted on, a fit the data leave loose."""
    if measured is None:
        return []
    contexts = np.arange(lengths.prompt_len + 1, lengths.prompt_len + lengths.gen_len)
    said = [extrapolation_warning(f"the cost model {cost}", fitted_range(measured), batch, contexts),
            underdetermined_warning(f"the cost model {cost}", measured, cost_model)]
    return [w for w in said if w]


def _plan_warnings(req: PlanRequest, planned: PlannedSchedule) -> list[str]:
    """What the user should hear of the plan itself: a schedule priced dense or slower than dense, and a
    profile of random weights."""
    result, lengths, threshold = planned.plan, planned.lengths, planned.plan.threshold
    warnings = []
    if not any(result.schedule.budgets) and any(result.plain_budgets):
        warnings.append(f"the cost model prices every budget that reaches {threshold:g} above dense "
                        f"decoding for {lengths.describe(req.batch)}, so the schedule is dense: "
                        "roll out --dense, or plan for longer contexts (--gen-len)")
    elif planned.speedup < 1:
        warnings.append(f"the schedule is predicted slower than dense decoding "
                        f"({format_speedup(planned.speedup)} for {lengths.describe(req.batch)}): its "
                        "budgets' steps cost more than dense ones at these lengths, so roll out "
                        "--dense, or plan for longer contexts (--gen-len)")
    if req.profile is not None and artifact_metadata(req.profile).get("random_weights"):
        warnings.append(f"--profile {req.profile} was measured with random weights (its metadata), so its "
                        "mismatch is not the model's and the plan says nothing of its training")
    return warnings


def rollout_bin_cost(cost_model: CostModel, bin_starts: np.ndarray, batch: int, prompt_len: int,
                     gen_len: int) -> BinCost:
    """The predicted seconds of the rollout's decode steps in each bin under each budget: the steps that
    `CostModel.rollout_seconds` prices, at the cache lengths `Schedule.budget_at` puts in that bin."""
    contexts = np.arange(prompt_len + 1, prompt_len + gen_len)
    index = np.searchsorted(bin_starts, contexts, side="right") - 1
    bins = {i: contexts[np.clip(index, 0, None) == i] for i in range(len(bin_starts))}

    def cost(i: int, budgets: np.ndarray) -> np.ndarray:
        return cost_model.step_seconds(batch, bins[i][:, None], budgets[None, :]).sum(axis=0)
    return cost


def _write_schedule(planned: PlannedSchedule, output: Path, name: str, model_config: str,
                    min_tokens: int) -> None:
    """The schedule artifact: the lossy plan with its threshold, or with --speculate the draft plan, whose
    metadata describes the drafts alone (no threshold, quantile or tail: the mean alpha sets them)."""
    from sparrow.schemas import write_artifact

    result = planned.plan
    meta = {"model": name, "model_config": model_config, "page_size": result.schedule.page_size,
            "bin_width": result.bin_width, "profile": profile_name(result.source), **planned.speedup_fields()}
    if planned.speculative is not None:
        write_artifact(schedule_table(_drafts(result, planned.speculative)), output, "schedule",
                       metadata={**meta, **_speculative_meta(planned.speculative), "min_tokens": min_tokens})
        return
    write_artifact(schedule_table(result, planned.sparse_s), output, "schedule", metadata={
        **meta, "threshold": result.threshold, "threshold_source": planned.threshold.source,
        "quantile": result.quantile, "min_tokens": min_tokens, "notes": json.dumps(result.notes)})


def _plan_speculation(req: PlanRequest, cost_model: CostModel, tails: TailProfile, lengths: Lengths,
                      scope: SpeedupScope, rows: ProfileRows | None) -> SpeculativePlan:
    """The draft plan from the profile's mean alpha, its bins thin by --min-tokens as the lossy plan's are."""
    if rows is None:
        raise ScheduleError("--speculate plans from a measured --profile (its mean alpha per bin sets the "
                            "drafts' acceptance); the reference profile holds tails only")
    alpha = mean_alpha(rows(), tails.bin_width, tails.num_bins, req.min_tokens)
    return plan_speculation(cost_model, alpha, req.batch, lengths.prompt_len, lengths.gen_len,
                            prefill_s=scope.prefill)


def _export_json(planned: PlannedSchedule, name: str) -> dict:
    """The json export of the schedule that -o writes: with --speculate the draft schedule (its K and
    speculative speedup beside it), so the two files never hold different plans; else the lossy plan."""
    extra = {**planned.speedup_fields(), "source": profile_name(planned.plan.source)}  # as the schedule's
    spec = planned.speculative
    if spec is None:
        return export_json(planned.plan, name, extra)
    meta = _speculative_meta(spec)
    return export_json(_drafts(planned.plan, spec), name, {
        **extra, "threshold": None, "quantile": None, "speculate": spec.k, "predicted_speedup": spec.speedup,
        "predicted_decode_speedup": spec.decode_speedup, "role": meta["role"],
        "tokens_per_cycle": json.loads(meta["speculative_tokens_per_cycle"])})


def _drafts(result: Plan, spec: SpeculativePlan) -> Plan:
    """The lossy plan's bins with the draft budgets, and no tail: the drafts' mean alpha sets the speed."""
    drafts = Schedule(result.schedule.bin_starts, tuple(spec.budgets), result.schedule.page_size)
    return replace(result, schedule=drafts, tails=[None] * len(spec.budgets))


def _speculative_meta(spec: SpeculativePlan) -> dict:
    """The draft plan's metadata: its K, speedups, tokens per cycle and notes (thin bins, and the warning
    where speculation is not predicted to pay)."""
    return {"speculate": spec.k, "predicted_speedup": spec.speedup,
            "predicted_decode_speedup": spec.decode_speedup,
            "speedups_by_k": json.dumps({str(k): v for k, v in spec.speedups_by_k.items()}),
            "speculative_tokens_per_cycle": json.dumps([None if t is None else round(t, 4)
                                                        for t in spec.tokens_per_cycle]),
            "notes": json.dumps([*spec.notes, *([spec.warning] if spec.warning else [])]),
            "role": "draft budgets of exact speculative rollouts (sparrow rollout --schedule this "
                    f"--speculate {spec.k}{'' if spec.pays else '; not predicted faster than dense'})"}


def export_text(exported: dict | list, form: str) -> str:
    """The export form as indented JSON."""
    return json.dumps(exported, indent=2)


def frontier_point(result: Plan, threshold: float, cost_model: CostModel, gen_len: int, batch: int,
                   prompt_len: int, prefill_s: float = 0.0) -> FrontierPoint:
    budgets = [b for b in result.schedule.budgets if b]
    speedup = cost_model.speedup(result.schedule.budgets_at, gen_len, batch, prompt_len, prefill_s)
    return FrontierPoint(threshold, speedup, sum(budgets) / len(budgets) if budgets else None,
                         len(result.schedule.budgets) - len(budgets))


def compare_published_at(hardware: str, threshold: float | None, gen_len: int | None, batch: int,
                         prompt_len: int) -> tuple[float, int, list[dict]]:
    """(threshold, gen_len, rows) of the published-speedup comparison, with their defaults filled in."""
    threshold = PUBLISHED_SPEEDUP_THRESHOLD if threshold is None else threshold
    check_threshold(threshold)
    gen_len = gen_len or REFERENCE_GEN_LEN
    return threshold, gen_len, compare_published(hardware, threshold, gen_len, batch, prompt_len)


def eviction_policy_of(profile: Path) -> str | None:
    """The eviction policy (snapkv, rkv) whose KV budgets a mismatch profile scored, or None."""
    return artifact_metadata(profile).get("kv_compression") or None


@dataclass
class EvictionPlan:
    """The cheapest profiled KV budget of an eviction policy whose tail holds. An evicted token is gone
    for every later position, so the budget is one number for the whole sequence, not one per bin: a
    budget holds when the tail statistic (the quantile of alpha) of every trusted position bin is at or
    above the threshold. Only profiled budgets that evicted something are candidates (no interpolation
    between them)."""

    policy: str  # snapkv | rkv
    specs: dict[int, str]  # budget -> the policy's full spec (window, buffer, sink) as profiled
    rows: list[dict]  # per budget: tail (min over trusted bins), weakest bin, mean alpha, tokens, holds,
    # evicted (whether it compressed any profiled sequence)
    budget: int | None  # the cheapest budget that holds; None: none does (stay dense)
    threshold: float
    quantile: float
    bin_width: int
    source: str
    resolved: ResolvedThreshold | None = None  # the threshold with its origin
    notes: list[str] = field(default_factory=list)  # the thin bins left unjudged

    def flags(self) -> str:
        """The rollout and train flags of the chosen budget."""
        from .kv_policies import parse_eviction

        flags = f"--kv-compression {self.policy} --kv-budget {self.budget}"
        if spec := self.specs.get(self.budget):
            policy = parse_eviction(spec)
            flags += f" --kv-window {policy.window} --kv-buffer {policy.buffer}"
        return flags


def plan_kv_budget(req: PlanRequest) -> EvictionPlan:
    """The eviction plan of `req.profile` (a profile of an eviction policy's KV budgets) for `req.model`."""
    _, name = model_shape(req.model)
    if not req.allow_model_mismatch:
        check_profile_model(req.profile, req.model)
    resolved = resolve_threshold(req.threshold, req.threshold_file, req.quantile, req.model)
    if req.threshold_file is not None and not req.allow_model_mismatch:
        check_threshold_model(req.threshold_file, resolved, req.model)
    result = plan_eviction(req.profile, resolved.value, resolved.quantile, req.bin_width, req.min_tokens)
    result.resolved = resolved
    return result


def plan_eviction(profile: Path, threshold: float, quantile: float, bin_width: int | None = None,
                  min_tokens: int = MIN_TOKENS) -> EvictionPlan:
    import duckdb

    check_threshold(threshold)
    check_quantile(quantile)
    scan = profile_rows(profile)
    meta = artifact_metadata(profile)
    policy = meta.get("kv_compression")
    if not policy:
        raise ScheduleError(f"{profile} profiles block top-k budgets, not an eviction policy's; plan it "
                            "without --kv-compression")
    binned = profile_bin_width(profile, bin_width)
    width = binned.width
    budgets = json.loads(meta.get("budgets", "[]"))
    specs = dict(zip(budgets, json.loads(meta.get("kv_policies", "[]"))))
    con = duckdb.connect()
    con.register("mismatch", scan())
    per_bin = con.execute(
        """SELECT budget, position // ? AS bin, count(*) AS tokens, quantile_cont(alpha::DOUBLE, ?) AS tail,
                  avg(alpha::DOUBLE) AS mean
           FROM mismatch GROUP BY ALL ORDER BY budget, bin""", [width, quantile]).fetchall()
    con.register("mismatch", scan())
    sequences = con.execute(
        "SELECT budget, min(position), count(*) FROM mismatch GROUP BY budget, prompt_id, sample").fetchall()
    thin = thin_bins(per_bin, min_tokens, profile)
    rows: list[dict] = []
    for budget in sorted({r[0] for r in per_bin}):
        lengths = [(int(r[1]), int(r[2])) for r in sequences if r[0] == budget]
        rows.append(budget_row(budget, [r for r in per_bin if r[0] == budget], thin, threshold,
                               evicted(specs.get(budget), lengths)))
    chosen = next((r["budget"] for r in rows if r["holds"] and r["evicted"]), None)
    notes = [n for n in (binned.note, thin_note(thin, width, min_tokens) if thin else None) if n]
    return EvictionPlan(policy, {int(b): str(sp) for b, sp in specs.items()}, rows, chosen, threshold,
                        quantile, width, str(profile), notes=notes)


def budget_row(budget: int, bins: list[tuple], thin: dict[int, int], threshold: float, evicts: bool) -> dict:
    """One budget's row from its (budget, bin, tokens, tail, mean) rows: the tail of its weakest trusted
    bin (None, and so not holding, where it was scored in thin bins alone), its mean alpha and tokens."""
    weakest = min((r for r in bins if r[1] not in thin), key=lambda r: r[3], default=None)
    tokens = sum(r[2] for r in bins)
    return {"budget": int(budget), "tail": None if weakest is None else float(weakest[3]),
            "weakest_bin": None if weakest is None else int(weakest[1]),
            "mean_alpha": sum(r[4] * r[2] for r in bins) / tokens, "tokens": int(tokens),
            "holds": weakest is not None and bool(weakest[3] >= threshold), "evicted": evicts}


def thin_bins(per_bin: list[tuple], min_tokens: int, profile: Path) -> dict[int, int]:
    """The position bins with fewer than `min_tokens` tokens at every budget -> their tokens, from the
    (budget, bin, tokens, ...) rows of an eviction profile: their tails are not judged, as the block top-k
    planner trusts no thin bin. Every bin thin is refused as `plan` refuses it, in the same sentence."""
    tokens: dict[int, int] = {}
    for r in per_bin:
        tokens[int(r[1])] = max(tokens.get(int(r[1]), 0), int(r[2]))
    if all(n < min_tokens for n in tokens.values()):
        raise ScheduleError(f"{profile}: no bin has the --min-tokens {min_tokens} tokens a tail needs (the "
                            f"most in one bin is {max(tokens.values())}); profile more samples or longer "
                            "generations, or lower --min-tokens")
    return {b: n for b, n in sorted(tokens.items()) if n < min_tokens}


def thin_note(thin: dict[int, int], width: int, min_tokens: int) -> str:
    """One sentence naming the thin bins an eviction plan did not judge, with their tokens."""
    shown = ", ".join(f"{b} ({b * width}-{(b + 1) * width}, {n} tokens)" for b, n in list(thin.items())[:8])
    more = f" and {len(thin) - 8} more" if len(thin) > 8 else ""
    one = len(thin) == 1
    return (f"bin{'' if one else 's'} {shown}{more}: fewer tokens than --min-tokens ({min_tokens}), so "
            f"{'its tail is' if one else 'their tails are'} not judged")


def evicted(spec: str | None, lengths: list[tuple[int, int]]) -> bool:
    """Whether the eviction `spec` compressed the cache of any profiled sequence, each given as (its first
    generated position = prompt length, its scored tokens), before that sequence's last scored token. A
    budget that never did scored the dense cache: its alpha of 1 says nothing about eviction, so it is
    no candidate. A profile that does not record its specs is taken as evicting."""
    from .kv_policies import parse_eviction

    if spec is None:
        return True
    policy = parse_eviction(spec)
    return any(policy.evicts_within(prompt, scored) for prompt, scored in lengths)


def compare_published(hardware: str = "h200", threshold: float = PUBLISHED_SPEEDUP_THRESHOLD,
                      gen_len: int = 32768, batch: int = 64, prompt_len: int = 0) -> list[dict]:
    """Predicted rollout speedup of the analytic model (the prompt's dense prefill on both sides) next
    to the published one, per Qwen3 model."""
    rows = []
    for model in published_models():
        cost = analytic(get_preset(model).config, hardware)
        schedule = plan(reference_profile(model), threshold).schedule
        prefill = SpeedupScope.of(cost, batch, prompt_len).prefill
        predicted = cost.speedup(schedule.budgets_at, gen_len, batch, prompt_len, prefill)
        published = (PUBLISHED_SPEEDUPS.get(model)
                     if abs(threshold - PUBLISHED_SPEEDUP_THRESHOLD) < 1e-9 else None)
        rows.append({"model": model, "published": published, "predicted": predicted,
                     "ratio": None if published is None else predicted / published})
    return rows
