"""`sparrow report`'s training figure draws both samplers' eval accuracy from step 0 (the initial eval the
run records in its metadata), so that the gap between the dense and the sparse sampler at the start shows."""

from __future__ import annotations

from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact

runner = CliRunner()


def test_both_eval_lines_start_at_step_0(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    rows = [{"run_id": "t", "step": s, "reward_mean": 0.5, "eval_accuracy": 0.5 + s / 10,
             "eval_accuracy_sparse": 0.25 + s / 10} for s in (1, 2)]
    write_artifact(rows, run / "metrics.parquet", "metrics", metadata={
        "label": "stable", "initial_eval_accuracy": 0.5, "initial_eval_accuracy_sparse": 0.125})
    lines = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (ax.get_title().startswith("eval accuracy")
                                                          and lines.append((k.get("label"), a[:2])))
                        or plot(ax, *a, **k))
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    drawn = {label: (list(x), list(y)) for label, (x, y) in lines}
    assert drawn["dense sampler"] == ([0, 1, 2], [0.5, 0.6, 0.7])
    assert drawn["the run's sparse sampler"] == ([0, 1, 2], [0.125, 0.35, 0.45])
