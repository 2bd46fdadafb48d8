"""Users' own datasets and rewards, as a verl or TRL user brings them: a GSM8K-shaped verl Parquet (written
here as verl's examples/data_preprocess/gsm8k.py writes it), TRL-style datasets (text or chat prompts, an
answer column; Parquet, JSONL, a save_to_disk folder), and rewards by --reward math, --reward code and
--reward-fn. Expected values are computed here independently: math-verify called directly on the same
strings, the user's function imported and called directly, the tokenizer's own chat template.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path
from shlex import quote as shlex_quote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact
from sparrow.stages.core.prompt_set import PromptError, PromptSet
from sparrow.stages.core.user_data import DataOptions

from cli_checks import error_line
from tiny_models import tiny_chat_llama

runner = CliRunner()
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
PROBLEMS = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
            ("A box holds 12 eggs. How many eggs are in 2 boxes?", "24"),
            ("Sara had 10 pens and gave away 3. How many pens are left?", "7")]
# completions a user's sampler might give, scored against every ground truth above
COMPLETIONS = ["The answer is 7.", "#### 24", "So he has \\boxed{7} apples.", "I think it is 25",
               "3 + 4 = 7", "no idea"]


def write_verl_gsm8k(path, n: int = len(PROBLEMS), split: str = "train"):
    """Rows as verl's gsm8k preprocessing makes them (question + instruction as one user message, the
    extracted solution as ground truth), written with pyarrow."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i, "answer": f"Some working.\n#### {a}", "question": q}}
            for i, (q, a) in enumerate(PROBLEMS[:n])]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_trl_jsonl(path):
    """TRL's conversational GRPO layout: a system and a user turn in `prompt`, the answer in `solution`."""
    system = {"role": "system", "content": "Answer with a number."}
    rows = [{"prompt": [system, {"role": "user", "content": q}], "solution": a} for q, a in PROBLEMS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_verify_reward(completion: str, truth: str) -> float:
    """The reference: math-verify itself, as verl's math_verify reward configures it."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse("\\boxed{" + truth + "}", extraction_config=[LatexExtractionConfig()])
    given = parse(completion, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])
    return float(bool(given) and verify(gold, given))


def _import(path, name):
    spec = importlib.util.spec_from_file_location(f"direct_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


USER_REWARDS = '''\
import math

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = ground_truth in solution_str
    return {"score": 2.0 * hit - 0.5, "hit": hit, "source": data_source, "index": extra_info["index"]}

def plain(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10

def raises(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise ValueError("cannot read the answer")
    return 1.0

def says_yes(data_source, solution_str, ground_truth, extra_info=None):
    return "yes"

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def not_finite(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

def numpy_or_bool(data_source, solution_str, ground_truth, extra_info=None):
    import numpy as np
    return np.float32(0.25) if extra_info["index"] == 0 else {"score": ground_truth in solution_str}

CALLS = []

def trl_style(prompts, completions, solution, **kwargs):
    CALLS.append(len(completions))
    return [float(s in c[0]["content"]) for c, s in zip(completions, solution)]

def trl_short(completions, **kwargs):
    return [1.0]

def two_args(a, b):
    return 1.0

def exits(data_source, solution_str, ground_truth, extra_info=None):
    import sys
    if extra_info["index"] == 1:
        sys.exit(0)
    return 1.0

def raises_exit(data_source, solution_str, ground_truth, extra_info=None):
    raise SystemExit(3)

def trl_exits(completions, **kwargs):
    raise SystemExit()

def interrupted(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyboardInterrupt

def prints(data_source, solution_str, ground_truth, extra_info=None):
    import os
    print("DEBUG from the reward function")
    os.write(1, b"DEBUG written to descriptor 1\\n")
    return 1.0

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")

def raises_unprintable(data_source, solution_str, ground_truth, extra_info=None):
    raise Unprintable()

class Odd(BaseException):
    pass

def raises_base_exception(data_source, solution_str, ground_truth, extra_info=None):
    raise Odd("not an Exception")

def raises_generator_exit(data_source, solution_str, ground_truth, extra_info=None):
    raise GeneratorExit()

def closes_its_stdout(data_source, solution_str, ground_truth, extra_info=None):
    import sys
    sys.stdout.close()
    sys.stderr.close()
    return 1.0
'''


@pytest.fixture
def user_fns(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.fixture
def verl_file(tmp_path):
    return write_verl_gsm8k(tmp_path / "train.parquet")


def stage_error(result) -> str:
    """The error line of a command that failed after its work began (progress lines may come first): one
    "error: ..." line, last, and no traceback."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and sum(x.startswith("error:") for x in lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[-1]


def _completions_jsonl(path, prompt_ids):
    rows = [{"prompt_id": pid, "text": text} for pid in prompt_ids for text in COMPLETIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# ---------------------------------------------------------------- reading the formats


def test_verl_parquet_reads_as_prompts(verl_file):
    prompts = PromptSet.read(verl_file)
    assert prompts.ids == ["train-0", "train-1", "train-2"]
    for row, (q, a) in zip(prompts.rows, PROBLEMS):
        assert row["messages"] == [{"role": "user", "content": f"{q} {INSTRUCTION}"}]
        assert row["answer"] == a and row["task"] == "verl"
        meta = json.loads(row["metadata"])
        assert meta["columns"]["data_source"] == "openai/gsm8k"
        assert meta["columns"]["extra_info"]["question"] == q
    scored = PromptSet.read(verl_file, DataOptions(reward="math"))
    assert {r["task"] for r in scored.rows} == {"math-verify"}


def test_trl_layouts_and_answer_column(tmp_path):
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?", "What is 3+3?"], "answer": ["4", "6"],
                             "solution": ["four", "six"], "meta": [{"a": 1}, {"a": 2}]}), text)
    rows = PromptSet.read(text).rows
    assert [r["answer"] for r in rows] == ["4", "6"]  # 'answer' comes before 'solution'
    assert rows[0]["prompt"] == "What is 2+2?" and rows[0]["messages"] is None
    answers = lambda col: [r["answer"] for r in PromptSet.read(text, DataOptions(answer_column=col)).rows]
    assert answers("solution") == ["four", "six"] and answers("meta.a") == [1, 2]  # as stored
    with pytest.raises(PromptError, match="has no column 'gold' \\(--answer-column\\)"):
        PromptSet.read(text, DataOptions(answer_column="gold"))
    chat = PromptSet.read(write_trl_jsonl(tmp_path / "chat.jsonl")).rows
    assert chat[0]["messages"][0] == {"role": "system", "content": "Answer with a number."}
    assert [r["answer"] for r in chat] == [a for _, a in PROBLEMS]


def _save_to_disk_folder(folder, table):
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    folder.mkdir()
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def test_save_to_disk_folder(tmp_path):
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": q}], "solution": a}
                                  for q, a in PROBLEMS])
    rows = PromptSet.read(_save_to_disk_folder(tmp_path / "ds", table)).rows
    assert [r["answer"] for r in rows] == [a for _, a in PROBLEMS] and rows[1]["prompt_id"] == "ds-1"
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    _save_to_disk_folder(tmp_path / "dd" / "train", table)
    with pytest.raises(PromptError, match="is a Hugging Face DatasetDict; give one split's folder"):
        PromptSet.read(tmp_path / "dd")


def test_save_to_disk_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": q, "answer": a} for q, a in PROBLEMS])
    ds.save_to_disk(str(tmp_path / "hf"))
    assert [r["answer"] for r in PromptSet.read(tmp_path / "hf").rows] == [a for _, a in PROBLEMS]


def test_unfit_columns_refused_in_one_sentence(tmp_path):
    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"question": ["q"], "label": [1]}), odd)
    for command in (["rollout"], ["profile", "--budgets", "64"], ["train"]):
        r = runner.invoke(app, [*command, "--prompts", str(odd), "-o", str(tmp_path / "out")])
        line = error_line(r)
        assert "has columns question, label, which fit none of the formats" in line, line
        assert "a verl dataset (prompt as chat messages" in line and "loading model" not in r.output
        assert line.endswith("; if its column 'question' is the prompt, pass --prompt-column question")


def test_a_conversation_dataset_is_told_how_to_make_prompts_of_it_and_the_query_does(tmp_path):
    """SFT data's `messages` (whole conversations): the hint's query gives every turn but the last as the
    prompt and the last one's content as the answer."""
    sft = tmp_path / "sft.parquet"
    turns = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    pq.write_table(pa.table({"messages": [turns]}), sft)
    r = runner.invoke(app, ["rollout", "--prompts", str(sft), "-o", str(tmp_path / "out")])
    query = error_line(r).split('sparrow sql "')[1].split('"')[0]
    r = runner.invoke(app, ["sql", query, "--run", str(tmp_path), "-o", str(tmp_path / "prompts.parquet")])
    assert r.exit_code == 0, r.output
    rows = PromptSet.read(tmp_path / "prompts.parquet", DataOptions(reward="math")).rows
    assert [(r["messages"], r["answer"]) for r in rows] == [(turns[:1], "5")]


def test_rows_are_counted_from_0_in_every_message_as_in_the_ids(tmp_path):
    """A dataset's prompt ids are `<stem>-<row>` counted from 0; every message names rows the same way."""
    completions = tmp_path / "c.jsonl"
    completions.write_text('{"prompt_id": "trl-0", "text": "4"}\n{"prompt_id": "trl-0", "text": null}\n')
    out = tmp_path / "r.parquet"

    def refusal(prompts: dict) -> str:
        data = tmp_path / "trl.parquet"
        pq.write_table(pa.Table.from_pydict(prompts), data)
        r = runner.invoke(app, ["reward", "--prompts", str(data), "--completions", str(completions),
                                "--reward", "math", "-o", str(out)])
        assert not out.exists()
        return error_line(r).removeprefix(f"error: {data}: ")

    assert refusal({"prompt": ["What is 2+2?", " ", "What is 3+3?"], "answer": ["4", "0", "6"]}) == \
        "prompt 'trl-1', row 1 (counting from 0), is empty: it has no token ids and no text"
    assert refusal({"prompt_id": ["a", "b", "a"], "prompt": ["x", "y", "z"], "answer": ["1", "2", "3"]}) == \
        "prompt_id 'a' appears in rows 0 and 2 (counting from 0); each prompt needs its own id"
    chats = [[{"role": "user", "content": "x"}], [{"role": "user", "content": None}]]
    assert refusal({"prompt": chats, "answer": ["1", "2"]}).startswith(
        "row 1 (counting from 0) has a 'prompt' that is neither text nor a list of chat messages")
    pq.write_table(pa.table({"prompt": ["What is 2+2?"], "answer": ["4"]}), tmp_path / "trl.parquet")
    r = runner.invoke(app, ["reward", "--prompts", str(tmp_path / "trl.parquet"), "--completions",
                            str(completions), "--reward", "math", "-o", str(out)])
    assert f"{completions}: row 1 (counting from 0), prompt 'trl-0', has no text" in error_line(r)


def test_messages_get_the_chat_template_as_trl_applies_it(tmp_path):
    from sparrow.stages.model.loading import spec_tokenizer

    tok = spec_tokenizer("smollm2-135m")
    prompts = PromptSet.read(write_trl_jsonl(tmp_path / "chat.jsonl"))
    prompts.tokenize(tok)
    for row, (q, _) in zip(prompts.rows, PROBLEMS):
        messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert row["prompt"] == text and text.endswith("<|im_start|>assistant\n")
        assert list(row["prompt_token_ids"]) == tok(text, add_special_tokens=False).input_ids


def _refused_without_writing(args: list[str], out: Path) -> str:
    """The one error line of a refused command, which left `out` (already on disk) as it was."""
    before = out.read_bytes()
    line = error_line(runner.invoke(app, [*args, "-o", str(out)]))
    assert out.read_bytes() == before
    return line


def test_jsonl_that_is_not_utf8_is_named_with_its_line(tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "What is 2 + 3?", "solution": "5"}\n{"prompt": "Caf\xe9 2 + 3?", '
                     b'"solution": "5"}\n')
    out = tmp_path / "kept.parquet"
    out.write_bytes(b"the user's own file")
    run = tmp_path / "run"
    rollout = ["rollout", "--reward", "math", "--prompts", str(data), "--force"]
    train = ["train", "--reward", "math", "--prompts", str(data), "-o", str(run)]
    for line in (_refused_without_writing(rollout, out), error_line(runner.invoke(app, train))):
        assert line == (f"error: {data} line 2 is not UTF-8 text (byte 0xe9 at column 16); Sparrow reads "
                        "JSON lines as UTF-8, so re-encode the file as UTF-8")
    assert not run.exists()
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "What is 2 + 3?", "solution": "5"}\n')
    assert [(r["prompt"], r["answer"]) for r in PromptSet.read(bom).rows] == [("What is 2 + 3?", "5")]


LIST_AND_INT_TRUTHS = {"prompt": ["What is 2 + 3?", "What is 4 + 4?"], "solution": [["5", "five"], ["8"]]}
ECHO = '''\
def echo(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.0, "type": type(ground_truth).__name__, "value": ground_truth}
'''


def test_a_verl_function_gets_the_ground_truth_as_stored(tmp_path):
    fn = tmp_path / "echo.py"
    fn.write_text(ECHO)
    stored = [["5", "five"], 5, {"a": 1}, "7"]
    data = tmp_path / "gt.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "reward_model": {"ground_truth": json.dumps(v)}}
                                         for v in stored]), data)  # a verl file whose truths are JSON text
    typed = tmp_path / "typed.jsonl"
    typed.write_text("".join(json.dumps({"prompt": "q", "solution": v}) + "\n" for v in stored))
    completions = tmp_path / "c.jsonl"
    completions.write_text("".join(json.dumps({"prompt_id": f"typed-{i}", "text": "5"}) + "\n"
                                   for i in range(len(stored))))
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(typed), "--completions", str(completions),
                            "--reward-fn", f"{fn}:echo", "-o", str(out)])
    assert r.exit_code == 0, r.output
    extras = [json.loads(x) for x in read_artifact(out, "rewards").column("reward_extra").to_pylist()]
    assert extras == [{"type": "list", "value": ["5", "five"]}, {"type": "int", "value": 5},
                      {"type": "dict", "value": {"a": 1}}, {"type": "str", "value": "7"}]
    verl_rows = PromptSet.read(data, DataOptions(reward_fn=f"{fn}:echo")).rows
    assert [row["answer"] for row in verl_rows] == [json.dumps(v) for v in stored]  # text stays text


def test_reward_math_reads_numbers_and_refuses_other_ground_truths(tmp_path):
    from sparrow.stages.tasks import judge_batch

    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"prompt": "What is 2 + 3?", "solution": 5}\n'
                       '{"prompt": "Half of 5?", "solution": 2.5}\n')
    rows = PromptSet.read(numbers, DataOptions(reward="math")).rows
    assert [r["answer"] for r in rows] == ["5", "2.5"]
    texts = ("5", "2.5")
    judged = judge_batch([(r["task"], text, r["answer"], r["metadata"]) for r in rows for text in texts])
    assert [j.reward for j in judged] == [math_verify_reward(text, truth) for truth in texts
                                          for text in texts] == [1.0, 0.0, 0.0, 1.0]
    lists = tmp_path / "lists.parquet"
    pq.write_table(pa.table(LIST_AND_INT_TRUTHS), lists)
    completions = tmp_path / "c.jsonl"
    completions.write_text('{"prompt_id": "lists-0", "text": "5"}\n')
    out = tmp_path / "r.parquet"
    out.write_bytes(b"already here")
    line = _refused_without_writing(["reward", "--prompts", str(lists), "--completions", str(completions),
                                     "--reward", "math", "--force"], out)
    assert line == (f"error: {lists}: prompt 'lists-0', row 0 (counting from 0), cannot be scored by the "
                    "math-verify reward: its ground truth is a list ([\"5\", \"five\"]), not text or a "
                    "number, and math-verify compares the completion with one answer (score such rows with "
                    "--reward-fn)")
    structs = tmp_path / "structs.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "gold": [{"value": "5", "unit": "apples"}]}), structs)
    shown = re.escape('a struct ({"value": "5", "unit": "apples"})')
    with pytest.raises(PromptError, match=f"its ground truth is {shown}.*with --answer-column column.field"):
        PromptSet.read(structs, DataOptions(reward="math", answer_column="gold"))
    picked = PromptSet.read(structs, DataOptions(reward="math", answer_column="gold.value"))
    assert [r["answer"] for r in picked.rows] == ["5"]


def test_reward_code_reads_tests_kept_as_a_struct():
    from sparrow.stages.tasks.rewards import CODE, CodeTests, answer_for

    tests = {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
    assert CodeTests.parse(answer_for(CODE, tests)) == CodeTests([[1, 2]], [3], "add")


def test_a_typo_in_a_dotted_answer_column_names_the_fields(verl_file, tmp_path):
    completions = tmp_path / "c.jsonl"
    completions.write_text('{"prompt_id": "train-0", "text": "7"}\n')
    out = tmp_path / "r.parquet"
    out.write_bytes(b"already here")
    base = ["reward", "--prompts", str(verl_file), "--completions", str(completions), "--reward", "math",
            "--force", "--answer-column"]
    assert _refused_without_writing([*base, "reward_model.nope"], out) == (
        f"error: {verl_file}: struct column 'reward_model' has no field 'nope' (--answer-column "
        "reward_model.nope); its fields: style, ground_truth")
    assert _refused_without_writing([*base, "data_source.name"], out) == (
        f"error: {verl_file}: column 'data_source' is not a struct (it holds text), so it has no field "
        "'name' (--answer-column data_source.name)")
    assert _refused_without_writing([*base, "extra_info.split.x"], out) == (
        f"error: {verl_file}: column 'extra_info.split' is not a struct (it holds text), so it has no field "
        "'x' (--answer-column extra_info.split.x)")


def _converted(line: str, tmp_path) -> None:
    """Runs the conversion a refusal suggests ("convert it with python -c ..."), with this Python."""
    command = line.split("convert it with ", 1)[1]
    command = command[:-1] if command.endswith(")") else command
    assert command.startswith("python -c ")
    done = subprocess.run(f"{shlex_quote(sys.executable)} {command.removeprefix('python ')}", shell=True,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_formats_that_are_not_read_are_named_with_a_working_conversion(tmp_path):
    table = pa.table({"prompt": ["What is 2 + 3?", "What is 4 + 4?"], "solution": ["5", "8"]})
    expected = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
    formats = "give Parquet, JSON lines (one object per line) or a `datasets` save_to_disk folder"
    csv = tmp_path / "trl.csv"
    csv.write_text("prompt,solution\nWhat is 2 + 3?,5\nWhat is 4 + 4?,8\n")
    stream, file = tmp_path / "s.arrow", tmp_path / "f.arrow"
    with pa.ipc.new_stream(str(stream), table.schema) as w:
        w.write_table(table)
    with pa.ipc.new_file(str(file), table.schema) as w:
        w.write_table(table)
    array, pretty, named = tmp_path / "array.json", tmp_path / "pretty.json", tmp_path / "named.jsonl"
    array.write_text(json.dumps(table.to_pylist()) + "\n")
    pretty.write_text(json.dumps(table.to_pylist(), indent=2) + "\n")
    named.write_bytes(b"\xef\xbb\xbf" + array.read_bytes())
    out = tmp_path / "o.parquet"
    out.write_bytes(b"already here")
    for source, what, converted in ((csv, "is CSV", "trl.parquet"), (stream, "is an Arrow file", "s.parquet"),
                                    (file, "is an Arrow file", "f.parquet"),
                                    (array, "holds one JSON array", "array.jsonl"),
                                    (pretty, "holds one JSON array", "pretty.jsonl"),
                                    (named, "holds one JSON array", "named.converted.jsonl")):
        line = _refused_without_writing(["rollout", "--reward", "math", "--prompts", str(source), "--force"],
                                        out)
        assert line.startswith(f"error: {source} {what}"), line
        assert (formats in line) if what != "holds one JSON array" else \
            "Sparrow reads JSON lines (one object per line)" in line
        _converted(line, tmp_path)
        rows = PromptSet.read(tmp_path / converted, DataOptions(reward="math")).rows
        assert [(r["prompt"], r["answer"]) for r in rows] == expected
    folder = _save_to_disk_folder(tmp_path / "ds", table)
    line = _refused_without_writing(["rollout", "--prompts", str(folder / "data-00000-of-00001.arrow"),
                                     "--force"], out)
    assert line.endswith(f"is one Arrow file of a `datasets` save_to_disk folder; give the folder, {folder}")
    notes = tmp_path / "notes.parquet"
    notes.write_text("not data\n")
    assert _refused_without_writing(["rollout", "--prompts", str(notes), "--force"], out) == (
        f"error: {notes} is not a Parquet file (it does not start with the Parquet magic bytes); Sparrow "
        "reads prompts from Parquet, JSON lines (one object per line) or a `datasets` save_to_disk folder")


def test_chat_messages_need_a_model_with_a_chat_template(verl_file, tmp_path):
    out = tmp_path / "r.parquet"
    line = error_line(runner.invoke(app, ["rollout", "--model", "tiny-llama", "--prompts", str(verl_file),
                                          "-o", str(out)]))
    assert line == (f"error: {verl_file}: prompt 'train-0' is a list of chat messages, and a model without a "
                    "chat template cannot take chat messages (this one has no tokenizer)")
    assert not out.exists()


def test_raw_prompts_on_chat_messages_says_so_once(tmp_path, capsys):
    from sparrow.stages.model.loading import spec_tokenizer

    tok = spec_tokenizer("smollm2-135m")
    chat = PromptSet.read(write_trl_jsonl(tmp_path / "chat.jsonl"))
    chat.tokenize(tok, chat_template=False)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: --raw-prompts applies to text prompts only; {tmp_path / 'chat.jsonl'}'s "
                   "chat-message prompts go through the model's chat template"]
    system = {"role": "system", "content": "Answer with a number."}
    for row, (q, _) in zip(chat.rows, PROBLEMS):  # the template still applies, as TRL applies it
        text = tok.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=False)
        assert row["prompt"] == text
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?"], "answer": ["4"]}), text)
    raw = PromptSet.read(text)
    raw.tokenize(tok, chat_template=False)
    assert capsys.readouterr().err == "" and raw.rows[0]["prompt"] == "What is 2+2?"


# ---------------------------------------------------------------- rewards, scored by `sparrow reward`


def test_reward_math_equals_math_verify(verl_file, tmp_path):
    rows = _completions_jsonl(tmp_path / "c.jsonl", ["train-0", "train-1", "train-2"])
    r = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
                            "--reward", "math", "-o", str(tmp_path / "r.parquet")])
    assert r.exit_code == 0, r.output
    got = read_artifact(tmp_path / "r.parquet", "rewards").to_pylist()
    truth = {f"train-{i}": a for i, (_, a) in enumerate(PROBLEMS)}
    expected = [math_verify_reward(c["text"], truth[c["prompt_id"]]) for c in rows]
    assert [g["reward"] for g in got] == expected
    assert 0 < sum(expected) < len(expected)  # both outcomes are exercised
    assert {g["task"] for g in got} == {"math-verify"}


def test_reward_fn_verl_signature_equals_direct_call(verl_file, user_fns, tmp_path):
    rows = _completions_jsonl(tmp_path / "c.jsonl", ["train-0", "train-1", "train-2"])
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
                            "--reward-fn", f"{user_fns}:compute_score", "-o", str(out)])
    assert r.exit_code == 0, r.output
    fn = _import(user_fns, "compute_score")
    table = pq.read_table(verl_file).to_pylist()
    got = read_artifact(out, "rewards").to_pylist()
    for g, c in zip(got, rows):
        source = table[int(c["prompt_id"].rsplit("-", 1)[1])]
        direct = fn(data_source=source["data_source"], solution_str=c["text"],
                    ground_truth=source["reward_model"]["ground_truth"], extra_info=source["extra_info"])
        assert g["reward"] == direct["score"]  # as returned: -0.5 is kept, not clamped
        assert json.loads(g["reward_extra"]) == {k: v for k, v in direct.items() if k != "score"}
    plain = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions",
                                str(tmp_path / "c.jsonl"), "--reward-fn", f"{user_fns}:plain", "-o",
                                str(tmp_path / "p.parquet")])
    assert plain.exit_code == 0, plain.output
    got = read_artifact(tmp_path / "p.parquet", "rewards").to_pylist()
    assert [g["reward"] for g in got] == [len(c["text"]) / 10 for c in rows]
    assert all(g["reward_extra"] is None for g in got)


@pytest.mark.parametrize("name, message", [
    ("raises", "raised ValueError (cannot read the answer) on row 1 (counting from 0) of train.parquet"),
    ("says_yes", "returned 'yes' on row 0 (counting from 0) of train.parquet; a verl reward function "
                 "returns a finite number or a dict with a numeric 'score'"),
    ("no_score", "returned a dict without a 'score' key (its keys: 'acc') on row 0 (counting from 0) of "
                 "train.parquet; a verl reward function returns a finite number or a dict with a numeric "
                 "'score'"),
    ("not_finite", "returned nan on row 0"),
    ("exits", "exited (sys.exit(0)) on row 1 (counting from 0) of train.parquet; a reward function returns "
              "its score instead of exiting"),
    ("raises_exit", "exited (sys.exit(3)) on row 0 (counting from 0) of train.parquet"),
    ("trl_exits", "exited (sys.exit()) on row 0 (counting from 0) of train.parquet"),
    ("trl_short", "returned a list of 1 for 18 completions"),
    ("two_args", "takes (a, b), neither verl's compute_score(data_source, solution_str, ground_truth, "
                 "extra_info) nor TRL's"),
    ("missing", "has no function 'missing'"),
    ("raises_unprintable", "raised Unprintable on row 0 (counting from 0) of train.parquet"),
    ("raises_base_exception", "raised Odd (not an Exception) on row 0 (counting from 0) of train.parquet"),
    ("raises_generator_exit", "raised GeneratorExit on row 0 (counting from 0) of train.parquet"),
])
def test_reward_fn_refusals_are_one_sentence_and_write_nothing(verl_file, user_fns, tmp_path, name, message):
    _completions_jsonl(tmp_path / "c.jsonl", ["train-0", "train-1", "train-2"])
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
                            "--reward-fn", f"{user_fns}:{name}", "-o", str(out)])
    line = error_line(r)
    assert f"--reward-fn {user_fns}:{name}" in line and message in line, line
    assert "Traceback" not in r.output and not out.exists() and list(tmp_path.glob(".r.parquet*")) == []


def test_reward_fn_exiting_at_import_is_named(verl_file, tmp_path):
    """A script whose reward function sits beside a top-level sys.exit() is refused, not obeyed."""
    script = tmp_path / "script.py"
    script.write_text("import sys\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):"
                      "\n    return 1.0\n\nsys.exit(0)\n")
    _completions_jsonl(tmp_path / "c.jsonl", ["train-0"])
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
                            "--reward-fn", f"{script}:compute_score", "-o", str(out)])
    assert f"importing {script} exited (sys.exit(0))" in error_line(r) and not out.exists()


def test_reward_fn_keyboard_interrupt_still_interrupts(verl_file, user_fns, tmp_path):
    _completions_jsonl(tmp_path / "c.jsonl", ["train-0"])
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
                            "--reward-fn", f"{user_fns}:interrupted", "-o", str(out)])
    assert r.exit_code == 130 and "interrupted" in r.stderr and "error:" not in r.stderr, r.output
    assert not out.exists()


def test_reward_fn_output_goes_to_stderr_not_into_the_data(verl_file, user_fns, tmp_path):
    """A printing reward function leaves `-o -` Parquet and `-f json` on stdout intact (the real CLI, in a
    shell pipe: Python's prints and writes to descriptor 1 both go to stderr)."""
    _completions_jsonl(tmp_path / "c.jsonl", ["train-0", "train-1"])
    sparrow = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sparrow"
    args = [str(sparrow), "reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"),
            "--reward-fn", f"{user_fns}:prints"]
    piped = subprocess.run([*args, "-o", "-"], capture_output=True, timeout=300, cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert pq.read_table(io.BytesIO(piped.stdout)).num_rows == 2 * len(COMPLETIONS)
    assert b"DEBUG from the reward function" in piped.stderr and b"DEBUG written to" in piped.stderr
    summary = runner.invoke(app, [*args[1:], "-o", str(tmp_path / "r.parquet"), "--format", "json"])
    assert summary.exit_code == 0, summary.output
    assert json.loads(summary.stdout)[0]["completions"] == 2 * len(COMPLETIONS)
    assert "DEBUG from the reward function" in summary.stderr


def test_reward_fn_closing_its_stdout_leaves_the_commands_streams(verl_file, user_fns, tmp_path):
    """Code that closes sys.stdout and sys.stderr closes stand-ins: the command still prints its table and
    its last line, and exits 0 (the real CLI: a closed stderr would end it in CPython's own complaint)."""
    _completions_jsonl(tmp_path / "c.jsonl", ["train-0"])
    sparrow = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sparrow"
    args = ["reward", "--prompts", str(verl_file), "--completions", str(tmp_path / "c.jsonl"), "--reward-fn",
            f"{user_fns}:closes_its_stdout", "-o", str(tmp_path / "r.parquet"), "-f", "tsv"]
    done = subprocess.run([str(sparrow), *args], capture_output=True, timeout=300, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("task\tdata_source\tcompletions") and "wrote 6 rewards" in done.stderr
    assert "Exception" not in done.stderr


def test_reward_fn_numbers_as_verl_takes_them(verl_file, user_fns):
    from sparrow.stages.tasks import judge_batch

    prompts = PromptSet.read(verl_file, DataOptions(reward_fn=f"{user_fns}:numpy_or_bool"))
    items = [(r["task"], "it is 24", r["answer"], r["metadata"]) for r in prompts.rows]
    assert [j.reward for j in judge_batch(items)] == [0.25, 1.0, 0.0]  # np.float32, True, False


def test_reward_fn_trl_signature_batched_with_columns(tmp_path, user_fns):
    from sparrow.stages.tasks import judge_batch

    chat = write_trl_jsonl(tmp_path / "chat.jsonl")
    prompts = PromptSet.read(chat, DataOptions(reward_fn=f"{user_fns}:trl_style"))
    items = [(r["task"], text, r["answer"], r["metadata"]) for r in prompts.rows for text in COMPLETIONS]
    judged = judge_batch(items)
    fn = _import(user_fns, "trl_style")
    sources = [json.loads(line) for line in chat.read_text().splitlines()]
    direct = fn(prompts=[s["prompt"] for s in sources for _ in COMPLETIONS],
                completions=[[{"role": "assistant", "content": t}] for _ in sources for t in COMPLETIONS],
                solution=[s["solution"] for s in sources for _ in COMPLETIONS])
    assert [j.reward for j in judged] == direct
    from sparrow.stages.tasks import rewards

    module = next(m for n, m in __import__("sys").modules.items() if n.startswith("sparrow_reward_")
                  and getattr(m, "CALLS", None) is not None and m.__file__ == str(user_fns))
    assert module.CALLS == [len(items)]  # one call for the batch, as TRL calls it
    assert rewards.REWARDS[prompts.rows[0]["task"]].clamp is False


def test_reward_needs_an_answer_or_refuses(tmp_path):
    text = tmp_path / "q.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?"], "hint": ["even"]}), text)
    with pytest.raises(PromptError, match="has no answer, which --reward scores against .*--answer-column"):
        PromptSet.read(text, DataOptions(reward="math"))
    with pytest.raises(PromptError, match="--reward and --reward-fn are two ways to score"):
        PromptSet.read(text, DataOptions(reward="math", reward_fn="x.py:f"))


def test_reward_code_runs_the_datasets_tests(tmp_path):
    from sparrow.stages.tasks import judge_batch
    from sparrow.stages.tasks import sandbox as sb

    if sb.sandbox_problem(sb.bwrap_binary()) is not None:
        pytest.skip("no sandbox here")
    call = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [3, 7, 0]}
    stdio = {"inputs": ["1 2\n", "5 6\n"], "outputs": ["3\n", "11\n"]}
    data = tmp_path / "code.parquet"
    pq.write_table(pa.table({"prompt": ["Write add(a, b).", "Read two ints, print their sum."],
                             "tests": [json.dumps(call), json.dumps(stdio)]}), data)
    prompts = PromptSet.read(data, DataOptions(answer_column="tests", reward="code"))
    add_ok = "```python\ndef add(a, b):\n    return a + b\n```"
    add_wrong = "```python\ndef add(a, b):\n    return a * b\n```"  # right for [0, 0] only... and 1*2 != 3
    sum_ok = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    sum_wrong = "```python\nprint(3)\n```\nIt prints:\n```text\n3\n```"  # the Python block is the program
    a, b = prompts.rows
    judged = judge_batch([(a["task"], add_ok, a["answer"], a["metadata"]),
                          (a["task"], add_wrong, a["answer"], a["metadata"]),
                          (b["task"], sum_ok, b["answer"], b["metadata"]),
                          (b["task"], sum_wrong, b["answer"], b["metadata"]),
                          (b["task"], "no code here (", b["answer"], b["metadata"])])
    assert [j.reward for j in judged] == [1.0, pytest.approx(1 / 3), 1.0, 0.5, 0.0]
    assert [j.status for j in judged] == ["passed", "failed", "passed", "failed", "no_code"]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "tests": ["assert f(1) == 2"]}), bad)
    with pytest.raises(PromptError, match=r"row 0 \(counting from 0\), cannot be scored by the code-tests "
                                          "reward: its ground"):
        PromptSet.read(bad, DataOptions(answer_column="tests", reward="code"))


# ---------------------------------------------------------------- the pipeline, on a tiny chat model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


def _pipeline(model: str, data, tmp_path, max_new_tokens: int = 12) -> list[dict]:
    """profile, rollout --reward math, reward --reward math and train --reward math on `data`, unchanged;
    the rollouts' rows."""
    base = ["--model", model, "--prompts", str(data)]
    r = runner.invoke(app, ["profile", *base, "--budgets", "48", "--samples", "1", "--max-new-tokens",
                            str(max_new_tokens), "-o", str(tmp_path / "mismatch.parquet")])
    assert r.exit_code == 0, r.output
    assert read_artifact(tmp_path / "mismatch.parquet", "mismatch").num_rows > 0
    rollouts = tmp_path / "rollouts.parquet"
    r = runner.invoke(app, ["rollout", *base, "--reward", "math", "--samples", "2", "--max-new-tokens",
                            str(max_new_tokens), "-o", str(rollouts)])
    assert r.exit_code == 0, r.output
    rows = read_artifact(rollouts, "rollouts").to_pylist()
    r = runner.invoke(app, ["reward", "--prompts", str(data), "--completions", str(rollouts), "--reward",
                            "math", "-o", str(tmp_path / "rewards.parquet")])
    assert r.exit_code == 0, r.output
    rewards = read_artifact(tmp_path / "rewards.parquet", "rewards").to_pylist()
    assert [x["reward"] for x in rewards] == [x["reward"] for x in rows]
    r = runner.invoke(app, ["train", *base, "--reward", "math", "--steps", "1", "--prompts-per-step", "2",
                            "--samples", "2", "--max-new-tokens", str(max_new_tokens), "--lora-rank", "2",
                            "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert read_artifact(tmp_path / "run" / "metrics.parquet", "metrics").num_rows == 1
    return rows


@pytest.mark.parametrize("layout", ["verl", "trl"])
def test_dataset_through_the_pipeline(tiny_chat, tmp_path, layout):
    data = (write_verl_gsm8k(tmp_path / "gsm8k.parquet") if layout == "verl"
            else write_trl_jsonl(tmp_path / "trl.jsonl"))
    rows = _pipeline(tiny_chat, data, tmp_path)
    truth = {r["prompt_id"]: r["answer"] for r in PromptSet.read(data).rows}
    assert [r["reward"] for r in rows] == [math_verify_reward(r["text"], truth[r["prompt_id"]]) for r in rows]
    assert len(rows) == 2 * len(PROBLEMS)


def test_reward_fn_raising_in_rollout_writes_no_artifact_and_keeps_the_samples(tiny_chat, verl_file, user_fns,
                                                                              tmp_path):
    out = tmp_path / "rollouts.parquet"
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(verl_file), "--reward-fn",
                            f"{user_fns}:raises", "--max-new-tokens", "4", "-o", str(out)])
    line = stage_error(r)
    assert "raised ValueError (cannot read the answer) on row 1 (counting from 0) of train.parquet" in line
    assert "keeps the 3 of 3 prompts that had finished" in " ".join(line.split())  # for a resume
    assert not out.exists() and list(tmp_path.glob(".rollouts.parquet*")) == []
    assert sorted(p.name for p in (tmp_path / "rollouts.parquet.partial").iterdir()
                  if not p.name.startswith(".")) == ["manifest.json", "unscored-00000.parquet"]
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(verl_file), "--reward-fn",
                            f"{user_fns}:exits", "--max-new-tokens", "4", "-o", str(out), "--force"])
    assert r.exit_code == 2 and "exited (sys.exit(0)) on row 1 (counting from 0)" in stage_error(r)
    assert not out.exists() and list(tmp_path.glob(".rollouts.parquet*")) == []
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(verl_file), "--reward-fn",
                            f"{user_fns}:compute_score", "--samples", "2", "--max-new-tokens", "4",
                            "-o", str(out), "--force"])
    assert r.exit_code == 0, r.output
    fn = _import(user_fns, "compute_score")
    source = pq.read_table(verl_file).to_pylist()
    for row in read_artifact(out, "rollouts").to_pylist():
        s = source[int(row["prompt_id"].rsplit("-", 1)[1])]
        direct = fn(s["data_source"], row["text"], s["reward_model"]["ground_truth"], s["extra_info"])
        assert row["reward"] == direct["score"]
        assert json.loads(row["reward_extra"]) == {k: v for k, v in direct.items() if k != "score"}


def test_train_with_reward_fn_raising_names_the_row(tiny_chat, verl_file, user_fns, tmp_path):
    r = runner.invoke(app, ["train", "--model", tiny_chat, "--prompts", str(verl_file), "--reward-fn",
                            f"{user_fns}:raises", "--steps", "1", "--prompts-per-step", "3", "--samples", "2",
                            "--max-new-tokens", "4", "-o", str(tmp_path / "run")])
    line = stage_error(r)
    assert "raised ValueError (cannot read the answer) on row 1 (counting from 0) of train.parquet" in line
    # no step's metrics, checkpoint or adapter: only the schedule the run started with, written whole
    assert not (tmp_path / "run").exists()  # nothing resumable, so no schedule either: the empty run is gone
    r = runner.invoke(app, ["train", "--model", tiny_chat, "--prompts", str(verl_file), "--steps", "1",
                            "--prompts-per-step", "3", "-o", str(tmp_path / "run2")])
    assert error_line(r).endswith("is a row of a verl dataset, which names no reward of its own; score it "
                                  "with --reward math|code or --reward-fn path.py:function")


def test_distill_reads_a_verl_dataset(tiny_chat, verl_file, tmp_path):
    r = runner.invoke(app, ["distill", "--model", tiny_chat, "--prompts", str(verl_file), "--budget", "48",
                            "--steps", "1", "--trajectories-per-step", "2", "--samples", "2",
                            "--max-new-tokens", "4", "--lora-rank", "2", "-o", str(tmp_path / "adapter")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


# ---------------------------------------------------------------- on the embedded SmolLM2-135M


@pytest.mark.slow
def test_verl_gsm8k_on_smollm2(tmp_path):
    verl = write_verl_gsm8k(tmp_path / "gsm8k.parquet")
    rows = _pipeline("smollm2-135m", verl, tmp_path, max_new_tokens=24)
    truth = {f"gsm8k-{i}": a for i, (_, a) in enumerate(PROBLEMS)}
    assert [r["reward"] for r in rows] == [math_verify_reward(r["text"], truth[r["prompt_id"]]) for r in rows]
    assert all(not math.isnan(r["reward"]) for r in rows)


# ---------------------------------------------------------- a row without an answer; back to the dataset


def test_a_verl_row_without_ground_truth_is_told_where_verl_keeps_it(tmp_path):
    from sparrow.stages.core.user_data import missing_answer_advice, read_dataset

    data = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "openai/gsm8k", "prompt": [{"role": "user",
                                                                                     "content": "2 + 3?"}],
                                          "reward_model": {"style": "rule", "ground_truth": None}}]), data)
    (row,) = read_dataset(data)
    advice = missing_answer_advice(json.loads(row["metadata"]))
    assert "reward_model.ground_truth" in advice and "--answer-column" not in advice
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": "2 + 3?"}) + "\n")
    assert "--answer-column" in missing_answer_advice(json.loads(read_dataset(trl)[0]["metadata"]))


def _docs_command(marker: str) -> list[str]:
    """The `sparrow ...` command of the docs/datasets.md bash block that holds `marker`, as argv."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "datasets.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if marker in b]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[0] == "sparrow"
    return argv[1:]


def test_the_docs_join_gives_each_rollout_its_verl_rows_columns(tiny_chat, tmp_path, monkeypatch):
    """The query docs/datasets.md shows, run as written on a verl dataset (one row's extra_info null) and
    its rollouts: each sample gets the columns of the dataset row its id names, as pyarrow reads them."""
    ds = tmp_path / "ds"
    ds.mkdir()
    write_verl_gsm8k(ds / "gsm8k.parquet")
    table = pq.read_table(ds / "gsm8k.parquet").to_pylist()
    table[1]["extra_info"] = None
    pq.write_table(pa.Table.from_pylist(table), ds / "gsm8k.parquet")
    r = runner.invoke(app, ["rollout", "--model", tiny_chat, "--prompts", str(ds / "gsm8k.parquet"),
                            "--samples", "2", "--max-new-tokens", "3", "-o", str(ds / "rollouts.parquet")])
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, [*_docs_command("rollouts__rollouts r JOIN dataset"), "-f", "json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    rollouts = pq.read_table(ds / "rollouts.parquet").to_pylist()
    assert len(got) == len(rollouts) == 2 * len(table)
    expected = sorted(({"prompt_id": x["prompt_id"], "sample": x["sample"], "text": x["text"],
                        "reward": x["reward"], "data_source": row["data_source"], "ability": row["ability"],
                        "gts": row["reward_model"]["ground_truth"], "extra_info": row["extra_info"]}
                       for x in rollouts for row in [table[int(x["prompt_id"].rsplit("-", 1)[1])]]),
                      key=lambda e: (e["prompt_id"], e["sample"]))
    assert got == expected


def test_prompts_that_are_chat_messages_as_json_text_are_warned_of_and_the_fix_works(tmp_path, capsys):
    """A dataset whose prompt column is json.dumps of the messages: read as text (as verl and TRL read a
    string), with a warning whose query turns them into the list of structs verl keeps."""
    turns = [{"role": "user", "content": "What is 2 + 3?"}]
    data = tmp_path / "jsonp.parquet"
    pq.write_table(pa.table({"prompt": [json.dumps(turns)] * 2, "answer": ["5", "6"]}), data)
    rows = PromptSet.read(data, DataOptions(reward="math")).rows
    assert rows[0]["prompt"] == json.dumps(turns)  # as stored
    warned = " ".join(capsys.readouterr().err.split())
    assert f"warning: {data}: the prompt of 2 of 2 rows (first: row 0 (counting from 0)) is text that " \
           "holds chat messages as JSON" in warned
    query = warned.split('sparrow sql "')[1].split('"')[0]
    r = runner.invoke(app, ["sql", query, "--run", str(tmp_path), "-o", str(tmp_path / "prompts.parquet")])
    assert r.exit_code == 0, r.output
    fixed = PromptSet.read(tmp_path / "prompts.parquet", DataOptions(reward="math")).rows
    assert [r["messages"] for r in fixed] == [turns, turns]
    capsys.readouterr()
    pq.write_table(pa.table({"prompt": [json.dumps(turns), "plain"], "answer": ["5", "6"]}), data)
    PromptSet.read(data, DataOptions(reward="math"))
    warned = " ".join(capsys.readouterr().err.split())
    assert "the prompt of 1 of 2 rows" in warned and "sparrow sql" not in warned  # no one query fits both


def test_a_map_extra_info_reaches_a_verl_function_as_a_dict():
    from sparrow.stages.tasks.reward_function import verl_extra_info

    assert verl_extra_info([("split", "train"), ("index", "3")]) == {
        "split": "train", "index": "3", "num_turns": 2, "rollout_reward_scores": {}}
    assert verl_extra_info('{"a": 1}') == '{"a": 1}'  # text is passed as verl passes it


def test_message_content_as_typed_text_parts_is_read_as_its_text(tmp_path):
    """TRL's typed layout, text parts only: the parts' text joined; an image part is refused as before."""
    data = tmp_path / "parts.parquet"
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": parts}], "answer": "5"}]),
                   data)
    rows = PromptSet.read(data, DataOptions(reward="math")).rows
    assert rows[0]["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]
    image = [{"type": "image", "text": None}, {"type": "text", "text": "What is this?"}]
    row = {"prompt": [{"role": "user", "content": image}], "answer": "a cat"}
    pq.write_table(pa.Table.from_pylist([row]), data)
    with pytest.raises(PromptError, match="holds a part of type 'image'"):
        PromptSet.read(data, DataOptions(reward="math"))
