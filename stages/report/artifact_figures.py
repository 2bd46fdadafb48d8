"""One figure per artifact: a profile's tail and mean alpha, a calibration's runs, a schedule, a cost model,
rollouts, rewards. Each reads what it draws of its artifact (tables.py: DuckDB for the per-bin aggregates,
the columns it draws batch by batch for the per-sample ones) and returns the saved Figure."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.schemas import artifact_metadata, read_artifact
from sparrow.schemas.footer import file_json, footer_number

from ..calibrate import PRIOR_RANGE_NOTE, ResolvedThreshold
from ..core.schedule import MIN_TOKENS
from ..kv_policies.eviction import EVICTION_POLICIES
from .canvas import Figure, integer_steps, save, say
from .collect import calibrated_runs
from .tables import RolloutStats, caption_bins, files_of, reward_stats, rollout_stats, sql_rows


@dataclass(frozen=True)
class TailLine:
    """What a profile's tail is drawn against: the threshold, and the fewest tokens a bin needs for the
    planner to trust its tail (--min-tokens, as the schedule that gave the threshold records it; the
    planner's default else). Bins with fewer are drawn hollow."""

    threshold: ResolvedThreshold
    min_tokens: int = MIN_TOKENS


def tail_figure(mismatch: Path, name: str, line_at: TailLine, out: Path, plt) -> Figure:
    """Tail and mean alpha per bin and budget, each point at the mean position of its bin's tokens (a bin's
    tokens may fill only part of it); the threshold applies to the tail only."""
    threshold, min_tokens = line_at.threshold, line_at.min_tokens
    rows = tail_rows(mismatch, threshold.quantile)
    meta = artifact_metadata(mismatch)
    evicting = meta.get("kv_compression") or None
    budget_word = f"{evicting} KV budget" if evicting else "budget"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    if not rows:
        for ax in axes:
            say(ax, "the profile has no scored tokens")
    for budget in sorted({r[0] for r in rows}):
        part = [r for r in rows if r[0] == budget]
        x = [r[5] for r in part]
        for ax, column in ((axes[0], 2), (axes[1], 3)):
            line, = ax.plot(x, [r[column] for r in part], marker="o", label=f"{budget_word} {budget}")
            thin = [(r[5], r[column]) for r in part if r[4] < min_tokens]
            if thin:  # hollow: a tail the planner does not trust
                ax.plot(*zip(*thin), ls="none", marker="o", mfc="white", mec=line.get_color())
    thin_bins = sorted({r[1] for r in rows if r[4] < min_tokens})
    label = f"threshold {threshold.short}"
    if rows:
        axes[0].axhline(threshold.value, color="k", ls="--", lw=1, label=label)
        if thin_bins:
            axes[0].plot([], [], ls="none", marker="o", mfc="white", mec="grey",
                         label=f"fewer than {min_tokens} tokens")
        for ax, title in zip(axes, (f"p{threshold.quantile * 100:g} of alpha (the tail)", "mean alpha")):
            ax.set_xlabel("position (cache length when the token was produced)")
            integer_steps(ax.xaxis)  # positions are whole numbers
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("acceptance alpha")
    top_in = _shared_legend(fig, axes[0]) if rows else 0.0
    title = f"Tail and mean alpha per position bin and {budget_word}: {mismatch.name}{_actor(meta)[0]}"
    if not rows:
        return save(fig, out, name, title, f"From {mismatch.name}: no scored tokens, so no tail to draw.",
                     plt, 0)
    tokens = sum(r[4] for r in rows) // max(len({r[0] for r in rows}), 1)
    said = "bin " if len(thin_bins) == 1 else "bins "
    thin_words = (f" Hollow points: {said}{', '.join(map(str, thin_bins))}, with fewer than {min_tokens} "
                  f"tokens, whose tails plan-schedule does not trust (--min-tokens {min_tokens})."
                  if thin_bins else "")
    return save(fig, out, name, title,
                 f"From {mismatch.name}: {tokens} generated tokens, each scored at every {budget_word}, in "
                 f"{_bins(mismatch, rows)} (each point sits at the mean position of its bin's tokens). The "
                 f"dashed line on the tail panel is the {label}: {_planned(evicting)} Where the threshold "
                 f"comes from: {threshold.source}.{thin_words}{_actor(meta)[1]}", plt, len(rows), top_in)


def tail_rows(mismatch: Path, quantile: float) -> list[tuple]:
    """Per budget and bin of a profile: its tail (the `quantile` of alpha), mean alpha, token count, and the
    mean, first and last position of its tokens."""
    return sql_rows(files_of(mismatch), lambda scan: f"""SELECT budget, bin,
                    quantile_cont(alpha, {float(quantile)}) AS tail, avg(alpha) AS mean,
                    count(*) AS n, avg(position) AS at, min(position) AS first, max(position) AS last
                    FROM {scan} GROUP BY ALL ORDER BY ALL""")


def _actor(meta: dict) -> tuple[str, str]:
    """The title's and the caption's words on the actor that scored a profile, where it records one
    (`sparrow distill` writes its profiles before and after its adapter): ("", "") otherwise."""
    adapter, actor, start = meta.get("adapter"), meta.get("actor"), meta.get("init_adapter")
    if isinstance(adapter, str) and adapter:
        return (f", with the adapter {Path(adapter).name}",
                f" Scored by the sparse actor with the distilled adapter {adapter}.")
    if isinstance(start, str) and start:
        return (f", with the starting adapter {Path(start).name}",
                f" Scored by the sparse actor with the adapter distillation started from, {start}.")
    if isinstance(actor, str) and actor:
        return ", without an adapter", f" Scored by the {actor}, without an adapter."
    return "", ""


def distill_figure(before: Path, after: Path, name: str, line_at: TailLine, out: Path, plt) -> Figure:
    """A profile scored without and with a distilled adapter (distill's before.parquet and after.parquet):
    their tails per position bin and budget on one panel, against the threshold of `line_at`."""
    threshold = line_at.threshold
    start = artifact_metadata(before).get("init_adapter")
    started = isinstance(start, str) and bool(start)
    before_label = "the starting adapter" if started else "without the adapter"
    before_said = f"with the starting adapter {start}" if started else "without the adapter"
    fig, ax = plt.subplots(figsize=(9, 4.8))
    rows = {path: tail_rows(path, threshold.quantile) for path in (before, after)}
    budgets = sorted({r[0] for part in rows.values() for r in part})
    for i, budget in enumerate(budgets):
        colour = f"C{i % 10}"
        for path, style, words in ((before, "--", before_label), (after, "-", "with the distilled adapter")):
            part = [r for r in rows[path] if r[0] == budget]
            if part:
                ax.plot([r[5] for r in part], [r[2] for r in part], style, color=colour, marker="o",
                        mfc="white" if path == before else colour,
                        label=f"budget {budget}, {words}")
    if not budgets:
        say(ax, "neither profile has scored tokens")
    else:
        ax.axhline(threshold.value, color="k", ls=":", lw=1, label=f"threshold {threshold.short}")
        ax.set_xlabel("position (cache length when the token was produced)")
        integer_steps(ax.xaxis)
        ax.set_ylabel(f"p{threshold.quantile * 100:g} of alpha (the tail)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncols=2)
    adapter = artifact_metadata(after).get("adapter")
    title = f"Tail per position bin before and after distillation ({before.parent.name}/)"
    return save(fig, out, name, title,
                f"From {before.name} ({before_said}: dashed, hollow) and {after.name} (with the "
                f"adapter {adapter}: solid), each point at the mean position of its bin's tokens; a point "
                f"above the dotted line is a bin where that budget's tail reaches the threshold "
                f"({threshold.source}).",
                plt, sum(len(part) for part in rows.values()))


LEGEND_COLUMNS = 4
LEGEND_ROW_IN = 0.18  # a legend row's height, inches, at fontsize 8


def _shared_legend(fig, ax) -> float:
    """One legend for both panels, above them (inside a panel it covers lines, and the panels share their
    budgets' colours); returns the inches it takes at the figure's top."""
    handles, labels = ax.get_legend_handles_labels()
    columns = min(len(handles), LEGEND_COLUMNS)
    rows = -(-len(handles) // columns)
    height_in = fig.get_size_inches()[1]
    fig.legend(handles, labels, loc="upper center", ncols=columns, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / height_in))
    return 0.15 + rows * LEGEND_ROW_IN


def _bins(mismatch: Path, rows: list[tuple]) -> str:
    """The profile's bins as the caption names them (`caption_bins`)."""
    return caption_bins(mismatch, [(r[1], r[6], r[7]) for r in rows]).words


def _planned(evicting: str | None) -> str:
    """How plan-schedule reads the tail against the threshold: block top-k per bin, eviction one KV budget
    for the whole sequence (what it evicts is gone for every later position)."""
    if not evicting:
        return "a budget whose tail stays above it in a bin may be scheduled there."
    return (f"{evicting} keeps one KV budget for the whole sequence (an evicted token is gone for every "
            "later position), so plan-schedule plans the cheapest KV budget whose tail stays at or above it "
            "in every trusted bin, never one budget per bin.")


def calibration_figure(threshold: Path, name: str, out: Path, plt) -> Figure | None:
    """Per calibrated run: its tail statistic and its mean alpha against its outcome, with the threshold
    and its interval: the method's key claim (the tail separates stable from collapsed runs, the mean
    need not) as one figure. None when the artifact holds no runs (the prior or a shipped calibration)."""
    meta = artifact_metadata(threshold)
    runs = calibrated_runs(threshold)
    if not runs:
        return None
    t = read_artifact(threshold, "threshold").to_pylist()[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    jitter = np.random.default_rng(0).uniform(-0.12, 0.12, len(runs))
    y = np.array([1.0 if r["collapsed"] else 0.0 for r in runs]) + jitter
    colour = ["tab:red" if r["collapsed"] else "tab:green" for r in runs]
    mean_at = meta.get("mean_threshold")
    tail_is = f"p{t['quantile'] * 100:g}"  # the quantile the runs' tails were calibrated at
    for ax, key, line, what in ((axes[0], "tail", t["threshold"], f"tail: min over bins of {tail_is} alpha"),
                                (axes[1], "mean", mean_at, "mean alpha")):
        ax.scatter([r[key] for r in runs], y, c=colour, s=36, edgecolors="k", linewidths=0.4)
        if line is not None:  # a threshold the runs did not give (the prior) is drawn too, dotted, so
            # the runs' tails show where they lie against the threshold a plan uses
            given = key == "mean" or t["source"] == "calibrated"
            what_line = "boundary" if key == "mean" else "threshold" if given else f"{t['source']} threshold"
            ax.axvline(float(line), color="k", ls="--" if given else ":", lw=1,
                       label=f"{what_line} {float(line):.3g}")
            ax.legend(fontsize=8, loc="center left")
        ax.set_xlabel(what)
        ax.grid(alpha=0.3)
    if t["source"] == "calibrated" and t["lower"] is not None and t["upper"] is not None:
        axes[0].axvspan(t["lower"], t["upper"], color="grey", alpha=0.25, label="95% interval")
        axes[0].legend(fontsize=8, loc="center left")
    if mean_at is not None and (between := _mean_interval(meta)) is not None:
        axes[1].axvspan(*between, color="grey", alpha=0.25, label="95% interval")
        axes[1].legend(fontsize=8, loc="center left")
    axes[0].set_yticks([0, 1], ["stable", "collapsed"])
    axes[0].set_ylim(-0.5, 1.5)
    n_c = sum(r["collapsed"] for r in runs)
    calibrated = t["source"] == "calibrated" and t["lower"] is not None and t["upper"] is not None
    interval = (f" [{t['lower']:.3g}, {t['upper']:.3g}] (calibrated, 95% bootstrap interval)" if calibrated
                else f" ({t['source']})" if t["source"] != "prior" else f" (prior; {PRIOR_RANGE_NOTE})")
    return save(fig, out, name, f"Runs' tail and mean alpha against their outcome ({threshold.name})",
                 f"From {threshold.name}: {len(runs)} run{'s' * (len(runs) != 1)}, {n_c} collapsed "
                 f"(labelled by what training did, never by mismatch); each run's tail is the minimum over "
                 f"position bins of the {t['quantile']:g} quantile ({tail_is}) of alpha. Threshold "
                 f"{t['threshold']:.3g}{interval}. "
                 f"{_sentence(meta.get('mean_note') or '')}", plt, len(runs))


def _mean_interval(meta: dict) -> tuple[float, float] | None:
    """The 95% bootstrap interval of the boundary on mean alpha, from the threshold artifact's `separations`
    (what `calibrate-threshold` says in the caption's mean note); None where it records none."""
    try:
        separations = file_json(meta.get("separations") or "[]")
    except (TypeError, ValueError):
        return None
    for s in separations if isinstance(separations, list) else []:
        if isinstance(s, dict) and s.get("what") == "mean alpha":
            low, high = s.get("lower"), s.get("upper")
            return (float(low), float(high)) if _number(low) and _number(high) and low <= high else None
    return None


def schedule_figure(schedule: Path, name: str, out: Path, plt) -> Figure:
    from ..core.published_schedules import published_budgets

    table = read_artifact(schedule, "schedule").sort_by("bin").to_pylist()
    meta = artifact_metadata(schedule)
    model, threshold = meta.get("model"), footer_number(meta, "threshold", schedule)
    published = published_budgets(model, threshold) if model and threshold else None
    fig, ax = plt.subplots(figsize=(8, 4.4))
    drafts = meta.get("speculate")  # plan-schedule --speculate's draft budgets
    title = (f"The draft schedule for --speculate {drafts}" if drafts else "The schedule"
             ) + f": budget per position bin ({schedule.name})"
    if not table:  # no bin to draw, and "every bin is dense" would be false
        say(ax, "the schedule has no bins")
        return save(fig, out, name, title, f"From {schedule.name}: no bins, so no budget to draw.", plt, 0)
    starts = [r["bin_start"] for r in table]
    budgets = [r["budget"] or 0 for r in table]
    last = table[-1]["bin_end"] if table else None
    width = footer_number(meta, "bin_width", schedule) or (starts[1] - starts[0] if len(starts) > 1 else 2000)
    edges = [*starts, last if last is not None else (starts[-1] if starts else 0) + width]
    if any(budgets):
        sparse = [b if b else np.nan for b in budgets]
        ax.step(edges, [*sparse, sparse[-1]], where="post", marker="", label="planned budget")
    for i, b in enumerate(budgets):
        if not b:
            ax.axvspan(edges[i], edges[i + 1], color="grey", alpha=0.2,
                       label="dense (whole cache)" if i == budgets.index(0) else None)
    if published:
        x = [2000 * i for i in range(len(published) + 1)]
        ax.step(x, [*published, published[-1]], where="post", ls="--", label=f"published ({model})")
    if not any(budgets) and not published:
        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(_all_dense(meta), 60)), ha="center", va="center",
                transform=ax.transAxes, fontsize=10, color="#333")
        ax.set_yticks([])
    else:
        ax.set_ylabel("budget (KV tokens)")
        ax.legend(fontsize=8)
    ax.set_xlabel("position (cache length)")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    dense = budgets.count(0)
    what = (f"{len(table)} bins, {dense} dense" + (f", budgets {min(b for b in budgets if b)}-{max(budgets)}"
                                                     if any(budgets) else ""))
    source = ((f", model {model}" if model else "")
              + (f", threshold {threshold:.3g}" if threshold else "")
              + (f", the sampler a training run used ({meta['source']}), not a plan"
                 if _sampled(meta) else "")
              + (f", draft budgets for exact speculative rollouts (--speculate {drafts}), planned for speed "
                 "under verification with no tail threshold behind them" if drafts else ""))
    ends = _last_bin(meta, last, edges[-1])
    return save(fig, out, name, title,
                 f"From {schedule.name}{source}: {what}. "
                 + (f"Grey spans are dense bins (every cached token is attended); {ends}" if dense
                    else _sentence(ends))
                 + (" The dashed line is the published schedule at this threshold." if published else ""),
                 plt, len(table))


def _last_bin(meta: dict, end: int | None, drawn_to: int) -> str:
    """The caption's words on the last bin: where an open one is drawn to and where it really ends (the
    model's context, from the schedule's `model_config` where it records one)."""
    if end is not None:
        return f"the last bin ends at position {end}."
    try:
        config = file_json(meta.get("model_config") or "{}")
    except (TypeError, ValueError):
        config = None
    context = config.get("max_position_embeddings") if isinstance(config, dict) else None
    known = isinstance(context, int) and not isinstance(context, bool) and context > 0
    ends = f"the end of the context ({context:,} tokens)" if known else "the end of the context"
    return f"the last bin is open: it is drawn to position {drawn_to:,} but holds its budget to {ends}."


def _sampled(meta: dict) -> bool:
    """A schedule that records the sampler a training run used (`sparrow train` writes its run's
    `source`), not one that `plan-schedule` planned from a profile against a threshold."""
    return bool(meta.get("source")) and not meta.get("threshold") and not meta.get("profile")


def _all_dense(meta: dict) -> str:
    """Why every bin of a schedule is dense, by what made it: a planned schedule's profile and threshold
    gave no sparse bin; a training run's was dense by choice; anything else says only what it is."""
    if meta.get("threshold") or meta.get("profile"):
        return ("Every bin is dense: no profiled budget's tail reached the threshold in any bin, so no "
                "position is decoded sparsely (a lower threshold, or larger profiled budgets, would give a "
                "sparse bin).")
    if _sampled(meta):
        plain = meta["source"] == "dense"
        return ((f"Dense run (no schedule): the training run sampled with the whole cache at every position "
                 f"(sampler {meta['source']})" if plain else
                 f"Dense run: the training run's schedule ({meta['source']}) has the whole cache at every "
                 "position") + "; no profile or threshold was involved.")
    return "Every bin is dense: every position attends to the whole cache (the artifact names no plan)."


def _sentence(line: str) -> str:
    """A printed line ("mean alpha: ...") as a caption's sentence: capitalised, ended by a full stop."""
    return f"{line[:1].upper()}{line[1:]}{'' if not line or line.endswith('.') else '.'}"


def cost_figure(cost: Path, name: str, out: Path, plt) -> Figure:
    rows = read_artifact(cost, "cost").to_pylist()
    measured_rows = [r for r in rows if r["seconds"] is not None]
    meta = artifact_metadata(cost)
    if measured_rows:
        fig, ax = plt.subplots(figsize=(6, 5))
        measured = np.array([r["seconds"] for r in measured_rows]) * 1e3
        predicted = np.array([r["predicted_seconds"] for r in measured_rows]) * 1e3
        sparse = np.array([r["budget"] is not None for r in measured_rows])
        for chosen, label in ((~sparse, "dense"), (sparse, "sparse")):
            if chosen.any():  # a legend names only what was drawn
                ax.scatter(measured[chosen], predicted[chosen], label=label, s=18)
        both = np.concatenate([measured, predicted])
        logged = spans_decades(both)
        low, top = (both.min() / 1.2, both.max() * 1.2) if logged else (0, both.max() * 1.05)
        ax.plot([low, top], [low, top], "k--", lw=1, label="y = x (a perfect fit)")
        if logged:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("measured decode step (ms" + (", log scale)" if logged else ")"))
        ax.set_ylabel("cost model (ms" + (", log scale)" if logged else ")"))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        err = np.abs(predicted - measured) / measured
        return save(fig, out, name, f"Cost model against measured decode steps ({cost.name})",
                     f"From {cost.name} ({meta.get('source', 'measured')}, model {meta.get('model', '?')}): "
                     f"{len(measured_rows)} measured (batch, context, budget) points, each the fastest of "
                     f"its timed steps; median relative error of the fit {np.median(err):.1%}.", plt,
                     len(measured_rows))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    if not rows:
        say(ax, "the cost artifact has no points")
        return save(fig, out, name, f"Cost model ({cost.name})", f"From {cost.name}: no points to draw.",
                     plt, 0)
    batches = sorted({r["batch"] for r in rows})
    drawn = batches[:-3:-1]  # the largest batch, then the next
    for batch, style in zip(drawn, ("-", "--")):
        for budget in sorted({r["budget"] or 0 for r in rows}):
            pts = sorted((r["context"], r["predicted_seconds"] * 1e3) for r in rows
                         if r["batch"] == batch and (r["budget"] or 0) == budget)
            ax.plot(*zip(*pts), style, marker="o", ms=3,
                    label=f"batch {batch}, {'dense' if not budget else f'budget {budget}'}")
    if rows:
        ax.set_xlabel("context (cached tokens)")
        ax.set_ylabel("predicted decode step (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return save(fig, out, name, f"Analytic cost model: predicted decode step ({cost.name})",
                 f"From {cost.name}: the {meta.get('source', 'analytic')} model for "
                 f"{meta.get('model', 'the model')}, predicted only (no measured points to compare with; "
                 "`sparrow fit-cost --device` measures them). "
                 + (f"Solid: the largest batch ({drawn[0]}), dashed: the next ({drawn[1]})." if len(drawn) > 1
                    else f"One batch ({drawn[0]})."), plt, len(rows))


def spans_decades(values: np.ndarray, ratio: float = 10.0) -> bool:
    """Positive values whose largest is `ratio` times their smallest or more: drawn on a linear axis, the
    small ones would sit in one blob at the origin, so their axis is logarithmic."""
    positive = values[values > 0]
    return len(positive) == len(values) and len(values) > 1 and positive.max() >= ratio * positive.min()


def rollouts_figure(rollouts: Path, name: str, out: Path, plt) -> Figure:
    from matplotlib.ticker import MaxNLocator

    stats = rollout_stats(rollouts)
    meta = artifact_metadata(rollouts)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    n = len(stats.lengths)
    if not n:
        for ax in axes:
            say(ax, "the rollouts artifact has no samples")
        return save(fig, out, name, f"Rollouts ({rollouts.name})", f"From {rollouts.name}: no samples.",
                     plt, 0)
    lengths, stops = stats.lengths, stats.stops
    low, top = int(lengths.min()), int(lengths.max())
    bins = np.arange(low - 1, top + 3) - 0.5 if top - low < 40 else 20  # one bar per length when few
    ignore_eos = bool(meta.get("ignore_eos"))
    cut = "ran to --max-new-tokens (--ignore-eos)" if ignore_eos else "cut at --max-new-tokens"
    groups = [(part, label) for part, label in ((lengths[stops], "stopped (EOS)"), (lengths[~stops], cut))
              if len(part)]  # a legend names only what was drawn
    axes[0].hist([part for part, _ in groups], bins=bins, stacked=True, label=[label for _, label in groups])
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_xlabel("generated tokens per sample")
    axes[0].set_title(f"length per sample (mean {lengths.mean():.1f})", fontsize=10)
    axes[0].set_ylabel("samples")
    axes[0].legend(fontsize=8, loc="best")
    finite = _reward_panel(axes[1], stats.rewards,
                           "no rewards: the prompts carry no answer, or their task has no scorer")
    for ax in axes[:2 if len(finite) else 1]:  # a panel that says why it is empty gets no ticks
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of samples
    summary = meta.get("summary") or {}
    summary = summary if isinstance(summary, dict) else {}
    speed = summary.get("tokens_per_s")
    caption = (f"From {rollouts.name}: {n} samples, sampler {meta.get('sparsity', 'unknown')}"
               + _budget_words(stats) + _speculation_words(stats, summary.get("tokens_per_cycle"))
               + (", every sample ran to --max-new-tokens (--ignore-eos)" if ignore_eos
                  else f", {stops.mean():.0%} stopped at EOS")
               + (f", {float(speed):.1f} tokens/s" if _number(speed) else "") + _sampling(meta) + "."
               + _reward_range(finite, len(stats.rewards) - len(finite)))
    return save(fig, out, name, f"Rollouts: lengths and rewards ({rollouts.name})", caption, plt, n)


def _budget_words(stats: RolloutStats) -> str:
    """The caption's words on the budgets of the sparse tokens: under an eviction policy the KV budget (the
    tokens its cache keeps), else block top-k's budget (the cached tokens a step reads)."""
    if not stats.sparse_tokens:
        return ""
    mean = stats.sparse_budget_sum / stats.sparse_tokens
    names = {p.split(":")[0] for p in stats.policies}
    if evicting := sorted(n for n in names if n.lower() in EVICTION_POLICIES):
        return f" (mean KV budget {mean:.0f}: the cached tokens {' and '.join(evicting)} eviction keeps)"
    return f" (mean budget of sparse tokens {mean:.0f})"


def _speculation_words(stats: RolloutStats, tokens_per_cycle: object) -> str:
    """The caption's words on speculative rollouts: the acceptance the artifact records (drafts the dense
    model kept over drafts proposed), and the tokens a sample's cycle emitted where the summary has them."""
    if not stats.drafted:
        return ""
    per_cycle = f", {float(tokens_per_cycle):.2f} tokens per cycle" if _number(tokens_per_cycle) else ""
    return (f"; acceptance {stats.accepted / stats.drafted:.1%} ({stats.accepted} of {stats.drafted} drafts "
            f"kept){per_cycle}")


def _sampling(meta: dict) -> str:
    """The caption's words on how the samples were drawn, as the artifact records it: two panels of one
    prompt set differ by these."""
    temperature, seed = meta.get("temperature"), meta.get("seed")
    words = []
    if _number(temperature):
        words.append("greedy" if float(temperature) <= 0 else f"temperature {float(temperature):g}")
    if _number(meta.get("top_p")) and float(meta["top_p"]) < 1:
        words.append(f"top-p {float(meta['top_p']):g}")
    if _number(meta.get("top_k")) and int(meta["top_k"]) > 0:
        words.append(f"top-k {int(meta['top_k'])}")
    if _number(seed):
        words.append(f"seed {int(seed)}")
    return "; sampled " + ", ".join(words) if words else ""


def rewards_figure(rewards: Path, name: str, out: Path, plt) -> Figure:
    """A `sparrow reward` artifact: its rewards as rollouts' are drawn, and how many completions got each
    status (passed, failed, timeout, ...)."""
    from matplotlib.ticker import MaxNLocator

    stats = reward_stats(rewards)
    meta = artifact_metadata(rewards)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    n = len(stats.rewards)
    if not n:
        for ax in axes:
            say(ax, "the rewards artifact has no scored completions")
        return save(fig, out, name, f"Rewards ({rewards.name})", f"From {rewards.name}: no completions.",
                     plt, 0)
    finite = _reward_panel(axes[0], stats.rewards, "")
    labels = [status or "none" for status, _ in stats.statuses]
    axes[1].barh(labels[::-1], [count for _, count in stats.statuses][::-1])
    axes[1].set_xlabel("completions")
    axes[1].set_title("status per completion", fontsize=10)
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(finite):  # a panel that says why it is empty gets no ticks
        axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[0 if len(finite) else 1:]:
        ax.grid(alpha=0.3)
    scorer = meta.get("reward")
    statuses = ", ".join(f"{count} {status or 'without a status'}" for status, count in stats.statuses)
    caption = (f"From {rewards.name}: {n} scored completions" + (f", reward {scorer}" if scorer else "")
               + f", {statuses}." + _reward_range(finite, n - len(finite)))
    return save(fig, out, name, f"Rewards: per completion and by status ({rewards.name})", caption, plt, n)


def _reward_panel(ax, rewards: np.ndarray, none_why: str) -> np.ndarray:
    """The histogram of `rewards` on `ax` (or why there is none); the finite rewards it holds."""
    finite = rewards[np.isfinite(rewards)]
    if len(finite):
        edges = reward_bins(finite)
        ax.hist(finite, bins=edges)
        ax.set_xlim(edges[0], edges[-1])
        ax.set_xlabel("reward")
        ax.set_ylabel("samples")
        over = "" if len(finite) == len(rewards) else f" of the {len(finite)} finite"
        ax.set_title(f"reward per sample (mean{over} {finite.mean():.3f})", fontsize=10)
    else:
        say(ax, "no finite reward to draw: every reward is NaN or infinite" if len(rewards) else none_why)
    return finite


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and bool(np.isfinite(value))


def reward_bins(rewards: np.ndarray, bins: int = 10) -> np.ndarray:
    """The edges of the reward histogram: `bins` equal bins over [0, 1] widened to the rewards' own range,
    so that every reward is drawn (a reward function's are kept as it returns them: -1, a bonus of 1.5)
    and the usual [0, 1] rewards keep their usual axis."""
    return np.linspace(min(0.0, float(rewards.min())), max(1.0, float(rewards.max())), bins + 1)


def _reward_range(finite: np.ndarray, not_finite: int) -> str:
    """The caption's words on the rewards the histogram's axis does not say: a range beyond [0, 1], and
    the NaN or infinite rewards it cannot draw."""
    said = ""
    if len(finite) and (finite.min() < 0 or finite.max() > 1):
        said += f" Rewards range from {finite.min():.4g} to {finite.max():.4g}, beyond [0, 1]."
    if not_finite:
        said += (f" {not_finite} reward{'s are' if not_finite > 1 else ' is'} NaN or infinite, left out of "
                 "the histogram and of the mean in its title.")
    return said
