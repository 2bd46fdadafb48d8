"""`sparrow report`'s tail figure tells the story of the schedule beside it: with no threshold artifact in the
folder it draws the threshold (and quantile) the folder's schedule was planned at, and says so (of several,
the one planned from the drawn profile, with a warning when they disagree); it marks the bins too thin for
plan-schedule to trust (fewer than the --min-tokens that schedule records, else its default 50); and the
training figures of a one-step run tick whole steps only."""

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


def _schedule(path, profile, threshold: float, quantile: float, **meta):
    """A lossy schedule as plan-schedule records it (threshold, quantile, the profile's absolute path)."""
    rows = [{"bin": 0, "bin_start": 0, "bin_end": 128, "budget": 64, "tail": 0.9,
             "predicted_step_seconds": None},
            {"bin": 1, "bin_start": 128, "bin_end": None, "budget": None, "tail": None,
             "predicted_step_seconds": None}]
    return write_artifact(rows, path, "schedule", metadata={
        "model": "smollm2-135m", "page_size": 16, "bin_width": 128, "profile": str(profile.absolute()),
        "threshold": threshold, "threshold_source": "given", "quantile": quantile, **meta})


def _hollow_and_lines(monkeypatch) -> tuple[list, list]:
    """Spies on the tail figure: the hollow points' (panel, x), and the horizontal lines' heights."""
    from matplotlib.axes import Axes

    hollow, lines = [], []
    plot, axhline = Axes.plot, Axes.axhline
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (k.get("mfc") == "white" and a[0]
                                                          and hollow.append((ax, list(a[0]))))
                        or plot(ax, *a, **k))
    monkeypatch.setattr(Axes, "axhline", lambda ax, y, *a, **k: lines.append(y) or axhline(ax, y, *a, **k))
    return hollow, lines


def test_hollow_bins_follow_the_min_tokens_of_the_schedule_that_gives_the_threshold(tmp_path, monkeypatch):
    """Bin 1 holds 100 tokens and bin 2 holds 300: planned with --min-tokens 200, bin 1 is one the planner
    did not trust, so it is drawn hollow and the caption says 200, not the default 50."""
    run = tmp_path / "run"
    profile = _profile(run / "mismatch.parquet", {1: 100, 2: 300})
    _schedule(run / "schedule.parquet", profile, 0.5, 0.25, min_tokens=200)
    hollow, lines = _hollow_and_lines(monkeypatch)
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    at = 128 + float(np.mean(range(100)))
    panels = ("p25 of alpha (the tail)", "mean alpha")
    assert sorted((ax.get_title(), x) for ax, x in hollow) == sorted([(t, [at]) for t in panels] * 2)
    assert lines == [0.5]
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    assert "Hollow points: bin 1, with fewer than 200 tokens" in caption and "--min-tokens 200" in caption


def test_the_schedule_planned_from_the_profile_gives_the_line_and_disagreeing_ones_are_warned(
        tmp_path, monkeypatch):
    """Two schedules at different thresholds: the tail is drawn against the one whose recorded profile
    is the drawn mismatch file (though it sorts second), the other's min_tokens plays no part, and the
    report warns, naming both."""
    run = tmp_path / "run"
    profile = _profile(run / "mismatch.parquet", {1: 100, 2: 100})
    _schedule(run / "a.parquet", tmp_path / "elsewhere.parquet", 0.5, 0.25, min_tokens=500)
    _schedule(run / "b.parquet", profile, 0.7, 0.05)
    hollow, lines = _hollow_and_lines(monkeypatch)
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    assert lines == [0.7] and hollow == []  # b's default --min-tokens 50: no bin is thin
    said = " ".join(r.stderr.split())
    assert ("warning: the folder's schedules were planned at different thresholds (a.parquet: 0.5 at "
            "quantile 0.25; b.parquet: 0.7 at quantile 0.05); the tail of mismatch.parquet is drawn "
            "against b.parquet's (planned from it)") in said, said
    caption = _caption((run / "report" / "index.html").read_text(), "tail.png")
    assert "threshold 0.7 (b.parquet was planned at it)" in caption


def test_agreeing_schedules_give_no_warning(tmp_path, monkeypatch):
    run = tmp_path / "run"
    profile = _profile(run / "mismatch.parquet", {1: 100})
    _schedule(run / "a.parquet", profile, 0.7, 0.05)
    _schedule(run / "b.parquet", profile, 0.7, 0.05)
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    assert "warning" not in r.stderr
