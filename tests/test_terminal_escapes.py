"""Names and values from a run's files reach the terminal escaped: a file name holding an escape sequence
and a newline, or provenance holding colour codes, prints as one line of visible escapes per warning or
error, in `sql` and in `report`, never as control characters that clear the screen or forge a line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.cli.messages import printable
from sparrow.schemas import write_artifact

runner = CliRunner()

EVIL = "a\x1b[2J\x1b]0;PWNED\x07b\nwarning: all good"
SHOWN = "a\\x1b[2J\\x1b]0;PWNED\\x07b\\nwarning: all good"  # as printable writes it, by hand


def rollouts(path: Path, meta: dict | None = None) -> Path:
    return write_artifact({"prompt_id": ["p0"], "sample": [0], "prompt_token_ids": [[1]],
                           "token_ids": [[2, 3]], "text": ["x"], "logprobs": [[-0.5, -0.5]],
                           "budgets": [[0, 0]], "finish_reason": ["stop"], "reward": [1.0]},
                          path, "rollouts", meta or {})


@pytest.fixture()
def run(tmp_path) -> Path:
    run = tmp_path / "esc"
    rollouts(run / "good.parquet")
    (run / f"{EVIL}.parquet").write_bytes(b"junk")
    return run


def test_printable_escapes_controls_and_keeps_text():
    assert printable(EVIL) == SHOWN
    assert printable("tab\tstays, é and ✓ too; \x9b (a C1 CSI) does not") == (
        "tab\tstays, é and ✓ too; \\x9b (a C1 CSI) does not")


def test_sql_warns_in_one_escaped_line(run):
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "--run", str(run), "-f", "json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [f"warning: {run}/{SHOWN}.parquet is not a Parquet file: it does not "
                                     "start with the Parquet magic bytes; skipped it"]


def test_sql_provenance_is_escaped_in_the_mixed_warning(tmp_path):
    run = tmp_path / "mixed"
    rollouts(run / "a.parquet", {"engine": "\x1b[31mRED\x1b[0m"})
    rollouts(run / "b.parquet", {"engine": "sparrow"})
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "--run", str(run), "-f", "json"])
    assert r.exit_code == 0, r.output
    [line] = r.stderr.splitlines()
    assert "engine: \\x1b[31mRED\\x1b[0m, sparrow" in line and "\x1b" not in line


def test_report_says_a_skipped_file_in_one_escaped_line(run):
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    not_drawn = [line for line in r.stderr.splitlines() if line.startswith("not drawn: ")]
    assert not_drawn == [f"not drawn: {run}/{SHOWN}.parquet is not a Parquet file: it does not start with "
                         "the Parquet magic bytes"]
    assert "\x1b" not in r.stderr
    assert not any(line.startswith("warning: all good") for line in r.stderr.splitlines())


def test_report_error_is_one_escaped_line(tmp_path):
    run = tmp_path / "only"
    run.mkdir()
    (run / f"{EVIL}.parquet").write_bytes(b"junk")
    r = runner.invoke(app, ["report", "--run", str(run)])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"error: {run} holds nothing to plot (no mismatch, schedule, cost, rollouts, rewards, calibrated "
        f"threshold or training run; not drawn: {run}/{SHOWN}.parquet is not a Parquet file: it does not "
        "start with the Parquet magic bytes)"]
