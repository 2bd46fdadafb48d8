"""`sparrow sql` is read-only whatever DuckDB types a statement as: a write inside a PIVOT statement (typed
MULTI) or inside a WITH clause (typed SELECT) is refused in one sentence and leaves every file as it was, and
DuckDB itself cannot write a file of the run even when handed such a statement (its files are read through a
read-only file system). Reads that hold a PIVOT give what DuckDB gives on the same data directly."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.sql import open_run, run_query
from sparrow.stages.sql.connection import close_run, open_views
from sparrow.stages.sql.files import file_url
from sparrow.stages.sql.views import run_views

from cli_checks import error_line

runner = CliRunner()

STATUS = ["passed", "failed", "passed", "error", "passed", "failed"]
TASK = ["code", "code", "math", "math", "math", "code"]


@pytest.fixture()
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(pa.table({"task": TASK, "status": STATUS, "reward": [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]}),
                   run / "scores.parquet")
    write_artifact({"bin": [0, 1], "bin_start": [0, 2000], "bin_end": [2000, None], "budget": [128, None],
                    "tail": [0.9, None], "predicted_step_seconds": [0.01, 0.02]}, run / "plan.parquet",
                   "schedule")
    return run


def digests(run: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.iterdir())}


def sql(run: Path, query: str, *extra: str):
    return runner.invoke(app, ["sql", query, "--run", str(run), *extra])


@pytest.mark.parametrize("query,word", [
    ("COPY (PIVOT scores ON status USING count(*)) TO '{target}' (FORMAT parquet, USE_TMP_FILE false)",
     "COPY"),
    ("/* a comment */ COPY (SELECT * FROM (PIVOT scores ON status USING count(*))) TO '{target}' "
     "(FORMAT parquet, USE_TMP_FILE false)", "COPY"),
    ("CREATE TABLE z AS PIVOT scores ON status USING count(*)", "CREATE"),
    ("INSERT INTO z PIVOT scores ON status USING count(*)", "INSERT"),
    ("EXPLAIN ANALYZE COPY (PIVOT scores ON status USING count(*)) TO '{target}' (USE_TMP_FILE false)",
     "COPY"),
    ("WITH x AS (COPY (SELECT 42 AS a) TO '{target}' (FORMAT parquet, USE_TMP_FILE false)) SELECT * FROM x",
     "COPY"),
    ("WITH x AS (COPY (SELECT 42 AS a) TO '{target}' (FORMAT parquet, USE_TMP_FILE false)) "
     "PIVOT scores ON status USING count(*)", "COPY"),
    ("WITH x AS (INSERT INTO z VALUES (1) RETURNING *) SELECT * FROM x", "INSERT"),
    ("WITH x AS (DELETE FROM z RETURNING *) PIVOT scores ON status USING count(*)", "DELETE"),
])
def test_a_write_that_holds_a_pivot_or_hides_in_a_with_clause_is_refused(run, query, word):
    before = digests(run)
    for target in (run / "plan.parquet", run / "scores.parquet"):
        line = error_line(sql(run, query.format(target=target)))
        assert f"sparrow sql is read-only over the run's views, so {word} is refused" in line
    assert digests(run) == before


def test_duckdb_cannot_write_a_file_of_the_run_even_when_asked(run):
    """The second wall: the connection itself, handed a COPY that no check saw, writes no file of the run,
    by its path or by the URL its views read it through."""
    before = digests(run)
    con = open_run(run)
    try:
        for target in (run.resolve() / "plan.parquet", file_url(run.resolve() / "plan.parquet")):
            for options in ("FORMAT parquet, USE_TMP_FILE false", "FORMAT parquet"):
                with pytest.raises(duckdb.Error):
                    con.execute(f"COPY (SELECT 42 AS a) TO '{target}' ({options})")
        assert con.execute("SELECT count(*) FROM schedule").fetchone() == (2,)  # reads still work
    finally:
        con.close()
    assert digests(run) == before


def test_the_run_files_are_reachable_only_through_the_views(run):
    """A file of the run named by its path is refused as every outside file is."""
    views = run_views(run)
    con, spill = open_views(run, views, warn=print, memory=None)
    try:
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"SELECT * FROM read_parquet('{run.resolve() / 'scores.parquet'}')")
        with pytest.raises(duckdb.Error):
            con.execute(f"SELECT * FROM read_text('{file_url('/etc/hostname')}')")
    finally:
        close_run(con, spill)


def direct(run: Path, query: str) -> list[dict]:
    """What DuckDB gives for `query` over scores.parquet read directly (no sandbox, no views)."""
    con = duckdb.connect()
    con.execute(f"CREATE VIEW scores AS SELECT * FROM read_parquet('{run / 'scores.parquet'}')")
    return con.sql(query).to_arrow_table().to_pylist()


@pytest.mark.parametrize("query", [
    "PIVOT scores ON status USING count(*) GROUP BY task ORDER BY task",
    "SELECT * FROM (PIVOT scores ON status USING count(*) GROUP BY task) ORDER BY task",
    "WITH p AS (PIVOT scores ON status USING sum(reward) GROUP BY task) SELECT * FROM p ORDER BY task",
    "-- a comment first\n(PIVOT scores ON status USING count(*) GROUP BY task ORDER BY task)",
])
def test_pivot_reads_still_run_and_match_duckdb(run, query):
    got = run_query(run, query).to_pylist()
    assert got == direct(run, query)
    if "count" in query:  # and a hand count
        counts = Counter(zip(TASK, STATUS))
        statuses = sorted(set(STATUS))
        assert got == [{"task": t, **{s: counts[(t, s)] for s in statuses}} for t in ("code", "math")]


def test_a_pivot_query_through_the_cli(run):
    r = sql(run, "PIVOT scores ON status USING count(*) GROUP BY task ORDER BY task", "-f", "json")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == ('[{"task": "code", "error": 0, "failed": 2, "passed": 1}, '
                                '{"task": "math", "error": 1, "failed": 0, "passed": 2}]')


@pytest.mark.parametrize("query", [
    "EXPLAIN(FORMAT json) SELECT count(*) FROM scores",
    "EXPLAIN/**/SELECT count(*) FROM scores",
    "EXPLAIN (ANALYZE) SELECT count(*) FROM scores",
    "EXPLAIN (FORMAT json, ANALYZE) SELECT count(*) FROM scores",
])
def test_every_form_of_explain_that_duckdb_takes_runs(run, query):
    assert run_query(run, query).num_rows == len(direct(run, query))


@pytest.mark.parametrize("query", ["EXPLAIN (ANALYZE) COPY scores TO 'x.parquet'",
                                   "EXPLAIN/**/ANALYZE COPY scores TO 'x.parquet'"])
def test_a_write_under_any_form_of_explain_is_refused(run, query):
    line = error_line(sql(run, query))
    assert "COPY is refused" in line


def test_sql_refuses_an_output_name_too_long_in_one_sentence(run, tmp_path):
    line = error_line(sql(run, "SELECT 1 AS a", "-o", str(tmp_path / ("a" * 300 + ".parquet"))))
    assert "choose a shorter name" in line


def test_a_json_lines_dataset_in_the_run_is_a_view_and_stays_read_only(run):
    """A user's TRL-layout .jsonl is a view (its stem), read through the same read-only file system: it can
    be queried and turned into Parquet, never written; one DuckDB cannot read is said and skipped."""
    rows = [{"prompt": "What is 2 + 3?", "solution": "5"}, {"prompt": "What is 4 times 6?", "solution": "24"}]
    (run / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = sql(run, "SELECT prompt, solution FROM gsm8k ORDER BY solution DESC", "-f", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == rows
    before = (run / "gsm8k.jsonl").read_bytes()
    r = sql(run, f"COPY gsm8k TO '{run / 'gsm8k.jsonl'}' (FORMAT json)")
    assert r.exit_code == 2 and (run / "gsm8k.jsonl").read_bytes() == before
    (run / "broken.jsonl").write_text('{"a": 1}\nnot json\n')
    r = sql(run, "SELECT count(*) AS n FROM gsm8k", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.split() == ["n", "2"]
    assert "broken.jsonl" in r.stderr and "skipped the view 'broken'" in r.stderr


def test_the_hubs_shards_of_a_split_are_one_view_named_by_the_split(tmp_path):
    """train-00000-of-00002.parquet and train-00001-of-00002.parquet are one dataset, as `datasets`
    reads them: one view `train`, its rows in shard order (so that row_number() gives a dataset's row)."""
    data = tmp_path / "data"
    data.mkdir()
    first = pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]})
    pq.write_table(first, data / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"prompt": ["c"], "answer": ["3"]}), data / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"prompt": ["t"]}), data / "test-00000-of-00001.parquet")
    r = sql(data, "SELECT prompt FROM train", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.split() == ["prompt", "a", "b", "c"], r.output
    r = sql(data, "SHOW TABLES", "-f", "csv")
    assert r.stdout.split() == ["name", "test", "train"]
