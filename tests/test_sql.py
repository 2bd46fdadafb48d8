"""`sparrow sql`: views per artifact kind, percentile queries against numpy, CLI output and errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli import sql as sql_cli
from sparrow.schemas import ArtifactError, read_artifact, write_artifact
from sparrow.stages.sql import QueryError, open_run, run_query, run_views

runner = CliRunner()


def mismatch(n: int, seed: int, prompt: str = "p0") -> dict:
    rng = np.random.default_rng(seed)
    position = rng.integers(0, 8000, n).astype(np.int32)
    lp = -rng.exponential(1.0, n).astype(np.float32)
    return {"prompt_id": [prompt] * n, "sample": np.zeros(n, np.int32), "position": position,
            "bin": position // 2000, "budget": rng.choice([64, 128, 256], n).astype(np.int32),
            "token_id": rng.integers(0, 100, n).astype(np.int32),
            "alpha": rng.beta(8, 1, n).astype(np.float32), "logp_dense": lp, "logp_sparse": lp,
            "log_ratio": np.zeros(n, np.float32), "k1": np.zeros(n, np.float32),
            "k2": np.zeros(n, np.float32), "k3": np.zeros(n, np.float32),
            "entropy_dense": np.ones(n, np.float32)}


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    write_artifact(mismatch(3000, 0), tmp_path / "mismatch_a.parquet", "mismatch")
    write_artifact(mismatch(1000, 1, "p1"), tmp_path / "mismatch_b.parquet", "mismatch")
    write_artifact({"bin": [0, 1], "bin_start": [0, 2000], "bin_end": [2000, None], "budget": [128, None],
                    "tail": [0.9, None], "predicted_step_seconds": [0.01, 0.02]},
                   tmp_path / "plan.parquet", "schedule", {"page_size": 16})
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "my data-2.parquet")
    pq.write_table(pa.table({"y": ["a"]}), tmp_path / "schedule.parquet")  # plain file, clashing name
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    (tmp_path / "sub").mkdir()  # a run of its own (not only Parquet parts): not part of this run's views
    write_artifact(mismatch(10, 2), tmp_path / "sub" / "ignored.parquet", "mismatch")
    (tmp_path / "sub" / "notes.txt").write_text("another run")
    return tmp_path


def test_views_by_artifact_kind(run_dir):
    views = {v.name: v for v in run_views(run_dir)}
    assert list(views) == ["mismatch", "schedule", "mismatch__mismatch_a", "mismatch__mismatch_b",
                           "schedule__plan", "my_data_2", "schedule_2"]
    assert [p.name for p in views["mismatch"].files] == ["mismatch_a.parquet", "mismatch_b.parquet"]
    assert views["mismatch"].artifact and not views["my_data_2"].artifact
    con = open_run(run_dir)
    assert con.execute("SELECT count(*) FROM mismatch").fetchone() == (4000,)
    assert dict(con.execute("SELECT source_file, count(*) FROM mismatch GROUP BY ALL").fetchall()) == {
        "mismatch_a.parquet": 3000, "mismatch_b.parquet": 1000}
    assert con.execute("SELECT sum(x) FROM my_data_2").fetchone() == (6,)
    assert con.execute("SELECT y FROM schedule_2").fetchone() == ("a",)
    assert con.execute("SELECT budget FROM schedule ORDER BY bin").fetchall() == [(128,), (None,)]
    con.close()


def test_tail_quantiles_match_numpy(run_dir):
    result = run_query(run_dir, "SELECT bin, budget, quantile_cont(alpha, 0.05) AS tail, count(*) AS n "
                                "FROM mismatch GROUP BY bin, budget ORDER BY bin, budget")
    table = pa.concat_tables([read_artifact(run_dir / "mismatch_a.parquet"),
                              read_artifact(run_dir / "mismatch_b.parquet")])
    bins, budgets = table["bin"].to_numpy(), table["budget"].to_numpy()
    alpha = table["alpha"].to_numpy()
    assert result.num_rows == 4 * 3
    for row in result.to_pylist():
        group = alpha[(bins == row["bin"]) & (budgets == row["budget"])]
        assert row["n"] == group.size
        assert row["tail"] == pytest.approx(np.percentile(group, 5, method="linear"), rel=1e-6)


def test_empty_run_dir_and_errors(tmp_path):
    assert run_query(tmp_path, "SELECT 42 AS answer").to_pylist() == [{"answer": 42}]
    with pytest.raises(ArtifactError, match="does not exist"):
        run_query(tmp_path / "nope", "SELECT 1")
    with pytest.raises(QueryError, match="Parser Error"):
        run_query(tmp_path, "SELEC 1")
    with pytest.raises(QueryError, match=r"mismatch.*\(views in .*: none\)"):
        run_query(tmp_path, "SELECT * FROM mismatch")


def test_corrupt_parquet_is_skipped_with_a_warning_naming_it(run_dir):
    data = (run_dir / "plan.parquet").read_bytes()
    (run_dir / "broken.parquet").write_bytes(data[: len(data) // 2])
    said: list[str] = []
    assert run_query(run_dir, "SELECT count(*) AS n FROM mismatch", warn=said.append).to_pylist() == [
        {"n": 4000}]
    assert len(said) == 1 and "broken.parquet is a truncated Parquet file" in said[0] and "skipped" in said[0]


# ---- CLI ----

def local_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("sql")(sql_cli.sql)
    app.command("noop", hidden=True)(lambda: None)  # keep `sql` a subcommand
    return app


def invoke(*args: str, app: typer.Typer | None = None):
    return runner.invoke(app or local_app(), ["sql", *args])


def test_cli_csv_and_json(run_dir):
    q = "SELECT bin, budget, tail FROM schedule ORDER BY bin"
    r = invoke(q, "--run", str(run_dir), "--format", "csv")
    assert r.exit_code == 0, r.output
    assert list(csv.reader(io.StringIO(r.stdout))) == [["bin", "budget", "tail"], ["0", "128", "0.9"],
                                                       ["1", "", ""]]
    r = invoke(q, "--run", str(run_dir), "-f", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"bin": 0, "budget": 128, "tail": 0.9},
                                    {"bin": 1, "budget": None, "tail": None}]
    r = invoke("SELECT sum(budget) AS s, 'nan'::DOUBLE AS x, [1, 2] AS l FROM schedule", "--run",
               str(run_dir), "-f", "json")
    assert json.loads(r.stdout) == [{"s": 128, "x": None, "l": [1, 2]}]


def test_cli_table(run_dir):
    r = invoke("SELECT bin, budget FROM schedule ORDER BY bin", "--run", str(run_dir), "--format", "table")
    assert r.exit_code == 0, r.output
    assert "budget" in r.stdout and "128" in r.stdout and "null" in r.stdout and "2 rows" in r.stdout


def test_cli_default_in_a_pipe_is_complete_tsv(run_dir):
    """stdout is not a terminal here: every row, tab-separated, nothing truncated."""
    r = invoke("SELECT bin, budget, repeat('x', 200) AS wide FROM schedule ORDER BY bin",
               "--run", str(run_dir))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "bin\tbudget\twide" and len(lines) == 3
    assert lines[2].split("\t")[1] == "" and lines[1].endswith("x" * 200)


def test_cli_parquet_output(run_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("out") / "deep" / "tails.parquet"
    r = invoke("SELECT bin, budget, quantile_cont(alpha, 0.05) AS tail FROM mismatch GROUP BY ALL",
               "--run", str(run_dir), "-o", str(target))
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert f"wrote 12 rows x 3 columns to {target}" in " ".join(r.stderr.split())
    assert pq.read_table(target).num_rows == 12
    assert [p.name for p in target.parent.iterdir()] == ["tails.parquet"]


@pytest.mark.parametrize("args,words", [
    (["SELEC 1"], "query failed: Parser Error: syntax error"),
    (["SELECT * FROM rollouts"], "rollouts does not exist"),
    (["SELECT 1", "--format", "xml"], "--format must be one of table, csv, json, tsv, got 'xml'"),
    (["SELECT 1", "-o", "out.csv"], "-o writes Parquet"),
])
def test_cli_errors(run_dir, args, words):
    r = invoke(*args, "--run", str(run_dir))
    assert r.exit_code == 2
    err = " ".join(r.stderr.split())
    assert err.startswith("error:") and words in err, r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


def test_cli_missing_run_and_corrupt_file(tmp_path):
    r = invoke("SELECT 1", "--run", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "does not exist" in r.stderr and "Traceback" not in r.output
    (tmp_path / "bad.parquet").write_text("not parquet at all")
    r = invoke("SELECT 1 AS one", "--run", str(tmp_path), "-f", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"one": 1}]
    assert "warning: " in r.stderr and "bad.parquet is not a Parquet file" in " ".join(r.stderr.split())


@pytest.mark.skipif(not (Path(sql_cli.__file__).parent / "prompts.py").exists(),
                    reason="sparrow_cli/prompts.py not written yet")
def test_cli_through_the_real_app(run_dir):
    from sparrow.cli.app import app

    r = invoke("SELECT count(*) AS n FROM mismatch", "--run", str(run_dir), "-f", "json", app=app)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"n": 4000}]
