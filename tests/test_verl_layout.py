"""`sparrow prompts --layout verl`: Sparrow's tasks as a verl dataset, scored in verl by
stages/integrations/verl.py. The independent expectations are transformers' chat template over the
dataset's messages (what verl's RLHFDataset applies), the reward file loaded the way verl loads a custom
reward function (by its path, as a module of its own), completions written here with each prompt's known
answer, and the samples of the same prompts read from a Sparrow prompts artifact.
"""

from __future__ import annotations

import importlib.util

import pyarrow.parquet as pq
import pytest
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.integrations import verl
from sparrow.stages.model.loading import embedded_checkpoint

from cli_checks import error_line

runner = CliRunner()
ARGS = ["prompts", "--task", "kv_lookup", "--n", "3", "--context-tokens", "600"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the verl dataset, the Sparrow prompts artifact) of the same task, seed and model."""
    folder = tmp_path_factory.mktemp("verl-layout")
    for layout in ("verl", "sparrow"):
        r = runner.invoke(app, [*ARGS, "--layout", layout, "-o", str(folder / f"{layout}.parquet")])
        assert r.exit_code == 0, r.output
    return folder / "verl.parquet", folder / "sparrow.parquet"


def _verl_loaded():
    """compute_score as verl's get_custom_reward_fn loads it: the file by its path, under another name."""
    spec = importlib.util.spec_from_file_location("custom_module", verl.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def test_the_rows_are_verls_and_render_the_artifacts_prompts(files):
    rows = pq.read_table(files[0]).to_pylist()
    ours = read_artifact(files[1], "prompts").to_pylist()
    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())  # the default model's
    assert [r["data_source"] for r in rows] == ["sparrow/kv_lookup"] * 3
    for i, (row, mine) in enumerate(zip(rows, ours)):
        assert [m["role"] for m in row["prompt"]] == ["user"]
        rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert rendered == mine["prompt"]
        assert row["reward_model"] == {"style": "rule", "ground_truth": mine["answer"]}
        assert row["extra_info"]["index"] == i and row["extra_info"]["prompt_id"] == mine["prompt_id"]
        assert row["ability"] == "long-context"


def test_verl_scores_a_response_by_the_tasks_answer(files):
    compute_score = _verl_loaded()
    for row in pq.read_table(files[0]).to_pylist():
        gt, extra = row["reward_model"]["ground_truth"], row["extra_info"]
        assert compute_score(row["data_source"], f"Found it.\nAnswer: {gt}", gt, extra) == 1.0
        assert compute_score(row["data_source"], "Answer: 000000", gt, extra) == 0.0
    with pytest.raises(ValueError, match="data_source 'openai/gsm8k' is not a Sparrow task's"):
        compute_score("openai/gsm8k", "Answer: 1", "1", {})


def test_sparrow_samples_the_verl_file_as_it_samples_the_artifact(files, tmp_path):
    outs = {}
    for name, extra in (("verl", ["--reward-fn", verl.__file__]), ("sparrow", [])):
        outs[name] = tmp_path / f"{name}-rollouts.parquet"
        r = runner.invoke(app, ["rollout", "--prompts", str(files[0] if name == "verl" else files[1]),
                                *extra, "--samples", "2", "--max-new-tokens", "8", "-o", str(outs[name])])
        assert r.exit_code == 0, r.output
    a, b = (read_artifact(outs[k], "rollouts") for k in ("verl", "sparrow"))
    for column in ("prompt_token_ids", "token_ids", "reward"):
        assert a.column(column).to_pylist() == b.column(column).to_pylist(), column


def test_another_layout_is_refused_in_one_sentence(tmp_path):
    line = error_line(runner.invoke(app, [*ARGS, "--layout", "trl", "-o", str(tmp_path / "p.parquet")]))
    assert line == "error: --layout must be sparrow or verl, got 'trl'"
    assert not (tmp_path / "p.parquet").exists()
