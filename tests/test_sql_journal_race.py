"""`sparrow sql` over a run whose rollout finishes while the query reads it: the rollout writes OUT, then
moves its journal OUT.partial/ away. The query answers from what is there (the journal's parts, or OUT once
written: every row either way), or says in one sentence to run it again; a file that went is never called
unreadable, and never a traceback.

The race is made deterministic by finishing the rollout at a chosen moment: while the run is listed,
between the listing and DuckDB's views, between the views and the query. The expected count is the rows
written by hand (PARTS parts of ROWS rows; OUT holds them all). A query listed again has only what the first
pass left of its --timeout, and an error of its own (its time, a bad cast) is never hidden behind a journal
that went.
"""

from __future__ import annotations

import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

import sparrow.stages.sql as sql_stage
import sparrow.stages.sql.views as views_module
from sparrow.cli import sql as sql_cli
from sparrow.schemas import ArtifactError, write_artifact
from sparrow.schemas.footer import read_schema
from sparrow.stages.sql import Limits, QueryError, QueryLimit, RunChanged, run_query, run_views

from cli_checks import error_line

PARTS, ROWS = 6, 5
COUNT = "SELECT count(*) AS n FROM mismatch"


def rows(n: int, prompt: str) -> dict:
    z = np.zeros(n, np.float32)
    i = np.zeros(n, np.int32)
    return {"prompt_id": [prompt] * n, "sample": i, "position": np.arange(n, dtype=np.int32), "bin": i,
            "budget": i + 64, "token_id": i + 1, "alpha": z, "logp_dense": z, "logp_sparse": z,
            "log_ratio": z, "k1": z, "k2": z, "k3": z, "entropy_dense": z}


@pytest.fixture()
def run(tmp_path) -> Path:
    """A run whose rollout `r.parquet` is unfinished: its journal holds PARTS parts of ROWS rows each; the
    finished artifact (all PARTS * ROWS rows) waits outside the run as done.parquet."""
    run = tmp_path / "run"
    journal = run / "r.parquet.partial"
    journal.mkdir(parents=True)
    (journal / "manifest.json").write_text("{}")
    for i in range(PARTS):
        write_artifact(rows(ROWS, f"p{i}"), journal / f"part-{i:05d}.parquet", "mismatch")
    every = {k: np.concatenate([rows(ROWS, f"p{i}")[k] for i in range(PARTS)]) for k in rows(1, "p")}
    write_artifact(every, tmp_path / "done.parquet", "mismatch")
    return run


def finish(run: Path) -> None:
    """What a rollout does at its end: OUT written, then its journal moved away and removed."""
    shutil.copy(run.parent / "done.parquet", run / "r.parquet")
    gone = run / ".r.parquet.partial.removed"
    (run / "r.parquet.partial").rename(gone)
    shutil.rmtree(gone)


def count(run: Path, said: list[str]) -> int:
    return run_query(run, COUNT, warn=said.append).column("n").to_pylist()[0]


def test_the_rollout_finishing_while_the_run_is_listed_answers_from_out(run, monkeypatch):
    real, calls = views_module.read_schema, []

    def read_then_finish(path):
        calls.append(path)
        if len(calls) == 3:
            finish(run)
        return real(path)

    monkeypatch.setattr(views_module, "read_schema", read_then_finish)
    said: list[str] = []
    assert count(run, said) == PARTS * ROWS
    assert not any("not a regular file" in s or "does not exist" in s or "partial" in s for s in said), said


@pytest.mark.parametrize("after", ["run_views", "open_views"])
def test_the_rollout_finishing_before_duckdb_reads_answers_from_out(run, monkeypatch, after):
    real = getattr(sql_stage, after)
    finished: list[bool] = []

    def then_finish(*args, **kwargs):
        out = real(*args, **kwargs)
        if not finished:
            finished.append(True)
            finish(run)
        return out

    monkeypatch.setattr(sql_stage, after, then_finish)
    said: list[str] = []
    assert count(run, said) == PARTS * ROWS
    assert not any("partial" in s for s in said), said  # the listing answered holds no journal


def test_a_journal_read_untouched_answers_from_its_parts(run):
    said: list[str] = []
    assert count(run, said) == PARTS * ROWS
    assert len(said) == 1 and "journal of an unfinished rollout" in said[0]


@pytest.fixture()
def always_gone(run, monkeypatch):
    """Every listing's journal goes before DuckDB reads it (and is back for the next listing), OUT never
    written: the query cannot be answered."""
    real = sql_stage.run_views
    journal, aside = run / "r.parquet.partial", run.parent / "aside"

    def listed_then_gone(*args, **kwargs):
        if aside.exists():
            aside.rename(journal)
        out = real(*args, **kwargs)
        journal.rename(aside)
        return out

    monkeypatch.setattr(sql_stage, "run_views", listed_then_gone)
    return run


def test_a_journal_gone_twice_is_one_sentence_to_run_again(always_gone):
    with pytest.raises(RunChanged) as e:
        run_query(always_gone, COUNT, warn=lambda s: None)
    message = str(e.value)
    assert "r.parquet finished while this query read its journal" in message
    assert "run the query again" in message
    assert "\n" not in message


def test_the_cli_says_it_in_one_line(always_gone):
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("sql")(sql_cli.sql)
    app.command("noop", hidden=True)(lambda: None)
    r = CliRunner().invoke(app, ["sql", COUNT, "--run", str(always_gone), "-f", "json"])
    line = error_line(r)
    assert "finished while this query read its journal" in line and "Traceback" not in r.output


def test_a_part_gone_before_its_footer_is_read_is_not_called_unreadable(run, monkeypatch):
    """The listing of `run_views` alone: a part gone is RunChanged, never a warning that skips it (the view
    would miss its rows)."""
    real = views_module.read_schema

    def gone_first(path):
        path.unlink()
        return real(path)

    monkeypatch.setattr(views_module, "read_schema", gone_first)
    said: list[str] = []
    with pytest.raises(RunChanged, match="finished while this query read its journal"):
        run_views(run, said.append)
    assert not any("not a regular file" in s for s in said)


def test_read_schema_of_a_file_gone_since_it_was_looked_at_is_one_sentence(tmp_path):
    class Vanishing(type(tmp_path)):
        def exists(self, **kwargs) -> bool:  # it was there when looked at
            return True

        def is_dir(self, **kwargs) -> bool:
            return False

    with pytest.raises(ArtifactError, match="gone.parquet does not exist"):
        read_schema(Vanishing(tmp_path / "gone.parquet"))


def test_a_run_directory_that_is_a_broken_symlink_is_named_so(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ArtifactError, match="loop is a symlink that loops back on itself"):
        run_views(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    nowhere = re.escape(str(tmp_path / "nowhere"))
    with pytest.raises(ArtifactError, match=f"dangling is a symlink to {nowhere}, which does not exist"):
        run_views(tmp_path / "dangling")
    with pytest.raises(ArtifactError, match="nope does not exist"):
        run_views(tmp_path / "nope")


def test_a_subfolder_that_cannot_be_listed_is_skipped_with_a_warning(run, monkeypatch):
    real = views_module._folder_files

    def refused(sub, warn):
        if sub.name == "locked":
            raise PermissionError(13, "Permission denied")
        return real(sub, warn)

    (run / "locked").mkdir()
    monkeypatch.setattr(views_module, "_folder_files", refused)
    said: list[str] = []
    assert count(run, said) == PARTS * ROWS
    assert any("locked cannot be read (Permission denied); skipped it" in s for s in said), said



def test_a_query_listed_again_runs_within_what_is_left_of_its_timeout(run, monkeypatch):
    """The first pass spends SPENT seconds, then the rollout finishes under it: the second pass's timer
    gets at most the 5 s asked for less SPENT, and its message still names the 5 s asked for."""
    spent, real, given, guards = 0.5, sql_stage.guarded, [], []

    @contextmanager
    def slow_first_pass(con, limits, seconds=None):
        given.append(limits.seconds if seconds is None else seconds)
        with real(con, limits, seconds) as guard:
            guards.append(guard)
            if len(given) == 1:
                time.sleep(spent)
                finish(run)
            yield guard

    monkeypatch.setattr(sql_stage, "guarded", slow_first_pass)
    table = run_query(run, COUNT, warn=lambda s: None, limits=Limits(seconds=5.0))
    assert table.column("n").to_pylist() == [PARTS * ROWS]
    assert len(given) == 2 and given[0] <= 5.0 and given[1] <= 5.0 - spent, given
    assert "time limit of 5 s" in guards[1].timeout_message()


@pytest.fixture()
def gone_after_views(run, monkeypatch):
    """Every listing's journal goes once DuckDB's views over it exist (and is back for the next listing),
    OUT never written: each pass's query meets its journal gone."""
    real_list, real_open = sql_stage.run_views, sql_stage.open_views
    journal, aside = run / "r.parquet.partial", run.parent / "aside"

    def listed(*args, **kwargs):
        if aside.exists():
            aside.rename(journal)
        return real_list(*args, **kwargs)

    def opened_then_gone(*args, **kwargs):
        out = real_open(*args, **kwargs)
        journal.rename(aside)
        return out

    monkeypatch.setattr(sql_stage, "run_views", listed)
    monkeypatch.setattr(sql_stage, "open_views", opened_then_gone)
    return run


def test_a_query_out_of_time_says_so_though_its_journal_went(gone_after_views, monkeypatch):
    real = sql_stage.guarded

    @contextmanager
    def out_of_time(con, limits, seconds=None):
        with real(con, limits, seconds) as guard:
            guard.expire()
            yield guard

    monkeypatch.setattr(sql_stage, "guarded", out_of_time)
    with pytest.raises(QueryLimit, match="ran past its time limit of 7 s"):
        run_query(gone_after_views, COUNT, warn=lambda s: None, limits=Limits(seconds=7.0))


def test_an_error_of_a_query_stays_its_own_when_a_journal_it_does_not_read_goes(gone_after_views):
    pq.write_table(pa.table({"s": ["abc"]}), gone_after_views / "other.parquet")
    with pytest.raises(QueryError) as e:
        run_query(gone_after_views, "SELECT CAST(s AS INTEGER) AS n FROM other", warn=lambda s: None)
    assert "Could not convert string 'abc' to INT32" in str(e.value)


def test_a_query_whose_views_the_parser_cannot_name_is_run_again_when_a_journal_goes(gone_after_views):
    """DuckDB's parser names no table of a PIVOT (several statements to it): every view counts as read."""
    with pytest.raises(RunChanged, match="finished while this query read its journal"):
        run_query(gone_after_views, "PIVOT mismatch ON bin USING count(*)", warn=lambda s: None)
