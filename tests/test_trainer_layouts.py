"""`sparrow prompts --layout verl|trl`: Sparrow's tasks as a verl or TRL dataset, scored by
stages/integrations/verl.py (verl's custom reward function) or trl_tasks.task_reward (a TRL reward
function). The independent expectations are transformers' chat template over the dataset's messages
(what verl's RLHFDataset and TRL apply), the reward file loaded the way verl loads a custom reward
function (by its path, as a module of its own), the columns passed as TRL passes them, completions written
here with each prompt's known answer, and the samples of the same prompts read from a Sparrow prompts
artifact.
"""

from __future__ import annotations

import importlib.util

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.integrations import trl_tasks, verl
from sparrow.stages.model.loading import embedded_checkpoint

from cli_checks import error_line

runner = CliRunner()
ARGS = ["prompts", "--task", "kv_lookup", "--n", "3", "--context-tokens", "600"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the verl dataset, the Sparrow prompts artifact, the TRL dataset) of the same task, seed and model."""
    folder = tmp_path_factory.mktemp("layouts")
    for layout in ("verl", "sparrow", "trl"):
        r = runner.invoke(app, [*ARGS, "--layout", layout, "-o", str(folder / f"{layout}.parquet")])
        assert r.exit_code == 0, r.output
    return folder / "verl.parquet", folder / "sparrow.parquet", folder / "trl.parquet"


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


def test_trl_scores_completions_by_each_rows_task(files):
    rows = pq.read_table(files[2]).to_pylist()
    ours = read_artifact(files[1], "prompts").to_pylist()
    assert [r["prompt_id"] for r in rows] == [r["prompt_id"] for r in ours]
    tok = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint())
    for row, mine in zip(rows, ours):  # TRL renders a conversational prompt with the model's template
        assert [m["role"] for m in row["prompt"]] == ["user"]
        rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert rendered == mine["prompt"] and row["answer"] == mine["answer"]
    columns = {k: [r[k] for r in rows] for k in ("task", "answer", "metadata", "prompt_id")}
    right = [[{"role": "assistant", "content": f"Answer: {r['answer']}"}] for r in rows]  # conversational
    prompts = [r["prompt"] for r in rows]
    assert trl_tasks.task_reward(completions=right, prompts=prompts, **columns) == [1.0] * 3
    wrong = ["Answer: 000000"] * 3  # as text
    assert trl_tasks.task_reward(completions=wrong, **columns) == [0.0] * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: it samples the default model's prompts as they are."""
    from dist_helper import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-layouts"))[0]


@pytest.mark.parametrize("layout,reward_fn", [
    ("verl", verl.__file__), ("trl", f"{trl_tasks.__file__}:task_reward"),
])
def test_sparrow_samples_a_trainers_file_as_it_samples_the_artifact(tiny, tmp_path, layout, reward_fn):
    short = ["prompts", "--task", "basic_arithmetic", "--n", "3"]  # prompts that fit the tiny context
    for name in (layout, "sparrow"):
        r = runner.invoke(app, [*short, "--layout", name, "-o", str(tmp_path / f"{name}.parquet")])
        assert r.exit_code == 0, r.output
    outs = {}
    for name, extra in ((layout, ["--reward-fn", reward_fn]), ("sparrow", [])):
        given = tmp_path / f"{name}.parquet"
        outs[name] = tmp_path / f"{name}-rollouts.parquet"
        r = runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(given), *extra, "--samples", "2",
                                "--max-new-tokens", "8", "-o", str(outs[name])])
        assert r.exit_code == 0, r.output
    a, b = (read_artifact(outs[k], "rollouts") for k in (layout, "sparrow"))
    for column in ("prompt_token_ids", "token_ids", "reward"):
        assert a.column(column).to_pylist() == b.column(column).to_pylist(), column


def test_another_layout_is_refused_in_one_sentence(tmp_path):
    line = error_line(runner.invoke(app, [*ARGS, "--layout", "slime", "-o", str(tmp_path / "p.parquet")]))
    assert line == "error: --layout must be one of sparrow, verl, trl, got 'slime'"
    assert not (tmp_path / "p.parquet").exists()


def test_a_dataset_it_wrote_is_replaced_and_nothing_else_is_without_force(tmp_path):
    out = tmp_path / "d.parquet"
    for layout in ("verl", "trl"):  # each replaces the other: both are datasets this command writes
        assert runner.invoke(app, [*ARGS, "--layout", layout, "-o", str(out)]).exit_code == 0
    assert pq.read_table(out).column_names == ["prompt", "task", "answer", "metadata", "prompt_id"]
    line = error_line(runner.invoke(app, [*ARGS, "-o", str(out)]))  # a prompts artifact over it
    assert line.startswith(f"error: -o {out} exists and is a verl or TRL dataset written by sparrow prompts, "
                           "not a 'prompts' artifact; pass --force")
    mine = tmp_path / "mine.parquet"  # a user's own Parquet file
    pq.write_table(pa.table({"x": [1]}), mine)
    line = error_line(runner.invoke(app, [*ARGS, "--layout", "verl", "-o", str(mine)]))
    assert "exists and is a Parquet file without Sparrow metadata, not a verl or TRL dataset" in line
    assert pq.read_table(mine).column_names == ["x"]
