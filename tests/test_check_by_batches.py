"""Checking an artifact a batch of rows at a time (`check_artifact`) says what reading it whole says.

The reference is the whole-table check of `read_artifact`, and hand counts of the broken rows: each broken
file is written so that its failures fall in different batches (a batch here is a few rows), with a later
batch breaking an earlier check than the first batch does.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_schemas import raw_write, valid

from sparrow.schemas import ArtifactError, footer, read_artifact, write_artifact
from sparrow.schemas.io import check_artifact, column_reader, read_columns

ROWS = 40


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(footer, "BATCH_BYTES", 200)  # a few rows per batch


def rollouts(**changes) -> dict[str, list]:
    """ROWS valid rollouts of 3 tokens, with `changes` as {column: {row: value}}."""
    base = valid("rollouts")
    data = {name: [values[i % 2] for i in range(ROWS)] for name, values in base.items()}
    data["sample"] = list(range(ROWS))
    for name, rows in changes.items():
        for row, value in rows.items():
            data[name][row] = value
    return data


def same_sentence(path, kind: str | None = None) -> str:
    with pytest.raises(ArtifactError) as whole:
        read_artifact(path, kind)
    with pytest.raises(ArtifactError) as batched:
        check_artifact(path, kind)
    assert str(batched.value) == str(whole.value)
    return str(whole.value)


def test_batches_are_small_and_rows_counted(tmp_path):
    path = write_artifact(rollouts(), tmp_path / "r.parquet", "rollouts")
    assert sum(1 for _ in footer.parquet_batches(path)) >= 5
    assert check_artifact(path) == ROWS == check_artifact(path, "rollouts")


def test_counts_and_first_row_span_batches(tmp_path):
    path = tmp_path / "r.parquet"
    raw_write(pa.table(rollouts(logprobs={25: [0.5, -0.1, 0.2], 33: [-0.1, 0.0, 0.7]})), path, "rollouts")
    message = same_sentence(path)
    assert message.endswith("has 3 values of column 'logprobs' outside the allowed range (-inf, 0] "
                            "(first: 0.5 in row 25)")


def test_an_earlier_check_in_a_later_batch_wins(tmp_path):
    path = tmp_path / "r.parquet"
    table = pa.table(rollouts(logprobs={2: [0.5, -0.1, 0.0]}, finish_reason={30: "eos", 38: "eos"}))
    sample = pa.array([0, 1, *([None] * 36), 38, 39], pa.int32())  # 'sample' precedes 'logprobs'
    raw_write(table.set_column(table.column_names.index("sample"), "sample", sample), path, "rollouts")
    assert same_sentence(path).endswith("has nulls in 36 rows of column 'sample', which allows no nulls")


def test_choices_and_rules_in_later_batches(tmp_path):
    path = tmp_path / "r.parquet"
    raw_write(pa.table(rollouts(finish_reason={31: "eos", 37: "abort"})), path, "rollouts")
    assert same_sentence(path).endswith("(first: 'eos' in row 31)")
    assert "has 2 values of column 'finish_reason'" in same_sentence(path)
    raw_write(pa.table(rollouts(budgets={22: [0, 1], 38: [0]})), path, "rollouts")
    assert same_sentence(path).endswith("has 2 rows whose 'token_ids', 'logprobs', 'budgets' lengths differ "
                                        "(first: row 22 with lengths 3, 3, 2)")


def test_a_value_that_does_not_fit_and_a_missing_column(tmp_path):
    path = tmp_path / "r.parquet"
    table = pa.table(rollouts())
    big = pa.array([*range(ROWS - 1), 2**40], pa.int64())
    raw_write(table.set_column(table.column_names.index("sample"), "sample", big), path, "rollouts")
    assert "has values in column 'sample' that do not fit int32" in same_sentence(path)
    raw_write(table.drop_columns(["finish_reason"]), path, "rollouts")
    assert same_sentence(path).endswith("lacks column 'finish_reason' required by the 'rollouts' schema")


def test_a_rule_between_rows_reads_the_table_whole(tmp_path):
    path = tmp_path / "s.parquet"
    bins = np.arange(ROWS, dtype=np.int32)
    bins[35] = 3  # bin 3 twice, in different batches
    raw_write(pa.table({"bin": bins, "bin_start": np.arange(ROWS) * 10,
                        "bin_end": np.arange(1, ROWS + 1) * 10, "budget": pa.array([64] * ROWS, pa.int32())}),
              path, "schedule")
    assert same_sentence(path).endswith("has bin 3 more than once")


def test_another_tools_file_and_parts(tmp_path):
    foreign = tmp_path / "f.parquet"
    table = pa.table(rollouts(sample={29: -1})).append_column("extra", pa.array(["x"] * ROWS))
    pq.write_table(table, foreign)
    message = same_sentence(foreign, "rollouts")
    assert message.endswith("has 1 value of column 'sample' outside the allowed range [0, inf) "
                            "(first: -1 in row 29)")
    parts = tmp_path / "parts"
    parts.mkdir()
    write_artifact(rollouts(), parts / "part-00000.parquet", "rollouts")
    raw_write(pa.table(rollouts(kv_lens={17: [1, 2]})), parts / "part-00001.parquet", "rollouts")
    assert same_sentence(parts).startswith(str(parts / "part-00001.parquet"))
    write_artifact(rollouts(), parts / "part-00001.parquet", "rollouts")
    assert check_artifact(parts) == 2 * ROWS


def test_an_empty_artifact(tmp_path):
    path = write_artifact({}, tmp_path / "r.parquet", "rollouts")
    assert check_artifact(path, "rollouts") == 0


def test_columns_read_without_the_rest_match_a_whole_read(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    write_artifact(rollouts(), parts / "part-00000.parquet", "rollouts")
    older = pa.table(rollouts()).drop_columns(["kv_lens", "accepted", "drafted"])  # before those columns
    raw_write(older, parts / "part-00001.parquet", "rollouts")
    columns = ("sample", "kv_lens", "token_ids")
    whole = read_artifact(parts, "rollouts").select(list(columns))
    got = read_columns(parts, "rollouts", columns)
    assert got.equals(whole) and got.schema.metadata == read_artifact(parts, "rollouts").schema.metadata
    streamed = pa.Table.from_batches(list(column_reader(parts, "rollouts", columns)))
    assert streamed.equals(whole.replace_schema_metadata(None))
    assert got["kv_lens"].null_count >= ROWS  # the older part's rows


def test_columns_are_checked_first(tmp_path):
    path = tmp_path / "r.parquet"
    raw_write(pa.table(rollouts(logprobs={30: [0.5, 0.0, 0.0]})), path, "rollouts")
    with pytest.raises(ArtifactError, match=r"first: 0.5 in row 30"):
        read_columns(path, "rollouts", ("sample",))


def test_a_column_twice_is_said_as_such_by_both_reads(tmp_path):
    """pyarrow reads no file with a name twice: the footer's names are checked first, so a healthy file is not
    called corrupt; another tool's file is read by its schema's columns alone, so an unknown one twice is
    dropped as any unknown column is."""
    table = pa.table(rollouts())
    twice = pa.Table.from_arrays([*table.columns, table["text"]], names=[*table.column_names, "text"])
    path = tmp_path / "r.parquet"
    raw_write(twice, path, "rollouts")
    assert same_sentence(path).endswith("has column 'text' more than once")
    foreign = tmp_path / "f.parquet"
    extra = pa.array(["x"] * ROWS)
    pq.write_table(pa.Table.from_arrays([*table.columns, extra, extra],
                                        names=[*table.column_names, "junk", "junk"]), foreign)
    assert read_artifact(foreign, "rollouts").num_rows == check_artifact(foreign, "rollouts") == ROWS
