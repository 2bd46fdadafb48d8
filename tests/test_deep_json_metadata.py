"""JSON that a file supplies and that nests deeper than Python's parser recurses (a `sparrow.meta` footer,
a threshold's calibrated runs) is bad input like any other that is not the JSON expected: `sql` skips the
file with its warning and queries the rest, `report` says it in one line; never a RecursionError."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import ArtifactError, artifact_metadata, write_artifact
from sparrow.schemas.footer import file_json

runner = CliRunner()

DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


def rollouts(path: Path, n: int = 3) -> Path:
    return write_artifact({"prompt_id": [f"p{i}" for i in range(n)], "sample": [0] * n,
                           "prompt_token_ids": [[1, 2]] * n, "token_ids": [[5, 6, 7]] * n, "text": ["x"] * n,
                           "logprobs": [[-0.5] * 3] * n, "budgets": [[0] * 3] * n,
                           "finish_reason": ["stop"] * n, "reward": [1.0] * n}, path, "rollouts")


def with_meta(path: Path, raw: bytes) -> Path:
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"sparrow.meta": raw}), path)
    return path


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("text", [DEEP, b"[" * 100_000 + b"]" * 100_000, DEEP.decode()])
def test_deep_json_is_a_value_error(text):
    with pytest.raises(ValueError, match="nests too deeply"):
        file_json(text)
    assert file_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}  # as json.loads reads it


def test_a_deep_sparrow_meta_is_metadata_that_is_not_a_json_object(tmp_path):
    bad = with_meta(rollouts(tmp_path / "r.parquet"), DEEP)
    with pytest.raises(ArtifactError) as raised:
        artifact_metadata(bad)
    assert str(raised.value) == f"{bad} has 'sparrow.meta' metadata that is not a JSON object"


def test_sql_skips_the_file_and_queries_the_rest(tmp_path):
    run = tmp_path / "run"
    rollouts(run / "good.parquet", 2)
    bad = with_meta(rollouts(run / "deep.parquet"), DEEP)
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "--run", str(run), "-f", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"n": 2}]
    assert lines(r.stderr) == [f"warning: {bad} has 'sparrow.meta' metadata that is not a JSON object; "
                               "skipped it"]


def test_report_says_it_in_one_line(tmp_path):
    run = tmp_path / "deep"
    bad = with_meta(rollouts(run / "prompts.parquet"), DEEP)
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    said = lines(r.stderr)
    assert len(said) == 1 and said[0].startswith("error: ") and "nothing to plot" in said[0]
    assert f"{bad} has 'sparrow.meta' metadata that is not a JSON object" in said[0]


def test_report_draws_the_rest_and_lists_a_threshold_whose_runs_are_not_json(tmp_path):
    run = tmp_path / "run"
    rollouts(run / "rollouts.parquet")
    bad_runs = {"deep.parquet": DEEP.decode(), "junk.parquet": "{not json", "odd.parquet": "[1]"}
    for name, runs in bad_runs.items():
        write_artifact({"threshold": [0.5], "lower": [0.4], "upper": [0.6], "quantile": [0.05],
                        "source": ["calibrated"], "n_runs": [1], "n_collapsed": [0], "note": [None]},
                       run / name, "threshold", {"runs": runs})
    r = runner.invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    not_drawn = [line.removeprefix("not drawn: ") for line in r.stderr.splitlines()
                 if line.startswith("not drawn: ")]
    assert not_drawn == [f"{run / name} has a 'runs' entry in its 'sparrow.meta' metadata that is not a JSON "
                         "list of calibrated runs (each with tail, mean, collapsed)"
                         for name in ("deep.parquet", "junk.parquet", "odd.parquet")]
    assert (run / "report" / "rollouts.png").exists()


def _chain_sum_prompts(tmp_path: Path, metadata: str | None = None) -> Path:
    from sparrow.stages.tasks import make_prompts

    class Words:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [1] * len(text.split())})()

    rows = make_prompts("chain_sum", 2, 0, Words())
    if metadata is not None:
        rows[1]["metadata"] = metadata
    return write_artifact(rows, tmp_path / "prompts.parquet", "prompts", {})


def test_reward_refuses_a_completions_line_too_deep_to_read_in_one_line(tmp_path):
    prompts = _chain_sum_prompts(tmp_path)
    completions = tmp_path / "completions.jsonl"
    completions.write_text(json.dumps({"prompt_id": "x", "text": "1"}) + "\n" + DEEP.decode() + "\n")
    out = tmp_path / "rewards.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                                 "-o", str(out)])
    assert result.exit_code != 0 and not out.exists()
    got = lines(result.stderr)
    assert len(got) == 1 and got[0].startswith("error:") and "line 2" in got[0], result.stderr


def test_reward_refuses_a_prompt_whose_metadata_nests_too_deep_before_scoring(tmp_path):
    prompts = _chain_sum_prompts(tmp_path, DEEP.decode())
    rows = pq.read_table(prompts).to_pylist()
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps({"prompt_id": r["prompt_id"], "text": "1"}) + "\n"
                                   for r in rows))
    out = tmp_path / "rewards.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                                 "-o", str(out)])
    assert result.exit_code != 0 and not out.exists()
    got = lines(result.stderr)
    assert len(got) == 1 and got[0].startswith("error:"), result.stderr
    assert repr(rows[1]["prompt_id"]) in got[0]
