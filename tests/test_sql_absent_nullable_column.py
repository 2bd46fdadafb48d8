"""A nullable schema column that no file of a kind has (a file written by a foreign writer or an older
Sparrow, as the schema allows) is read as NULL by the kind's views, so a query naming it answers; a
column that some file has keeps its values."""

from __future__ import annotations

import pyarrow.parquet as pq
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact


def _step(path, s: int, lb: list[float] | None, drop: bool) -> None:
    write_artifact({"step": [s] * 2, "prompt_id": ["p"] * 2, "sample": [0] * 2, "position": [10, 11],
                    "bin": [0, 0], "budget": [64] * 2, "token_id": [1] * 2, "logp_rollout": [-1.0] * 2,
                    "logp_dense": [-1.1] * 2, "log_ratio": [0.1] * 2, "k3": [0.01] * 2,
                    "alpha_top20_lb": lb or [None] * 2, "weight": [1.0] * 2, "masked": [False] * 2,
                    "vetoed": [False] * 2}, path, "train_mismatch")
    if drop:
        pq.write_table(pq.read_table(path).drop_columns(["alpha_top20_lb", "alpha"]), path)


def _query(run, sql: str) -> list[str]:
    result = CliRunner().invoke(app, ["sql", sql, "--run", str(run)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()


def test_a_column_no_file_has_reads_as_null_in_the_kind_and_file_views(tmp_path):
    run = tmp_path / "run"
    for s in (1, 2):
        _step(run / "mismatch" / f"step={s}.parquet", s, None, drop=True)
    counted = _query(run, "SELECT count(alpha_top20_lb), count(alpha), count(*) FROM train_mismatch")
    assert counted[1] == "0\t0\t4"
    typed = _query(run, "SELECT typeof(alpha_top20_lb) FROM train_mismatch__mismatch_step_1 LIMIT 1")
    assert typed[1] == "FLOAT"  # the schema's type


def test_a_column_some_file_has_keeps_its_values(tmp_path):
    run = tmp_path / "run"
    _step(run / "mismatch" / "step=1.parquet", 1, None, drop=True)
    _step(run / "mismatch" / "step=2.parquet", 2, [0.25, 0.75], drop=False)
    summed = _query(run, "SELECT step, sum(alpha_top20_lb) FROM train_mismatch GROUP BY step ORDER BY step")
    assert summed[1:] == ["1\t\\N", "2\t1.0"]
