"""Artifact schemas: round trips, every reading error on a real broken file, atomic writes."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow.schemas import (
    SCHEMAS,
    ArtifactError,
    artifact_kind,
    artifact_metadata,
    read_artifact,
    write_artifact,
)
from sparrow.schemas.artifacts import TRAIN_CORRECTION_METRICS

VALID: dict[str, dict[str, list]] = {
    "prompts": {
        "prompt_id": ["p0", "p1"], "task": ["arith", "retrieval"],
        "prompt": ["<|im_start|>user\n1+1?", None], "prompt_token_ids": [None, [1, 2, 3]],
        "answer": ["2", "blue"], "metadata": [None, json.dumps({"needle_depth": 0.3})],
    },
    "mismatch": {
        "prompt_id": ["p0"] * 3, "sample": [0, 0, 1], "position": [10, 11, 10], "bin": [0, 0, 0],
        "budget": [64, 64, 128], "token_id": [5, 9, 5], "alpha": [0.99, 1.0, 0.5],
        "logp_dense": [-0.1, 0.0, -2.0], "logp_sparse": [-0.2, 0.0, -1.0], "log_ratio": [0.1, 0.0, -1.0],
        "k1": [0.1, 0.0, -1.0], "k2": [0.005, 0.0, 0.5], "k3": [0.004, 0.0, 0.7],
        "entropy_dense": [0.3, 0.0, 2.0], "alpha_draft": [0.995, 1.0, None],
    },
    "threshold": {
        "threshold": [0.86], "lower": [None], "upper": [None], "quantile": [0.05], "source": ["prior"],
        "n_runs": [0], "n_collapsed": [0], "note": ["published prior"],
    },
    "cost": {
        "model": ["smollm2-135m"] * 2, "device": ["cpu", "analytic:h100"], "batch": [1, 8],
        "context": [1024, 4096], "budget": [None, 256], "seconds": [0.01, None],
        "predicted_seconds": [0.011, 0.002],
    },
    "schedule": {
        "bin": [0, 1, 2], "bin_start": [0, 2000, 4000], "bin_end": [2000, 4000, None],
        "budget": [256, 512, None], "tail": [0.9, 0.88, None], "predicted_step_seconds": [0.01, 0.012, 0.02],
    },
    "rollouts": {
        "prompt_id": ["p0", "p0"], "sample": [0, 1], "prompt_token_ids": [[1, 2], [1, 2]],
        "token_ids": [[7, 8, 9], [7]], "text": ["abc", None], "logprobs": [[-0.1, -0.2, 0.0], [-1.5]],
        "budgets": [[0, 64, 64], [0]], "finish_reason": ["stop", "length"], "reward": [1.0, None],
        "kv_policy": ["snapkv:512,window=8,buffer=128,sink=4", None], "kv_lens": [[2, 3, 4], None],
        "reward_extra": ['{"acc": true}', None], "accepted": [[False, True, False], None],
        "drafted": [3, None],
    },
    "metrics": {
        "run_id": ["r"] * 2, "step": [0, 1], "reward_mean": [0.1, 0.2], "reward_std": [0.3, None],
        "loss": [1.0, float("nan")], "grad_norm": [2.0, 3.0], "entropy": [1.1, 1.0],
        "mismatch_kl": [1e-3, 2e-3], "truncation_rate": [0.0, 0.5], "repetition_rate": [0.0, 1.0],
        "response_length": [100.0, 120.0], "lr": [1e-6, 1e-6], "seconds": [3.0, 3.1],
        "accuracy": [0.0, 0.25], "eval_accuracy": [0.1, None], "clip_fraction": [0.0, 0.01],
        "clip_fraction_low": [0.0, 0.004], "clip_fraction_high": [0.0, 0.006],
        "dual_clip_fraction": [0.0, 0.0],
        "masked_fraction": [0.0, 0.02], "vetoed_fraction": [0.0, 0.1], "alpha_lb_mean": [0.9, 0.8],
        "alpha_lb_p5": [0.5, 0.4], "policy_loss": [0.1, -0.1], "kl": [0.0, 0.01], "mean_budget": [0.0, 512.0],
        "rollout_seconds": [2.0, 2.1], "scoring_seconds": [0.5, 0.5], "update_seconds": [0.5, 0.5],
        "tokens_per_second": [100.0, 90.0], "weight_sync_seconds": [None, 0.01],
        "reward_seconds": [0.2, 1.5], "collapse": [None, "reward_drop"],
        **{name: [None, 0.5] for name in TRAIN_CORRECTION_METRICS}, "eval_accuracy_sparse": [0.1, None],
        "update_skipped": [None, "the rollout correction rejected every token of the batch"],
        "alpha_lb_p5_by_bin": [[0.5, 0.25], []], "oversample_acceptance_kept": [None, 0.9],
        "oversample_acceptance_dropped": [None, 0.8],
        "frac_reward_zero_std": [None, 0.5], "alpha_mean": [None, 0.9], "alpha_p5": [None, 0.6],
        "alpha_p5_by_bin": [None, [0.6, 0.7]], "sampler_gap": [0.1, None],
        "draft_acceptance": [None, 0.8], "reward_extra": [None, '{"acc": 0.5}'],
    },
    "train_mismatch": {
        "step": [0, 0], "prompt_id": ["p0", "p0"], "sample": [0, 1], "position": [100, 101], "bin": [0, 0],
        "budget": [0, 64], "token_id": [5, 9], "logp_rollout": [-0.2, -1.0], "logp_dense": [-0.1, -2.0],
        "log_ratio": [-0.1, 1.0], "k3": [0.005, 0.37], "alpha_top20_lb": [0.95, None], "alpha": [None, 0.97],
        "weight": [1.0, 0.0], "masked": [False, True], "vetoed": [False, False],
    },
    "train_completions": {
        "step": [1, 1], "prompt_id": ["p0", "p0"], "sample": [0, 1], "text": ["It is 5.", "six"],
        "tokens": [4, 2], "finish_reason": ["stop", "length"], "reward": [1.0, 0.0], "advantage": [0.7, -0.7],
        "mean_budget": [None, 64.0],
    },
    "rewards": {"prompt_id": ["code-0-0", "code-0-0"], "sample": [0, 1], "task": ["code", "code"],
                "reward": [1.0, 0.1], "status": ["passed", "failed"], "tests_passed": [6, 0],
                "tests_total": [6, 6], "reward_extra": [None, '{"pred": "x"}']},
}


def valid(kind: str, **changes) -> dict[str, list]:
    return {**VALID[kind], **changes}


def raw_write(table: pa.Table, path, kind: str | None, version: str | None = "1") -> None:
    """Write a Parquet file with Sparrow metadata but without any validation (to build broken files)."""
    meta = {}
    if kind is not None:
        meta["sparrow.artifact"] = kind
    if version is not None:
        meta["sparrow.version"] = version
    pq.write_table(table.replace_schema_metadata(meta or None), path)


def one_sentence(e: pytest.ExceptionInfo, path) -> str:
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


def test_every_kind_has_valid_example():
    assert set(VALID) == set(SCHEMAS) == {"prompts", "mismatch", "threshold", "cost", "schedule",
                                          "rollouts", "metrics", "train_mismatch", "train_completions",
                                          "rewards"}
    for kind, spec in SCHEMAS.items():
        assert spec.schema.metadata == {b"sparrow.artifact": kind.encode(), b"sparrow.version": b"1"}
        assert set(VALID[kind]) == set(spec.names)


@pytest.mark.parametrize("kind", sorted(VALID))
def test_round_trip(tmp_path, kind):
    path = write_artifact(VALID[kind], tmp_path / "sub" / f"{kind}.parquet", kind,
                          metadata={"page_size": 16, "model": "smollm2-135m", "q": 0.05})
    assert path == tmp_path / "sub" / f"{kind}.parquet"
    table = read_artifact(path, kind)
    assert table.schema.equals(SCHEMAS[kind].schema)
    expected = pa.table(VALID[kind]).to_pylist()
    got = table.to_pylist()
    for e_row, g_row in zip(expected, got, strict=True):
        for name, value in e_row.items():
            if isinstance(value, float) and np.isnan(value):
                assert np.isnan(g_row[name])
            elif isinstance(value, float | list):
                assert g_row[name] == pytest.approx(value, rel=1e-6), name
            else:
                assert g_row[name] == value, name
    assert artifact_kind(path) == kind
    assert read_artifact(path).num_rows == len(expected)  # kind=None accepts any known kind
    assert artifact_metadata(path) == {"page_size": 16, "model": "smollm2-135m", "q": 0.05}
    assert artifact_metadata(table) == artifact_metadata(path)
    assert json.loads(pq.read_schema(path).metadata[b"sparrow.meta"]) == artifact_metadata(path)


@pytest.mark.parametrize("kind", sorted(VALID))
def test_empty_tables_are_valid(tmp_path, kind):
    path = write_artifact([], tmp_path / "e.parquet", kind)
    assert read_artifact(path, kind).num_rows == 0
    assert artifact_metadata(path) == {}


def test_inputs_are_cast_to_the_schema(tmp_path):
    rows = [dict(zip(VALID["mismatch"], values, strict=True))
            for values in zip(*VALID["mismatch"].values(), strict=True)]
    path = write_artifact(rows, tmp_path / "m.parquet", "mismatch")  # list of row dicts
    assert read_artifact(path).column("alpha").type == pa.float32()

    table = pa.table({**VALID["schedule"], "bin": pa.array([0, 1, 2], pa.int64()),
                      "bin_start": pa.array([0, 2000, 4000], pa.uint16()),
                      "tail": pa.array([0.9, 0.88, None], pa.float32())})
    path = write_artifact(table, tmp_path / "s.parquet", "schedule")
    assert read_artifact(path).schema.field("bin").type == pa.int32()

    data = valid("rollouts", token_ids=pa.array([[7, 8, 9], [7]], pa.large_list(pa.int64())),
                 reward=[1, 0])  # integer rewards widen to float64
    table = read_artifact(write_artifact(data, tmp_path / "r.parquet", "rollouts"))
    assert table["reward"].to_pylist() == [1.0, 0.0]


def test_nullable_columns_may_be_omitted_when_writing(tmp_path):
    data = {k: v for k, v in VALID["threshold"].items() if k not in ("lower", "upper", "note")}
    table = read_artifact(write_artifact(data, tmp_path / "t.parquet", "threshold"))
    assert table["note"].to_pylist() == [None] and table.column_names == SCHEMAS["threshold"].names


def test_rewriting_a_read_table_keeps_its_metadata(tmp_path):
    table = read_artifact(write_artifact(VALID["cost"], tmp_path / "a.parquet", "cost", {"a": 1.5}))
    write_artifact(table, tmp_path / "b.parquet", "cost")
    assert artifact_metadata(tmp_path / "b.parquet") == {"a": 1.5}


# ---- reading errors, each on a real broken file ----

def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist") as e:
        read_artifact(tmp_path / "nope.parquet")
    one_sentence(e, tmp_path / "nope.parquet")


@pytest.mark.parametrize("content", [b"prompt_id,task\np0,arith\n", os.urandom(4096),
                                     b"{" + bytes(range(256)), b""])
def test_not_a_parquet_file(tmp_path, content):
    path = tmp_path / "x.parquet"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match="not a Parquet file") as e:
        read_artifact(path)
    one_sentence(e, path)
    with pytest.raises(ArtifactError, match="not a Parquet file"):
        artifact_kind(path)


def test_directory_is_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="is a directory"):
        read_artifact(tmp_path)


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_parquet_file(tmp_path, keep):
    good = write_artifact(VALID["mismatch"], tmp_path / "good.parquet", "mismatch")
    data = good.read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ArtifactError, match="truncated") as e:
        read_artifact(path, "mismatch")
    one_sentence(e, path)


def test_corrupt_data_pages(tmp_path):
    # Footer intact, data scrambled: detected when the data is read, still one sentence.
    table = pa.table({"x": np.arange(50_000, dtype=np.int64)})
    path = tmp_path / "c.parquet"
    raw_write(table, path, None)
    data = bytearray(path.read_bytes())
    data[100:20_000] = os.urandom(19_900)
    path.write_bytes(bytes(data))
    raw_write(pa.table({"x": [1]}), tmp_path / "ok.parquet", None)
    with pytest.raises(ArtifactError):
        read_artifact(path)


def test_wrong_artifact_kind(tmp_path):
    path = write_artifact(VALID["schedule"], tmp_path / "x.parquet", "schedule")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path, "mismatch")
    assert one_sentence(e, path) == f"{path} is a 'schedule' artifact, expected 'mismatch'"


def test_parquet_without_sparrow_metadata(tmp_path):
    """Read where a kind is expected, a plain Parquet file is validated by its columns; with no kind
    to go by it is refused in one sentence."""
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table(VALID["threshold"]), path)
    assert artifact_kind(path) is None
    assert read_artifact(path, "threshold").to_pydict() == VALID["threshold"]
    with pytest.raises(ArtifactError, match="without Sparrow artifact metadata") as e:
        read_artifact(path)
    one_sentence(e, path)
    assert artifact_metadata(path) == {}


def test_prompts_written_by_duckdb_and_pandas_are_read_by_columns(tmp_path):
    import duckdb

    sparrow_file = write_artifact(VALID["prompts"], tmp_path / "ours.parquet", "prompts")
    duck = tmp_path / "duck.parquet"
    duckdb.sql(f"COPY (SELECT * FROM read_parquet('{sparrow_file}')) TO '{duck}' (FORMAT parquet)")
    assert artifact_kind(duck) is None  # DuckDB keeps no Arrow schema metadata
    assert read_artifact(duck, "prompts").to_pydict() == VALID["prompts"]
    # pandas-style: 64-bit ints, large strings, an index column the schema does not have
    table = pa.table({**{k: v for k, v in VALID["prompts"].items() if k != "prompt_token_ids"},
                      "prompt_token_ids": pa.array([None, [1, 2, 3]], pa.large_list(pa.int64())),
                      "__index_level_0__": [0, 1]})
    pq.write_table(table.cast(pa.schema([pa.field(f.name, pa.large_string()) if f.type == pa.string()
                                         else f for f in table.schema])), tmp_path / "pd.parquet")
    assert read_artifact(tmp_path / "pd.parquet", "prompts").to_pydict() == VALID["prompts"]


def test_prompts_from_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_id": "a", "task": "passkey", "prompt": "hi", "answer": "1", '
                    '"metadata": {"depth": 0.2}}\n\n{"prompt_id": "b", "task": "t", '
                    '"prompt_token_ids": [4, 5]}\n')
    rows = read_artifact(path, "prompts").to_pylist()
    assert rows[0]["metadata"] == '{"depth": 0.2}' and rows[1]["prompt_token_ids"] == [4, 5]
    assert rows[1]["answer"] is None
    path.write_text('{"prompt_id": "a", "task": "t", "prompt": "x"}\nnot json\n')
    with pytest.raises(ArtifactError, match="line 2 is not JSON"):
        read_artifact(path, "prompts")


@pytest.mark.parametrize("change,message", [
    (dict(drop="task"), "lacks column 'task' required by the 'prompts' schema"),
    (dict(prompt_token_ids=["1 2", "3"]), "has column 'prompt_token_ids' of type string"),
])
def test_foreign_prompts_with_a_missing_or_mistyped_column(tmp_path, change, message):
    data = dict(VALID["prompts"])
    data.pop(change.pop("drop", None), None)
    data.update(change)
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(data), path)
    with pytest.raises(ArtifactError, match=message) as e:
        read_artifact(path, "prompts")
    assert str(e.value).startswith(f"{path} (read as 'prompts' by its columns)")


def test_unknown_kind(tmp_path):
    path = tmp_path / "k.parquet"
    raw_write(pa.table({"a": [1]}), path, "telemetry")
    assert artifact_kind(path) == "telemetry"
    with pytest.raises(ArtifactError, match="does not know"):
        read_artifact(path)
    with pytest.raises(ArtifactError, match="not an artifact kind"):
        read_artifact(path, "telemetry")
    with pytest.raises(ArtifactError, match="not an artifact kind"):
        write_artifact({}, tmp_path / "w.parquet", "telemetry")


@pytest.mark.parametrize("version,words", [("2", "upgrade Sparrow"), ("0", "regenerate it"),
                                           (None, "without a 'sparrow.version'")])
def test_other_schema_version(tmp_path, version, words):
    path = tmp_path / "v.parquet"
    raw_write(SCHEMAS["cost"].conform(pa.table(VALID["cost"]), "x"), path, "cost", version)
    with pytest.raises(ArtifactError, match=words) as e:
        read_artifact(path, "cost")
    msg = one_sentence(e, path)
    assert "reads only version 1" in msg
    if version is not None:
        assert f"has version {version} of the 'cost' schema" in msg


def test_missing_column(tmp_path):
    path = tmp_path / "m.parquet"
    raw_write(pa.table({k: v for k, v in VALID["mismatch"].items() if k != "alpha"}), path, "mismatch")
    with pytest.raises(ArtifactError, match="lacks column 'alpha' required by the 'mismatch' schema") as e:
        read_artifact(path)
    one_sentence(e, path)


def test_unknown_column(tmp_path):
    path = tmp_path / "u.parquet"
    raw_write(pa.table(valid("metrics", rewrd=[1.0, 2.0])), path, "metrics")
    with pytest.raises(ArtifactError, match="has column 'rewrd', which the 'metrics' schema does not have"):
        read_artifact(path)


@pytest.mark.parametrize("kind,column,values,found", [
    ("mismatch", "bin", ["0", "0", "0"], "string"),
    ("mismatch", "alpha", [True, True, False], "bool"),
    ("schedule", "bin", [0.0, 1.5, 2.0], "double"),  # a whole float is read as its integer
    ("rollouts", "token_ids", [["7"], ["8"]], "list<string>"),
    ("prompts", "prompt", [1, 2], "int64"),
])
def test_wrong_column_type(tmp_path, kind, column, values, found):
    path = tmp_path / "t.parquet"
    raw_write(pa.table(valid(kind, **{column: values})), path, kind)
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    msg = one_sentence(e, path)
    assert f"has column '{column}' of type {found}, expected" in msg
    if kind == "rollouts":
        assert msg.endswith("expected list<int32> (any list of integers)")


def test_integer_that_does_not_fit(tmp_path):
    path = tmp_path / "o.parquet"
    raw_write(pa.table(valid("mismatch", position=[10, 2**40, 3])), path, "mismatch")
    with pytest.raises(ArtifactError, match="values in column 'position' that do not fit int32"):
        read_artifact(path)


def test_nulls_in_non_nullable_column(tmp_path):
    path = tmp_path / "n.parquet"
    raw_write(pa.table(valid("mismatch", logp_sparse=[None, -1.0, None])), path, "mismatch")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    msg = one_sentence(e, path)
    assert msg == f"{path} has nulls in 2 rows of column 'logp_sparse', which allows no nulls"


def test_null_elements_in_list_column(tmp_path):
    path = tmp_path / "n.parquet"
    raw_write(pa.table(valid("rollouts", budgets=[[0, None, 64], [0]])), path, "rollouts")
    with pytest.raises(ArtifactError, match="1 null element inside the lists of column 'budgets'"):
        read_artifact(path)


@pytest.mark.parametrize("kind,column,values,bad,interval", [
    ("mismatch", "alpha", [0.5, 1.5, 0.2], "1.5", "[0, 1]"),
    ("mismatch", "alpha", [0.5, float("nan"), 0.2], "nan", "[0, 1]"),
    ("mismatch", "budget", [64, 0, 64], "0", "(0, inf)"),
    ("mismatch", "position", [1, 2, -1], "-1", "[0, inf)"),
    ("mismatch", "logp_dense", [-0.1, 0.01, 0.0], "0.01", "(-inf, 0]"),
    ("mismatch", "k3", [0.0, -0.001, 0.0], "-0.001", "[0, inf)"),
    ("threshold", "threshold", [1.0], "1", "(0, 1)"),
    ("threshold", "quantile", [0.0], "0", "(0, 1)"),
    ("schedule", "tail", [0.9, 1.2, None], "1.2", "[0, 1]"),
    ("cost", "batch", [1, -8], "-8", "(0, inf)"),
    ("metrics", "truncation_rate", [0.1, 2.0], "2", "[0, 1]"),
    ("rollouts", "logprobs", [[-0.1, -0.2, 0.0], [0.5]], "0.5", "(-inf, 0]"),
])
def test_values_out_of_range(tmp_path, kind, column, values, bad, interval):
    path = tmp_path / "r.parquet"
    raw_write(SCHEMAS[kind].conform(pa.table(valid(kind)), "x").set_column(
        SCHEMAS[kind].names.index(column), column, pa.array(values)), path, kind)
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    msg = one_sentence(e, path)
    assert f"value of column '{column}' outside the allowed range {interval} (first: {bad} in row" in msg
    with pytest.raises(ArtifactError, match="outside the allowed range"):  # writing checks the same
        write_artifact(valid(kind, **{column: values}), tmp_path / "w.parquet", kind)


def test_range_counts_and_rows(tmp_path):
    with pytest.raises(ArtifactError, match=r"2 values of column 'alpha' outside .*\(first: -0.5 in row 1\)"):
        write_artifact(valid("mismatch", alpha=[0.5, -0.5, 3.0]), tmp_path / "m.parquet", "mismatch")
    with pytest.raises(ArtifactError, match=r"first: 0.5 in row 1\)"):
        write_artifact(valid("rollouts", logprobs=[[-0.1, -0.2, 0.0], [0.5]]), tmp_path / "r.parquet",
                       "rollouts")


def test_float_tolerance(tmp_path):
    data = valid("mismatch", logp_dense=[5e-7, 0.0, -1.0], k3=[-5e-7, 0.0, 0.1], alpha=[1 + 5e-7, 0.0, 0.5])
    read_artifact(write_artifact(data, tmp_path / "m.parquet", "mismatch"))


def test_allowed_values(tmp_path):
    with pytest.raises(ArtifactError, match=r"'finish_reason' other than 'stop' or 'length' \(first: 'eos'"):
        write_artifact(valid("rollouts", finish_reason=["stop", "eos"]), tmp_path / "r.parquet", "rollouts")
    with pytest.raises(ArtifactError, match="column 'source' other than 'prior' or 'calibrated'"):
        write_artifact(valid("threshold", source=["guess"]), tmp_path / "t.parquet", "threshold")


def test_prompt_or_token_ids_required(tmp_path):
    path = tmp_path / "p.parquet"
    raw_write(pa.table(valid("prompts", prompt=[None, None])), path, "prompts")
    with pytest.raises(ArtifactError, match=r"1 row with neither 'prompt' nor 'prompt_token_ids'"):
        read_artifact(path)


def test_schedule_budget_must_not_decrease(tmp_path):
    path = tmp_path / "s.parquet"
    raw_write(pa.table(valid("schedule", bin=[2, 0, 1], budget=[256, 512, None])), path, "schedule")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    assert "has budget dense in bin 1 but 256 in bin 2" in one_sentence(e, path)
    with pytest.raises(ArtifactError, match="has budget 512 in bin 0 but 256 in bin 1"):
        write_artifact(valid("schedule", budget=[512, 256, None]), tmp_path / "w.parquet", "schedule")
    with pytest.raises(ArtifactError, match="has bin 1 more than once"):
        write_artifact(valid("schedule", bin=[0, 1, 1]), tmp_path / "w.parquet", "schedule")
    unsorted_ok = valid("schedule", bin=[2, 1, 0], bin_start=[4000, 2000, 0], bin_end=[None, 4000, 2000],
                        budget=[None, 512, 256])
    write_artifact(unsorted_ok, tmp_path / "w.parquet", "schedule")


@pytest.mark.parametrize("starts,ends,words", [
    ([16, 2000, 4000], [2000, 4000, None], "starts its first bin at position 16"),
    ([0, 4000, 2000], [4000, 2000, None], "starts a bin at position 2000, not after"),
    ([0, 2000, 4000], [1000, 4000, None], "ends the bin that starts at position 0 at 1000, but starts the "
                                          "next at 2000"),
    ([0, 2000, 4000], [2000, 4000, 8000], "ends its last bin at 8000"),
])
def test_schedule_bins_tile_every_position(tmp_path, starts, ends, words):
    """A schedule's bins start at 0 and meet, the last open, so that every position has one budget."""
    with pytest.raises(ArtifactError, match=re.escape(words)):
        write_artifact(valid("schedule", bin_start=starts, bin_end=ends), tmp_path / "s.parquet",
                       "schedule")


def test_rollout_lists_have_equal_lengths(tmp_path):
    path = tmp_path / "r.parquet"
    raw_write(pa.table(valid("rollouts", budgets=[[0, 64], [0]])), path, "rollouts")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    msg = one_sentence(e, path)
    assert msg.endswith("has 1 row whose 'token_ids', 'logprobs', 'budgets' lengths differ "
                        "(first: row 0 with lengths 3, 3, 2)")


def test_write_errors_name_the_target(tmp_path):
    target = tmp_path / "out" / "m.parquet"
    with pytest.raises(ArtifactError) as e:
        write_artifact({"prompt_id": ["a", "b"], "sample": [0]}, target, "mismatch")
    assert "different lengths" in one_sentence(e, target)
    with pytest.raises(ArtifactError, match="not JSON-serializable"):
        write_artifact(VALID["cost"], target, "cost", metadata={"x": object()})
    with pytest.raises(ArtifactError, match="Arrow cannot convert"):
        write_artifact(valid("cost", batch=[1, "x"]), target, "cost")
    with pytest.raises(ArtifactError, match="expected an Arrow table"):
        write_artifact(42, target, "cost")


# ---- atomic writes ----

def test_failed_validation_leaves_old_file_intact(tmp_path):
    path = write_artifact(VALID["mismatch"], tmp_path / "m.parquet", "mismatch", {"v": 1})
    before = path.read_bytes()
    with pytest.raises(ArtifactError, match="alpha"):
        write_artifact(valid("mismatch", alpha=[2.0, 0.0, 0.0]), path, "mismatch", {"v": 2})
    assert path.read_bytes() == before
    assert read_artifact(path).num_rows == 3 and artifact_metadata(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.parquet"]


def test_failed_write_removes_temp_file(tmp_path, monkeypatch):
    path = write_artifact(VALID["metrics"], tmp_path / "metrics.parquet", "metrics")
    before = path.read_bytes()

    def exploding_write(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", exploding_write)
    with pytest.raises(KeyboardInterrupt):
        write_artifact(VALID["metrics"], path, "metrics")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.parquet"]


def test_validation_is_fast_on_a_million_tokens(tmp_path):

    n = 1_000_000
    rng = np.random.default_rng(0)
    lp = -rng.random(n, dtype=np.float32)
    data = {"prompt_id": pa.array(["p"] * n), "sample": np.zeros(n, np.int32),
            "position": np.arange(n, dtype=np.int32), "bin": np.arange(n, dtype=np.int32) // 2000,
            "budget": np.full(n, 256, np.int32), "token_id": np.ones(n, np.int32),
            "alpha": rng.random(n, dtype=np.float32), "logp_dense": lp, "logp_sparse": lp,
            "log_ratio": np.zeros(n, np.float32), "k1": np.zeros(n, np.float32),
            "k2": np.zeros(n, np.float32), "k3": np.zeros(n, np.float32), "entropy_dense": -lp}
    path = write_artifact(data, tmp_path / "big.parquet", "mismatch")
    table = read_artifact(path, "mismatch")
    assert table.num_rows == n


def test_an_older_artifact_without_a_newer_nullable_column_reads_as_null(tmp_path):
    """Run directories written before a nullable column joined the schema stay readable (sql, report,
    calibrate-threshold, --resume): the column reads as null; a missing required column is still refused."""
    path = tmp_path / "old-metrics.parquet"
    raw_write(pa.table({k: v for k, v in valid("metrics").items() if k != "eval_accuracy_sparse"}), path,
              "metrics")
    table = read_artifact(path, "metrics")
    assert table.column("eval_accuracy_sparse").null_count == table.num_rows


def test_older_rollouts_read_without_kv_columns_and_kv_lens_must_match_the_tokens(tmp_path):
    """The rollouts' kv_policy and kv_lens (issue 28) are nullable: an artifact written before them reads
    with nulls; where kv_lens is given it has one entry per token."""
    path = tmp_path / "old-rollouts.parquet"
    raw_write(pa.table({k: v for k, v in valid("rollouts").items() if not k.startswith("kv_")}), path,
              "rollouts")
    table = read_artifact(path, "rollouts")
    assert table.column("kv_lens").null_count == table.column("kv_policy").null_count == table.num_rows
    bad = tmp_path / "bad.parquet"
    raw_write(pa.table(valid("rollouts", kv_lens=[[2, 3], None])), bad, "rollouts")
    with pytest.raises(ArtifactError) as e:
        read_artifact(bad)
    message = one_sentence(e, bad)
    assert message.endswith("has 1 row whose 'kv_lens' and 'token_ids' lengths differ (first: row 0)")


def test_rewards_status_and_tests(tmp_path):
    path = tmp_path / "r.parquet"
    raw_write(pa.table(valid("rewards", tests_passed=[6, 7])), path, "rewards")
    with pytest.raises(ArtifactError) as e:
        read_artifact(path)
    assert "more tests passed than tests in 1 row" in one_sentence(e, path)
    with pytest.raises(ArtifactError, match="column 'status' other than 'passed' or "):
        write_artifact(valid("rewards", status=["passed", "ok"]), tmp_path / "w.parquet", "rewards")
    older = {k: VALID["rewards"][k] for k in ("prompt_id", "sample", "task", "reward")}
    raw_write(pa.table(older), path, "rewards")  # written before the status columns
    assert read_artifact(path)["status"].to_pylist() == [None, None]
