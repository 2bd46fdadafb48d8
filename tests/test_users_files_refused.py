"""Users' files and settings that cannot be scored as given are one sentence before any work, naming the
file, the row or line and the column: completions (JSON lines and Parquet), a code prompt's hidden tests, a
verl reward_model, a column named twice, $SPARROW_REWARD_WORKERS; and what JSON lines hold reaches a
user's reward (TRL's completion_ids), as Parquet's does."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.sql.views import identifier

from cli_checks import error_line, passed_the_checks

runner = CliRunner()


def trl_text(path: Path) -> Path:
    pq.write_table(pa.table({"prompt": ["What is 2+3?", "What is 10-4?"], "solution": ["5", "6"]}), path)
    return path


def jsonl(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reward(tmp_path: Path, prompts: Path, completions: Path, *flags: str):
    return runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions), *flags,
                               "-o", str(tmp_path / "rewards.parquet")])


def test_a_sample_number_beyond_64_bits_names_its_line(tmp_path):
    lines = jsonl(tmp_path / "c.jsonl", {"prompt_id": "p-0", "text": "5", "sample": 2**63})
    result = reward(tmp_path, trl_text(tmp_path / "p.parquet"), lines, "--reward", "math")
    assert error_line(result) == (f"error: --completions {lines} line 1: 'sample' is {2**63}, expected a "
                                  "sample index from 0")


def test_a_null_sample_in_a_sample_column_is_refused_by_row(tmp_path):
    prompts = trl_text(tmp_path / "p.parquet")
    for samples in ([None, 0], [None, None]):
        completions = tmp_path / "c.parquet"
        pq.write_table(pa.table({"prompt_id": ["p-0", "p-0"], "text": ["5", "2"],
                                 "sample": pa.array(samples, pa.int32())}), completions)
        assert error_line(reward(tmp_path, prompts, completions, "--reward", "math")) == (
            f"error: --completions {completions}: row 0 (counting from 0), prompt 'p-0', has no sample in "
            "column 'sample' (give every row one, or drop the column to number each prompt's rows in order)")
    assert not (tmp_path / "rewards.parquet").exists()


def test_json_lines_completion_ids_reach_a_trl_reward_function(tmp_path):
    fn = tmp_path / "lengths.py"
    fn.write_text("def reward(prompts, completions, completion_ids, **kw):\n"
                  "    return [float(len(ids)) for ids in completion_ids]\n")
    lines = jsonl(tmp_path / "c.jsonl", {"prompt_id": "p-0", "text": "5", "completion_ids": [1, 2, 3]},
                  {"prompt_id": "p-1", "text": "6", "completion_ids": [4, 5]})
    result = reward(tmp_path, trl_text(tmp_path / "p.parquet"), lines, "--reward-fn", f"{fn}:reward")
    assert result.exit_code == 0, result.output
    assert read_artifact(tmp_path / "rewards.parquet").column("reward").to_pylist() == [3.0, 2.0]
    bad = jsonl(tmp_path / "bad.jsonl", {"prompt_id": "p-0", "text": "5", "completion_ids": [1, "x"]})
    assert error_line(reward(tmp_path, tmp_path / "p.parquet", bad, "--reward-fn", f"{fn}:reward")) == (
        f"error: --completions {bad} line 1: 'completion_ids' holds \"x\", expected token ids (integers "
        "from 0)")


def test_reward_refuses_two_rewards_as_rollout_does(tmp_path):
    result = runner.invoke(app, ["reward", "--prompts", "p.parquet", "--completions", "c.jsonl", "--reward",
                                 "code", "--reward", "math", "-o", "r.parquet"])
    assert error_line(result).startswith("error: --reward is given twice (--reward code, then --reward "
                                         "math), but it takes one value")


@pytest.fixture(scope="module")
def code_prompts() -> list[dict]:
    from sparrow.stages.model.loading import spec_tokenizer
    from sparrow.stages.tasks import make_prompts

    return make_prompts("code", 1, 0, spec_tokenizer("smollm2-135m"))


@pytest.mark.parametrize("change, said", [
    (lambda m: m.update(cases=[1, 2, 3]), "its metadata's cases are not a list of argument lists (one list "
                                          "of arguments per hidden test)"),
    (lambda m: m.update(cases=[], expected=[]), "its metadata's cases are an empty list, so no completion "
                                                "could pass a test"),
    (lambda m: m["expected"].pop(), "its metadata has {n} cases and {m} expected values: one expected value "
                                    "per case"),
    (lambda m: m.update(function="not a name"), "its metadata's function 'not a name' is not a Python name"),
])
def test_a_code_prompt_whose_hidden_tests_are_not_tests_is_refused(tmp_path, code_prompts, change, said):
    row = dict(code_prompts[0])
    meta = json.loads(row["metadata"])
    change(meta)
    row["metadata"] = json.dumps(meta)
    prompts = write_artifact([row], tmp_path / "p.parquet", "prompts")
    lines = jsonl(tmp_path / "c.jsonl", {"prompt_id": row["prompt_id"], "text": "def f(): pass"})
    n = len(meta["cases"]) if isinstance(meta["cases"], list) else 0
    expected = said.format(n=n, m=n - 1)
    assert error_line(reward(tmp_path, prompts, lines)) == (
        f"error: {prompts}: prompt {row['prompt_id']!r} of task code cannot be scored: {expected}")


def test_a_bad_reward_workers_setting_is_refused_before_any_work(tmp_path, monkeypatch, no_work):
    monkeypatch.setenv("SPARROW_REWARD_WORKERS", "abc")
    said = ("error: $SPARROW_REWARD_WORKERS must be a whole number of at least 1 (the programs run at once "
            "for code rewards), got 'abc'")
    prompts = trl_text(tmp_path / "p.parquet")
    lines = jsonl(tmp_path / "c.jsonl", {"prompt_id": "p-0", "text": "5"})
    assert error_line(reward(tmp_path, prompts, lines, "--reward", "math")) == said
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["rollout", "--prompts", str(prompts), "--reward", "math", "-o", str(out)])
    assert error_line(result) == said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "p.parquet"]
    monkeypatch.setenv("SPARROW_REWARD_WORKERS", "0")
    assert "got '0'" in error_line(runner.invoke(app, ["rollout", "--prompts", str(prompts), "--reward",
                                                       "math", "-o", str(out)]))
    monkeypatch.setenv("SPARROW_REWARD_WORKERS", "3")
    assert passed_the_checks(runner.invoke(app, ["rollout", "--prompts", str(prompts), "--reward", "math",
                                                 "-o", str(out)]))


@pytest.mark.parametrize("reward_model, said", [
    ('{"ground_truth": "5"}', "its reward_model is text; verl's is a struct with a field ground_truth, as "
                              "{'style': 'rule', 'ground_truth': '42'}"),
    ({"style": "rule"}, "its reward_model's fields are style; none is ground_truth"),
    ({"style": "rule", "ground_truth": None}, "a verl dataset's ground truth is reward_model.ground_truth, "
                                              "which is null in this row"),
])
def test_a_verl_row_without_ground_truth_says_what_its_reward_model_holds(tmp_path, reward_model, said):
    data = tmp_path / "verl.parquet"
    messages = [[{"role": "user", "content": "2+3?"}]] * 2
    pq.write_table(pa.table({"data_source": ["x", "x"], "prompt": messages,
                             "reward_model": [reward_model] * 2}), data)
    result = runner.invoke(app, ["rollout", "--prompts", str(data), "--reward", "math", "-o",
                                 str(tmp_path / "r.parquet")])
    assert error_line(result) == (f"error: {data}: prompt 'verl-0', row 0 (counting from 0), has no answer, "
                                  f"which --reward scores against ({said})")


def test_a_column_named_twice_is_said_so_not_called_corrupt(tmp_path):
    data = tmp_path / "twice.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array(["5"])],
                                        names=["prompt", "prompt", "answer"]), data)
    result = runner.invoke(app, ["rollout", "--prompts", str(data), "--reward", "math", "-o",
                                 str(tmp_path / "r.parquet")])
    assert error_line(result) == (f"error: {data} has more than one column named 'prompt'; give each column "
                                  "its own name")


@pytest.mark.parametrize("typed, ours, theirs", [
    ("--prompt-key", "--prompt-column", "verl's data.prompt_key"),
    ("--rollout-n", "--samples", "verl's rollout.n"),
])
def test_verl_names_point_to_ours(typed, ours, theirs):
    result = runner.invoke(app, ["rollout", "--prompts", "p.parquet", typed, "3", "-o", "r.parquet"])
    assert error_line(result) == (f"error: no such option: {typed}. Sparrow's name for {theirs} is {ours} "
                                  "(try 'sparrow rollout -h')")


def test_view_names_keep_accented_letters_as_their_ascii_letter_and_other_scripts_as_they_are():
    names = ("ü", "ö", "naïve-set", "日本", "がく", "한국어 v2", "ＡＢ", "x\u202ey")
    assert [identifier(s) for s in names] == ["u", "o", "naive_set", "日本", "がく", "한국어_v2", "AB", "x_y"]
    assert identifier("Việt") == "Viet"  # a letter with two accents loses both


def test_a_file_named_in_chinese_is_queried_by_its_name_unquoted(tmp_path):
    """A prompt set 数据.parquet is the view prompts__数据 (beside `prompts`, every prompt set), which
    DuckDB reads unquoted, as the user typed the file's name."""
    rows = [{"prompt_id": f"p{i}", "task": "count", "prompt": "x", "prompt_token_ids": None, "answer": "1",
             "metadata": None} for i in range(3)]
    write_artifact(rows, tmp_path / "数据.parquet", "prompts")
    r = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM prompts__数据", "--run", str(tmp_path),
                            "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == ["n", "3"]


def test_resume_of_a_folder_without_a_checkpoint_says_to_drop_resume(tmp_path, no_work):
    """A run stopped while its model loaded leaves its folder without a checkpoint."""
    rows = [{"prompt_id": f"p{i}", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 25)), "answer": "3", "metadata": None} for i in range(4)]
    prompts = write_artifact(rows, tmp_path / "p.parquet", "prompts")
    run = tmp_path / "run"
    run.mkdir()
    result = runner.invoke(app, ["train", "--model", "tiny-llama", "--prompts", str(prompts), "--resume",
                                 "--prompts-per-step", "2", "-o", str(run)])
    assert error_line(result) == (f"error: --resume: {run} holds no run to resume (none was checkpointed); "
                                  "drop --resume to start the run there")


@pytest.mark.parametrize("command", ["train", "distill"])
def test_a_bad_eval_prompts_file_names_the_flag(tmp_path, no_work, command):
    prompts, junk = trl_text(tmp_path / "p.parquet"), tmp_path / "junk.parquet"
    junk.write_text("junk")
    flags = (["--reward", "math", "--prompts-per-step", "2"] if command == "train" else ["--budget", "64"])
    result = runner.invoke(app, [command, "--prompts", str(prompts), "--eval-prompts", str(junk), *flags,
                                 "-o", str(tmp_path / "out")])
    assert error_line(result).startswith(f"error: --eval-prompts {junk} is not a Parquet file")
    assert not (tmp_path / "out").exists()



def test_a_schedule_budget_beyond_the_models_context_is_refused_as_a_budget_is(tmp_path, no_work):
    rows = [{"prompt_id": "p0", "task": "basic_arithmetic", "prompt": None,
             "prompt_token_ids": list(range(5, 25)), "answer": "3", "metadata": None}]
    prompts = write_artifact(rows, tmp_path / "p.parquet", "prompts")
    schedule = write_artifact({"bin": [0], "bin_start": [0], "bin_end": [None], "budget": [99984],
                               "tail": [None], "predicted_step_seconds": [None]}, tmp_path / "s.parquet",
                              "schedule", {"page_size": 16})
    result = runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(prompts), "--schedule",
                                 str(schedule), "-o", str(tmp_path / "r.parquet")])
    assert error_line(result) == (f"error: --schedule {schedule}: its budget 99984 exceeds the context of "
                                  "tiny-llama (2048 tokens); a budget that covers the whole context is dense "
                                  "attention")


def test_a_threshold_listed_twice_in_sweep_is_refused_as_fit_costs_grid_is():
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--sweep", "0.3,0.3,0.5"])
    assert error_line(result) == "error: --sweep lists 0.3 more than once; give each threshold once"


def test_plan_schedules_range_errors_name_their_flag():
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--threshold", "1.5"])
    assert error_line(result) == "error: --threshold: the threshold must be in (0, 1), got 1.5"
    result = runner.invoke(app, ["plan-schedule", "--model", "qwen3-4b", "--quantile", "0"])
    assert error_line(result) == "error: --quantile: the tail quantile must be in (0, 1), got 0"


def test_a_reward_functions_unwritable_fields_name_the_function_as_given(tmp_path):
    folder = tmp_path / "fn"
    folder.mkdir()
    (folder / "selfref.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                       "extra_info=None):\n    d = {'score': 1.0}\n    d['me'] = d\n"
                                       "    return d\n")
    lines = jsonl(tmp_path / "c.jsonl", {"prompt_id": "p-0", "text": "5"})
    spec = f"{folder}/selfref.py:compute_score"
    line = error_line(reward(tmp_path, trl_text(tmp_path / "p.parquet"), lines, "--reward-fn", spec))
    assert line.startswith(f"error: --reward-fn {spec} returned fields beside 'score' that cannot be JSON "
                           "(it holds itself: a circular reference) on row 0 (counting from 0) of p.parquet")



@pytest.mark.parametrize(("command", "timing"), [
    ("rollout", ""), ("profile", ", or --random-weights to time its shapes")])
def test_a_shapes_only_preset_is_refused_before_its_prompts_are_tokenized(tmp_path, no_work, command, timing):
    """qwen3-0.6b has shapes and a tokenizer, no weights: refused first, not after the prompts' text is
    tokenized for it and the model begins to load."""
    rows = [{"prompt_id": "p0", "task": "count", "prompt": "Count to three.", "prompt_token_ids": None,
             "answer": "3", "metadata": None}]
    prompts = write_artifact(rows, tmp_path / "p.parquet", "prompts")
    r = runner.invoke(app, [command, "--model", "qwen3-0.6b", "--prompts", str(prompts), "--max-new-tokens",
                            "4", "-o", str(tmp_path / "out.parquet")])
    assert error_line(r) == ("error: preset 'qwen3-0.6b' describes shapes only and has no weights; pass a "
                             f"checkpoint directory or a .gguf file to --model{timing}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.parquet"]


def test_a_verl_dataset_rolled_out_without_a_reward_says_its_rewards_are_null(tmp_path, no_work):
    """A verl dataset's rows name no Sparrow task to score them, so without --reward or --reward-fn its
    rewards are null (datasets.md): a note says so, and how to score them."""
    prompts = tmp_path / "v.parquet"
    assert runner.invoke(app, ["prompts", "--task", "gsm_symbolic", "--n", "2", "--layout", "verl",
                               "-o", str(prompts)]).exit_code == 0
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts), "--max-new-tokens", "4",
                            "-o", str(tmp_path / "r.parquet")])
    assert passed_the_checks(r), r.output
    assert (f"note: {prompts} is a verl dataset, whose rows name no Sparrow task to score them, so the "
            "samples' rewards are null; give --reward math or code, or --reward-fn, to score them"
            ) in " ".join(r.stderr.split())
    r = runner.invoke(app, ["rollout", "--prompts", str(prompts), "--max-new-tokens", "4", "--reward", "math",
                            "-o", str(tmp_path / "r.parquet")])
    assert passed_the_checks(r) and "rewards are null" not in r.stderr
