"""`--max-prompts N` (vLLM bench's `--num-prompts`) on `rollout` and `profile`: the first N rows of a prompts
file or a user's dataset, each with the prompt id, row and seeds it has in the whole file. The independent
expectation is the run over the whole file (the first rows of its artifact) and the file's rows as pandas
reads them; the model is a tiny random Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import SCHEMAS, artifact_metadata, read_artifact
from sparrow.stages.core.prompt_set import PromptSet

from cli_checks import error_line

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dist_helper import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-max-prompts"))


def _verl(path, n=4):
    pd.DataFrame([{"data_source": "openai/gsm8k",
                   "prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                   "extra_info": {"index": i}} for i in range(n)]).to_parquet(path)
    return path


def _rollout(tiny, prompts, out, *extra):
    """Batches of one prompt's 2 samples: a step holds the same rows whatever follows them in the file (rows
    that share a step may round logprobs otherwise in their last bits)."""
    return runner.invoke(app, ["rollout", "--model", tiny[0], "--prompts", str(prompts), "--samples", "2",
                               "--max-new-tokens", "6", "--max-num-seqs", "2", "--threads", "1",
                               "-o", str(out), *extra])


def _plain(table: pa.Table) -> pa.Table:
    return SCHEMAS["rollouts"].conform(table, "rollouts", fill_missing=True).replace_schema_metadata(None)


def test_the_first_rows_keep_the_ids_rows_and_answers_of_the_whole_file(tmp_path):
    path = _verl(tmp_path / "gsm8k.parquet", n=5)
    whole = pd.read_parquet(path)
    rows = PromptSet.read(path, max_prompts=3).rows
    assert [r["prompt_id"] for r in rows] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert [r["answer"] for r in rows] == [m["ground_truth"] for m in whole["reward_model"][:3]]
    assert len(PromptSet.read(path, max_prompts=50).rows) == len(whole)  # more than it has: every row


def test_rollout_samples_the_first_prompts_as_a_run_over_the_whole_file_does(tiny, tmp_path):
    whole, first = tmp_path / "whole.parquet", tmp_path / "first.parquet"
    assert _rollout(tiny, tiny[1], whole).exit_code == 0
    r = _rollout(tiny, tiny[1], first, "--max-prompts", "2")
    assert r.exit_code == 0, r.output
    expected = _plain(read_artifact(whole, "rollouts")).slice(0, 2 * 2)  # 2 prompts x 2 samples
    assert _plain(read_artifact(first, "rollouts")).equals(expected)
    assert artifact_metadata(first)["max_prompts"] == 2 and "max_prompts" not in artifact_metadata(whole)


def test_a_dataset_rollout_of_its_first_prompts_is_scored_against_the_whole_dataset(tiny, tmp_path):
    """`sparrow reward --prompts` takes the whole file: the first prompts' ids are the file's."""
    data, out = _verl(tmp_path / "gsm8k.parquet"), tmp_path / "r.parquet"
    r = _rollout(tiny, data, out, "--num-prompts", "2", "--reward", "math")
    assert r.exit_code == 0, r.output
    ids = read_artifact(out, "rollouts").column("prompt_id").to_pylist()
    assert sorted(set(ids)) == ["gsm8k-0", "gsm8k-1"]
    r = runner.invoke(app, ["reward", "--prompts", str(data), "--completions", str(out), "--reward", "math",
                            "-o", str(tmp_path / "rewards.parquet")])
    assert r.exit_code == 0, r.output
    assert read_artifact(tmp_path / "rewards.parquet", "rewards").num_rows == 4


def test_profile_samples_the_first_prompts_only(tiny, tmp_path):
    out = tmp_path / "m.parquet"
    r = runner.invoke(app, ["profile", "--model", tiny[0], "--prompts", tiny[1], "--max-prompts", "1",
                            "--samples", "1", "--max-new-tokens", "4", "--budgets", "48", "--threads", "1",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    table = read_artifact(out, "mismatch")
    assert set(table.column("prompt_id").to_pylist()) == {"vowels-0"}
    assert artifact_metadata(out)["max_prompts"] == 1


@pytest.mark.parametrize("args,said", [
    (["rollout", "--max-prompts", "0"], "error: --max-prompts must be at least 1, got 0"),
    (["profile", "--max-prompts", "-3"], "error: --max-prompts must be at least 1, got -3"),
])
def test_fewer_than_one_prompt_is_refused_before_any_work(tiny, tmp_path, args, said):
    out = tmp_path / "out.parquet"
    r = runner.invoke(app, [*args, "--model", tiny[0], "--prompts", tiny[1], "-o", str(out)])
    assert r.exit_code == 2 and error_line(r) == said, r.output
    assert not out.exists()


def test_profile_of_given_rollouts_refuses_max_prompts(tiny, tmp_path):
    rollouts = tmp_path / "r.parquet"
    assert _rollout(tiny, tiny[1], rollouts, "--max-prompts", "1").exit_code == 0
    r = runner.invoke(app, ["profile", "--model", tiny[0], "--rollouts", str(rollouts), "--max-prompts", "1",
                            "-o", str(tmp_path / "m.parquet")])
    assert r.exit_code == 2
    assert error_line(r).startswith("error: --max-prompts applies only when sampling from --prompts")
