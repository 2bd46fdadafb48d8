"""Every Parquet file Sparrow writes says which Sparrow, Python, torch, transformers and pyarrow wrote it
(`sparrow.provenance` in its footer), deterministically, apart from the stage's metadata, and read by
readers that know nothing of Sparrow: pyarrow's footer, DuckDB's parquet_kv_metadata."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, artifact_metadata, check_artifact, read_artifact, write_artifact
from sparrow.schemas import provenance as provenance_module
from sparrow.schemas.io import write_artifact_parts, write_batches, write_table
from sparrow.schemas.provenance import artifact_provenance

COST = {"model": ["tiny", "tiny"], "device": ["cpu", "cpu"], "batch": [1, 2], "context": [16, 32],
        "budget": [16, 16], "seconds": [0.01, 0.02], "predicted_seconds": [0.011, 0.019]}
META = {"page_size": 16, "coefficients": [1.5, 2.0]}
OLD = {"sparrow": "0.0.1", "python": "3.10.0", "torch": "2.4.0", "transformers": "4.46.0",
       "pyarrow": "15.0.0"}


@pytest.fixture(autouse=True)
def fresh_versions():
    provenance_module.current.cache_clear()
    yield
    provenance_module.current.cache_clear()


def expected() -> dict:
    """This environment's versions, each from another source than the one Sparrow reads where one exists."""
    return {"sparrow": version("sparrow-rl"), "python": ".".join(map(str, sys.version_info[:3])),
            "torch": version("torch"), "transformers": version("transformers"), "pyarrow": pa.__version__}


def footer(path: Path) -> dict[bytes, bytes]:
    return pq.read_schema(path).metadata


def recorded(path: Path) -> dict:
    return json.loads(footer(path)[b"sparrow.provenance"])


def test_an_artifact_records_the_versions_that_wrote_it(tmp_path):
    path = write_artifact(COST, tmp_path / "cost.parquet", "cost", META)
    assert recorded(path) == expected()


def test_the_stage_metadata_is_unchanged(tmp_path):
    path = write_artifact(COST, tmp_path / "cost.parquet", "cost", META)
    meta = footer(path)
    assert meta[b"sparrow.meta"] == json.dumps(META, sort_keys=True).encode()
    assert meta[b"sparrow.artifact"] == b"cost" and meta[b"sparrow.version"] == b"1"
    assert artifact_metadata(path) == META == artifact_metadata(read_artifact(path, "cost"))


def test_duckdb_reads_it_from_the_footer(tmp_path):
    path = write_artifact(COST, tmp_path / "cost.parquet", "cost", META)
    rows = duckdb.sql(f"SELECT decode(value) FROM parquet_kv_metadata('{path}') "
                      "WHERE decode(key) = 'sparrow.provenance'").fetchall()
    assert [json.loads(value) for (value,) in rows] == [expected()]


def test_parts_and_plain_files_record_it_too(tmp_path):
    parts = write_artifact_parts([COST, COST], tmp_path / "parts", "cost", [META, META])
    for part in sorted(Path(parts).iterdir()):
        assert recorded(part) == expected()
    table = pa.table({"x": [1, 2]})
    assert recorded(write_table(table, tmp_path / "plain.parquet")) == expected()
    write_batches(table.schema, table.to_batches(), tmp_path / "streamed.parquet")
    assert recorded(tmp_path / "streamed.parquet") == expected()


def test_a_rewrite_in_the_same_environment_is_byte_identical(tmp_path):
    first = write_artifact(COST, tmp_path / "a.parquet", "cost", META)
    again = write_artifact(COST, tmp_path / "b.parquet", "cost", META)
    from_disk = write_artifact(read_artifact(first, "cost"), tmp_path / "c.parquet", "cost")
    assert first.read_bytes() == again.read_bytes() == from_disk.read_bytes()


def test_another_process_writes_the_same_bytes(tmp_path):
    """No time, host or process id in the footer: a rerun of a stage writes the same file."""
    script = ("import sys; from sparrow.schemas import write_artifact; "
              f"write_artifact({COST!r}, sys.argv[1], 'cost', {META!r})")
    for name in ("one.parquet", "two.parquet"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], check=True, timeout=120)
    assert (tmp_path / "one.parquet").read_bytes() == (tmp_path / "two.parquet").read_bytes()
    assert recorded(tmp_path / "one.parquet") == expected()


def _older_file(path: Path, provenance: dict | None) -> Path:
    """An artifact as another Sparrow wrote it: the same keys, and `provenance` (None: none at all)."""
    meta = {b"sparrow.artifact": b"cost", b"sparrow.version": b"1",
            b"sparrow.meta": json.dumps(META).encode()}
    if provenance is not None:
        meta[b"sparrow.provenance"] = json.dumps(provenance).encode()
    pq.write_table(pa.table(COST).replace_schema_metadata(meta), path)
    return path


def test_a_table_read_from_disk_is_written_with_the_current_versions(tmp_path):
    old = _older_file(tmp_path / "old.parquet", OLD)
    table = read_artifact(old, "cost")
    assert artifact_provenance(table) == OLD
    rewritten = write_artifact(table, tmp_path / "new.parquet", "cost")
    assert recorded(rewritten) == expected() and artifact_metadata(rewritten) == META
    assert recorded(write_table(table, tmp_path / "plain.parquet")) == expected()


def test_files_without_it_still_read(tmp_path):
    old = _older_file(tmp_path / "old.parquet", None)
    assert read_artifact(old, "cost").num_rows == 2 == check_artifact(old, "cost")
    assert artifact_metadata(old) == META and artifact_provenance(old) == {}


def test_a_damaged_record_does_not_stop_reading(tmp_path):
    bad = tmp_path / "bad.parquet"
    meta = {b"sparrow.artifact": b"cost", b"sparrow.version": b"1", b"sparrow.provenance": b"[not json"}
    pq.write_table(pa.table(COST).replace_schema_metadata(meta), bad)
    assert read_artifact(bad, "cost").num_rows == 2
    said = r"bad.parquet has 'sparrow.provenance' metadata that is not a JSON object"
    with pytest.raises(ArtifactError, match=said):
        artifact_provenance(bad)


def test_a_source_tree_without_metadata_says_so(tmp_path, monkeypatch):
    def no_sparrow(name: str) -> str:
        if name == "sparrow-rl":
            raise PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(provenance_module, "version", no_sparrow)
    path = write_artifact(COST, tmp_path / "cost.parquet", "cost", META)
    assert recorded(path) == {**expected(), "sparrow": "unknown (not installed)"}
    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.stdout == "sparrow unknown (not installed)\n"


def test_every_form_of_an_artifact_gives_its_record_and_names_itself_when_damaged(tmp_path):
    """A table, a schema, a file and a directory of parts (its first part): the record written by hand,
    and a damaged one said with the form's name, for both footer keys."""
    parts = tmp_path / "parts"
    parts.mkdir()
    first = _older_file(parts / "part-0.parquet", OLD)
    _older_file(parts / "part-1.parquet", {"sparrow": "another"})
    table = pq.read_table(first)
    for form in (table, table.schema, first, parts):
        assert artifact_provenance(form) == OLD and artifact_metadata(form) == META
    bad = {b"sparrow.meta": b"[1]", b"sparrow.provenance": b"[1]"}
    damaged = table.replace_schema_metadata(bad)
    pq.write_table(damaged, tmp_path / "bad.parquet")
    for form, where in ((damaged, "the table"), (damaged.schema, "the schema"),
                        (tmp_path / "bad.parquet", str(tmp_path / "bad.parquet"))):
        for read, key in ((artifact_provenance, "sparrow.provenance"), (artifact_metadata, "sparrow.meta")):
            with pytest.raises(ArtifactError) as e:
                read(form)
            assert str(e.value) == f"{where} has '{key}' metadata that is not a JSON object"
