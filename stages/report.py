"""`sparrow report`: the figures a person wants from a run directory, as PNGs and one HTML page.

Whatever the directory holds decides the figures (every artifact and training run in it is drawn);
each PNG says in itself what it shows, and the HTML page embeds them so it can travel alone.
docs/report.md lists the figures.
"""

from __future__ import annotations

import base64
import html
import io
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.schemas import ArtifactError, artifact_metadata, read_artifact
from sparrow.schemas.footer import artifact_parts, kind_version, read_schema
from sparrow.schemas.io import write_bytes

from .calibrate import ResolvedThreshold, resolve_threshold
from .core.definitions import TAIL_QUANTILE
from .train.detectors import Detectors

DRAWN = ("mismatch", "schedule", "cost", "rollouts")
FIGURED = (*DRAWN, "threshold", "train_mismatch")  # threshold: when calibrated on runs
NO_FIGURE = {"metrics": "a 'metrics' artifact is drawn only as a training run's metrics.parquet"}


@dataclass
class Steps:
    """The per-step mismatch files of a training run (or of a train_mismatch artifact) that passed the
    footer check, drawn as one figure; `left_out` counts those that did not (each listed as not drawn)."""

    where: str  # the folder, as the caption names it
    name: str  # the figure's file
    files: list[Path]
    left_out: int = 0


@dataclass
class Figure:
    file: str
    title: str
    caption: str
    points: int  # data points drawn
    said: tuple[str, ...] = ()  # the words drawn where a panel had nothing to show


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _step_names(run: Path) -> list[Path]:
    """A training run's per-step mismatch files, by name (`sparrow train` writes mismatch/step=N.parquet)."""
    folder = run / "mismatch"
    return sorted(folder.glob("step=*.parquet")) if folder.is_dir() else []


def _runs(run_dir: Path) -> list[Path]:
    """The training runs: `run_dir` itself, then its immediate subdirectories, that hold a metrics.parquet
    or per-step mismatch files (a run whose metrics are missing still has its mismatch to draw)."""
    candidates = [run_dir, *(p for p in sorted(run_dir.iterdir()) if p.is_dir())]
    return [p for p in candidates if (p / "metrics.parquet").exists() or _step_names(p)]


def _artifacts(folder: Path, skipped: list[str], runs: list[Path]) -> dict[str, list[Path]]:
    """Every artifact directly in `folder` by kind, in name order: files, and directories of parts that are
    not training runs (nor the run's own files when `folder` is one). What cannot be read as an artifact,
    or has no figure, goes to `skipped`, with why."""
    own = set(runs)
    if folder in runs:
        own.add(folder / "metrics.parquet")
        if _step_names(folder):
            own.add(folder / "mismatch")
    out: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p in own:
            continue
        if p.is_dir() and not any(c.suffix == ".parquet" for c in p.iterdir()):
            continue
        if not p.is_dir() and p.suffix != ".parquet":
            continue
        if p.exists() and not p.is_dir() and not p.is_file():  # a FIFO or a device: reading it could block
            skipped.append(f"{p} is not a regular file")
            continue
        for kind, path in _kinds(p, skipped):
            if kind in FIGURED:
                out.setdefault(kind, []).append(path)
            else:
                skipped.append(f"{path} ({NO_FIGURE.get(kind, f'a {kind!r} artifact has no figure')})")
    return out


def _inside_runs(run_dir: Path, runs: list[Path], skipped: list[str]) -> None:
    """A subdirectory run is drawn by its metrics and mismatch; its other Parquet files and folders (its
    schedule, say) are named in `skipped`, with the command that draws them."""
    for run in runs:
        if run == run_dir:
            continue
        own = {run / "metrics.parquet", run / "mismatch"}
        for p in sorted(run.iterdir()):
            if p.name.startswith(".") or p in own:
                continue
            if p.suffix == ".parquet" or (p.is_dir() and any(c.suffix == ".parquet" for c in p.iterdir())):
                skipped.append(f"{p} (inside the training run {run.name}; `sparrow report {run}` draws it)")


def _checked_steps(files: list[Path], skipped: list[str]) -> tuple[list[Path], int]:
    """The files that pass the footer check every command runs (a regular, whole Parquet file of kind
    train_mismatch), and how many did not: each of those goes to `skipped`, so that a run killed in
    the middle of writing a step still has its other steps drawn."""
    good: list[Path] = []
    for f in files:
        if not f.is_file():  # a FIFO or a device: reading it could block
            skipped.append(f"{f} is not a regular file")
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


def _steps(run_dir: Path, runs: list[Path], kinds: dict[str, list[Path]], skipped: list[str]
           ) -> dict[Path, Steps]:
    """Each run's per-step mismatch, then each train_mismatch artifact outside a run (the files directly in
    `run_dir` as one), keyed by what they belong to."""
    out: dict[Path, Steps] = {}
    for run in runs:
        if names := _step_names(run):
            out[run] = Steps(f"{run.name}/mismatch", f"train-mismatch-{run.name}.png",
                             *_checked_steps(names, skipped))
    loose = [p for p in kinds.get("train_mismatch", []) if p.parent == run_dir and not p.is_dir()]
    if loose:  # keyed and named apart from `run_dir` itself, which may be a run
        name = f"train-mismatch-{run_dir.name}{'-files' if run_dir in out else ''}.png"
        out[run_dir / "*"] = Steps(run_dir.name, name, loose)
    for path in kinds.get("train_mismatch", []):
        if path not in loose:
            files = artifact_parts(path) if path.is_dir() else [path]
            out[path] = Steps(str(path.relative_to(run_dir)), _name("train-mismatch", path, True, run_dir),
                              files)
    return out


def _curves(runs: list[Path], skipped: list[str]) -> list[Path]:
    """The runs whose training curves can be drawn: a metrics.parquet that passes the footer check. The
    others are named in `skipped` (their per-step mismatch is drawn all the same)."""
    out: list[Path] = []
    for run in runs:
        metrics = run / "metrics.parquet"
        why = f"{metrics} does not exist" if not metrics.exists() else None
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


def _calibrated_runs(threshold: Path) -> list[dict]:
    """The runs a threshold artifact was calibrated on; none for the prior or a shipped calibration."""
    import json

    return json.loads(artifact_metadata(threshold).get("runs") or "[]")


def _calibrations(kinds: dict[str, list[Path]], skipped: list[str]) -> list[Path]:
    """The threshold artifacts that have a figure (those calibrated on runs). One without runs that no tail
    figure uses (the tail figures use the first) is named in `skipped`."""
    thresholds = kinds.get("threshold", [])
    used = thresholds[0] if thresholds and kinds.get("mismatch") else None
    out: list[Path] = []
    for path in thresholds:
        if _calibrated_runs(path):
            out.append(path)
        elif path != used:
            skipped.append(f"{path} (a 'threshold' artifact without calibrated runs has no figure of its own"
                           + (f", and the tail figures use {used}" if used else "") + ")")
    return out


def _kinds(path: Path, skipped: list[str]) -> list[tuple[str, Path]]:
    """(kind, artifact) of a Parquet file or of a directory of them. A directory whose files share a kind
    and a provenance (`sql`'s Provenance: model, sampler, adapter, ...) is one artifact of parts (a
    `--workers` output); one whose files share only the kind holds several artifacts, each drawn on its
    own (distill's profiles before and after its adapter: pooled, the curve would be neither's); one of
    several kinds is not one artifact and is skipped whole, in one line, so that the rest is drawn."""
    from .sql.views import Provenance

    files = artifact_parts(path) if path.is_dir() else [path]
    found: list[tuple[str | None, Provenance, Path]] = []
    try:
        for f in files:
            schema = read_schema(f)
            found.append((kind_version(schema)[0], Provenance.of(artifact_metadata(schema)), f))
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
    if path.is_dir() and len({p for _, p, _ in found}) > 1:
        return [(kind, f) for _, _, f in found]
    return [(kind, path)]


def _name(kind: str, path: Path, many: bool, run_dir: Path) -> str:
    """The figure's file: `tail.png` for the one profile, `tail-<file>.png` for each of several, where a
    file inside a directory is named with it (`tail-mismatch-before.png`), so that no two collide."""
    if not many:
        return f"{kind}.png"
    return f"{kind}-{'-'.join(path.relative_to(run_dir).with_suffix('').parts)}.png"


def _threshold(kinds: dict[str, list[Path]], mismatch: Path) -> ResolvedThreshold:
    """The threshold a profile's tail is drawn against, by the rule every command follows: the folder's
    threshold artifact, else the calibration shipped for the profile's model, else the prior."""
    files = kinds.get("threshold") or [None]
    return resolve_threshold(None, files[0], None, artifact_metadata(mismatch).get("model"))


def _say(ax, why: str) -> None:
    """A panel with nothing to draw says why, in place of empty axes."""
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 40)), ha="center", va="center", transform=ax.transAxes,
            fontsize=10, color="#555")


def _sql(query: str) -> list[tuple]:
    import duckdb

    return duckdb.sql(query).fetchall()


def _files(path: Path) -> str:
    """DuckDB's read_parquet argument for an artifact file or a directory of parts."""
    return f"'{path}/*.parquet'" if path.is_dir() else f"'{path}'"


def tail_figure(mismatch: Path, name: str, threshold: ResolvedThreshold, out: Path, plt) -> Figure:
    """Tail and mean alpha per bin and budget, each point at the mean position of its bin's tokens (a bin's
    tokens may fill only part of it); the threshold applies to the tail only."""
    rows = _sql(f"""SELECT budget, bin, quantile_cont(alpha, {threshold.quantile}) AS tail,
                    avg(alpha) AS mean, count(*) AS n, avg(position) AS at
                    FROM read_parquet({_files(mismatch)}) GROUP BY ALL ORDER BY ALL""")
    width = int(artifact_metadata(mismatch).get("bin_width", 2000))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    if not rows:
        for ax in axes:
            _say(ax, "the profile has no scored tokens")
    for budget in sorted({r[0] for r in rows}):
        part = [r for r in rows if r[0] == budget]
        x = [r[5] for r in part]
        axes[0].plot(x, [r[2] for r in part], marker="o", label=f"budget {budget}")
        axes[1].plot(x, [r[3] for r in part], marker="o", label=f"budget {budget}")
    label = f"threshold {threshold.short}"
    if rows:
        axes[0].axhline(threshold.value, color="k", ls="--", lw=1, label=label)
        for ax, title in zip(axes, (f"p{threshold.quantile * 100:g} of alpha (the tail)", "mean alpha")):
            ax.set_xlabel("position (cache length when the token was produced)")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("acceptance alpha")
    title = f"Tail and mean alpha per position bin and budget: {mismatch.name}"
    if not rows:
        return _save(fig, out, name, title, f"From {mismatch.name}: no scored tokens, so no tail to draw.",
                     plt, 0)
    tokens = sum(r[4] for r in rows) // max(len({r[0] for r in rows}), 1)
    return _save(fig, out, name, title,
                 f"From {mismatch.name}: {tokens} generated tokens, each scored at every budget, in bins of "
                 f"{width} tokens (each point sits at the mean position of its bin's tokens). The dashed "
                 f"line on the tail panel is the {label}: a budget whose tail stays above it in a bin may be "
                 "scheduled there.", plt, len(rows))


def calibration_figure(threshold: Path, name: str, out: Path, plt) -> Figure | None:
    """Per calibrated run: its tail statistic and its mean alpha against its outcome, with the threshold
    and its interval: the method's key claim (the tail separates stable from collapsed runs, the mean
    need not) as one figure. None when the artifact holds no runs (the prior or a shipped calibration)."""
    meta = artifact_metadata(threshold)
    runs = _calibrated_runs(threshold)
    if not runs:
        return None
    t = read_artifact(threshold, "threshold").to_pylist()[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    jitter = np.random.default_rng(0).uniform(-0.12, 0.12, len(runs))
    y = np.array([1.0 if r["collapsed"] else 0.0 for r in runs]) + jitter
    colour = ["tab:red" if r["collapsed"] else "tab:green" for r in runs]
    mean_at = meta.get("mean_threshold")
    for ax, key, line, what in ((axes[0], "tail", t["threshold"], "tail: min over bins of p5 alpha"),
                                (axes[1], "mean", mean_at, "mean alpha")):
        ax.scatter([r[key] for r in runs], y, c=colour, s=36, edgecolors="k", linewidths=0.4)
        if line is not None and (key == "mean" or t["source"] == "calibrated"):
            ax.axvline(float(line), color="k", ls="--", lw=1,
                       label=f"{'threshold' if key == 'tail' else 'boundary'} {float(line):.3g}")
            ax.legend(fontsize=8, loc="center left")
        ax.set_xlabel(what)
        ax.grid(alpha=0.3)
    if t["source"] == "calibrated" and t["lower"] is not None:
        axes[0].axvspan(t["lower"], t["upper"], color="grey", alpha=0.25, label="95% interval")
        axes[0].legend(fontsize=8, loc="center left")
    axes[0].set_yticks([0, 1], ["stable", "collapsed"])
    axes[0].set_ylim(-0.5, 1.5)
    n_c = sum(r["collapsed"] for r in runs)
    interval = f" [{t['lower']:.3g}, {t['upper']:.3g}]" if t["lower"] is not None else ""
    return _save(fig, out, name, f"Runs' tail and mean alpha against their outcome ({threshold.name})",
                 f"From {threshold.name}: {len(runs)} runs, {n_c} collapsed (labelled by what training did, "
                 f"never by mismatch). Threshold {t['threshold']:.3g}{interval} ({t['source']}). "
                 f"{meta.get('mean_note') or ''}", plt, len(runs))


def schedule_figure(schedule: Path, name: str, out: Path, plt) -> Figure:
    from .core.published_schedules import published_budgets

    table = read_artifact(schedule, "schedule").sort_by("bin").to_pylist()
    meta = artifact_metadata(schedule)
    model, threshold = meta.get("model"), meta.get("threshold")
    published = published_budgets(model, float(threshold)) if model and threshold else None
    fig, ax = plt.subplots(figsize=(8, 4.4))
    title = f"The schedule: budget per position bin ({schedule.name})"
    if not table:  # no bin to draw, and "every bin is dense" would be false
        _say(ax, "the schedule has no bins")
        return _save(fig, out, name, title, f"From {schedule.name}: no bins, so no budget to draw.", plt, 0)
    starts = [r["bin_start"] for r in table]
    budgets = [r["budget"] or 0 for r in table]
    last = table[-1]["bin_end"] if table else None
    width = int(meta.get("bin_width") or (starts[1] - starts[0] if len(starts) > 1 else 2000))
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
              + (f", threshold {float(threshold):.3g}" if threshold else "")
              + (f", the sampler a training run used ({meta['source']}), not a plan"
                 if _sampled(meta) else ""))
    return _save(fig, out, name, title,
                 f"From {schedule.name}{source}: {what}. Grey spans are dense bins (every cached token is "
                 "attended); the last bin extends to the end of the context."
                 + (" The dashed line is the published schedule at this threshold." if published else ""),
                 plt, len(table))


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
        return (f"Dense run (no schedule): the training run sampled with the whole cache at every position "
                f"(sampler {meta['source']}); no profile or threshold was involved.")
    return "Every bin is dense: every position attends to the whole cache (the artifact names no plan)."


def cost_figure(cost: Path, name: str, out: Path, plt) -> Figure:
    rows = read_artifact(cost, "cost").to_pylist()
    measured_rows = [r for r in rows if r["seconds"] is not None]
    meta = artifact_metadata(cost)
    if measured_rows:
        fig, ax = plt.subplots(figsize=(6, 5))
        measured = np.array([r["seconds"] for r in measured_rows]) * 1e3
        predicted = np.array([r["predicted_seconds"] for r in measured_rows]) * 1e3
        sparse = np.array([r["budget"] is not None for r in measured_rows])
        ax.scatter(measured[~sparse], predicted[~sparse], label="dense", s=18)
        ax.scatter(measured[sparse], predicted[sparse], label="sparse", s=18)
        top = max(measured.max(), predicted.max()) * 1.05
        ax.plot([0, top], [0, top], "k--", lw=1, label="y = x (a perfect fit)")
        ax.set_xlabel("measured decode step (ms)")
        ax.set_ylabel("cost model (ms)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        err = np.abs(predicted - measured) / measured
        return _save(fig, out, name, f"Cost model against measured decode steps ({cost.name})",
                     f"From {cost.name} ({meta.get('source', 'measured')}, model {meta.get('model', '?')}): "
                     f"{len(measured_rows)} measured (batch, context, budget) points, each the fastest of "
                     f"its timed steps; median relative error of the fit {np.median(err):.1%}.", plt,
                     len(measured_rows))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    if not rows:
        _say(ax, "the cost artifact has no points")
        return _save(fig, out, name, f"Cost model ({cost.name})", f"From {cost.name}: no points to draw.",
                     plt, 0)
    batches = sorted({r["batch"] for r in rows})
    for batch, style in zip(batches[-2:], ("-", "--")):  # the two largest batches
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
    return _save(fig, out, name, f"Analytic cost model: predicted decode step ({cost.name})",
                 f"From {cost.name}: the {meta.get('source', 'analytic')} model for "
                 f"{meta.get('model', 'the model')}, predicted only (no measured points to compare with; "
                 "`sparrow fit-cost --device` measures them). Solid: the largest batch, dashed: the next.",
                 plt, len(rows))


def rollouts_figure(rollouts: Path, name: str, out: Path, plt) -> Figure:
    from matplotlib.ticker import MaxNLocator

    rows = read_artifact(rollouts, "rollouts").to_pylist()
    meta = artifact_metadata(rollouts)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if not rows:
        for ax in axes:
            _say(ax, "the rollouts artifact has no samples")
        return _save(fig, out, name, f"Rollouts ({rollouts.name})", f"From {rollouts.name}: no samples.",
                     plt, 0)
    lengths = np.array([len(r["token_ids"]) for r in rows])
    stops = np.array([r["finish_reason"] == "stop" for r in rows])
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
    rewards = np.array([r["reward"] for r in rows if r["reward"] is not None], dtype=float)
    if len(rewards):
        axes[1].hist(rewards, bins=np.linspace(0, 1, 11))
        axes[1].set_xlim(0, 1)
        axes[1].set_xlabel("reward")
        axes[1].set_ylabel("samples")
        axes[1].set_title(f"reward per sample (mean {rewards.mean():.3f})", fontsize=10)
    else:
        _say(axes[1], "no rewards: the prompts carry no answer, or their task has no scorer")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of samples
    summary = meta.get("summary") or {}
    speed = summary.get("tokens_per_s") if isinstance(summary, dict) else None
    budgets = [b for r in rows for b in r["budgets"] if b]
    caption = (f"From {rollouts.name}: {len(rows)} samples, sampler {meta.get('sparsity', 'unknown')}"
               + (f" (mean budget of sparse tokens {np.mean(budgets):.0f})" if budgets else "")
               + (", every sample ran to --max-new-tokens (--ignore-eos)" if ignore_eos
                  else f", {stops.mean():.0%} stopped at EOS")
               + (f", {float(speed):.1f} tokens/s" if speed else "") + ".")
    return _save(fig, out, name, f"Rollouts: lengths and rewards ({rollouts.name})", caption, plt, len(rows))


TRAIN_PANELS = (("reward_mean", "reward (train, mean per step)"),
                ("eval_accuracy", "eval accuracy (greedy)"),
                ("mismatch_kl", "mismatch KL (sampled k3)"),
                ("alpha_lb_p5", "p5 of alpha's top-20 lower bound"), ("entropy", "entropy (nats)"),
                ("grad_norm", "grad norm"))
UNIT_PANELS = ("reward_mean", "eval_accuracy", "alpha_lb_p5")  # quantities in [0, 1], drawn on [0, 1]
EMPTY_PANEL = {"eval_accuracy": "no eval: the run had no --eval-prompts",
               "alpha_lb_p5": "not logged by this run"}


def training_figure(run: Path, out: Path, plt) -> Figure:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    rows = read_artifact(run / "metrics.parquet", "metrics").sort_by("step").to_pylist()
    meta = artifact_metadata(run / "metrics.parquet")
    label = meta.get("label", "unknown")
    name = f"train-{run.name}.png"
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    flagged = [r["step"] for r in rows if r.get("collapse")]
    warn_level = Detectors().mismatch_kl_limit
    for ax, (key, title) in zip(axes.flat, TRAIN_PANELS):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if key == "eval_accuracy" and meta.get("initial_eval_accuracy") is not None:
            pts.insert(0, (0, float(meta["initial_eval_accuracy"])))  # step 0: before any update
        ax.set_title(title, fontsize=10)
        if not pts:
            _say(ax, EMPTY_PANEL.get(key, "not logged by this run"))
            continue
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.plot(*zip(*pts), marker="o", ms=3, label="dense sampler")
        sparse = [(r["step"], r["eval_accuracy_sparse"]) for r in rows
                  if r.get("eval_accuracy_sparse") is not None]
        if key == "eval_accuracy" and sparse:  # the run's own sparse sampler, evaluated beside dense
            ax.plot(*zip(*sparse), marker="s", ms=3, label="the run's sparse sampler")
            ax.legend(fontsize=7)
        if key in UNIT_PANELS:
            ax.set_ylim(-0.02, 1.02)
        elif key in ("mismatch_kl", "grad_norm", "entropy"):
            ax.set_ylim(bottom=0)
        for s in flagged:
            ax.axvline(s, color="r", alpha=0.3)
        if key == "mismatch_kl":
            ax.axhline(warn_level, color="orange", ls="--", lw=1)
            peak = max(v for _, v in pts)
            ax.set_ylim(0, max(peak, warn_level) * 1.1 if peak > warn_level / 4 else peak * 1.1 or 1e-3)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color="orange", ls="--", label=f"mismatch KL warning level {warn_level:g} "
                      "(a diagnostic, not a collapse reason)")]
    if flagged:
        handles.insert(0, Line2D([], [], color="r", alpha=0.5, label="a collapse reason held at this step"))
    fig.legend(handles=handles, loc="upper right", fontsize=8, frameon=False, ncols=len(handles),
               bbox_to_anchor=(1, 0.955))
    story = f"label {label}" + (f" ({meta['reasons']})" if meta.get("reasons") else "")
    if meta.get("warnings"):
        story += f"; warning: {meta['warnings']}"
    caption = (f"From {run.name}/metrics.parquet: {len(rows)} steps; {story}. The label is the whole run's "
               "(its last step's collapse reasons: reward, grad norm, entropy, truncation or repetition); "
               + ("red lines mark the steps whose history up to them held a reason. " if flagged else
                  "no step held a collapse reason. ")
               + ("Step N is the row logged after N updates; eval accuracy at step 0 is before any update."
                  if meta.get("initial_eval_accuracy")
                  is not None else ""))
    return _save(fig, out, name, f"Training run {run.name}: {label}", caption, plt, len(rows), top_in=0.3)


def train_mismatch_figure(steps: Steps, out: Path, plt) -> Figure | None:
    """The sparse actor's mismatch over training, one line per position bin: the per-step summaries over
    all positions are in the training figure already. Only the files that passed the footer check are
    read; None when none did."""
    from matplotlib.ticker import MaxNLocator

    from .sql.views import sql_literal

    files = steps.files
    if not files:
        return None
    paths = ", ".join(sql_literal(str(p)) for p in files)
    rows = _sql(f"""SELECT bin, step, quantile_cont(alpha_top20_lb, {TAIL_QUANTILE}) AS p5, avg(k3) AS k3,
                    count(*) AS n FROM read_parquet([{paths}]) GROUP BY ALL ORDER BY ALL""")
    width = int(artifact_metadata(files[0]).get("bin_width", 512))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    bins = sorted({r[0] for r in rows})
    for b in bins:
        part = [r for r in rows if r[0] == b]
        label = f"positions {b * width}-{(b + 1) * width - 1}"
        axes[0].plot([r[1] for r in part], [r[2] for r in part], marker="o", ms=4, label=label)
        axes[1].plot([r[1] for r in part], [r[3] for r in part], marker="o", ms=4, label=label)
    axes[0].set_title("p5 of alpha's top-20 lower bound", fontsize=10)
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].set_title("mean k3 (sparse rollout vs dense learner)", fontsize=10)
    axes[1].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if not rows:
        for ax in axes:
            _say(ax, "the steps' mismatch files hold no tokens")
    else:
        axes[1].legend(fontsize=8, title="bin", title_fontsize=8)
    n_steps = len({r[1] for r in rows})
    left_out = (f" ({steps.left_out} unreadable {'file' if steps.left_out == 1 else 'files'} left out, each "
                "named under Not drawn)" if steps.left_out else "")
    return _save(fig, out, steps.name, f"Mismatch per position bin over training: {steps.where}",
                 f"From {len(files)} train_mismatch files in {steps.where}{left_out}: every generated token "
                 f"of {n_steps} steps, in bins of {width} tokens, one line per bin (the sampled-token k3 and "
                 "the top-20 lower bound of alpha, as the rollout and the dense recompute saw them).", plt,
                 len(rows))


def _save(fig, out: Path, name: str, title: str, caption: str, plt, points: int, top_in: float = 0.0
          ) -> Figure:
    """Title above (and `top_in` inches for a figure legend), the caption (wrapped to the figure's width)
    below the axes, then the PNG."""
    width_in, height_in = fig.get_size_inches()
    lines = textwrap.wrap(caption, int(width_in * 15))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.15 * (len(lines) + 1) / height_in, 1, 1 - top_in / height_in))
    said = tuple(dict.fromkeys(" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts))  # once
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, color="#333", va="bottom")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes(out / name, png.getvalue())  # atomic: an interrupted report never leaves half a PNG
    return Figure(name, title, caption, points, said)


def build_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Path, list[Figure]]:
    """Write the figures and a self-contained index.html for `run_dir` into `out_dir` (default
    RUN/report)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    out = Path(out_dir) if out_dir else run_dir / "report"
    plt, note = _plt(), progress or (lambda _: None)
    skipped: list[str] = []
    runs = _runs(run_dir)
    kinds = _artifacts(run_dir, skipped, runs)
    _inside_runs(run_dir, runs, skipped)
    steps = _steps(run_dir, runs, kinds, skipped)
    curves = _curves(runs, skipped)
    calibrations = _calibrations(kinds, skipped)
    if not (curves or calibrations or any(s.files for s in steps.values())
            or any(kinds.get(k) for k in DRAWN)):
        raise ValueError(f"{run_dir} holds nothing to plot (no mismatch, schedule, cost, rollouts, "
                         "calibrated threshold or training run"
                         + (f"; not drawn: {'; '.join(skipped)}" if skipped else "") + ")")
    for why in skipped:
        note(f"not drawn: {why}")
    thresholds = _check_artifacts(kinds, curves, steps)
    out.mkdir(parents=True, exist_ok=True)
    before = _listed_figures(out)
    draw = {"mismatch": ("tail", lambda p, n: tail_figure(p, n, thresholds[p], out, plt)),
            "schedule": ("schedule", lambda p, n: schedule_figure(p, n, out, plt)),
            "cost": ("cost", lambda p, n: cost_figure(p, n, out, plt)),
            "rollouts": ("rollouts", lambda p, n: rollouts_figure(p, n, out, plt))}
    figures: list[Figure] = []
    for kind, (stem, figure) in draw.items():
        paths = kinds.get(kind, [])
        for path in paths:
            note(f"drawing {kind} {path.name}")
            figures.append(figure(path, _name(stem, path, len(paths) > 1, run_dir)))
    for path in calibrations:
        fig_ = calibration_figure(path, _name("calibration", path, len(kinds["threshold"]) > 1, run_dir),
                                  out, plt)
        if fig_ is not None:
            note(f"drawing calibration {path.name}")
            figures.append(fig_)
    for run in runs:
        if run in curves or (run in steps and steps[run].files):
            note(f"drawing training run {run.name}")
        if run in curves:
            figures.append(training_figure(run, out, plt))
        if run in steps and (per_bin := train_mismatch_figure(steps[run], out, plt)) is not None:
            figures.append(per_bin)
    for key, series in steps.items():
        if key in runs or not series.files:
            continue
        note(f"drawing train_mismatch {series.where}")
        if (per_bin := train_mismatch_figure(series, out, plt)) is not None:
            figures.append(per_bin)
    write_bytes(out / "index.html", _page(run_dir, out, figures, skipped).encode())
    _remove_stale(out, before - {f.file for f in figures})
    return out / "index.html", figures


def _listed_figures(out: Path) -> set[str]:
    """The PNGs the report already in `out` wrote: its index.html lists each as a figure id. That page is
    the record of what the report wrote, so a file it does not list (a user's) is never touched."""
    page = out / "index.html"
    if not page.is_file():
        return set()
    text = page.read_text(errors="replace")
    if "Sparrow report" not in text[:2000]:
        return set()
    names = {html.unescape(n) for n in re.findall(r"<figure id='([^']+)'>", text)}
    return {n for n in names if n.endswith(".png") and Path(n).name == n}


def _remove_stale(out: Path, names: set[str]) -> None:
    """The previous report's figures that this one did not draw (their artifact is gone): removed once the
    new page is written, so the folder holds what the page shows and an interrupted report loses nothing."""
    for n in sorted(names):
        path = out / n
        if path.is_file() and not path.is_symlink():
            path.unlink()


def _check_artifacts(kinds: dict[str, list[Path]], runs: list[Path], steps: dict[Path, Steps]
                     ) -> dict[Path, ResolvedThreshold]:
    """Every artifact to draw read against its schema (a bad value is refused with the one sentence every
    command gives), and each profile's threshold resolved, before any figure is written."""
    for kind, paths in kinds.items():
        for path in paths if kind != "train_mismatch" else ():  # read file by file, as `steps`
            read_artifact(path, kind)
    for run in runs:
        read_artifact(run / "metrics.parquet", "metrics")
    for series in steps.values():
        for f in series.files:
            read_artifact(f, "train_mismatch")
    return {p: _threshold(kinds, p) for p in kinds.get("mismatch", [])}


def _page(run_dir: Path, out: Path, figures: list[Figure], skipped: list[str]) -> str:
    name = html.escape(str(run_dir))
    parts = [f"<!doctype html><meta charset='utf-8'><title>Sparrow report: {name}</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
             "figure{margin:2em 0}figcaption{color:#444}</style>",
             f"<h1>Sparrow report: {name}</h1>"]
    for f in figures:
        title = html.escape(f.title)
        data = base64.b64encode((out / f.file).read_bytes()).decode()
        parts.append(f"<figure id='{html.escape(f.file)}'><h2>{title}</h2>"
                     f"<img src='data:image/png;base64,{data}' alt='{title}'>"
                     f"<figcaption>{html.escape(f.caption)} ({html.escape(f.file)})</figcaption></figure>")
    if skipped:
        parts.append("<h2>Not drawn</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in skipped)
                     + "</ul>")
    return "\n".join(parts) + "\n"
