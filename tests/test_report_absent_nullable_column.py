"""Training step files without the nullable `alpha_top20_lb` column (a foreign writer or an SQL export left
it out, as the schema allows): `sparrow report` draws them, reading the column as NULL as `sparrow sql`
does, and says in the p5 panel that the files do not log it; the k3 panel is drawn as before."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.report import training_figures
from sparrow.stages.report.canvas import pyplot
from sparrow.stages.report.collect import Steps


def _steps(folder, lb: dict[int, list[float | None]] | None = None, drop: set[int] = frozenset()):
    """Step files of 4 tokens (2 in bin 0, 2 in bin 1); step s's alpha_top20_lb is `lb[s]`, dropped from
    the files of the steps in `drop` (their footers kept)."""
    k3 = {}
    for s in (1, 2):
        k3[s] = [0.01 * s, 0.03 * s, 0.002 * s, 0.004 * s]
        path = folder / "mismatch" / f"step={s:05d}.parquet"
        write_artifact({"step": [s] * 4, "prompt_id": ["p"] * 4, "sample": [0] * 4,
                        "position": [10, 11, 600, 601], "bin": [0, 0, 1, 1], "budget": [64] * 4,
                        "token_id": [1] * 4, "logp_rollout": [-1.0] * 4, "logp_dense": [-1.1] * 4,
                        "log_ratio": [0.1] * 4, "k3": k3[s],
                        "alpha_top20_lb": (lb or {}).get(s, [None] * 4), "weight": [1.0] * 4,
                        "masked": [False] * 4, "vetoed": [False] * 4},
                       path, "train_mismatch", metadata={"bin_width": 512})
        if s in drop:
            table = pq.read_table(path)
            pq.write_table(table.drop_columns(["alpha_top20_lb"]), path)
    return sorted((folder / "mismatch").glob("step=*.parquet")), k3


def _figure(files, tmp_path, monkeypatch):
    figures, save = [], training_figures.save
    monkeypatch.setattr(training_figures, "save",
                        lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k))
    training_figures.train_mismatch_figure(Steps("run/mismatch", "per-bin.png", files), tmp_path, pyplot())
    return figures[0]


def test_files_without_the_column_are_drawn_and_the_p5_panel_says_why(tmp_path, monkeypatch):
    files, k3 = _steps(tmp_path / "run", drop={1, 2})
    fig = _figure(files, tmp_path, monkeypatch)
    p5, mean_k3 = fig.axes
    assert not p5.get_lines() and "not logged by these files" in p5.texts[0].get_text()
    assert not p5.get_xticks().size and not p5.get_yticks().size  # no stray ticks on a panel with words
    want = {(b, s): np.mean(k3[s][2 * b:2 * b + 2]) for b in (0, 1) for s in (1, 2)}
    got = {(b, s): y for b, line in enumerate(mean_k3.get_lines())
           for s, y in zip(line.get_xdata(), line.get_ydata())}
    assert got.keys() == want.keys() and all(np.isclose(got[k], want[k]) for k in want)


def test_all_null_values_say_the_same_as_a_missing_column(tmp_path, monkeypatch):
    files, _ = _steps(tmp_path / "run")
    p5 = _figure(files, tmp_path, monkeypatch).axes[0]
    assert not p5.get_lines() and "not logged by these files" in p5.texts[0].get_text()


def test_one_file_with_the_column_and_one_without_draw_the_logged_steps_p5(tmp_path, monkeypatch):
    lb = [0.9, 0.5, 0.8, 0.2]
    files, _ = _steps(tmp_path / "run", lb={2: lb}, drop={1})
    p5 = _figure(files, tmp_path, monkeypatch).axes[0]
    got = {b: dict(zip(line.get_xdata(), line.get_ydata())) for b, line in enumerate(p5.get_lines())}
    for b in (0, 1):
        assert np.isnan(got[b][1])
        assert np.isclose(got[b][2], np.quantile(lb[2 * b:2 * b + 2], 0.05))  # linear, as quantile_cont


def test_sparrow_report_on_such_a_run_succeeds(tmp_path):
    run = tmp_path / "run"
    _steps(run, drop={1, 2})
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "not logged by these files" in result.stderr
    assert (run / "report" / "train-mismatch-run.png").is_file()
