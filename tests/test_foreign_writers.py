"""Artifacts saved again by other tools (pandas, DuckDB, pyarrow) that drop Sparrow's footer or change
column types: plans infer the profile's bin width from its `bin` column, pandas' float-typed nullable
integers are read as the integers they are, `sql -o` refuses a column Parquet cannot hold and writes
row groups of a useful size, and pandas' index column is not taken for data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from sparrow.cli import sql as sql_cli
from sparrow.schemas import ArtifactError, artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.io import check_artifact, read_columns, write_batches
from sparrow.stages.core.schedule import ScheduleError
from sparrow.stages.plan import (
    PlanRequest,
    inferred_bin_width,
    plan_eviction,
    plan_schedule,
    profile_bin_width,
)

runner = CliRunner()


def profile_rows(positions: np.ndarray, bins: np.ndarray, alpha_by_budget: dict[int, np.ndarray]) -> dict:
    """Mismatch rows scoring the same tokens (8 prompts, `positions` each) at every budget."""
    n = len(positions)
    rows: dict[str, list] = {k: [] for k in ("prompt_id", "sample", "position", "bin", "budget", "token_id",
                                             "alpha", "logp_dense", "logp_sparse", "log_ratio", "k1", "k2",
                                             "k3", "entropy_dense")}
    for budget, alpha in alpha_by_budget.items():
        for k, v in (("prompt_id", [f"p{i // (n // 8)}" for i in range(n)]), ("sample", np.zeros(n, int)),
                     ("position", positions), ("bin", bins), ("budget", np.full(n, budget)),
                     ("token_id", np.ones(n, int)), ("alpha", alpha), ("logp_dense", -np.ones(n)),
                     ("logp_sparse", -np.ones(n)), ("log_ratio", np.zeros(n)), ("k1", np.zeros(n)),
                     ("k2", np.zeros(n)), ("k3", np.zeros(n)), ("entropy_dense", np.ones(n))):
            rows[k] += list(v)
    return rows


def late_failing_profile(path, meta: dict | None = None, width: int = 512):
    """8 prompts of 480 tokens, 64 generated (positions 480-543, across 512): budget 64's alpha is 0.99
    before position 512 and 0.1 from it, budget 128's 0.99 everywhere."""
    positions = np.tile(np.arange(480, 544), 8)
    a64 = np.where(positions < 512, 0.99, 0.1)
    rows = profile_rows(positions, positions // width, {64: a64, 128: np.full(len(positions), 0.99)})
    write_artifact(rows, path, "mismatch", metadata=meta if meta is not None else
                   {"bin_width": width, "model": "smollm2-135m", "page_size": 16})
    return path


def pandas_copy(path, to):
    pd.read_parquet(path).to_parquet(to)
    return to


def fitting_widths(positions: np.ndarray, bins: np.ndarray, up_to: int = 4096) -> list[int]:
    """Brute force: every w <= up_to with bin == position // w on every row."""
    return [w for w in range(1, up_to + 1) if np.array_equal(positions // w, bins)]


def preferred(fits: list[int]) -> int:
    """512 where it fits, else the smallest multiple of 16, else the smallest (the narrower bins)."""
    return 512 if 512 in fits else next((w for w in fits if w % 16 == 0), fits[0])


# ---- 1. the bin width of a profile that lost its footer

def test_pandas_copy_of_a_profile_plans_as_the_original(tmp_path):
    original = late_failing_profile(tmp_path / "profile.parquet")
    copy = pandas_copy(original, tmp_path / "profile_pandas.parquet")
    assert artifact_metadata(copy) == {}
    planned = {}
    for name, path in (("original", original), ("copy", copy)):
        result = plan_schedule(PlanRequest("smollm2-135m", profile=path, threshold=0.5)).plan
        planned[name] = (list(result.schedule.bin_starts), list(result.schedule.budgets), result.bin_width)
    # by hand: budget 64 holds before 512 and fails from it (its p5 there is 0.1 < 0.5)
    assert planned["original"] == planned["copy"] == ([0, 512], [64, 128], 512)
    notes = plan_schedule(PlanRequest("smollm2-135m", profile=copy, threshold=0.5)).plan.notes
    assert notes[0].startswith("bins of 512 tokens, inferred from the profile's bin column")


def test_a_bin_column_no_width_fits_is_refused(tmp_path):
    path = tmp_path / "edited.parquet"
    positions = np.tile(np.arange(480, 544), 8)
    bins = positions // 512
    bins[0] = 5  # position 480 in bin 5: no w has 480 // w == 5 and 511 // w == 0
    write_artifact(profile_rows(positions, bins, {64: np.full(len(positions), 0.99)}), path, "mismatch")
    assert fitting_widths(positions, bins) == []
    copy = pandas_copy(path, tmp_path / "edited_pandas.parquet")
    with pytest.raises(ScheduleError, match=r"records no bin width .* 'bin' column is not position // w for "
                                            r"any width w .*give --bin-width"):
        plan_schedule(PlanRequest("smollm2-135m", profile=copy, threshold=0.5))
    # --bin-width re-bins by position: the bin column is not read
    result = plan_schedule(PlanRequest("smollm2-135m", profile=copy, threshold=0.5, bin_width=512)).plan
    assert result.bin_width == 512 and result.notes[0] == "bins of 512 tokens (--bin-width)"


def test_recorded_width_and_a_different_bin_width_flag_keep_their_meaning(tmp_path):
    path = late_failing_profile(tmp_path / "p.parquet", width=256)  # footer says 256, bins of 256
    assert profile_bin_width(path).width == 256 and profile_bin_width(path).note is None
    assert profile_bin_width(path, 512).width == 512  # re-binned by position, as before


@pytest.mark.parametrize("width, first, n", [(512, 480, 64), (512, 512, 32), (300, 100, 700), (97, 0, 1000),
                                             (2000, 1500, 900), (516, 3100, 164), (2010, 2010, 290)])
def test_inferred_width_prefers_the_default_then_the_narrowest(width, first, n):
    positions = np.arange(first, first + n)
    bins = positions // width
    spans = [(int(b), int(positions[bins == b].min()), int(positions[bins == b].max())) for b in set(bins)]
    found = inferred_bin_width(spans, "p")
    if bins.max() == 0:  # any width past the last position fits: sparrow profile's default if it does
        past = int(positions.max()) + 1  # the narrowest width that fits
        assert found.width == (512 if past <= 512 else -(-past // 16) * 16) and found.high is None
    else:
        assert found.width == preferred(fitting_widths(positions, bins, up_to=8192))


def test_eviction_plan_infers_its_bin_width(tmp_path):
    path = tmp_path / "kv.parquet"
    positions = np.tile(np.arange(480, 544), 8)
    rows = profile_rows(positions, positions // 256, {64: np.full(len(positions), 0.99)})
    write_artifact(rows, path, "mismatch", metadata={"kv_compression": "snapkv", "budgets": "[64]"})
    result = plan_eviction(path, 0.5, 0.05, min_tokens=1)
    # by hand: bin 1 holds 480-511, so 255 < w <= 480; bin 2 holds 512-543, so 181 < w <= 256: w = 256
    assert result.bin_width == 256
    assert result.notes[0].startswith("bins of 256 tokens, inferred from the profile's bin column")


def test_tail_figure_names_the_inferred_width(tmp_path):
    from sparrow.stages.report.artifact_figures import _bins

    copy = pandas_copy(late_failing_profile(tmp_path / "p.parquet"), tmp_path / "c.parquet")
    rows = [(64, 0, 0.99, 0.99, 256, 495.5, 480, 511), (64, 1, 0.1, 0.1, 256, 527.5, 512, 543)]
    assert _bins(copy, rows) == "bins of 512 tokens (inferred from its 'bin' column: it records no bin width)"
    assert _bins(tmp_path / "p.parquet", rows) == "bins of 512 tokens"


# ---- 3. pandas' nullable integers, saved as float64

def rollouts(path):
    return write_artifact({"prompt_id": ["a", "b"], "sample": [0, 1], "prompt_token_ids": [[1, 2], [3]],
                           "token_ids": [[4], [5, 6]], "text": ["x", None],
                           "logprobs": [[-0.5], [-0.1, -0.2]],
                           "budgets": [[64], [64, 0]], "finish_reason": ["stop", "length"],
                           "drafted": [None, 3]}, path, "rollouts")


def schedule(path):
    return write_artifact({"bin": [0, 1], "bin_start": [0, 512], "bin_end": [512, None], "budget": [64, None],
                           "tail": [0.9, None], "predicted_step_seconds": [0.01, 0.02]}, path, "schedule")


def cost(path):
    return write_artifact({"model": ["m", "m"], "device": ["d", "d"], "batch": [1, 1], "context": [10, 10],
                           "budget": [None, 64], "seconds": [0.1, None], "predicted_seconds": [0.1, 0.05]},
                          path, "cost")


@pytest.mark.parametrize("kind, make", [("rollouts", rollouts), ("schedule", schedule), ("cost", cost)])
def test_pandas_round_trip_reads_as_the_original(tmp_path, kind, make):
    original = make(tmp_path / f"{kind}.parquet")
    copy = pandas_copy(original, tmp_path / f"{kind}_pd.parquet")
    floats = [f.name for f in pq.read_schema(copy) if pa.types.is_floating(f.type)
              and pa.types.is_integer(read_artifact(original, kind).schema.field(f.name).type)]
    assert floats  # pandas did turn a nullable integer column into float64
    expected = read_artifact(original, kind).replace_schema_metadata(None)
    assert read_artifact(copy, kind).replace_schema_metadata(None).equals(expected)
    assert check_artifact(copy, kind) == expected.num_rows
    assert read_columns(copy, kind, floats).replace_schema_metadata(None).equals(expected.select(floats))


@pytest.mark.parametrize("values, why", [([1.5, None], "a fraction"), ([float("nan"), 1.0], "NaN"),
                                         ([3e9, None], "beyond int32")])
def test_a_float_that_is_not_a_whole_integer_is_still_refused(tmp_path, values, why):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"bin": pa.array([0, 1], pa.int32()), "bin_start": [0, 512],
                             "bin_end": pa.array([512.0, None]), "budget": pa.array(values, pa.float64()),
                             "tail": [0.9, None], "predicted_step_seconds": [0.01, 0.02]}), path)
    sentence = (f"{path} (read as 'schedule' by its columns) has column 'budget' of type double, expected "
                "int32 (any integer type)")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path, "schedule")
    assert str(e.value) == sentence, why
    with pytest.raises(ArtifactError) as e:
        check_artifact(path, "schedule")
    assert str(e.value) == sentence, why



@pytest.mark.parametrize("dtype, values, whole", [
    (pa.float16(), [1.0, 2.0], True), (pa.float16(), [1.5, 2.0], False),  # Arrow has no floor for halves
    (pa.float32(), [16.0, 2.0 ** 24], True), (pa.float32(), [16.0, 2.0 ** 24 + 2], False)])  # 2^24+: rounded
def test_a_float_is_taken_for_an_integer_only_where_it_is_exact(tmp_path, dtype, values, whole):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"bin": pa.array([0, 1], pa.int32()), "bin_start": [0, 512],
                             "bin_end": pa.array([512, None], pa.int64()), "budget": pa.array(values, dtype),
                             "tail": [0.9, None], "predicted_step_seconds": [0.01, 0.02]}), path)
    if whole:
        assert read_artifact(path, "schedule").column("budget").to_pylist() == [int(v) for v in values]
    else:
        with pytest.raises(ArtifactError, match="has column 'budget' of type"):
            read_artifact(path, "schedule")

# ---- 2. and the row groups of `sql -o`

def sql_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("sql")(sql_cli.sql)
    app.command("noop", hidden=True)(lambda: None)
    return app


@pytest.mark.parametrize("select, column, what", [
    ("interval 3 day AS iv", "iv", "is an INTERVAL"), ("union_value(k := 1) AS u", "u", "is a UNION"),
    ("[interval 1 day] AS l", "l", "holds an INTERVAL")])
def test_sql_output_refuses_what_parquet_cannot_hold(tmp_path, select, column, what):
    schedule(tmp_path / "schedule.parquet")
    out = tmp_path / "r.parquet"
    r = runner.invoke(sql_app(), ["sql", f"SELECT {select}", "--run", str(tmp_path), "-o", str(out)])
    assert r.exit_code == 2
    assert r.stderr.strip().startswith(f"error: column '{column}' {what}, which Parquet cannot hold; cast it")
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["schedule.parquet"]  # nothing written, no temporary


def test_sql_output_writes_row_groups_of_128k_rows(tmp_path):
    schema = pa.schema([("x", pa.int64())])
    batches = (pa.record_batch([pa.array(np.arange(i, min(i + 8192, 300_000)))], schema=schema)
               for i in range(0, 300_000, 8192))
    out = tmp_path / "r.parquet"
    assert write_batches(schema, batches, out) == 300_000
    meta = pq.ParquetFile(out).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    # 8192-row batches gathered while they fit 131072 rows: 16 batches a group
    assert sizes == [131072, 131072, 300_000 - 2 * 131072]
    assert pq.read_table(out).column("x").to_numpy().tolist() == list(range(300_000))


def test_sql_output_row_groups_are_bounded_in_bytes(tmp_path):
    schema = pa.schema([("blob", pa.binary())])
    big = b"x" * (1 << 20)  # 1 MiB a row, 8 rows a batch: 64 MiB is 8 batches
    batches = [pa.record_batch([pa.array([big] * 8)], schema=schema) for _ in range(20)]
    out = tmp_path / "r.parquet"
    write_batches(schema, batches, out)
    meta = pq.ParquetFile(out).metadata
    assert max(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) <= 64
    assert meta.num_rows == 160


# ---- pandas' index column in a prompts file

def test_pandas_index_of_a_prompts_file_is_dropped_without_a_word(tmp_path, capsys):
    from sparrow.stages.core.user_data import read_dataset

    frame = pd.DataFrame({"prompt_id": ["a", "b", "c"], "task": ["kv_lookup"] * 3, "prompt": ["x", "y", "z"],
                          "answer": ["1", "2", "3"]})
    frame[frame.prompt_id != "a"].to_parquet(tmp_path / "filtered.parquet", index=True)
    assert "__index_level_0__" in pq.read_schema(tmp_path / "filtered.parquet").names
    named = frame.rename_axis("row")
    named.to_parquet(tmp_path / "named.parquet", index=True)
    named.assign(extra=1).to_parquet(tmp_path / "extra.parquet", index=True)
    for name in ("filtered", "named"):
        assert read_dataset(tmp_path / f"{name}.parquet") is None  # ours
        assert capsys.readouterr().err == ""
    kept = read_artifact(tmp_path / "filtered.parquet", "prompts")
    assert kept.column("prompt_id").to_pylist() == ["b", "c"]
    read_dataset(tmp_path / "extra.parquet")
    said = capsys.readouterr().err
    assert "'extra' do not reach the reward" in said and "'row'" not in said
