"""A first `sparrow report` stopped half-way (Ctrl-C while drawing) leaves no folder behind, so the rerun
is not refused as "not a Sparrow report folder"; a report stopped in an earlier report's folder keeps its
page and the figures beside it, every byte (the new figures are drawn aside and put in place with the
page)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sparrow.stages.report as report
from sparrow.schemas import write_artifact


def rollouts(run: Path) -> Path:
    n = 3
    return write_artifact({"prompt_id": [f"p{i}" for i in range(n)], "sample": [0] * n,
                           "prompt_token_ids": [[1, 2]] * n, "token_ids": [[5, 6, 7]] * n, "text": ["x"] * n,
                           "logprobs": [[-0.5] * 3] * n, "budgets": [[0] * 3] * n,
                           "finish_reason": ["stop"] * n, "reward": [1.0] * n}, run / "rollouts.parquet",
                          "rollouts")


@pytest.fixture()
def stopped_while_drawing(monkeypatch):
    """The rollouts figure writes its PNG, then the user presses Ctrl-C."""
    draw = report.rollouts_figure

    def stop(path, name, out, plt):
        draw(path, name, out, plt)
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "rollouts_figure", stop)


def test_a_first_report_stopped_half_way_leaves_no_folder(tmp_path, stopped_while_drawing):
    rollouts(tmp_path)
    out = tmp_path / "report"
    with pytest.raises(KeyboardInterrupt):
        report.build_report(tmp_path, out)
    assert not out.exists()


def test_a_report_stopped_in_an_earlier_reports_folder_keeps_that_page(tmp_path, monkeypatch):
    rollouts(tmp_path)
    out = tmp_path / "report"
    report.build_report(tmp_path, out)
    page = (out / "index.html").read_bytes()
    draw = report.rollouts_figure

    def stop(path, name, out_, plt):
        draw(path, name, out_, plt)
        raise KeyboardInterrupt

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    n = 3  # other rollouts: a figure drawn of them differs
    write_artifact({"prompt_id": [f"p{i}" for i in range(n)], "sample": [0] * n,
                    "prompt_token_ids": [[1, 2]] * n, "token_ids": [[5, 6, 7, 8]] * n, "text": ["y"] * n,
                    "logprobs": [[-0.5] * 4] * n, "budgets": [[0] * 4] * n, "finish_reason": ["length"] * n,
                    "reward": [0.0] * n}, tmp_path / "rollouts.parquet", "rollouts")
    monkeypatch.setattr(report, "rollouts_figure", stop)
    with pytest.raises(KeyboardInterrupt):
        report.build_report(tmp_path, out)
    assert (out / "index.html").read_bytes() == page
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no new PNG beside the old page


def test_the_folders_a_stopped_report_made_on_its_way_are_removed_too(tmp_path, stopped_while_drawing):
    rollouts(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        report.build_report(tmp_path, tmp_path / "a" / "b" / "report")
    assert not (tmp_path / "a").exists()
