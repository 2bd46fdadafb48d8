"""`--prompt-column` (verl's data.prompt_key): a Hugging Face dataset whose prompt is in another column
than `prompt` (gsm8k's `question`, MATH's `problem`) read as it is. The independent expectations are the
file's own values as pandas reads them, the model's chat template applied by transformers, and what a TRL
reward function is handed, recorded by the function itself.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import transformers
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.core.prompt_set import PromptSet
from sparrow.stages.core.user_data import DataOptions

from cli_checks import error_line

runner = CliRunner()
QUESTIONS = ["What is 2 + 3?", "What is 4 times 6?"]
# returns 1 where the function was handed the other columns and not the prompt's, and the question as prompt
TRL = """def seen(prompts, completions, **columns):
    return [float("question" not in columns and columns["level"][i] == "easy"
                  and prompts[i].startswith("What")) for i in range(len(completions))]
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dist_helper import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-prompt-column"))[0]


@pytest.fixture
def gsm(tmp_path):
    path = tmp_path / "gsm.parquet"
    pd.DataFrame({"question": QUESTIONS, "answer": ["5", "24"], "level": ["easy", "easy"]}).to_parquet(path)
    return path


def test_the_named_column_is_the_prompt_and_the_others_stay_columns(gsm):
    rows = PromptSet.read(gsm, DataOptions(prompt_column="question")).rows
    table = pd.read_parquet(gsm)
    assert [r["prompt"] for r in rows] == list(table["question"])
    assert [r["answer"] for r in rows] == list(table["answer"])
    assert [r["prompt_id"] for r in rows] == ["gsm-0", "gsm-1"]
    meta = json.loads(rows[0]["metadata"])
    assert meta["prompt_column"] == "question" and meta["prompt"] == QUESTIONS[0]
    assert set(meta["columns"]) == {"answer", "level"}


def test_rollout_samples_the_question_through_the_chat_template(tiny, gsm, tmp_path):
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(gsm), "--prompt-column", "question",
                            "--reward", "math", "--max-new-tokens", "4", "-o", str(out)])
    assert r.exit_code == 0, r.output
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    want = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
            for q in QUESTIONS]
    assert read_artifact(out, "rollouts").column("prompt_token_ids").to_pylist() == want


def test_a_trl_function_gets_the_other_columns_and_the_question_as_the_prompt(gsm, tmp_path):
    done = tmp_path / "done.jsonl"
    done.write_text("".join(json.dumps({"prompt_id": f"gsm-{i}", "sample": 0, "text": "5"}) + "\n"
                            for i in range(2)))
    (tmp_path / "fn.py").write_text(TRL)
    out = tmp_path / "rewards.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(gsm), "--prompt-column", "question", "--completions",
                            str(done), "--reward-fn", f"{tmp_path / 'fn.py'}:seen", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert read_artifact(out, "rewards").column("reward").to_pylist() == [1.0, 1.0]


def test_a_column_it_lacks_or_a_file_of_ours_is_refused_in_one_sentence(tiny, gsm, tmp_path):
    line = error_line(runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(gsm),
                                          "--prompt-column", "query", "-o", str(tmp_path / "r.parquet")]))
    assert line == (f"error: {gsm} has no column 'query' (--prompt-column); its columns: question, answer, "
                    "level")
    prompts = f"{tiny}/prompts.parquet"  # a Sparrow prompts file (the tiny fixture's): its prompt is its own
    line = error_line(runner.invoke(app, ["rollout", "--model", tiny, "--prompts", prompts,
                                          "--prompt-column", "prompt", "-o", str(tmp_path / "r.parquet")]))
    assert line == (f"error: {prompts} is a Sparrow prompts file, whose prompt is its column 'prompt'; "
                    "--prompt-column names the prompt of a verl or TRL dataset")
    assert not (tmp_path / "r.parquet").exists()
    line = error_line(runner.invoke(app, ["rollout", "--model", tiny, "--prompts", str(gsm),
                                          "-o", str(tmp_path / "r.parquet")]))
    assert line.endswith("; if its column 'question' is the prompt, pass --prompt-column question")
