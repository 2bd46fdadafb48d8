"""`sparrow report`: the figures a person wants from a run directory, as PNGs and one HTML page.

Design decisions:
- Whatever the directory holds decides the figures; nothing is required. The directory's artifacts
  and those of its training runs (immediate subdirectories with a `metrics.parquet`, whose per-step
  `mismatch/step=N.parquet` files are read as one table) are read through DuckDB (`stages.sql`).
- Figures: from a `mismatch` profile, the tail (p5) and mean alpha per position bin and budget with
  the threshold line (the `threshold` artifact's value, else the published prior), the key figure of
  the method; from a `schedule`, the budget per bin (with the published schedule of the same model when
  there is one); from a `cost` artifact, the fitted model against the measured step times; from
  `rollouts`, tokens per sample and reward by sampler budget; from each training run, reward, eval
  accuracy, mismatch KL, the p5 of alpha's top-20 lower bound, entropy and the steps where collapse
  reasons held.
- matplotlib with the Agg backend (headless); the HTML page references the PNGs by relative path and
  lists what each figure was drawn from. Each figure is written only if it has data to show.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparrow.schemas import artifact_kind, artifact_metadata, read_artifact

from .definitions import PRIOR_THRESHOLD, TAIL_QUANTILE


@dataclass
class Figure:
    file: str
    title: str
    caption: str
    points: int  # data points drawn (a figure is written only with some)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_kind(folder: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(folder.glob("*.parquet")):
        kind = artifact_kind(p)
        if kind is not None and kind not in out:
            out[kind] = p
    return out


def _threshold(kinds: dict[str, Path]) -> tuple[float, str]:
    if "threshold" in kinds:
        t = read_artifact(kinds["threshold"], "threshold").to_pylist()[0]
        return float(t["threshold"]), f"threshold {t['threshold']:.3f} ({t['source']})"
    return PRIOR_THRESHOLD, f"published prior {PRIOR_THRESHOLD}"


def tail_figure(mismatch: Path, kinds: dict[str, Path], out: Path, plt) -> Figure | None:
    import duckdb

    rows = duckdb.sql(f"""SELECT budget, bin, quantile_cont(alpha, {TAIL_QUANTILE}) AS p5, avg(alpha) AS mean,
                          count(*) AS n FROM read_parquet('{mismatch}')
                          GROUP BY ALL ORDER BY ALL""").fetchall()
    if not rows:
        return None
    width = int(artifact_metadata(mismatch).get("bin_width", 2000))
    threshold, label = _threshold(kinds)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for budget in sorted({r[0] for r in rows}):
        part = [r for r in rows if r[0] == budget]
        x = [(r[1] + 0.5) * width for r in part]
        axes[0].plot(x, [r[2] for r in part], marker="o", label=f"budget {budget}")
        axes[1].plot(x, [r[3] for r in part], marker="o", label=f"budget {budget}")
    for ax, name in zip(axes, ("p5 of alpha (the tail)", "mean alpha")):
        ax.axhline(threshold, color="k", ls="--", lw=1, label=label)
        ax.set_xlabel("position (cache length when the token was produced)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance alpha")
    axes[1].legend(fontsize=8)
    return _save(fig, out, "tail.png", "Tail and mean alpha per position bin and budget",
                 f"From {mismatch.name}: {sum(r[4] for r in rows)} scored tokens, bins of {width} tokens; "
                 f"the dashed line is the {label}.", plt, len(rows))


def schedule_figure(schedule: Path, out: Path, plt) -> Figure | None:
    from .published_schedules import published_budgets

    table = read_artifact(schedule, "schedule").sort_by("bin").to_pylist()
    meta = artifact_metadata(schedule)
    starts = [r["bin_start"] for r in table]
    budgets = [r["budget"] or 0 for r in table]
    if not table:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    end = (table[-1]["bin_end"] or starts[-1] + max(starts[-1] - (starts[-2] if len(starts) > 1 else 0), 512))
    edges = [*starts, end]
    sparse = [b if b else np.nan for b in budgets]
    ax.step(edges, [*sparse, sparse[-1]], where="post", label="planned budget")
    for i, b in enumerate(budgets):
        if not b:
            ax.axvspan(edges[i], edges[i + 1], color="grey", alpha=0.2,
                       label="dense (whole cache)" if i == budgets.index(0) else None)
    model, threshold = meta.get("model"), meta.get("threshold")
    published = published_budgets(model, float(threshold)) if model and threshold else None
    if published:
        x = [2000 * i for i in range(len(published) + 1)]
        ax.step(x, [*published, published[-1]], where="post", ls="--", label=f"published ({model})")
    ax.set_xlabel("position")
    ax.set_ylabel("budget (KV tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "schedule.png", "The schedule: budget per position bin",
                 f"From {schedule.name}" + (f", model {model}, threshold {threshold}" if model else "") + ".",
                 plt, len(table))


def cost_figure(cost: Path, out: Path, plt) -> Figure | None:
    rows = [r for r in read_artifact(cost, "cost").to_pylist() if r["seconds"] is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 4.5))
    measured = np.array([r["seconds"] for r in rows]) * 1e3
    predicted = np.array([r["predicted_seconds"] for r in rows]) * 1e3
    sparse = np.array([r["budget"] is not None for r in rows])
    ax.scatter(measured[~sparse], predicted[~sparse], label="dense", s=18)
    ax.scatter(measured[sparse], predicted[sparse], label="sparse", s=18)
    top = max(measured.max(), predicted.max()) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=1, label="y = x")
    ax.set_xlabel("measured decode step (ms)")
    ax.set_ylabel("cost model (ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    err = np.abs(predicted - measured) / measured
    return _save(fig, out, "cost.png", "Cost model against measured decode steps",
                 f"From {cost.name}: {len(rows)} points, median relative error {np.median(err):.1%}.", plt,
                 len(rows))


def rollouts_figure(rollouts: Path, out: Path, plt) -> Figure | None:
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    if not rows:
        return None
    meta = artifact_metadata(rollouts)
    lengths = np.array([len(r["token_ids"]) for r in rows])
    rewards = np.array([np.nan if r["reward"] is None else r["reward"] for r in rows])
    budgets = [np.mean([b for b in r["budgets"] if b] or [0]) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].hist(lengths, bins=20)
    axes[0].set_xlabel("generated tokens per sample")
    axes[1].scatter(budgets, rewards, s=14)
    axes[1].set_xlabel("mean sparse budget of the sample (0 = dense)")
    axes[1].set_ylabel("reward")
    for ax in axes:
        ax.grid(alpha=0.3)
    speed = meta.get("tokens_per_s") or meta.get("tokens_per_second")
    caption = f"From {rollouts.name}: {len(rows)} samples ({meta.get('sparsity', 'sampler unknown')})"
    caption += f", {float(speed):.1f} tokens/s." if speed else "."
    return _save(fig, out, "rollouts.png", "Rollouts: lengths and rewards", caption, plt, len(rows))


def training_figure(run: Path, out: Path, plt) -> Figure | None:
    rows = read_artifact(run / "metrics.parquet", "metrics").sort_by("step").to_pylist()
    if not rows:
        return None
    meta = artifact_metadata(run / "metrics.parquet")
    steps = [r["step"] for r in rows]
    panels = (("reward_mean", "reward (train)"), ("eval_accuracy", "eval accuracy (greedy, dense)"),
              ("mismatch_kl", "mismatch KL (sampled k3)"),
              ("alpha_lb_p5", "p5 of alpha's top-20 lower bound"), ("entropy", "entropy (nats)"),
              ("grad_norm", "grad norm"))
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    collapsed = [r["step"] for r in rows if r.get("collapse")]
    from matplotlib.ticker import MaxNLocator

    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if r.get(key) is not None]
        if key == "eval_accuracy" and meta.get("initial_eval_accuracy") is not None:
            pts.insert(0, (-1, float(meta["initial_eval_accuracy"])))  # before the first update
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3)
        for s in collapsed:
            ax.axvline(s, color="r", alpha=0.25)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    name = f"train-{run.name}.png"
    caption = (f"From {run.name}/metrics.parquet: {len(rows)} steps, label {meta.get('label', 'unknown')}"
               + (f" ({meta['reasons']})" if meta.get("reasons") else "")
               + "; red lines mark steps where a collapse reason held; eval accuracy at step -1 is before "
               "any update.")
    return _save(fig, out, name, f"Training run {run.name}", caption, plt, len(rows))


def train_mismatch_figure(run: Path, out: Path, plt) -> Figure | None:
    """Per position bin, over training: the per-step summaries are in the training figure already."""
    import duckdb

    files = sorted((run / "mismatch").glob("step=*.parquet"))
    if not files:
        return None
    paths = ", ".join(f"'{p}'" for p in files)
    rows = duckdb.sql(f"""SELECT step, bin, quantile_cont(alpha_top20_lb, {TAIL_QUANTILE}) AS p5,
                          avg(k3) AS k3 FROM read_parquet([{paths}]) GROUP BY ALL ORDER BY ALL""").fetchall()
    width = int(artifact_metadata(files[0]).get("bin_width", 512))
    steps = sorted({r[0] for r in rows})
    colors = plt.cm.viridis(np.linspace(0, 1, len(steps)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for step, color in zip(steps, colors):
        part = [r for r in rows if r[0] == step]
        x = [(r[1] + 0.5) * width for r in part]
        label = f"step {step}" if step in (steps[0], steps[-1]) else None
        axes[0].plot(x, [r[2] for r in part], marker="o", ms=3, color=color, label=label)
        axes[1].plot(x, [r[3] for r in part], marker="o", ms=3, color=color, label=label)
    axes[0].set_title("p5 of alpha's top-20 lower bound per bin", fontsize=10)
    axes[1].set_title("mean k3 per bin (rollout vs dense learner)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("position (cache length when the token was produced)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    return _save(fig, out, f"train-mismatch-{run.name}.png", f"Mismatch per position bin over {run.name}",
                 f"From {len(files)} files {run.name}/mismatch/step=N.parquet, bins of {width} tokens; "
                 "colour runs from the first step (dark) to the last (light).", plt, len(rows))


def _save(fig, out: Path, name: str, title: str, caption: str, plt, points: int) -> Figure:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return Figure(name, title, caption, points)


def build_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Path, list[Figure]]:
    """Write the figures and index.html for `run_dir` into `out_dir` (default RUN/report)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt, note = _plt(), progress or (lambda _: None)
    kinds = _by_kind(run_dir)
    figures: list[Figure | None] = []
    if "mismatch" in kinds:
        note("tail per bin and budget")
        figures.append(tail_figure(kinds["mismatch"], kinds, out, plt))
    if "schedule" in kinds:
        note("schedule")
        figures.append(schedule_figure(kinds["schedule"], out, plt))
    if "cost" in kinds:
        note("cost model")
        figures.append(cost_figure(kinds["cost"], out, plt))
    if "rollouts" in kinds:
        note("rollouts")
        figures.append(rollouts_figure(kinds["rollouts"], out, plt))
    runs = [p for p in sorted(run_dir.iterdir()) if p.is_dir() and (p / "metrics.parquet").exists()]
    if (run_dir / "metrics.parquet").exists():
        runs.insert(0, run_dir)
    for run in runs:
        note(f"training run {run.name}")
        figures.append(training_figure(run, out, plt))
        figures.append(train_mismatch_figure(run, out, plt))
    done = [f for f in figures if f is not None]
    if not done:
        raise ValueError(f"{run_dir} holds nothing to plot (no mismatch, schedule, cost, rollouts or "
                         "training metrics)")
    (out / "index.html").write_text(_page(run_dir, done))
    return out / "index.html", done


def _page(run_dir: Path, figures: list[Figure]) -> str:
    name = html.escape(str(run_dir))
    parts = [f"<!doctype html><meta charset='utf-8'><title>Sparrow report: {name}</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
             "figure{margin:2em 0}figcaption{color:#444}</style>",
             f"<h1>Sparrow report: {name}</h1>"]
    for f in figures:
        title = html.escape(f.title)
        parts.append(f"<figure><h2>{title}</h2><img src='{html.escape(f.file)}' alt='{title}'>"
                     f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")
    return "\n".join(parts) + "\n"
