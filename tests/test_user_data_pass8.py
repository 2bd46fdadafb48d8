"""A user's own datasets and reward functions, as a verl or TRL user brings them: ground truths math-verify
cannot score against, multi-task mixes with `prompt_id` and `task` columns, TRL's logging keywords, Hub
Parquet shards, typed columns, integer prompt ids and Parquet under a JSON lines name. Expectations are
computed here from the files written: math-verify called directly, the rows as pyarrow reads them, the
values a function was handed as it recorded them.
"""

from __future__ import annotations

import datetime
import decimal
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.core.prompt_set import PromptError, PromptSet
from sparrow.stages.core.user_data import DataOptions
from sparrow.stages.tasks import reward_function

from cli_checks import error_line

runner = CliRunner()

RECORDING = '''\
import pickle


def trl(prompts, completions, **kwargs):
    calls = pickle.load(open(OUT, "rb")) if OUT.exists() else []
    calls.append({k: v for k, v in kwargs.items() if isinstance(v, list)} | {"prompts": prompts})
    pickle.dump(calls, open(OUT, "wb"))
    return [0.0] * len(completions)


def verl(data_source, solution_str, ground_truth, extra_info=None):
    calls = pickle.load(open(OUT, "rb")) if OUT.exists() else []
    calls.append({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info})
    pickle.dump(calls, open(OUT, "wb"))
    return 0.0


def logs(prompts, completions, log_metric, log_extra, **kwargs):
    log_metric("my/len", sum(len(c) for c in completions) / len(completions))
    log_metric("my/len", 0.0)
    log_extra("first_word", [c.split()[0] for c in completions])
    return [1.0] * len(completions)


def short_extra(prompts, completions, **kwargs):
    kwargs["log_extra"]("col", [1])
    return [1.0] * len(completions)
'''


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _completions(path, pairs):
    """JSON lines of (prompt_id, text), one sample each."""
    return _jsonl(path, [{"prompt_id": pid, "sample": 0, "text": text} for pid, text in pairs])


def _reward(*args):
    return runner.invoke(app, ["reward", *map(str, args)])


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "fns.py"
    out = tmp_path / "calls.pkl"
    path.write_text(f"from pathlib import Path\nOUT = Path({str(out)!r})\n" + RECORDING)
    return path, out


def _calls(out):
    return pickle.loads(out.read_bytes())


# ---------------------------------------------------------------- the math reward's ground truth


@pytest.mark.parametrize("gold, why", [("", "is empty"), ("   ", "is empty"),
                                       ("N/A", "missing-value mark"), ("nan", "missing-value mark"),
                                       (float("nan"), "is NaN"), ("-", "no answer math-verify can read")])
def test_math_reward_refuses_a_ground_truth_it_cannot_score_against(tmp_path, gold, why):
    data = tmp_path / "golds.jsonl"
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+2?", "answer": gold}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # a NaN as Python's json writes it
    comps = _completions(tmp_path / "c.jsonl", [("golds-0", "2"), ("golds-1", "\\boxed{4}")])
    out = tmp_path / "rw.parquet"
    line = error_line(_reward("--prompts", data, "--completions", comps, "--reward", "math", "-o", out))
    for part in (str(data), "prompt 'golds-1'", "row 1 (counting from 0)", "column 'answer'", why):
        assert part in line, line
    assert not out.exists()


def test_math_reward_names_a_verl_ground_truth_column(tmp_path):
    data = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1?"}],
                                          "reward_model": {"style": "rule", "ground_truth": ""}}]), data)
    comps = _completions(tmp_path / "c.jsonl", [("v-0", "2")])
    line = error_line(_reward("--prompts", data, "--completions", comps, "--reward", "math", "-o",
                              tmp_path / "rw.parquet"))
    assert "column 'reward_model.ground_truth'" in line and "row 0 (counting from 0)" in line, line


def test_math_reward_reads_a_gsm8k_solution_as_its_final_number(tmp_path):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 1,048 in all.\n#### 1,048"
    data = _jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "prompt": "How many?", "answer": solution}])
    texts = ["The answer is 1048", "The answer is 48", "\\boxed{1,048}"]
    comps = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "gsm-0", "sample": i, "text": t}
                                          for i, t in enumerate(texts)])
    out = tmp_path / "rw.parquet"
    r = _reward("--prompts", data, "--completions", comps, "--reward", "math", "-o", out)
    assert r.exit_code == 0, r.output
    gold = parse("\\boxed{1048}", extraction_config=[LatexExtractionConfig()])  # verl's extracted answer
    want = [float(verify(gold, parse(t, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])))
            for t in texts]
    assert [x["reward"] for x in read_artifact(out, "rewards").to_pylist()] == want == [1.0, 0.0, 1.0]


# ---------------------------------------------------------------- a mix with prompt_id and task columns


def test_a_mix_with_prompt_id_and_task_of_its_own_is_a_dataset(tmp_path, fns):
    fn, calls = fns
    rows = [{"prompt_id": "q1", "task": "arith", "prompt": "What is 2+2?", "answer": "4", "difficulty": 1},
            {"prompt_id": "q2", "task": "arith", "prompt": "What is 3+3?", "answer": "6", "difficulty": 2}]
    data = _jsonl(tmp_path / "own.jsonl", rows)
    comps = _completions(tmp_path / "c.jsonl", [("q1", "4"), ("q2", "6")])
    r = _reward("--prompts", data, "--completions", comps, "--reward-fn", f"{fn}:trl", "-o",
                tmp_path / "rw.parquet")
    assert r.exit_code == 0, r.output
    (got,) = _calls(calls)
    assert got == {k: [row[k] for row in rows] for k in ("prompt_id", "task", "answer", "difficulty")} | {
        "prompts": [row["prompt"] for row in rows]}
    r = _reward("--prompts", data, "--completions", comps, "--reward", "math", "--answer-column",
                "difficulty", "-o", tmp_path / "rw2.parquet")
    assert r.exit_code == 0, r.output


def test_a_mix_with_chat_prompts_is_a_dataset_even_with_sparrow_task_names(tmp_path):
    rows = [{"prompt_id": "q1", "task": "basic_arithmetic", "answer": "4",
             "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]}]
    prompts = PromptSet.read(_jsonl(tmp_path / "msgs.jsonl", rows))
    assert prompts.rows[0]["messages"] == rows[0]["prompt"] and prompts.rows[0]["prompt_id"] == "q1"


def test_a_verl_file_with_prompt_token_ids_is_read_as_verl(tmp_path):
    data = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1?"}],
                                          "prompt_token_ids": [1, 2, 3], "data_source": "x",
                                          "reward_model": {"style": "rule", "ground_truth": "2"}}]), data)
    (row,) = PromptSet.read(data).rows
    assert row["task"] == "verl" and row["answer"] == "2"


def test_a_file_taken_for_ours_says_how_to_be_read_as_a_dataset(tmp_path, capsys):
    rows = [{"prompt_id": "a", "task": "basic_arithmetic", "prompt": "2+2?", "answer": "4", "difficulty": 3}]
    data = _jsonl(tmp_path / "ours.jsonl", rows)
    with pytest.raises(PromptError, match="rename its column 'task' to have it read as a TRL dataset"):
        PromptSet.read(data, DataOptions(answer_column="difficulty"))
    assert PromptSet.read(data).rows[0]["task"] == "basic_arithmetic"
    err = capsys.readouterr().err
    assert "its columns 'difficulty' do not reach the reward" in err and "rename its column 'task'" in err


# ---------------------------------------------------------------- TRL's log_metric and log_extra


def test_trl_log_metric_and_log_extra_are_kept_with_the_completions(tmp_path, fns):
    fn, _ = fns
    data = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["What is 7 + 8?", "What is 9 - 4?"], "solution": ["15", "5"]}), data)
    texts = ["fifteen it is", "The answer is 5.", "no", "five"]
    comps = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": f"t-{i // 2}", "sample": i % 2, "text": t}
                                          for i, t in enumerate(texts)])
    out = tmp_path / "rw.parquet"
    r = _reward("--prompts", data, "--completions", comps, "--reward-fn", f"{fn}:logs", "-o", out)
    assert r.exit_code == 0, r.output
    mean = (sum(map(len, texts)) / len(texts) + 0.0) / 2  # the two values logged under one name, averaged
    extras = [json.loads(x["reward_extra"]) for x in read_artifact(out, "rewards").to_pylist()]
    assert extras == [{"my/len": mean, "first_word": t.split()[0]} for t in texts]


def test_trl_log_extra_of_the_wrong_length_is_refused(tmp_path, fns):
    fn, _ = fns
    data = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "solution": "1"}])
    comps = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": "t-0", "sample": i, "text": "x"} for i in range(2)])
    line = error_line(_reward("--prompts", data, "--completions", comps, "--reward-fn", f"{fn}:short_extra",
                              "-o", tmp_path / "rw.parquet"))
    assert "logged 1 values for column 'col' with log_extra, for a batch of 2 completions" in line, line


def test_logged_metrics_are_averaged_for_a_command_to_read(tmp_path, fns):
    fn, _ = fns
    reward_function.logged_metrics()
    reward = reward_function.load_reward_function(f"{fn}:logs")
    meta = {"prompt": "p", "columns": {}, "row": 0, "file": "f"}
    reward.judge_many([("ab", None, meta), ("abcd", None, meta)])
    reward.judge_many([("abcdef", None, meta)])
    assert reward_function.logged_metrics() == {"my/len": (3.0 + 0.0 + 6.0 + 0.0) / 4}
    assert reward_function.logged_metrics() == {}


# ---------------------------------------------------------------- a folder of Hub Parquet shards


def test_a_folder_of_parquet_shards_is_one_dataset(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows[3:]), shards / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), shards / "train-00000-of-00002.parquet")
    read = PromptSet.read(shards, DataOptions(reward="math")).rows
    assert [(r["prompt_id"], r["prompt"], r["answer"]) for r in read] == [
        (f"data-{i}", row["prompt"], row["solution"]) for i, row in enumerate(rows)]


def test_shards_that_do_not_merge_are_named(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    for i, answer in enumerate(["1", "2", 3]):  # the last shard's column is an integer
        shard = shards / f"train-0000{i}-of-00003.parquet"
        pq.write_table(pa.table({"prompt": ["a"], "answer": [answer]}), shard)
    with pytest.raises(PromptError, match=r"train-00002-of-00003.parquet does not merge with the 2 before it "
                                          r"\(train-00000-of-00003.parquet, ...\) \(Unable to merge: Field "
                                          r"answer has incompatible types: string vs int64\)"):
        PromptSet.read(shards)


def test_a_folder_of_several_splits_is_refused_with_the_splits(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.table({"prompt": ["a"]}), shards / f"{split}-00000-of-00001.parquet")
    with pytest.raises(PromptError, match="shards of splits test, train; give a folder holding one split"):
        PromptSet.read(shards)
    with pytest.raises(PromptError, match=f"keeps them in {tmp_path / 'data'}, give that folder"):
        PromptSet.read(tmp_path)


# ---------------------------------------------------------------- typed columns


def test_typed_columns_reach_the_function_as_python_values(tmp_path, fns):
    fn, calls = fns
    when = datetime.datetime(2024, 1, 2, 3, 4, 5)
    zoned = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    columns = {"created": [when], "zoned": [zoned], "day": [datetime.date(2024, 5, 6)],
               "price": [decimal.Decimal("1.50")], "blob": [b"\x00\x01"],
               "took": [datetime.timedelta(seconds=90, microseconds=7)]}
    data = tmp_path / "types.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?"], "solution": ["4"], **columns}), data)
    comps = _completions(tmp_path / "c.jsonl", [("types-0", "4")])
    r = _reward("--prompts", data, "--completions", comps, "--reward-fn", f"{fn}:trl", "-o",
                tmp_path / "rw.parquet")
    assert r.exit_code == 0, r.output
    (got,) = _calls(calls)
    assert {k: got[k] for k in columns} == columns
    assert got["zoned"][0].utcoffset() == datetime.timedelta(hours=2)


def test_verl_extra_info_and_ground_truth_keep_their_types(tmp_path, fns):
    fn, calls = fns
    extra = {"when": datetime.date(2024, 5, 6), "raw": b"xy", "index": 3}
    data = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}], "data_source": "src",
                                          "reward_model": {"ground_truth": decimal.Decimal("2.5")},
                                          "extra_info": extra}]), data)
    comps = _completions(tmp_path / "c.jsonl", [("v-0", "2.5")])
    r = _reward("--prompts", data, "--completions", comps, "--reward-fn", f"{fn}:verl", "-o",
                tmp_path / "rw.parquet")
    assert r.exit_code == 0, r.output
    verl_keys = {"num_turns": 2, "rollout_reward_scores": {}}  # what verl's reward manager adds
    assert _calls(calls) == [{"data_source": "src", "ground_truth": decimal.Decimal("2.5"),
                              "extra_info": {**extra, **verl_keys}}]


# ---------------------------------------------------------------- integer ids, Parquet under a JSON name


def test_integer_prompt_ids_match_in_completions(tmp_path):
    data = _jsonl(tmp_path / "ids.jsonl", [{"prompt_id": 101, "prompt": "What is 2+2?", "answer": "4"}])
    jsonl = _jsonl(tmp_path / "c.jsonl", [{"prompt_id": 101, "sample": 0, "text": "\\boxed{4}"}])
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt_id": pa.array([101], pa.int64()), "text": ["\\boxed{4}"]}), parquet)
    for comps in (jsonl, parquet):
        out = tmp_path / f"rw-{comps.suffix[1:]}.parquet"
        r = _reward("--prompts", data, "--completions", comps, "--reward", "math", "-o", out)
        assert r.exit_code == 0, r.output
        got = [(x["prompt_id"], x["reward"]) for x in read_artifact(out, "rewards").to_pylist()]
        assert got == [("101", 1.0)]


def test_parquet_under_a_json_lines_name_is_read_as_parquet(tmp_path):
    data = tmp_path / "trl.jsonl"
    pq.write_table(pa.table({"prompt": ["What is 7 + 8?"], "solution": ["15"]}), data)
    comps = tmp_path / "c.jsonl"
    pq.write_table(pa.table({"prompt_id": ["trl-0"], "text": ["\\boxed{15}"]}), comps)
    out = tmp_path / "rw.parquet"
    r = _reward("--prompts", data, "--completions", comps, "--reward", "math", "-o", out)
    assert r.exit_code == 0, r.output
    assert [x["reward"] for x in read_artifact(out, "rewards").to_pylist()] == [1.0]


TRL_LOGGING = ("def reward(prompts, completions, log_metric, log_extra, **kwargs):\n"
               "    log_metric('my/pos', 1.0)\n"
               "    log_metric('my/pos', 3.0)\n"
               "    log_extra('flag', [1, 0][:len(completions)])\n"
               "    return [0.5] * len(completions)\n")
VERL_EXTRAS = ("def reward(data_source, solution_str, ground_truth, extra_info=None):\n"
               "    return {'score': 0.5, 'acc': 1.0 if ground_truth == '2' else 0.0, 'pred': 'text'}\n")


@pytest.mark.parametrize("source, expected", [
    (TRL_LOGGING, {"flag": 0.5, "my/pos": 2.0}),  # log_metric: the mean of 1 and 3; log_extra: of 1 and 0
    (VERL_EXTRAS, {"acc": 0.5}),  # prompt 0 (answer 2) and prompt 1 (answer 3), one per step
], ids=["trl", "verl"])
def test_train_records_what_a_reward_reports_beside_its_scores(tmp_path, source, expected):
    """Each step's row keeps the means of a user reward's numeric extras: TRL's log_metric (the mean of the
    values logged) and log_extra, verl's returned fields (text left out); over the run's two steps, one
    prompt each, verl's acc is 1 on one and 0 on the other."""
    from tiny_models import tiny_chat_llama

    model = tiny_chat_llama(tmp_path / "model")
    fn = tmp_path / "logging_reward.py"
    fn.write_text(source)
    data = _jsonl(tmp_path / "t.jsonl", [{"prompt": f"What is {i} + 1?", "solution": str(i + 2)}
                                         for i in range(2)])
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "--model", model, "--prompts", str(data), "--reward-fn", f"{fn}:reward",
                            "--steps", "2", "--prompts-per-step", "1", "--samples", "2",
                            "--max-new-tokens", "2", "-o", str(run)])
    assert r.exit_code == 0, r.output
    assert "log_metric" not in r.stderr
    rows = [json.loads(x) for x in read_artifact(run / "metrics.parquet", "metrics")
            .column("reward_extra").to_pylist()]
    if "acc" in expected:  # one prompt per step: the two steps' acc are 1 and 0 in some order
        assert sorted(row["acc"] for row in rows) == [0.0, 1.0] and all(set(row) == {"acc"} for row in rows)
    else:
        assert rows == [expected, expected]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward_extra"] for line in lines] == rows


def test_reward_extra_means_take_numpy_numbers_and_bools_and_leave_text_and_nan_out():
    """A verl function's numpy scalars count as numbers (np.float32 is no Python float) and its bools as
    0/1, as verl's np.mean reads an `acc` field; text and non-finite values are not averaged; a
    log_metric name takes TRL's mean of what was logged."""
    import numpy as np

    from sparrow.stages.train.metrics import reward_extra_means

    extras = [{"acc": np.float32(1.0), "pred": "7", "ok": True, "x": float("nan")},
              {"acc": np.int64(0), "x": 2.0}, None]
    assert reward_extra_means(extras, {"my/pos": 2.0, "bad": float("inf")}) == \
        {"acc": 0.5, "my/pos": 2.0, "ok": 1.0, "x": 2.0}
    assert reward_extra_means([None, {"pred": "7"}], {}) is None
