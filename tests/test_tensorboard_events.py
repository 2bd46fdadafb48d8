"""What TensorBoard itself reads back from a run's event files (its own EventAccumulator, the reader
behind the dashboard): every scalar of metrics.jsonl at its step, once, a resumed run included, where the
resume purges the first writer's events and writes them again."""

from __future__ import annotations

import json
import math

import pytest
from test_tracker_step0_and_bins import train  # noqa: F401 - a fixture
from test_train import tiny_llama  # noqa: F401 - a fixture

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def dashboard(run) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's (step, value) points as TensorBoard shows them."""
    acc = event_accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logged(run) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's plain finite numbers, by name, as (step, value) points."""
    points: dict[str, list[tuple[int, float]]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                points.setdefault(key, []).append((row["step"], float(value)))
    return points


def assert_shown_once(run) -> None:
    shown, expected = dashboard(run), logged(run)
    assert set(expected) <= set(shown)
    for key, points in expected.items():
        assert [s for s, _ in shown[key]] == [s for s, _ in points], key
        assert [v for _, v in shown[key]] == pytest.approx([v for _, v in points], rel=1e-6), key


def test_tensorboard_shows_each_step_once_across_a_resume(train):  # noqa: F811 - the imported fixture
    run = train("--steps", "1", "--report-to", "jsonl,tensorboard")
    assert_shown_once(run)
    run = train("--steps", "2", "--resume", "--report-to", "jsonl,tensorboard")
    assert_shown_once(run)
    assert sorted({s for points in dashboard(run).values() for s, _ in points}) == [0, 1, 2]
