"""The cost figures: the analytic one draws the largest batch solid, as its caption says; the measured one
draws points that span orders of magnitude on log axes, and names in its legend only what it drew."""

from __future__ import annotations

from sparrow.schemas import write_artifact
from sparrow.stages.report import artifact_figures
from sparrow.stages.report.canvas import pyplot


def _drawn(monkeypatch) -> list:
    """The figures `save` is given (still open, so their lines and axes can be read)."""
    figures, save = [], artifact_figures.save
    monkeypatch.setattr(artifact_figures, "save",
                        lambda fig, *a, **k: figures.append((fig, a)) or save(fig, *a, **k))
    return figures


def test_the_largest_batch_is_the_solid_line_and_the_caption_says_which(tmp_path, monkeypatch):
    from sparrow.stages.cost import Grid, write_analytic
    from sparrow.stages.model.presets import PRESETS

    write_analytic(PRESETS["qwen3-4b"].config, "qwen3-4b", "h100", Grid([1, 16, 64], [2048, 8192], [0, 512]),
                   tmp_path / "cost.parquet")
    figures = _drawn(monkeypatch)
    artifact_figures.cost_figure(tmp_path / "cost.parquet", "cost.png", tmp_path, pyplot())
    (fig, (_, _, _, caption, *_)), = figures
    styles = {line.get_label(): line.get_linestyle() for line in fig.axes[0].get_lines()}
    assert styles == {"batch 64, dense": "-", "batch 64, budget 512": "-",
                      "batch 16, dense": "--", "batch 16, budget 512": "--"}
    assert "Solid: the largest batch (64), dashed: the next (16)." in caption


def test_measured_points_over_orders_of_magnitude_are_drawn_on_log_axes_with_no_dense_entry(tmp_path,
                                                                                          monkeypatch):
    write_artifact({"model": ["m"] * 4, "device": ["cpu"] * 4, "batch": [1, 4, 1, 4],
                    "context": [256, 256, 1024, 1024], "budget": [48, 48, 128, 128],
                    "seconds": [0.001, 0.004, 0.120, 0.435],
                    "predicted_seconds": [0.0011, 0.0038, 0.110, 0.440]}, tmp_path / "cost.parquet", "cost")
    figures = _drawn(monkeypatch)
    artifact_figures.cost_figure(tmp_path / "cost.parquet", "cost.png", tmp_path, pyplot())
    (fig, _), = figures
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    labels = ax.get_legend_handles_labels()[1]
    assert "dense" not in labels and "sparse" in labels


def test_measured_points_within_one_order_of_magnitude_keep_linear_axes(tmp_path, monkeypatch):
    write_artifact({"model": ["m"] * 2, "device": ["cpu"] * 2, "batch": [1, 4], "context": [256, 256],
                    "budget": [None, 48], "seconds": [0.010, 0.030], "predicted_seconds": [0.011, 0.028]},
                   tmp_path / "cost.parquet", "cost")
    figures = _drawn(monkeypatch)
    artifact_figures.cost_figure(tmp_path / "cost.parquet", "cost.png", tmp_path, pyplot())
    (fig, _), = figures
    assert (fig.axes[0].get_xscale(), fig.axes[0].get_yscale()) == ("linear", "linear")
    assert {"dense", "sparse"} <= set(fig.axes[0].get_legend_handles_labels()[1])
