"""`sparrow sql` over a hostile run directory: nothing read from a run's files runs as SQL, the spill folder
is bounded, and an outside file named as a table is refused as every outside file is."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow.schemas import write_artifact
from sparrow.stages.sql import Limits, QueryError, QueryLimit, open_run, run_query
from sparrow.stages.sql.connection import close_run, open_views
from sparrow.stages.sql.views import Source, View


def _payload(target: Path) -> str:
    """Metadata text that, pasted into `CREATE VIEW "<kind>" AS ...`, would write `target`."""
    return f'x" AS SELECT 1 AS a; COPY (SELECT \'pwned\' AS s) TO \'{target}\'; CREATE VIEW "y'


def _hostile_file(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"a": [1]}).replace_schema_metadata({"sparrow.artifact": kind, "sparrow.version": "1"})
    pq.write_table(table, path)


def _artifact(path: Path, model: str = "m") -> None:
    """A small, valid Sparrow artifact (a schedule) made by `model`."""
    write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [None], "tail": [None],
                    "predicted_step_seconds": [0.01]}, path, "schedule", {"model": model})


@pytest.fixture
def outside(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("outside") / "PWNED.csv"


@pytest.mark.parametrize("where", ["data.parquet", "parts/data.parquet"])
def test_a_kind_from_a_footer_never_runs_as_sql(tmp_path, outside, where):
    run = tmp_path / "run"
    _hostile_file(run / where, _payload(outside))
    _artifact(run / "p.parquet")
    warnings: list[str] = []
    names = run_query(run, "SHOW TABLES", warn=warnings.append).column("name").to_pylist()
    assert not outside.exists()
    assert names == ["schedule", "schedule__p"]  # the hostile file is skipped, the rest of the run is queried
    assert len(warnings) == 1 and "none of Sparrow's" in warnings[0] and "skipped it" in warnings[0]


def test_a_view_name_that_is_not_an_identifier_is_skipped_not_run(tmp_path, outside):
    """The second guard: a view whose name came through unchecked is skipped, and the sandbox is on before
    any view is made."""
    _hostile_file(tmp_path / "data.parquet", "schedule")
    source = Source((tmp_path / "data.parquet").resolve(), "data.parquet")
    warnings: list[str] = []
    con, folder = open_views(tmp_path, [View(_payload(outside), (source,), False)], warnings.append, None)
    try:
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchone()[0] == 0
    finally:
        close_run(con, folder)
    assert not outside.exists()
    assert len(warnings) == 1 and "skipped the view" in warnings[0]


def test_quotes_in_file_names_and_provenance_are_data(tmp_path):
    model = "it's \"odd\"'); COPY (SELECT 1) TO '/tmp/x.csv'; --"
    _artifact(tmp_path / "a'b\"é c.parquet", model)
    _artifact(tmp_path / "d.parquet", "plain")
    sql = "SELECT source_file, source_model FROM schedule ORDER BY source_file"
    rows = run_query(tmp_path, sql).to_pylist()
    assert rows == [{"source_file": "a'b\"é c.parquet", "source_model": model},
                    {"source_file": "d.parquet", "source_model": "plain"}]
    names = run_query(tmp_path, "SHOW TABLES").column("name").to_pylist()
    assert names == ["schedule", "schedule__a_b_e_c", "schedule__d"]


def test_glob_characters_in_a_file_name_are_part_of_the_name(tmp_path):
    """A view reads its file by name: `*`, `?` and `[...]` in it match nothing else (`b[1].parquet` is not a
    pattern for `b1.parquet`), and the file is read, not skipped."""
    for name, model in (("a*?.parquet", "star"), ("b[1].parquet", "bracket"), ("b1.parquet", "plain")):
        _artifact(tmp_path / name, model)
    warnings: list[str] = []
    rows = run_query(tmp_path, "SELECT source_file, source_model FROM schedule ORDER BY source_file",
                     warn=warnings.append).to_pylist()
    assert rows == [{"source_file": "a*?.parquet", "source_model": "star"},
                    {"source_file": "b1.parquet", "source_model": "plain"},
                    {"source_file": "b[1].parquet", "source_model": "bracket"}]
    assert [w for w in warnings if "skipped" in w] == []


def test_a_path_named_as_a_table_gets_the_sandbox_sentence(tmp_path):
    _artifact(tmp_path / "p.parquet")
    sentences = []
    for sql in ("SELECT * FROM '/etc/passwd'", "SELECT * FROM read_csv('/etc/passwd')"):
        with pytest.raises(QueryError) as e:
            run_query(tmp_path, sql)
        sentences.append(str(e.value))
    assert sentences[0] == sentences[1]
    assert "file system operations are disabled" in sentences[0] and "/etc/passwd" in sentences[0]
    with pytest.raises(QueryError, match="Table with name nope does not exist"):
        run_query(tmp_path, "SELECT * FROM nope")


def test_the_spill_folder_is_bounded_by_default(tmp_path):
    _artifact(tmp_path / "p.parquet")
    memory = 512 * 2**20
    free = shutil.disk_usage(tempfile.gettempdir()).free
    expected = max(min(2 * memory, free // 4), 2**24) // 2**20  # twice the memory, at most a quarter of free
    got = run_query(tmp_path, "SELECT value FROM duckdb_settings() WHERE name = 'max_temp_directory_size'",
                    limits=Limits(memory=memory)).column("value")[0].as_py()
    number, unit = got.split()
    assert unit in ("MiB", "GiB")
    assert float(number) * (1024 if unit == "GiB" else 1) == pytest.approx(expected, rel=0.01)
    assert open_run(tmp_path).execute("SELECT 1").fetchone() == (1,)


def test_a_query_past_the_spill_limit_stops_with_one_sentence(tmp_path):
    _artifact(tmp_path / "p.parquet")
    sql = ("SELECT count(*) FROM (SELECT i, md5(i::varchar) || repeat('y', 200) s FROM range(3000000) t(i) "
           "ORDER BY s)")
    with pytest.raises(QueryLimit, match=r"spilled more than its disk limit of 32 MiB"):
        run_query(tmp_path, sql, limits=Limits(memory=64 * 2**20, seconds=60, spill=32 * 2**20))


def test_a_json_lines_file_beside_an_artifact_of_its_stem_is_named_by_its_suffix(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "metrics.parquet")
    (tmp_path / "metrics.jsonl").write_text('{"a": 2}\n')
    (tmp_path / "other.jsonl").write_text('{"a": 3}\n')
    assert sorted(run_query(tmp_path, "SHOW TABLES").column("name").to_pylist()) == [
        "metrics", "metrics_jsonl", "other"]
