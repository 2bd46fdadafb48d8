"""A footer number of the wrong kind (bin_width 'wide' or 0, threshold 'high'): plan-schedule refuses the
profile in one sentence naming the file and the key, and `sparrow report` leaves that artifact out with the
same sentence under "not drawn" and draws the rest."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, write_artifact
from sparrow.schemas.footer import footer_number

from cli_checks import error_line


def _profile(path, bin_width) -> None:
    rows = [{"prompt_id": "p", "sample": 0, "position": 100 + k, "bin": (100 + k) // 512, "budget": b,
             "token_id": 1, "alpha": 0.9, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0,
             "k1": 0.0, "k2": 0.0, "k3": 0.0, "entropy_dense": 1.0} for b in (64, 128) for k in range(40)]
    write_artifact(rows, path, "mismatch", metadata={"bin_width": bin_width, "model": "smollm2-135m"})


def _schedule(path, threshold) -> None:
    write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": [64, None],
                    "tail": [0.9, None], "predicted_step_seconds": [None] * 2}, path, "schedule",
                   metadata={"page_size": 16, "model": "smollm2-135m", "threshold": threshold})


@pytest.mark.parametrize("value", ["wide", 0, True, 2.5])
def test_plan_schedule_refuses_a_recorded_bin_width_that_is_no_width_in_one_sentence(tmp_path, value):
    _profile(tmp_path / "p.parquet", value)
    result = CliRunner().invoke(app, ["plan-schedule", "--model", "smollm2-135m", "--profile",
                                      str(tmp_path / "p.parquet"), "--threshold", "0.3",
                                      "-o", str(tmp_path / "s.parquet")])
    assert error_line(result) == (f"error: {tmp_path / 'p.parquet'} records bin_width {value!r} in its "
                                  "'sparrow.meta' metadata, not a positive whole number")
    assert not (tmp_path / "s.parquet").exists()


def test_report_leaves_out_the_artifacts_with_bad_footer_numbers_and_draws_the_rest(tmp_path):
    run = tmp_path / "run"
    _profile(run / "wide.parquet", "wide")
    _profile(run / "good.parquet", 512)
    _schedule(run / "high.parquet", "high")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    not_drawn = [line.removeprefix("not drawn: ") for line in result.stderr.splitlines()
                 if line.startswith("not drawn: ")]
    assert sorted(not_drawn) == [
        f"{run / 'high.parquet'} records threshold 'high' in its 'sparrow.meta' metadata, not a number "
        "between 0 and 1 (both excluded)",
        f"{run / 'wide.parquet'} records bin_width 'wide' in its 'sparrow.meta' metadata, not a positive "
        "whole number"]
    assert sorted(p.name for p in (run / "report").glob("*.png")) == ["tail.png"]


def test_footer_number_reads_whole_numbers_and_open_unit_numbers():
    assert footer_number({"bin_width": 512.0}, "bin_width", "f") == 512
    assert footer_number({"quantile": 0.05}, "quantile", "f") == 0.05
    assert footer_number({"threshold": None}, "threshold", "f") is None
    assert footer_number({}, "min_tokens", "f") is None
    for key, value in (("threshold", 1), ("quantile", float("nan")), ("min_tokens", "50")):
        with pytest.raises(ArtifactError, match=f"^f records {key} "):
            footer_number({key: value}, key, "f")
