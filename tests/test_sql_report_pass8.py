"""`sparrow sql` and `sparrow report` over damaged and odd run folders, and sql's text formats.

A damaged data page or another schema version leaves one file out of the report (the rest is drawn), and
every message about a file names it; sql warns about what it skips or reads as it is; the reward
histogram holds every reward; sql writes BLOB, INTERVAL, NaN and the infinities as PostgreSQL writes and
reads them back (the expected texts are PostgreSQL 15's own, from `COPY ... TO` and `to_json`)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli import sql as sql_cli
from sparrow.cli.app import app
from sparrow.schemas import write_artifact
from sparrow.stages.sql import QueryError, run_query

from cli_checks import error_line

# ---- artifacts ----

def _profile(path: Path, n: int = 40) -> Path:
    rows = [{"prompt_id": "p", "sample": 0, "position": 10 + k, "bin": 0, "budget": b, "token_id": 1,
             "alpha": 0.9, "logp_dense": -1.0, "logp_sparse": -1.0, "log_ratio": 0.0, "k1": 0.0, "k2": 0.0,
             "k3": 0.0, "entropy_dense": 1.0} for b in (64, 128) for k in range(n)]
    return write_artifact(rows, path, "mismatch", metadata={"bin_width": 512, "model": "smollm2-135m"})


def _rollouts(path: Path, rewards: list[float | None], tokens: int = 50) -> Path:
    n = len(rewards)
    return write_artifact({"prompt_id": [f"p{i}" for i in range(n)], "sample": [0] * n,
                           "prompt_token_ids": [[1, 2, 3]] * n, "token_ids": [list(range(tokens))] * n,
                           "text": ["x" * tokens] * n, "logprobs": [[-0.5] * tokens] * n,
                           "budgets": [[0] * tokens] * n, "finish_reason": ["length"] * n,
                           "reward": rewards}, path, "rollouts")


def _damage_first_page(path: Path) -> Path:
    """Overwrite the first data page's header: the footer stays whole, the data cannot be read."""
    offset = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    raw = bytearray(path.read_bytes())
    raw[offset:offset + 24] = b"\xff" * 24
    path.write_bytes(bytes(raw))
    pq.read_schema(path)  # the footer check passes
    with pytest.raises((OSError, pa.ArrowException)):
        pq.read_table(path)
    return path


def _set_footer(path: Path, **keys: bytes) -> Path:
    """Rewrite `path` with footer metadata keys replaced (`sparrow_version`: `sparrow.version`)."""
    table = pq.read_table(path)
    meta = {**table.schema.metadata, **{k.replace("_", ".").encode(): v for k, v in keys.items()}}
    pq.write_table(table.replace_schema_metadata(meta), path)
    return path


def _said(text: str) -> str:
    return " ".join(text.split())


def _not_drawn(result) -> list[str]:
    return [line.removeprefix("not drawn: ") for line in result.stderr.splitlines()
            if line.startswith("not drawn: ")]


def _figures(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.png")}


# ---- report: one damaged file is left out, the rest drawn ----

def test_report_leaves_out_a_file_with_a_damaged_data_page_and_draws_the_rest(tmp_path):
    run = tmp_path / "run"
    _profile(run / "m.parquet")
    bad = _damage_first_page(_rollouts(run / "r.parquet", [1.0, 0.0]))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    [line] = _not_drawn(result)
    assert line.startswith(f"{bad} is a corrupt Parquet file (")
    assert _figures(run / "report") == {"tail.png"}
    assert "Not drawn" in (run / "report" / "index.html").read_text()


def test_report_of_nothing_but_a_damaged_file_is_one_sentence_naming_it(tmp_path):
    run = tmp_path / "run"
    bad = _damage_first_page(_rollouts(run / "r.parquet", [1.0, 0.0]))
    result = CliRunner().invoke(app, ["report", str(run)])
    line = error_line(result)
    assert line.startswith(f"error: {run} holds nothing to plot")
    assert f"{bad} is a corrupt Parquet file" in line
    assert not (run / "report").exists()


def test_report_leaves_out_files_of_other_schema_versions_and_draws_the_rest(tmp_path):
    """An old profile, a newer rollouts file and a training run's newer metrics are each one "not drawn"
    line with the sentence every reader gives; the good files and the run's per-step mismatch are drawn."""
    run = tmp_path / "run"
    old = _set_footer(_profile(run / "old.parquet"), sparrow_version=b"0")
    _profile(run / "m.parquet")
    new = _set_footer(_rollouts(run / "r.parquet", [1.0]), sparrow_version=b"2")
    train = run / "train"
    write_artifact([{"run_id": "t", "step": s, "reward_mean": 0.5, "grad_norm": 1.0, "entropy": 1.0,
                     "mismatch_kl": 1e-3, "alpha_lb_p5": 0.8} for s in range(3)],
                   train / "metrics.parquet", "metrics")
    _set_footer(train / "metrics.parquet", sparrow_version=b"2")
    for s in range(3):
        write_artifact({"step": [s] * 2, "prompt_id": ["p"] * 2, "sample": [0, 1], "position": [10, 11],
                        "bin": [0, 0], "budget": [0, 64], "token_id": [1, 2], "logp_rollout": [-1.0] * 2,
                        "logp_dense": [-1.1] * 2, "log_ratio": [0.1] * 2, "k3": [0.005] * 2,
                        "alpha_top20_lb": [0.9, 0.8], "weight": [1.0] * 2, "masked": [False] * 2,
                        "vetoed": [False] * 2},
                       train / "mismatch" / f"step={s:05d}.parquet", "train_mismatch")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert sorted(_not_drawn(result)) == sorted([
        f"{old} has version 0 of the 'mismatch' schema but this Sparrow reads only version 1, so regenerate "
        "it with this Sparrow",
        f"{new} has version 2 of the 'rollouts' schema but this Sparrow reads only version 1, so upgrade "
        "Sparrow to read it",
        f"the training curves of {train} ({train / 'metrics.parquet'} has version 2 of the 'metrics' schema "
        "but this Sparrow reads only version 1, so upgrade Sparrow to read it)"])
    assert _figures(run / "report") == {"tail.png", "train-mismatch-train.png"}


def test_a_bad_value_still_refuses_the_report(tmp_path):
    """Unreadable bytes are left out; a value every command refuses (a NaN alpha) still refuses it all."""
    run = tmp_path / "run"
    path = _profile(run / "m.parquet")
    table = pq.read_table(path)
    alpha = table.column("alpha").to_numpy().copy()
    alpha[0] = np.nan
    pq.write_table(table.set_column(table.schema.get_field_index("alpha"), "alpha", pa.array(alpha)), path)
    _rollouts(run / "r.parquet", [1.0])
    line = error_line(CliRunner().invoke(app, ["report", str(run)]))
    assert line == (f"error: {path} has 1 value of column 'alpha' outside the allowed range [0, 1] "
                    "(first: nan in row 0)")


# ---- sql and report name the file of a bad footer or a damaged page ----

def _local_sql() -> typer.Typer:
    local = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    local.command("sql")(sql_cli.sql)
    local.command("noop", hidden=True)(lambda: None)  # keep `sql` a subcommand
    return local


def _sql(*args: str):
    return CliRunner().invoke(_local_sql(), ["sql", *args])


def test_a_bad_sparrow_meta_footer_is_named_by_sql_and_report(tmp_path):
    run = tmp_path / "run"
    bad = _set_footer(_profile(run / "m_badmeta.parquet"), sparrow_meta=b"{not json")
    _rollouts(run / "r.parquet", [1.0])
    sentence = f"{bad} has 'sparrow.meta' metadata that is not a JSON object"
    result = _sql("SELECT count(*) AS n FROM rollouts", "--run", str(run), "-f", "json")
    assert result.exit_code == 0 and json.loads(result.stdout) == [{"n": 1}]
    assert _said(result.stderr) == f"warning: {sentence}; skipped it"
    reported = CliRunner().invoke(app, ["report", str(run)])
    assert reported.exit_code == 0, reported.output
    assert _not_drawn(reported) == [sentence]


def test_a_query_that_meets_a_damaged_page_names_the_file(tmp_path):
    """Named whether DuckDB fails before the first rows or in the stream after them (a good file's rows
    first), and the damaged bytes DuckDB quotes never reach the terminal raw."""
    run = tmp_path / "run"
    _profile(run / "m.parquet")
    _rollouts(run / "a.parquet", [1.0])
    bad = _damage_first_page(_rollouts(run / "r.parquet", [0.0]))
    for _ in range(3):  # DuckDB's threads decide which file fails first
        with pytest.raises(QueryError) as raised:
            run_query(run, "SELECT * FROM rollouts")
        assert str(raised.value).startswith(f"{bad} cannot be read, its data is damaged (")
        result = _sql("SELECT * FROM rollouts", "--run", str(run), "-f", "json")
        line = error_line(result)
        assert line.startswith(f"error: query failed: {bad} cannot be read")
        assert line.isprintable()
    good = _sql("SELECT count(*) AS n FROM rollouts__a", "--run", str(run), "-f", "json")
    assert good.exit_code == 0 and json.loads(good.stdout) == [{"n": 1}]


# ---- sql says what it skips or reads as it is ----

@pytest.fixture()
def no_hang():
    """Fail, not hang, if a FIFO is ever opened for reading."""
    def stop(signum, frame):
        raise TimeoutError("a FIFO was opened for reading")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_sql_warns_of_a_fifo_and_a_broken_symlink_as_report_does(tmp_path, no_hang):
    run = tmp_path / "run"
    _rollouts(run / "r.parquet", [1.0])
    os.mkfifo(run / "fifo.parquet")
    os.symlink(tmp_path / "nowhere", run / "broken.parquet")
    parts = run / "parts"
    _rollouts(parts / "part-0.parquet", [0.5])
    os.mkfifo(parts / "part-1.parquet")
    result = _sql("SELECT source_file, reward FROM rollouts ORDER BY 1", "--run", str(run), "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"source_file": "parts/part-0.parquet", "reward": 0.5},
                                         {"source_file": "r.parquet", "reward": 1.0}]
    assert [_said(line) for line in result.stderr.splitlines()] == [
        f"warning: {run / 'broken.parquet'} is a broken symlink (to {tmp_path / 'nowhere'}); skipped it",
        f"warning: {run / 'fifo.parquet'} is not a regular file; skipped it",
        f"warning: {parts / 'part-1.parquet'} is not a regular file; skipped it"]
    reported = CliRunner().invoke(app, ["report", str(run)])
    assert f"{run / 'broken.parquet'} is a broken symlink (to {tmp_path / 'nowhere'})" in _not_drawn(reported)


def test_links_in_a_loop_leave_the_rest_of_the_run_readable(tmp_path, no_hang):
    """Two links that lead to each other (one named like an artifact, two not) are no folder and no file:
    the run is read without them, the `.parquet` one said as a broken link."""
    run = tmp_path / "run"
    _rollouts(run / "r.parquet", [1.0])
    os.symlink("loop-b", run / "loop-a")
    os.symlink("loop-a", run / "loop-b")
    os.symlink("x.parquet", run / "x.parquet")
    result = _sql("SELECT reward FROM rollouts", "--run", str(run), "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"reward": 1.0}]
    assert [_said(line) for line in result.stderr.splitlines()] == [
        f"warning: {run / 'x.parquet'} is a broken symlink (to x.parquet); skipped it"]
    reported = CliRunner().invoke(app, ["report", str(run)])
    assert reported.exit_code == 0, reported.output
    assert f"{run / 'x.parquet'} is a broken symlink (to x.parquet)" in _not_drawn(reported)


def test_sql_reads_another_schema_version_with_a_warning_naming_file_and_version(tmp_path):
    run = tmp_path / "run"
    old = _set_footer(_profile(run / "m_v0.parquet"), sparrow_version=b"0")
    new = _set_footer(_rollouts(run / "r_v2.parquet", [1.0]), sparrow_version=b"2")
    _rollouts(run / "r.parquet", [0.0])
    result = _sql("SELECT count(*) AS n FROM rollouts", "--run", str(run), "-f", "json")
    assert result.exit_code == 0 and json.loads(result.stdout) == [{"n": 2}]
    assert [_said(line) for line in result.stderr.splitlines()] == [
        f"warning: {old} has version '0' of the 'mismatch' schema, but this Sparrow reads only version 1; "
        "its views read its columns as they are, where other commands refuse it (regenerate it with this "
        "Sparrow)",
        f"warning: {new} has version '2' of the 'rollouts' schema, but this Sparrow reads only version 1; "
        "its views read its columns as they are, where other commands refuse it (upgrade Sparrow to read it)"]


def test_files_of_one_other_version_are_one_warning(tmp_path):
    """A run from another Sparrow has many files of its version (a training run's steps): one sentence."""
    run = tmp_path / "run"
    steps = [_set_footer(_profile(run / "old" / f"step={s}.parquet"), sparrow_version=b"0") for s in range(3)]
    result = _sql("SELECT count(DISTINCT source_file) AS n FROM mismatch", "--run", str(run), "-f", "json")
    assert result.exit_code == 0 and json.loads(result.stdout) == [{"n": 3}]
    assert _said(result.stderr) == (
        f"warning: {steps[0]} and 2 more 'mismatch' files have version '0' of the 'mismatch' schema, but "
        "this Sparrow reads only version 1; their views read their columns as they are, where other "
        "commands refuse them (regenerate them with this Sparrow)")


# ---- report: the reward histogram holds every reward ----

def test_the_reward_histogram_bins_every_reward_beyond_zero_to_one(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    rewards = [-1.0, 3.0, -1.0, 0.5, 1.5, None, float("nan")]
    _rollouts(run / "r.parquet", rewards)
    drawn = []
    hist = Axes.hist
    monkeypatch.setattr(Axes, "hist", lambda ax, x, *a, **k: drawn.append((np.asarray(x), k.get("bins")))
                        or hist(ax, x, *a, **k))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    values, edges = drawn[-1]  # the reward panel, after the lengths
    finite = [-1.0, 3.0, -1.0, 0.5, 1.5]
    assert sorted(values.tolist()) == sorted(finite)
    counts, _ = np.histogram(finite, bins=np.asarray(edges))
    assert counts.sum() == len(finite) and edges[0] <= -1.0 and edges[-1] >= 3.0
    page = (run / "report" / "index.html").read_text()
    assert ("Rewards range from -1 to 3, beyond [0, 1]. 1 reward is NaN or infinite, left out of the "
            "histogram and of the mean in its title.") in _said(page)
    titles = []
    monkeypatch.setattr(Axes, "set_title", lambda ax, text, *a, **k: titles.append(text))
    assert CliRunner().invoke(app, ["report", str(run), "--force"]).exit_code == 0
    assert f"reward per sample (mean of the 5 finite {np.mean(finite):.3f})" in titles


def test_rewards_within_zero_to_one_keep_the_usual_bins(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    run = tmp_path / "run"
    _rollouts(run / "r.parquet", [0.0, 1.0, 1.0])
    drawn = []
    hist = Axes.hist
    monkeypatch.setattr(Axes, "hist", lambda ax, x, *a, **k: drawn.append(k.get("bins"))
                        or hist(ax, x, *a, **k))
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    assert np.allclose(drawn[-1], [i / 10 for i in range(11)])


# ---- sql's text formats: what PostgreSQL writes and reads back ----

VALUES = ("SELECT '\\x01\\xff'::BLOB AS b, INTERVAL 1 DAY AS d, "
          "INTERVAL 1 DAY + INTERVAL 90 MINUTE - INTERVAL 14 MONTH + INTERVAL 1500 MILLISECOND AS mixed, "
          "INTERVAL 0 DAY AS zero, -(INTERVAL 3 SECOND + INTERVAL 250 MICROSECOND) AS neg, "
          "'nan'::DOUBLE AS n, 'inf'::DOUBLE AS i, '-inf'::DOUBLE AS mi, NULL::DOUBLE AS z")

# PostgreSQL 15 with IntervalStyle iso_8601: COPY ... TO of the same values, and to_json of each
PG_TEXT = ["\\x01ff", "P1D", "P-1Y-2M1DT1H30M1.5S", "PT0S", "PT-3.00025S"]
PG_JSON = {"b": "\\x01ff", "d": "P1D", "mixed": "P-1Y-2M1DT1H30M1.5S", "zero": "PT0S", "neg": "PT-3.00025S",
           "n": "NaN", "i": "Infinity", "mi": "-Infinity", "z": None}


def test_tsv_and_csv_write_blob_and_interval_as_postgresql_does(tmp_path):
    tsv = _sql(VALUES, "--run", str(tmp_path), "-f", "tsv")
    assert tsv.exit_code == 0, tsv.output
    header, row = tsv.stdout.splitlines()
    assert header.split("\t") == list(PG_JSON)
    fields = row.split("\t")
    assert fields[:5] == ["\\" + PG_TEXT[0], *PG_TEXT[1:]]  # COPY's text format escapes the backslash
    assert fields[8] == "\\N"
    as_csv = _sql(VALUES, "--run", str(tmp_path), "-f", "csv")
    assert as_csv.exit_code == 0, as_csv.output
    assert list(csv.reader(io.StringIO(as_csv.stdout)))[1][:5] == PG_TEXT


def test_json_tells_nan_and_the_infinities_from_null(tmp_path):
    result = _sql(VALUES + ", ['nan'::DOUBLE, NULL] AS l", "--run", str(tmp_path), "-f", "json")
    assert result.exit_code == 0, result.output
    [record] = json.loads(result.stdout, parse_constant=_not_json)
    assert record == {**PG_JSON, "l": ["NaN", None]}


def _not_json(constant: str) -> None:
    """json.loads reads NaN and Infinity, which strict JSON has not: a reader of ours must not meet them."""
    raise AssertionError(f"{constant} is not strict JSON")


def test_the_table_shows_blob_and_interval_as_text(tmp_path):
    result = _sql("SELECT '\\x01\\xff'::BLOB AS b, INTERVAL 36 HOUR AS h", "--run", str(tmp_path),
                  "-f", "table")
    assert result.exit_code == 0, result.output
    assert "\\x01ff" in result.stdout and "PT36H" in result.stdout and "b'" not in result.stdout


def test_format_and_parquet_output_together_are_refused_before_the_query(tmp_path):
    _profile(tmp_path / "mismatch.parquet")
    out = tmp_path / "rows.parquet"
    r = CliRunner().invoke(app, ["sql", "SELECT 1 AS x", "--run", str(tmp_path), "-f", "csv", "-o", str(out)])
    assert r.exit_code == 2
    line = error_line(r)
    assert "-f/--format" in line and "-o writes them as Parquet" in line
    assert not out.exists()


def test_a_wide_sql_table_into_a_pipe_keeps_every_column_name_whole(tmp_path):
    _profile(tmp_path / "mismatch.parquet")
    names = [f"a_rather_long_column_name_{i}" for i in range(8)]
    query = "SELECT " + ", ".join(f"{i} AS {n}" for i, n in enumerate(names))
    r = CliRunner().invoke(app, ["sql", query, "--run", str(tmp_path), "-f", "table"])
    assert r.exit_code == 0, r.output
    assert all(n in r.stdout for n in names) and "…" not in r.stdout


def test_rollouts_scored_by_different_rewards_are_not_pooled_unawares(tmp_path):
    for name, fn in (("a", "fns.py:strict"), ("b", "fns.py:lenient")):
        _rollouts(tmp_path / f"{name}.parquet", [1.0, 0.0])
        table = pq.read_table(tmp_path / f"{name}.parquet")
        meta = json.loads(table.schema.metadata[b"sparrow.meta"])
        meta.update(reward_fn=fn, reward_fn_sha256=name * 64)
        _set_footer(tmp_path / f"{name}.parquet", sparrow_meta=json.dumps(meta).encode())
    r = CliRunner().invoke(app, ["sql", "SELECT avg(reward) AS r FROM rollouts", "--run", str(tmp_path),
                                 "-f", "json"])
    assert r.exit_code == 0, r.output
    warning = _said(r.stderr)
    assert "pools 2 files of different provenance" in warning
    assert "reward_fn: fns.py:lenient, fns.py:strict" in warning and "source_reward_fn" in warning
