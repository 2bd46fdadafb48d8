"""`sparrow sql`'s artifact views carry the versions that wrote each file (its footer's
`sparrow.provenance`) as `source_sparrow_version` and `source_torch_version`, and pooling files written by
different versions is said, as any other difference of provenance is."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

import pyarrow.parquet as pq
from test_sql import mismatch

from sparrow.schemas import write_artifact
from sparrow.stages.sql import open_run, run_query


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def without_provenance(path) -> None:
    """`path` as an older Sparrow wrote it: the same footer but the versions."""
    table = pq.read_table(path)
    meta = {k: v for k, v in table.schema.metadata.items() if k != b"sparrow.provenance"}
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_each_file_says_which_versions_wrote_it(tmp_path):
    write_artifact(mismatch(20, 0), tmp_path / "new.parquet", "mismatch")
    write_artifact(mismatch(10, 1), tmp_path / "old.parquet", "mismatch")
    without_provenance(tmp_path / "old.parquet")
    warnings: list[str] = []
    rows = run_query(tmp_path, "SELECT DISTINCT source_file, source_sparrow_version, source_torch_version "
                               "FROM mismatch ORDER BY source_file", warnings.append).to_pylist()
    footer = json.loads(pq.read_schema(tmp_path / "new.parquet").metadata[b"sparrow.provenance"])
    assert footer["torch"] == installed("torch")
    assert rows == [
        {"source_file": "new.parquet", "source_sparrow_version": installed("sparrow-rl") or footer["sparrow"],
         "source_torch_version": installed("torch")},
        {"source_file": "old.parquet", "source_sparrow_version": None, "source_torch_version": None}]
    assert not warnings  # the query names source_file: it tells the files apart


def test_pooling_files_of_other_versions_is_said(tmp_path):
    write_artifact(mismatch(20, 0), tmp_path / "new.parquet", "mismatch")
    write_artifact(mismatch(10, 1), tmp_path / "old.parquet", "mismatch")
    without_provenance(tmp_path / "old.parquet")
    warnings: list[str] = []
    counted = run_query(tmp_path, "SELECT count(*) AS n FROM mismatch", warnings.append)
    assert counted.to_pylist() == [{"n": 30}]
    assert len(warnings) == 1 and "sparrow_version" in warnings[0] and "torch_version" in warnings[0]


def test_a_damaged_record_is_said_and_the_rows_still_read(tmp_path):
    write_artifact(mismatch(5, 0), tmp_path / "a.parquet", "mismatch")
    write_artifact(mismatch(3, 1), tmp_path / "b.parquet", "mismatch")
    table = pq.read_table(tmp_path / "a.parquet")
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"sparrow.provenance": b"[1"}),
                   tmp_path / "a.parquet")
    warnings: list[str] = []
    con = open_run(tmp_path, warn=warnings.append)
    found = con.execute("SELECT source_file, count(*), any_value(source_sparrow_version) IS NULL "
                        "FROM mismatch GROUP BY ALL ORDER BY ALL").fetchall()
    assert found == [("a.parquet", 5, True), ("b.parquet", 3, False)]
    con.close()
    assert any("a.parquet" in w and "sparrow.provenance" in w for w in warnings)
