"""The published prior (0.86, 'keep the per-bin 5th percentile above 0.86') is a rule on the 0.05 quantile of
alpha: no command applies it at another --quantile (a given threshold, or a calibration at that quantile,
still works), and its published range 0.85-0.90 is said and stored as a range, never as a 95% interval."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.calibrate import RunResult, calibrate
from sparrow.stages.core.schedule import ScheduleError

from cli_checks import error_line

runner = CliRunner()
PRIOR_REFUSED = ("the published prior 0.86 is a threshold on the 0.05 quantile of alpha, not on the 0.25 "
                 "quantile")
RANGE = "published range 0.85-0.90 (no confidence interval was published)"


def _profile(path, model="smollm2-135m"):
    """Four trajectories of 60 tokens after a 100-token prompt, scored at budgets 64 and 128."""
    rng = np.random.default_rng(0)
    rows = []
    for pid in range(4):
        for k in range(60):
            for budget in (64, 128):
                rows.append({"prompt_id": f"p{pid}", "sample": 0, "position": 100 + k,
                             "bin": (100 + k) // 128, "budget": budget, "token_id": 1,
                             "alpha": float(rng.uniform(0.5, 1.0)),
                             "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
                             "k3": 0.0, "entropy_dense": 1.0})
    return write_artifact(rows, path, "mismatch", metadata={"model": model, "bin_width": 128})


def _prior_file(path, quantile):
    """A prior threshold artifact as an earlier Sparrow wrote it: the range stored as lower and upper."""
    return write_artifact({"threshold": [0.86], "lower": [0.85], "upper": [0.9], "quantile": [quantile],
                           "source": ["prior"], "n_runs": [0], "n_collapsed": [0], "note": ["prior"]},
                          path, "threshold")


def test_plan_schedule_refuses_the_prior_at_another_quantile_but_plans_with_a_given_threshold(tmp_path):
    profile, out = _profile(tmp_path / "m.parquet"), tmp_path / "s.parquet"
    line = error_line(runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile",
                                          str(profile), "--quantile", "0.25", "--min-tokens", "1", "-o",
                                          str(out)]))
    assert PRIOR_REFUSED in line and "--threshold" in line
    assert not out.exists()
    r = runner.invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile", str(profile),
                            "--quantile", "0.25", "--threshold", "0.5", "--min-tokens", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    meta = artifact_metadata(out)
    assert (meta["threshold"], meta["quantile"], meta["threshold_source"]) == (0.5, 0.25, "given")


def test_calibrate_threshold_writes_no_prior_at_another_quantile(tmp_path):
    profile, out = _profile(tmp_path / "m.parquet"), tmp_path / "t.parquet"
    line = error_line(runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "--quantile",
                                          "0.25", "-o", str(out)]))
    assert "--quantile 0.25" in line and "stands in only at the 0.05 quantile" in line
    assert not out.exists()


def test_runs_that_do_not_calibrate_fall_back_to_the_prior_at_0_05_only():
    stable = [RunResult("a", 0.7, []), RunResult("b", 0.8, [])]  # no run collapsed: no separation
    with pytest.raises(ScheduleError, match="no run collapsed"):
        calibrate(stable, 0.25, n_boot=0)
    prior = calibrate(stable, 0.05, n_boot=0)
    assert (prior.threshold, prior.lower, prior.upper, prior.source) == (0.86, None, None, "prior")


def test_profile_refuses_the_prior_for_its_summary_at_another_quantile_before_any_work(tmp_path):
    prompts = write_artifact([{"prompt_id": "t0", "task": "test", "prompt": None, "answer": None,
                               "metadata": None, "prompt_token_ids": list(range(3, 40))}],
                             tmp_path / "p.parquet", "prompts")
    out = tmp_path / "m.parquet"
    line = error_line(runner.invoke(app, ["profile", "--model", "tiny-llama", "--prompts", str(prompts),
                                          "--quantile", "0.25", "-o", str(out)]))
    assert PRIOR_REFUSED in line
    assert not out.exists()


def test_report_refuses_a_prior_stored_under_another_quantile(tmp_path):
    run = tmp_path / "run"
    _profile(run / "mismatch.parquet")
    _prior_file(run / "threshold.parquet", 0.25)
    line = error_line(runner.invoke(app, ["report", str(run)]))
    assert "published prior 0.86 under the 0.25 quantile" in line
    assert not (run / "report").exists()


def test_the_prior_is_stored_without_an_interval_and_its_range_is_said_as_a_range(tmp_path):
    profile, out = _profile(tmp_path / "m.parquet"), tmp_path / "t.parquet"
    r = runner.invoke(app, ["calibrate-threshold", "--profile", str(profile), "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    row = read_artifact(out, "threshold").to_pylist()[0]
    assert (row["threshold"], row["lower"], row["upper"], row["source"]) == (0.86, None, None, "prior")
    assert RANGE in " ".join(r.stderr.split()) and "[0.85" not in r.stderr
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert RANGE in r.stderr and "95% interval" not in r.stderr
    old = _prior_file(tmp_path / "old.parquet", 0.05)  # an earlier prior file's lower/upper: no interval
    r = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--threshold-file", str(old), "-f",
                            "csv"])
    assert r.exit_code == 0, r.output
    assert RANGE in r.stderr and "95% interval" not in r.stderr


def test_the_calibration_figure_of_a_prior_draws_and_captions_no_interval(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    runs = [{"run": "a", "tail": 0.7, "mean": 0.9, "collapsed": False},
            {"run": "b", "tail": 0.8, "mean": 0.95, "collapsed": False}]
    write_artifact({"threshold": [0.86], "lower": [None], "upper": [None], "quantile": [0.05],
                    "source": ["prior"], "n_runs": [2], "n_collapsed": [0], "note": ["prior"]},
                   run / "threshold.parquet", "threshold", metadata={"runs": json.dumps(runs)})
    spans = []
    monkeypatch.setattr(Axes, "axvspan", lambda ax, *a, **k: spans.append(a))
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    page = (run / "report" / "index.html").read_text()
    assert f"Threshold 0.86 (prior; {RANGE})" in " ".join(page.split())
    assert spans == []


def test_the_calibration_figure_draws_the_prior_threshold_its_runs_lie_below(tmp_path, monkeypatch):
    """Runs that did not separate leave the prior 0.86 in force: its line is drawn (dotted, named the
    prior's) on the tail panel, where a run at 0.739 then shows below it, and the axis reaches it."""
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    from sparrow.stages.report.artifact_figures import calibration_figure

    path = tmp_path / "threshold.parquet"
    runs = [{"run": "a", "tail": 0.739, "mean": 0.9, "collapsed": False}]
    write_artifact({"threshold": [0.86], "lower": [None], "upper": [None], "quantile": [0.05],
                    "source": ["prior"], "n_runs": [1], "n_collapsed": [0], "note": ["prior"]},
                   path, "threshold", metadata={"runs": json.dumps(runs)})
    lines, limits = [], []
    drawn = Axes.axvline

    def recorded(ax, x, *a, **k):
        lines.append((x, k["ls"], k["label"]))
        line = drawn(ax, x, *a, **k)
        limits.append(ax.get_xlim)
        return line

    monkeypatch.setattr(Axes, "axvline", recorded)
    figure = calibration_figure(path, "calibration.png", tmp_path, plt)
    assert figure is not None and lines == [(0.86, ":", "prior threshold 0.86")]
    low, high = limits[0]()
    assert low <= 0.739 and 0.86 <= high
    assert "1 run, 0 collapsed" in figure.caption
