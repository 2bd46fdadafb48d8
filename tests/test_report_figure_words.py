"""What the figures say of themselves: the rollouts figure's acceptance of speculative drafts and an
eviction policy's KV budget, no ticks on a panel that says why it is empty, the training figure's legend
on a KL warning line its axis cuts off, the calibration's interval on mean alpha, whole positions and one
legend above the panels on the tail figure, and a distill folder's profiles named and overlaid without
and with the adapter."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.report import artifact_figures, training_figures


def _drawn(monkeypatch, module=artifact_figures) -> list:
    figures, save = [], module.save
    monkeypatch.setattr(module, "save",  # (figure, its file, its caption), the figure still open
                        lambda fig, *a, **k: figures.append((fig, a[1], a[3])) or save(fig, *a, **k))
    return figures


def _report(run) -> None:
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output


def _rollouts(path, **extra) -> None:
    write_artifact({"prompt_id": ["p0", "p1"], "sample": [0, 0], "prompt_token_ids": [[1, 2]] * 2,
                    "token_ids": [[7, 8, 9], [7, 8]], "text": [None, None],
                    "logprobs": [[-0.1, -0.2, -0.3], [-1.5, -0.1]], "finish_reason": ["stop", "length"],
                    "reward": [None, None], **extra}, path, "rollouts")


def test_speculative_rollouts_give_the_acceptance_their_rows_record(tmp_path, monkeypatch):
    _rollouts(tmp_path / "run" / "rollouts.parquet", budgets=[[0, 0, 0], [0, 0]],
              accepted=[[True, False, True], [True, False]], drafted=[4, 2])
    figures = _drawn(monkeypatch)
    _report(tmp_path / "run")
    (fig, _, caption), = figures
    assert "acceptance 50.0% (3 of 6 drafts kept)" in caption  # 2 + 1 kept of 4 + 2 drafted
    reward_panel = fig.axes[1]
    assert not reward_panel.get_yticks().size and not reward_panel.get_xticks().size


def test_evicting_rollouts_name_their_kv_budget(tmp_path, monkeypatch):
    policy = "snapkv:128,window=8,buffer=128,sink=4"
    _rollouts(tmp_path / "run" / "rollouts.parquet", budgets=[[0, 128, 128], [0, 128]],
              kv_policy=[policy, policy], kv_lens=[[400, 129, 130], [300, 129]])
    figures = _drawn(monkeypatch)
    _report(tmp_path / "run")
    assert "(mean KV budget 128: the cached tokens snapkv eviction keeps)" in figures[0][2]


def test_a_kl_warning_line_above_the_axis_is_said_to_be(tmp_path, monkeypatch):
    write_artifact([{"run_id": "t", "step": s, "reward_mean": 0.5, "mismatch_kl": 1e-11, "collapse": None}
                    for s in (1, 2)], tmp_path / "run" / "metrics.parquet", "metrics",
                   metadata={"label": "stable"})
    figures = _drawn(monkeypatch, training_figures)
    _report(tmp_path / "run")
    fig = figures[0][0]
    kl = next(ax for ax in fig.axes if ax.get_title().startswith("mismatch KL"))
    assert kl.get_ylim()[1] < 0.05
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert labels == ["mismatch KL warning level 0.05 (above the KL panel's axis, so not drawn; a "
                      "diagnostic, not a collapse reason)"]


def test_the_calibration_draws_the_interval_of_the_mean_boundary(tmp_path, monkeypatch):
    runs = [{"run": f"r{i}", "tail": t, "mean": m, "collapsed": c}
            for i, (t, m, c) in enumerate([(0.1, 0.66, True), (0.4, 0.84, False)])]
    separations = [{"what": "mean alpha", "point": 0.75, "lower": 0.6992, "upper": 0.8001}]
    write_artifact({"threshold": [0.25], "lower": [0.07], "upper": [0.43], "quantile": [0.05],
                    "source": ["calibrated"], "n_runs": [2], "n_collapsed": [1], "note": [None]},
                   tmp_path / "run" / "threshold.parquet", "threshold",
                   metadata={"runs": json.dumps(runs), "mean_threshold": 0.75,
                             "separations": json.dumps(separations)})
    figures = _drawn(monkeypatch)
    _report(tmp_path / "run")
    mean_panel = figures[0][0].axes[1]
    spans = [(p.get_x(), p.get_x() + p.get_width()) for p in mean_panel.patches]
    assert len(spans) == 1 and np.allclose(spans[0], (0.6992, 0.8001))


def _profile(path, shift: float, **meta) -> None:
    rows = [{"prompt_id": "p", "sample": 0, "position": 500 + k, "bin": (500 + k) // 512, "budget": 64,
             "token_id": 1, "alpha": 0.5 + shift - k / 100, "logp_dense": -1.0, "logp_sparse": -1.0,
             "log_ratio": 0.0, "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0} for k in range(19)]
    write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, "model": "m", **meta})


def test_a_distill_folder_is_drawn_before_then_after_each_named_and_overlaid(tmp_path, monkeypatch):
    run = tmp_path / "out"
    _profile(run / "mismatch" / "before.parquet", 0.0, actor="plain sparse actor (before distillation)")
    _profile(run / "mismatch" / "after.parquet", 0.1, actor=f"sparse actor + {run}", adapter=str(run))
    figures = _drawn(monkeypatch)
    _report(run)
    names = [name for _, name, _ in figures]
    assert names == ["tail-mismatch-before.png", "tail-mismatch-after.png", "tail-adapter-mismatch.png"]
    titles = [fig._suptitle.get_text() for fig, _, _ in figures]
    assert titles[0].endswith("before.parquet, without an adapter")
    assert titles[1].endswith("after.parquet, with the adapter out")
    overlay = figures[2][0].axes[0]
    tails = {line.get_label(): line.get_ydata() for line in overlay.get_lines()
             if "budget" in line.get_label()}
    alpha = np.array([0.5 - k / 100 for k in range(19)])  # bin 0: positions 500-511, bin 1: 512-518
    want = [np.quantile(alpha[:12], 0.05), np.quantile(alpha[12:], 0.05)]
    assert np.allclose(tails["budget 64, without the adapter"], want)
    assert np.allclose(tails["budget 64, with the distilled adapter"], np.array(want) + 0.1)
    for fig, _, _ in figures[:1]:  # positions are whole numbers: so are the ticks
        ticks = fig.axes[0].get_xticks()
        assert np.allclose(ticks, np.round(ticks))


def test_a_distill_from_a_starting_adapter_says_so_before(tmp_path, monkeypatch):
    """distill --init-adapter scores before.parquet with the adapter it starts from: no figure may say
    'without an adapter' of it."""
    run = tmp_path / "out"
    start = tmp_path / "start"
    _profile(run / "mismatch" / "before.parquet", 0.0, init_adapter=str(start),
             actor=f"sparse actor + {start} (the starting adapter, before distillation)")
    _profile(run / "mismatch" / "after.parquet", 0.1, actor=f"sparse actor + {run}", adapter=str(run))
    figures = _drawn(monkeypatch)
    _report(run)
    titles = [fig._suptitle.get_text() for fig, _, _ in figures]
    assert titles[0].endswith("before.parquet, with the starting adapter start")
    labels = [line.get_label() for line in figures[2][0].axes[0].get_lines()]
    assert "budget 64, the starting adapter" in labels and not any("without" in x for x in labels)


def test_a_narrow_tail_figure_ticks_whole_positions(tmp_path, monkeypatch):
    rows = [{"prompt_id": "p", "sample": 0, "position": 510 + k % 4, "bin": (510 + k % 4) // 512, "budget": b,
             "token_id": 1,
             "alpha": 0.9, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
             "k3": 0.0, "entropy_dense": 1.0} for b in (64, 128) for k in range(60)]
    write_artifact(rows, tmp_path / "run" / "mismatch.parquet", "mismatch", metadata={"bin_width": 512})
    figures = _drawn(monkeypatch)
    _report(tmp_path / "run")
    for ax in figures[0][0].axes:
        ticks = ax.get_xticks()
        assert ticks.size and np.allclose(ticks, np.round(ticks)), ticks


def test_the_tail_figure_has_one_legend_above_its_panels(tmp_path, monkeypatch):
    rows = [{"prompt_id": "p", "sample": 0, "position": 100 + k, "bin": 0, "budget": b, "token_id": 1,
             "alpha": a, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
             "k3": 0.0, "entropy_dense": 1.0} for b, a in ((64, 0.2), (128, 0.5)) for k in range(60)]
    write_artifact(rows, tmp_path / "run" / "mismatch.parquet", "mismatch", metadata={"bin_width": 512})
    figures = _drawn(monkeypatch)
    _report(tmp_path / "run")
    fig = figures[0][0]
    assert all(ax.get_legend() is None for ax in fig.axes)  # inside a panel a legend covers its lines
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[:2] == ["budget 64", "budget 128"] and labels[2].startswith("threshold 0.86")
    panels_top = max(ax.get_position().y1 for ax in fig.axes)
    fig.canvas.draw()
    box = legend.get_window_extent().transformed(fig.transFigure.inverted())
    assert box.y0 > panels_top  # above the panels, not over them
