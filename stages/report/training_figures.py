"""A training run's figures: its curves from metrics.parquet, and its sparse actor's mismatch per position
bin over the steps from mismatch/step=N.parquet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparrow.schemas import artifact_metadata, read_artifact

from ..core.definitions import TAIL_QUANTILE
from ..train.detectors import Detectors
from .canvas import Figure, integer_steps, save, say
from .collect import Steps
from .tables import CaptionBins, caption_bins, sql_rows

TRAIN_PANELS = (("reward_mean", "reward (train, mean per step)"),
                ("eval_accuracy", "eval accuracy (greedy)"),
                ("mismatch_kl", "mismatch KL (sampled k3)"),
                ("alpha_lb_p5", "p5 of alpha's top-20 lower bound"), ("entropy", "entropy (nats)"),
                ("grad_norm", "grad norm"))

UNIT_PANELS = ("reward_mean", "eval_accuracy", "alpha_lb_p5")  # quantities in [0, 1], drawn on [0, 1]

EMPTY_PANEL = {"eval_accuracy": "no eval: the run had no --eval-prompts",
               "alpha_lb_p5": "not logged by this run"}


def _sparse_eval(rows: list[dict], meta: dict) -> list[tuple[int, float]]:
    """The run's sparse sampler's eval accuracy by step, from step 0 (the initial eval, before any update)
    where the run recorded it, so that the gap between the samplers at the start shows."""
    pts = [(r["step"], r["eval_accuracy_sparse"]) for r in rows if r.get("eval_accuracy_sparse") is not None]
    if meta.get("initial_eval_accuracy_sparse") is not None:
        pts.insert(0, (0, float(meta["initial_eval_accuracy_sparse"])))
    return pts


def training_figure(run: Path, label: str, out: Path, plt) -> Figure:
    """The run's curves from its metrics.parquet; `label` names it (its path under the report's folder)."""
    from matplotlib.lines import Line2D

    rows = read_artifact(run / "metrics.parquet", "metrics").sort_by("step").to_pylist()
    meta = artifact_metadata(run / "metrics.parquet")
    outcome = meta.get("label", "unknown")
    name = f"train-{label.replace('/', '-')}.png"
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    flagged = [r["step"] for r in rows if r.get("collapse")]
    warn_level = Detectors().mismatch_kl_limit
    kl_top = None  # the top of the mismatch KL axis, where it is drawn
    for ax, (key, title) in zip(axes.flat, TRAIN_PANELS):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if key == "eval_accuracy" and meta.get("initial_eval_accuracy") is not None:
            pts.insert(0, (0, float(meta["initial_eval_accuracy"])))  # step 0: before any update
        ax.set_title(title, fontsize=10)
        if not pts:
            say(ax, EMPTY_PANEL.get(key, "not logged by this run"))
            continue
        integer_steps(ax.xaxis)
        ax.plot(*zip(*pts), marker="o", ms=3, label="dense sampler")
        sparse = _sparse_eval(rows, meta)
        if key == "eval_accuracy" and sparse:  # the run's own sparse sampler, evaluated beside dense
            # dashed over hollow squares: where both samplers score the same, the dense line shows through
            ax.plot(*zip(*sparse), marker="s", ms=5, ls="--", mfc="none", label="the run's sparse sampler")
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
            kl_top = max(peak, warn_level) * 1.1 if peak > warn_level / 4 else peak * 1.1 or 1e-3
            ax.set_ylim(0, kl_top)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles = [] if kl_top is None else [Line2D([], [], color="orange", ls="--", label=(
        f"mismatch KL warning level {warn_level:g} ("
        + ("above the KL panel's axis, so not drawn; " if warn_level > kl_top else "")
        + "a diagnostic, not a collapse reason)"))]
    if flagged:
        handles.insert(0, Line2D([], [], color="r", alpha=0.5, label="a collapse reason held at this step"))
    if handles:
        fig.legend(handles=handles, loc="upper right", fontsize=8, frameon=False, ncols=len(handles),
                   bbox_to_anchor=(1, 0.955))
    story = f"label {outcome}" + (f" ({meta['reasons']})" if meta.get("reasons") else "")
    if meta.get("warnings"):
        story += f"; warning: {meta['warnings']}"
    steps = f"{len(rows)} step{'s' * (len(rows) != 1)}"
    caption = (f"From {label}/metrics.parquet: {steps}; {story}. The label is the whole run's "
               "(its last step's collapse reasons: reward, grad norm, entropy, truncation or repetition); "
               + ("red lines mark the steps whose history up to them held a reason. " if flagged else
                  "no step held a collapse reason. ")
               + ("Step N is the row logged after N updates; eval accuracy at step 0 is before any update."
                  if meta.get("initial_eval_accuracy")
                  is not None else ""))
    return save(fig, out, name, f"Training run {label}: {outcome}", caption, plt, len(rows), top_in=0.3)


def train_mismatch_figure(steps: Steps, out: Path, plt) -> Figure | None:
    """The sparse actor's mismatch over training, one line per position bin: the per-step summaries over
    all positions are in the training figure already. Only the files that passed the footer check are
    read; None when none did."""
    files = steps.files
    if not files:
        return None
    rows = sql_rows(files, lambda scan: f"""SELECT bin, step, quantile_cont(alpha_top20_lb, {TAIL_QUANTILE})
                    AS p5, avg(k3) AS k3, count(*) AS n, min(position), max(position)
                    FROM {scan} GROUP BY ALL ORDER BY ALL""", kind="train_mismatch")
    width = caption_bins(files[0], [(r[0], r[5], r[6]) for r in rows], len(files))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    logged = any(r[2] is not None for r in rows)  # alpha_top20_lb is nullable: a file may not log it
    for b in sorted({r[0] for r in rows}):
        part = [r for r in rows if r[0] == b]
        label = (f"positions {b * width.tokens}-{(b + 1) * width.tokens - 1}" if width.tokens
                 else f"bin {b}")
        if logged:
            axes[0].plot([r[1] for r in part], [np.nan if r[2] is None else r[2] for r in part], marker="o",
                         ms=4, label=label)
        axes[1].plot([r[1] for r in part], [r[3] for r in part], marker="o", ms=4, label=label)
    axes[0].set_title("p5 of alpha's top-20 lower bound", fontsize=10)
    axes[1].set_title("mean k3 (sparse rollout vs dense learner)", fontsize=10)
    if not rows:
        for ax in axes:
            say(ax, "the steps' mismatch files hold no tokens")
        return _saved_steps(fig, steps, rows, width, out, plt)
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].set_ylim(bottom=0)
    for ax in axes if logged else axes[1:]:
        ax.set_xlabel("step")
        integer_steps(ax.xaxis)
        ax.grid(alpha=0.3)
    if not logged:
        say(axes[0], "not logged by these files: their alpha_top20_lb is null or missing")
    axes[1].legend(fontsize=8, title="bin", title_fontsize=8)
    return _saved_steps(fig, steps, rows, width, out, plt)


def _saved_steps(fig, steps: Steps, rows: list[tuple], width: CaptionBins, out: Path, plt) -> Figure:
    """The per-bin figure of the steps' mismatch, with its caption, saved."""
    files = steps.files
    n_steps = len({r[1] for r in rows})
    left_out = (f" ({steps.left_out} unreadable {'file' if steps.left_out == 1 else 'files'} left out, each "
                "named under Not drawn)" if steps.left_out else "")
    counted = (f"{len(files)} train_mismatch file{'s' * (len(files) != 1)}",
               f"{n_steps} step{'s' * (n_steps != 1)}")
    return save(fig, out, steps.name, f"Mismatch per position bin over training: {steps.where}",
                f"From {counted[0]} in {steps.where}{left_out}: every generated token of {counted[1]}, in "
                f"{width.words}, one line per bin (the sampled-token k3 and the top-20 lower bound of alpha, "
                "as the rollout and the dense recompute saw them).", plt, len(rows))

