"""A file whose name is not UTF-8 (a Latin-1 name, which Python holds with a surrogate escape) reads like
any other; `sparrow sql` cannot hand it to DuckDB, so it skips it with a warning naming it and queries the
rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from sparrow.schemas import artifact_metadata, read_artifact, write_artifact

LATIN1 = os.fsdecode(b"caf\xe9.parquet")
PROMPTS = pa.table({"prompt_id": ["p1", "p2"], "task": ["chain_sum"] * 2,
                    "prompt_token_ids": [[1, 2, 3], [4, 5]], "answer": ["7", "9"]})


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    try:
        (tmp_path / LATIN1).touch()
        (tmp_path / LATIN1).unlink()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    write_artifact(PROMPTS, tmp_path / LATIN1, "prompts", {"source": "latin"})
    write_artifact(PROMPTS.slice(0, 1), tmp_path / "ok.parquet", "prompts", {"source": "utf8"})
    return tmp_path


def sparrow(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from sparrow.cli.app import main; main()", *map(str, args)],
                          capture_output=True, text=True, errors="backslashreplace", timeout=60)


def test_read_back(folder):
    table = read_artifact(folder / LATIN1, "prompts")
    assert table.column("prompt_id").to_pylist() == ["p1", "p2"]
    assert table.column("prompt_token_ids").to_pylist() == [[1, 2, 3], [4, 5]]
    assert artifact_metadata(folder / LATIN1) == {"source": "latin"}
    assert read_artifact(folder / LATIN1).num_rows == 2  # any kind


def test_sql_skips_it_with_a_warning(folder):
    r = sparrow("sql", "select prompt_id from prompts", "--run", folder, "-f", "csv")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["prompt_id", "p1"]  # the other file only
    assert "caf\\xe9.parquet" in r.stderr and "not UTF-8" in r.stderr
    assert "Traceback" not in r.stderr


def test_output_over_it(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / LATIN1  # an existing artifact, checked before it is replaced
    write_artifact(PROMPTS, out, "prompts")
    query = "select 'p9' as prompt_id, 'chain_sum' as task, [1]::int[] as prompt_token_ids, '1' as answer"
    r = sparrow("sql", query, "--run", folder, "-o", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "is a 'prompts' artifact" in r.stderr  # its footer was read: the usual refusal to replace it
    r = sparrow("sql", query, "--run", folder, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    assert read_artifact(out, "prompts").column("prompt_id").to_pylist() == ["p9"]


def test_report_leaves_it_out_and_names_it(folder, tmp_path_factory):
    """The report draws the rest, naming the file that it cannot hand to DuckDB instead of failing on it."""
    run = tmp_path_factory.mktemp("run")
    planned = sparrow("plan-schedule", "--model", "qwen3-4b", "-o", run / "s.parquet")
    assert planned.returncode == 0, planned.stderr
    os.rename(run / "s.parquet", run / os.fsdecode(b"s\xe9.parquet"))
    assert sparrow("plan-schedule", "--model", "qwen3-4b", "-o", run / "s.parquet").returncode == 0
    r = sparrow("report", run, "-o", run / "report")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert f"not drawn: {run}/s\\xe9.parquet has a name that is not UTF-8" in r.stderr
    assert (run / "report" / "schedule.png").exists()
