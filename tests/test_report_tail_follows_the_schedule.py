"""`sparrow report`'s tail figure tells the story of the schedule beside it: with no threshold artifact in the
folder it draws the threshold (and quantile) the folder's schedule was planned at, and says so; it marks the
bins too thin for plan-schedule to trust (fewer than its default --min-tokens, 50); and the training figures
of a one-step run tick whole steps only."""

from __future__ import annotations

import re

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

runner = CliRunner()


def _profile(path, tokens_per_bin: dict[int, int]):
    """One trajectory per bin of 128 positions, `n` tokens from the bin's start, scored at 64 and 128."""
    rows = [{"prompt_id": f"p{b}", "sample": 0, "position": 128 * b + k, "bin": b, "budget": budget,
             "token_id": 1, "alpha": 0.6 + 0.3 * k / n, "logp_dense": -1.0, "logp_sparse": -1.0,
             "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0}
            for b, n in tokens_per_bin.items() for k in range(n) for budget in (64, 128)]
    return write_artifact(rows, path, "mismatch", metadata={"model": "smollm2-135m", "bin_width": 128})


def _caption(page: str, figure: str) -> str:
    return " ".join(re.search(rf"<figure id='{re.escape(figure)}'>.*?<figcaption>(.*?)</figcaption>", page,
                              re.S)[1].split())


def test_the_tail_figure_draws_the_threshold_the_schedule_was_planned_at(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    profile = _profile(run / "mismatch.parquet", {1: 100, 2: 100})
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--threshold", "0.5", "--quantile", "0.25", "-o", str(run / "schedule.parquet")])
    assert r.exit_code == 0, r.output
    lines = []
    axhline = Axes.axhline
    monkeypatch.setattr(Axes, "axhline", lambda ax, y, *a, **k: lines.append((ax, y))
                        or axhline(ax, y, *a, **k))
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    assert [(ax.get_title(), y) for ax, y in lines] == [("p25 of alpha (the tail)", 0.5)]
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    assert "threshold 0.5 (schedule.parquet was planned at it)" in caption
    assert "comes from: schedule.parquet was planned at it (given)" in caption
    assert "0.86" not in caption


def test_bins_thinner_than_min_tokens_are_drawn_hollow_and_named(tmp_path, monkeypatch):
    """Bin 0 has 14 tokens (thin), bin 1 has 60: only bin 0's points are hollow, at its mean position."""
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    _profile(run / "mismatch.parquet", {0: 14, 1: 60})
    hollow = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (k.get("mfc") == "white" and a[0]
                                                          and hollow.append((ax, list(a[0]))))
                        or plot(ax, *a, **k))
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    at = float(np.mean(range(14)))
    assert sorted((ax.get_title(), x) for ax, x in hollow) == sorted(
        [(title, [at]) for title in ("p5 of alpha (the tail)", "mean alpha")] * 2)  # budgets 64 and 128
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    assert "Hollow points: bin 0, with fewer than 50 tokens" in caption


def test_a_one_step_run_ticks_whole_steps(tmp_path, monkeypatch):
    import sparrow.stages.report.training_figures as figures

    run = tmp_path / "run"
    write_artifact([{"run_id": "t", "step": 1, "reward_mean": 0.5, "grad_norm": 1.0, "entropy": 1.0,
                     "mismatch_kl": 1e-3, "alpha_lb_p5": 0.8}], run / "metrics.parquet", "metrics",
                   metadata={"label": "stable"})
    write_artifact({"step": [1] * 3, "prompt_id": ["p"] * 3, "sample": [0, 1, 2], "position": [10, 11, 12],
                    "bin": [0] * 3, "budget": [0, 64, 64], "token_id": [1, 2, 3], "logp_rollout": [-1.0] * 3,
                    "logp_dense": [-1.1] * 3, "log_ratio": [0.1] * 3, "k3": [0.005] * 3,
                    "alpha_top20_lb": [0.9, 0.8, 0.7], "weight": [1.0] * 3, "masked": [False] * 3,
                    "vetoed": [False] * 3}, run / "mismatch" / "step=00001.parquet", "train_mismatch")
    ticks = []
    save = figures.save

    def seen(fig, *a, **k):
        for ax in fig.axes:
            low, high = ax.get_xlim()
            ticks.extend(t for t in ax.get_xticks() if low <= t <= high and ax.has_data())
        return save(fig, *a, **k)

    monkeypatch.setattr(figures, "save", seen)
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
