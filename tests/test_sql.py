"""`sparrow sql`: views per artifact kind, percentile queries against numpy, CLI output and errors."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli import sql as sql_cli
from sparrow.schemas import ArtifactError, read_artifact, write_artifact
from sparrow.stages.sql import QueryError, machine_memory, memory_text, open_run, run_query, run_views

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
    assert json.loads(r.stdout) == [{"s": 128, "x": "NaN", "l": [1, 2]}]


def test_cli_table(run_dir):
    r = invoke("SELECT bin, budget FROM schedule ORDER BY bin", "--run", str(run_dir), "--format", "table")
    assert r.exit_code == 0, r.output
    assert "budget" in r.stdout and "128" in r.stdout and "null" in r.stdout and "2 rows" in r.stdout


def test_cli_table_keeps_a_row_on_one_line_where_its_text_breaks_lines(run_dir):
    """commands.md: tabs and newlines in text show as spaces in a table (a completion's text has them)."""
    r = invoke("SELECT 'a' || chr(10) || 'b' || chr(9) || 'c' || chr(13) || 'd' AS t", "--run", str(run_dir),
               "--format", "table")
    assert r.exit_code == 0, r.output
    assert "│ a b c d │" in r.stdout.splitlines(), r.stdout


def test_cli_table_prints_text_that_looks_like_markup_as_stored(run_dir):
    """A Llama-2 prompt's [/INST], a rich tag or an emoji code, in a cell or a header, is data."""
    r = invoke("SELECT 'foo [/INST] bar' AS s, ':x: [bold]hi[/bold]' AS \"[/bold]:fire:\"", "--run",
               str(run_dir), "--format", "table")
    assert r.exit_code == 0, r.output
    assert "foo [/INST] bar" in r.stdout and ":x: [bold]hi[/bold]" in r.stdout
    assert "[/bold]:fire:" in r.stdout and "1 row" in r.stdout


def test_a_warning_names_a_file_as_it_is_called(tmp_path):
    (tmp_path / "[INST]:fire:[bold].parquet").write_text("not parquet at all")
    r = invoke("SELECT 1 AS one", "--run", str(tmp_path), "-f", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"one": 1}]
    assert "[INST]:fire:[bold].parquet is not a Parquet file" in " ".join(r.stderr.split())


def test_cli_default_in_a_pipe_is_complete_tsv(run_dir):
    """stdout is not a terminal here: every row, tab-separated, nothing truncated."""
    r = invoke("SELECT bin, budget, repeat('x', 200) AS wide FROM schedule ORDER BY bin",
               "--run", str(run_dir))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "bin\tbudget\twide" and len(lines) == 3
    assert lines[2].split("\t")[1] == "\\N" and lines[1].endswith("x" * 200)


def test_tsv_loses_nothing_of_a_value(run_dir):
    """Floats whole, NULL apart from '', tabs, newlines and backslashes escaped as PostgreSQL COPY writes
    them, booleans as CSV shows them: one line per row."""
    query = ("SELECT 1/3 AS x, 123456789.0::DOUBLE AS y, true AS b, NULL AS n, '' AS e, "
             "'a' || chr(9) || 'b' || chr(10) || 'c' || chr(13) || chr(92) || 'N' AS t, [1, 2] AS l")
    r = invoke(query, "--run", str(run_dir), "-f", "tsv")
    assert r.exit_code == 0, r.output
    assert r.stdout == ("x\ty\tb\tn\te\tt\tl\n"
                        "0.3333333333333333\t123456789.0\tTrue\t\\N\t\ta\\tb\\nc\\r\\\\N\t[1, 2]\n")
    as_csv = invoke(query, "--run", str(run_dir), "-f", "csv")
    assert next(csv.reader(io.StringIO(as_csv.stdout.splitlines()[1])))[2] == "True"


def test_tsv_reads_back_with_pandas(run_dir):
    import pandas as pd

    r = invoke("SELECT 0.1::DOUBLE + 0.2::DOUBLE AS x, NULL::DOUBLE AS y, false AS b", "--run", str(run_dir),
               "-f", "tsv")
    frame = pd.read_csv(io.StringIO(r.stdout), sep="\t", na_values=["\\N"], keep_default_na=False,
                        quoting=csv.QUOTE_NONE)
    [row] = frame.to_dict("records")
    assert row["x"] == 0.1 + 0.2 and np.isnan(row["y"]) and frame["b"].dtype == bool and not row["b"]


def test_an_empty_result_has_its_caption_on_one_line(run_dir):
    r = invoke("SELECT 1 WHERE false", "--run", str(run_dir), "-f", "table")
    assert r.exit_code == 0, r.output
    assert "0 rows" in r.stdout.splitlines()[-1]


def test_cli_parquet_output(run_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("out") / "deep" / "tails.parquet"
    r = invoke("SELECT bin, budget, quantile_cont(alpha, 0.05) AS tail FROM mismatch GROUP BY ALL",
               "--run", str(run_dir), "-o", str(target))
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert f"wrote 12 rows x 3 columns to {target}" in " ".join(r.stderr.split())
    assert pq.read_table(target).num_rows == 12
    assert [p.name for p in target.parent.iterdir()] == ["tails.parquet"]


def digest(path: Path) -> bytes:
    return path.read_bytes()


def test_o_replaces_only_its_own_results(run_dir, tmp_path_factory):
    """A user's Parquet file (pandas, datasets, verl) is not a query result: refused without --force and
    left as it was; an earlier result of `-o` and an empty file are replaced."""
    folder = tmp_path_factory.mktemp("out")
    mine = folder / "train.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2 + 3?"], "answer": ["5"]}), mine)
    before = digest(mine)
    r = invoke("SELECT 1 AS oops", "--run", str(run_dir), "-o", str(mine))
    assert one_error(r) == (f"error: -o {mine} exists and is a Parquet file without Sparrow metadata, not a "
                            "query result of sparrow sql; pass --force to replace it, or choose another path")
    assert digest(mine) == before and sorted(p.name for p in folder.iterdir()) == ["train.parquet"]
    assert invoke("SELECT 1 AS oops", "--run", str(run_dir), "-o", str(mine), "--force").exit_code == 0
    assert pq.read_table(mine).to_pylist() == [{"oops": 1}]

    result = folder / "tails.parquet"
    for n in (1, 2):
        r = invoke(f"SELECT {n} AS a", "--run", str(run_dir), "-o", str(result))
        assert r.exit_code == 0, r.output
    assert pq.read_table(result).to_pylist() == [{"a": 2}]
    assert pq.read_schema(result).metadata[b"sparrow.query"] == b"SELECT 2 AS a"
    empty = folder / "empty.parquet"
    empty.write_bytes(b"")
    assert invoke("SELECT 3 AS a", "--run", str(run_dir), "-o", str(empty)).exit_code == 0
    assert pq.read_table(empty).to_pylist() == [{"a": 3}]


def test_o_refuses_a_text_file_and_an_artifact(run_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("out")
    notes = folder / "notes.parquet"
    notes.write_text("my notes")
    r = invoke("SELECT 1 AS a", "--run", str(run_dir), "-o", str(notes))
    assert "is not a Sparrow artifact, not a query result of sparrow sql; pass --force" in one_error(r)
    plan = run_dir / "plan.parquet"
    before = digest(plan)
    elsewhere = folder / "plan.parquet"
    shutil.copy(plan, elsewhere)
    r = invoke("SELECT 1 AS a", "--run", str(run_dir), "-o", str(elsewhere))
    assert "is a 'schedule' artifact, not a query result of sparrow sql; pass --force" in one_error(r)
    r = invoke("SELECT 1 AS a", "--run", str(run_dir), "-o", str(plan), "--force")  # what the query reads
    assert "is a file of the --run this command reads; choose another path" in one_error(r)
    assert notes.read_text() == "my notes" and digest(plan) == before == digest(elsewhere)


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


def test_the_run_directory_may_come_before_the_query(run_dir, monkeypatch):
    """`sparrow sql RUN QUERY` as `sparrow report RUN`; one argument is the query, over --run or here."""
    q = "SELECT count(*) AS n FROM mismatch"
    for args in ([str(run_dir), q], [q, "--run", str(run_dir)]):
        r = invoke(*args, "-f", "json")
        assert r.exit_code == 0 and json.loads(r.stdout) == [{"n": 4000}], r.output
    monkeypatch.chdir(run_dir)
    assert json.loads(invoke(q, "-f", "json").stdout) == [{"n": 4000}]
    for args, said in (([str(run_dir), q, "--run", str(run_dir)], "the run directory was given twice"),
                       ([q, str(run_dir)], f"the run directory before the query: sparrow sql {run_dir} "),
                       ([str(run_dir), q, "SELECT 2"], "got 3 arguments")):
        assert said in one_error(invoke(*args))
    artifact = next(run_dir.glob("*.parquet"))  # a file after the query: its directory is the run
    assert (f"sparrow sql takes a run directory, then the query, and {artifact} is a file: give its "
            f"directory first, sparrow sql {run_dir} QUERY") in one_error(invoke(q, str(artifact)))


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


# ---- limits: memory, time, rows; the spill folder ----

@pytest.fixture()
def private_tmp(tmp_path_factory, monkeypatch) -> Path:
    """A temporary folder of the test's own, where the query's spill folder goes."""
    tmp = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def one_error(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return " ".join(lines[0].split())


def test_a_cross_join_stops_at_max_rows_with_unique_column_names(run_dir, private_tmp):
    r = invoke("SELECT * FROM mismatch a, mismatch b, mismatch c", "--run", str(run_dir), "-f", "tsv",
               "--max-rows", "100")
    assert one_error(r) == ("error: the result has more than 100 rows, so only its first 100 were printed; "
                            "raise --max-rows (0: no limit), or write every row with -o FILE.parquet")
    lines = r.stdout.splitlines()
    columns = list(mismatch(1, 0)) + ["alpha_draft", "source_file",  # the schema's nullable column filled
                                      "source_sparrow_version", "source_torch_version"]
    assert len(lines) == 101 and all(line.count("\t") == 3 * len(columns) - 1 for line in lines)
    header = lines[0].split("\t")
    assert header == columns + [f"{c}_1" for c in columns] + [f"{c}_2" for c in columns]
    assert list(private_tmp.iterdir()) == []


def test_duplicate_columns_get_unique_names_in_parquet(run_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("out") / "pairs.parquet"
    r = invoke("SELECT a.bin, b.bin, a.budget, b.budget AS bin_1 FROM schedule a, schedule b", "--run",
               str(run_dir), "-o", str(target))
    assert r.exit_code == 0, r.output
    table = pq.read_table(target)
    assert table.column_names == ["bin", "bin_2", "budget", "bin_1"] and table.num_rows == 4


def test_a_huge_string_stops_at_the_memory_limit(run_dir, private_tmp):
    r = invoke("SELECT repeat('x', 2000000000) AS s", "--run", str(run_dir), "--memory-limit", "256MiB")
    assert one_error(r) == ("error: the query needed more memory than its limit of 256 MiB and was stopped "
                            "(raise it with --memory-limit, or let SQL aggregate more)")
    assert r.stdout == "" and list(private_tmp.iterdir()) == []


def test_a_long_query_stops_at_the_timeout(run_dir, private_tmp):
    start = time.monotonic()
    r = invoke("SELECT count(*) FROM mismatch a, mismatch b, mismatch c, mismatch d, mismatch e",
               "--run", str(run_dir), "--timeout", "1")
    assert one_error(r) == ("error: the query ran past its time limit of 1 s and was stopped (raise it with "
                            "--timeout)")
    assert time.monotonic() - start < 15 and r.stdout == "" and list(private_tmp.iterdir()) == []


def test_a_stopped_query_leaves_the_earlier_output_as_it_was(run_dir, tmp_path_factory, private_tmp):
    target = tmp_path_factory.mktemp("out") / "rows.parquet"
    assert invoke("SELECT * FROM range(1, 3) t(a)", "--run", str(run_dir), "-o", str(target)).exit_code == 0
    r = invoke("SELECT * FROM mismatch a, mismatch b, mismatch c", "--run", str(run_dir), "-o", str(target),
               "--timeout", "1")
    assert one_error(r).startswith("error: the query ran past its time limit of 1 s")
    assert pq.read_table(target).to_pylist() == [{"a": 1}, {"a": 2}]
    assert list(target.parent.iterdir()) == [target] and list(private_tmp.iterdir()) == []


def test_a_query_that_spills_leaves_no_folder_and_old_ones_of_dead_runs_go(run_dir, private_tmp):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = private_tmp / f"sparrow-sql-{dead.pid}-abc123"  # a run killed before it could clean up
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "duckdb_temp_block").write_bytes(b"x" * 100)
    alive = private_tmp / f"sparrow-sql-{os.getppid()}-def456"  # another query, still running
    alive.mkdir()
    r = invoke("SELECT i, md5(i::VARCHAR) AS h FROM range(3000000) t(i) ORDER BY h LIMIT 1", "--run",
               str(run_dir), "--memory-limit", "128MiB", "-f", "json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)) == 1
    assert list(private_tmp.iterdir()) == [alive]


@pytest.mark.parametrize("args,words", [
    (["--memory-limit", "lots"], "--memory-limit must be a size such as 4GB, 512MiB or 25% (of this "
                                 "machine's memory), got 'lots'"),
    (["--memory-limit", "1MB"], "--memory-limit must be at least 16MiB, got '1MB'"),
    (["--timeout", "-1"], "--timeout must be a number of seconds from 0 (no limit) to 31,536,000 (a year), "
                          "got -1"),
    (["--max-rows", "-5"], "--max-rows must be >= 0 (0: no limit), got -5"),
])
def test_bad_limits_are_refused_before_the_query(run_dir, args, words):
    assert one_error(invoke("SELECT 1", "--run", str(run_dir), *args)) == f"error: {words}"


def test_a_memory_limit_above_the_machines_memory_is_refused(run_dir):
    total = machine_memory()
    given = f"{total // 2**30 + 1}GiB"
    assert one_error(invoke("SELECT 1", "--run", str(run_dir), "--memory-limit", given)) == (
        f"error: --memory-limit must be at most this machine's memory ({memory_text(total)}), got '{given}'")


# ---- statements ----

@pytest.mark.parametrize("query,words", [
    ("", "the query is empty; give one SQL statement, e.g. \"SHOW TABLES\""),
    ("  ;  -- nothing", "the query is empty; give one SQL statement, e.g. \"SHOW TABLES\""),
    ("SELECT 1 AS a; SELECT 2 AS b", "the query holds 2 statements, and sparrow sql runs one per call (each "
                                     "result is one table); run them one at a time"),
])
def test_an_empty_query_or_several_statements_are_refused(run_dir, query, words):
    r = invoke(query, "--run", str(run_dir), "-f", "json")
    assert one_error(r) == f"error: query failed: {words}" and r.stdout == ""


# ---- provenance ----

@pytest.fixture()
def mixed_run(tmp_path) -> Path:
    run = tmp_path / "mixed"
    run.mkdir()
    write_artifact(mismatch(30, 0), run / "dense.parquet", "mismatch", {"model": "m", "sampler": "dense"})
    write_artifact(mismatch(20, 1), run / "b64.parquet", "mismatch",
                   {"model": "m", "sampler": "budget:64", "adapter": "/adapters/a"})
    (run / "distill" / "mismatch").mkdir(parents=True)
    return run


def test_a_union_of_different_provenance_warns_and_can_be_filtered(mixed_run):
    r = invoke("SELECT count(*) AS n FROM mismatch", "--run", str(mixed_run), "-f", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"n": 50}], r.output
    warning = " ".join(r.stderr.split())
    assert warning == ("warning: the view 'mismatch' pools 2 files of different provenance (sampler: "
                       "budget:64, dense; adapter: /adapters/a, none); filter on source_sampler, "
                       "source_adapter, or query one file's view (mismatch__...)")


def test_a_query_that_tells_the_files_apart_is_not_warned(mixed_run):
    """A query that names source_file or a differing source_* column filters or groups by it."""
    r = invoke("SELECT source_file, source_model, source_sampler, source_adapter, count(*) AS n "
               "FROM mismatch GROUP BY ALL ORDER BY n", "--run", str(mixed_run), "-f", "json")
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout) == [
        {"source_file": "b64.parquet", "source_model": "m", "source_sampler": "budget:64",
         "source_adapter": "/adapters/a", "n": 20},
        {"source_file": "dense.parquet", "source_model": "m", "source_sampler": "dense",
         "source_adapter": None, "n": 30}]
    for where in ("source_file = 'dense.parquet'", "SOURCE_SAMPLER = 'dense'"):
        r = invoke(f"SELECT count(*) AS n FROM mismatch WHERE {where}", "--run", str(mixed_run), "-f", "json")
        assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout) == [{"n": 30}], r.output
    r = invoke("SELECT count(*) AS n FROM mismatch WHERE source_model = 'm'", "--run", str(mixed_run))
    assert "pools 2 files of different provenance" in r.stderr  # the model does not tell them apart


def test_sampling_settings_are_provenance_and_seeds_pool_without_a_warning(tmp_path):
    """Greedy and T=1 rollouts, or rollouts cut at different lengths, are different data; two seeds of one
    setting are more samples of it."""
    run = tmp_path / "sampled"
    run.mkdir()
    sampling = {"top_p": 1.0, "top_k": 0, "max_new_tokens": 24}
    for name, temperature, seed, n in (("t1_s0", 1.0, 0, 3), ("t1_s1", 1.0, 1, 4), ("greedy", 0.0, 0, 5)):
        write_artifact(mismatch(n, 0), run / f"{name}.parquet", "mismatch",
                       {"model": "m", "temperature": temperature, "seed": seed, **sampling})
    r = invoke("SELECT count(*) AS n FROM mismatch", "--run", str(run), "-f", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"n": 12}], r.output
    assert "(temperature: 0.0, 1.0); filter on source_temperature," in " ".join(r.stderr.split())
    r = invoke("SELECT source_seed, count(*) AS n FROM mismatch WHERE source_temperature = '1.0' "
               "GROUP BY ALL ORDER BY source_seed", "--run", str(run), "-f", "json")
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout) == [{"source_seed": "0", "n": 3}, {"source_seed": "1", "n": 4}]
    shutil.move(run / "greedy.parquet", tmp_path / "greedy.parquet")
    r = invoke("SELECT count(*) AS n FROM mismatch", "--run", str(run), "-f", "json")
    assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout) == [{"n": 7}], r.output


def test_each_artifact_file_is_a_view_of_its_own_without_the_warning(mixed_run):
    r = invoke("SELECT (SELECT count(*) FROM mismatch__dense) AS dense, (SELECT count(*) FROM mismatch__b64) "
               "AS b64", "--run", str(mixed_run), "-f", "json")
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout) == [{"dense": 30, "b64": 20}]
    r = invoke("SHOW TABLES", "--run", str(mixed_run), "-f", "tsv")
    assert r.stdout.split() == ["name", "mismatch", "mismatch__b64", "mismatch__dense"]


def test_the_same_provenance_pools_quietly(run_dir):
    r = invoke("SELECT count(*) AS n FROM mismatch", "--run", str(run_dir), "-f", "json")
    assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout) == [{"n": 4000}]


# ---- a closed pipe, Ctrl-C and SIGTERM, in a process of their own ----

def sparrow(*args: str, tmp: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "-c", "from sparrow.cli.app import main; main()", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def test_a_closed_pipe_ends_quietly_with_0(run_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tmp")
    p = sparrow("sql", "SELECT * FROM range(3000000)", "--run", str(run_dir), tmp=tmp)
    assert p.stdout.readline() == b"range\n"
    p.stdout.close()  # as `| head -1` does
    assert p.wait(timeout=60) == 0
    assert p.stderr.read() == b"" and list(tmp.iterdir()) == []


@pytest.mark.parametrize("signum,line", [
    (signal.SIGINT, "interrupted; nothing half-written was left behind"),
    (signal.SIGTERM, "terminated; nothing half-written was left behind")])
def test_a_signal_stops_the_query_in_one_line(run_dir, tmp_path_factory, signum, line):
    tmp = tmp_path_factory.mktemp("tmp")
    p = sparrow("sql", "SELECT count(*) FROM range(100000) a, range(100000) b, range(100000) c",
                "--run", str(run_dir), tmp=tmp)
    deadline = time.monotonic() + 60
    while not list(tmp.glob(f"sparrow-sql-{p.pid}-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the query is running
    start = time.monotonic()
    p.send_signal(signum)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signum and time.monotonic() - start < 10
    assert err.decode().splitlines() == [line] and out == b""
    assert list(tmp.iterdir()) == []


def test_a_training_run_that_holds_its_schedule_alone_is_a_run_of_its_own(tmp_path):
    """As `sparrow train -o run/train` starts, its folder holds its schedule and its lock file only: it is
    the training run's, not parts of the pipeline directory's schedule artifact."""
    from sparrow.schemas.locations import hold_folder, release_folder

    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [128], "tail": [0.9],
                    "predicted_step_seconds": [0.01]}, tmp_path / "schedule.parquet", "schedule",
                   {"page_size": 16})
    train = tmp_path / "train"
    train.mkdir()
    hold_folder(train, "sparrow train", "another run directory (-o)")
    try:
        shutil.copy(tmp_path / "schedule.parquet", train / "schedule.parquet")
        views = run_views(tmp_path)
        assert [v.name for v in views] == ["schedule", "schedule__schedule"]
        assert [p.name for p in views[0].files] == ["schedule.parquet"]
    finally:
        release_folder(train)


def test_file_names_that_differ_in_case_alone_are_two_views(tmp_path):
    """DuckDB's names are case-insensitive: select.parquet and Select.parquet cannot both be `select`; the
    second is suffixed as any clash is, and each file's rows are read from its own view."""
    pq.write_table(pa.table({"x": [1]}), tmp_path / "select.parquet")
    pq.write_table(pa.table({"y": [2]}), tmp_path / "Select.parquet")
    write_artifact(mismatch(5, 0), tmp_path / "mismatch.parquet", "mismatch")
    pq.write_table(pa.table({"z": [3]}), tmp_path / "Mismatch.parquet")
    names = {v.name: [p.name for p in v.files] for v in run_views(tmp_path)}
    assert names == {"mismatch": ["mismatch.parquet"], "mismatch__mismatch": ["mismatch.parquet"],
                     "Mismatch_2": ["Mismatch.parquet"], "Select": ["Select.parquet"],
                     "select_2": ["select.parquet"]}
    con = open_run(tmp_path)
    assert con.execute('SELECT x FROM "select_2"').fetchall() == [(1,)]
    assert con.execute('SELECT y FROM "Select"').fetchall() == [(2,)]
    assert con.execute("SELECT z FROM mismatch_2").fetchall() == [(3,)]
    con.close()
