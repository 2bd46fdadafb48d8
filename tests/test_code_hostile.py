"""The code tasks' rewards under hostile input: a prompts file's own format weight, HumanEval's `assert True`
lines, completions the parser cannot take, and a program that hangs on every call.

Expected values come from the published rule (docs/tasks.md: 0.9 x passed / tests + 0.1 for a runnable
function) and from HumanEval's own `check` text, not from the scorer's output.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.schemas import read_artifact, write_artifact
from sparrow.stages.tasks import humaneval, make_prompts
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.base import TaskError
from sparrow.stages.tasks.code import check_metadata, default_sandbox, extract_code, run_tests
from sparrow.stages.tasks.humaneval import problems
from sparrow.stages.tasks.humaneval import verdict as humaneval_verdict
from sparrow.stages.tasks.rewards import _parses

from cli_checks import error_line

runner = CliRunner()
needs_sandbox = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None,
                                   reason="no sandbox here")
PUBLISHED_FORMAT_CREDIT = 0.1  # docs/tasks.md


class WordTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [1] * len(text.split())})()


def _problem(number: int) -> dict:
    return next(p for p in problems() if p["task_id"] == f"HumanEval/{number}")


def _humaneval_metadata(number: int) -> dict:
    p = _problem(number)
    return {"task_id": p["task_id"], "function": p["entry_point"], "stub": p["prompt"], "test": p["test"]}


# ---------------------------------------------------------------- the format weight is the task's


@pytest.mark.parametrize("task", ["code", "humaneval"])
def test_a_prompts_files_own_format_weight_is_refused_before_scoring(tmp_path, monkeypatch, task):
    monkeypatch.delenv(sb.UNSAFE_ENV, raising=False)
    rows = make_prompts(task, 1, 0, WordTokenizer())
    meta = json.loads(rows[0]["metadata"])
    meta["format_weight"] = 1.0
    rows[0]["metadata"] = json.dumps(meta)
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    completions = tmp_path / "completions.jsonl"
    wrong = f"```python\ndef {meta['function']}(*args):\n    return 42\n```"
    completions.write_text(json.dumps({"prompt_id": rows[0]["prompt_id"], "text": wrong}) + "\n")
    out = tmp_path / "rewards.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                                 "-o", str(out)])
    assert result.exit_code == 2
    assert "format_weight" in error_line(result)
    assert not out.exists()


@pytest.mark.parametrize("weight", [1.0, -1.0, 0.5, 0.0, "0.1", True, None])
def test_only_the_published_format_weight_is_accepted(weight):
    with pytest.raises(TaskError, match="format_weight"):
        check_metadata({"function": "f", "cases": [[1]], "expected": [1], "format_weight": weight})
    check_metadata({"function": "f", "cases": [[1]], "expected": [1]})
    check_metadata({"function": "f", "cases": [[1]], "expected": [1],
                    "format_weight": PUBLISHED_FORMAT_CREDIT})


@needs_sandbox
def test_a_function_that_fails_every_test_earns_the_format_credit_at_most():
    verdict = run_tests("def f(x):\n    return 42\n", "f", [[1], [2], [3]], [1, 2, 3], default_sandbox())
    assert (verdict.reward, verdict.status, verdict.passed) == (pytest.approx(PUBLISHED_FORMAT_CREDIT),
                                                                "failed", 0)
    with pytest.raises(ValueError, match="format_weight"):
        run_tests("def f(x):\n    return 42\n", "f", [[1]], [1], default_sandbox(), format_weight=1.0)


# ---------------------------------------------------------------- HumanEval: a test calls the candidate


# Asserts on the candidate in the package's `check` text (its `assert True, "..."` lines excluded).
CANDIDATE_ASSERTS = {83: 5, 113: 3, 0: 7}


@pytest.mark.parametrize("number", sorted(CANDIDATE_ASSERTS))
def test_assert_true_lines_are_not_humaneval_tests(number):
    p = _problem(number)
    written = len(re.findall(r"^\s*assert\s+candidate\(", p["test"], re.MULTILINE))
    assert written == CANDIDATE_ASSERTS[number]
    assert humaneval.test_count(p["test"], p["entry_point"]) == CANDIDATE_ASSERTS[number]


def test_every_humaneval_statement_that_calls_the_candidate_is_a_test():
    """So passing every test is HumanEval's own verdict: `check` runs through."""
    import ast

    for p in problems():
        tree = ast.parse(p["test"])
        check = next(s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check")
        calls = sum("candidate" in ast.get_source_segment(p["test"], s) for s in check.body)
        assert humaneval.test_count(p["test"], p["entry_point"]) == calls > 0, p["task_id"]


@needs_sandbox
@pytest.mark.parametrize("number", sorted(CANDIDATE_ASSERTS))
def test_a_function_that_does_nothing_earns_only_the_format_credit(number):
    p = _problem(number)
    nothing = f"```python\ndef {p['entry_point']}(*args):\n    return None\n```"
    v = humaneval_verdict(nothing, _humaneval_metadata(number))
    assert (v.reward, v.passed, v.tests, v.status) == (
        pytest.approx(PUBLISHED_FORMAT_CREDIT), 0, CANDIDATE_ASSERTS[number], "failed")
    canonical = f"```python\n{p['prompt']}{p['canonical_solution']}```"
    v = humaneval_verdict(canonical, _humaneval_metadata(number))
    assert (v.reward, v.passed, v.status) == (1.0, CANDIDATE_ASSERTS[number], "passed")


# ---------------------------------------------------------------- parsing is bounded


@pytest.mark.parametrize("dashes", [5_000, 200_000])
def test_deeply_nested_code_is_unparsable_not_a_crash(dashes):
    start = time.monotonic()
    deep = "-" * dashes + "n"
    assert extract_code(f"```python\ndef digit_sum(n):\n    return {deep}\n```", "digit_sum") is None
    assert not _parses(f"print({deep})")
    kept = extract_code(f"```python\ndef digit_sum(n):\n    return n\n    x = {deep}\n```", "digit_sum")
    assert kept == "def digit_sum(n):\n    return n\n"
    assert time.monotonic() - start < 10


def test_a_huge_block_is_read_only_up_to_a_bound():
    start = time.monotonic()
    code = "def f():\n    return 1\n" + "# filler line\n" * 1_000_000
    assert extract_code(f"```python\n{code}```", "f") is not None
    assert time.monotonic() - start < 10


@needs_sandbox
def test_reward_scores_a_degenerate_completion_no_code(tmp_path, monkeypatch):
    monkeypatch.delenv(sb.UNSAFE_ENV, raising=False)
    rows = make_prompts("code", 1, 0, WordTokenizer())
    prompts = tmp_path / "prompts.parquet"
    write_artifact(rows, prompts, "prompts", {})
    name = json.loads(rows[0]["metadata"])["function"]
    text = f"```python\ndef {name}(n):\n    return {'-' * 5000}n\n```"
    completions = tmp_path / "completions.jsonl"
    completions.write_text(json.dumps({"prompt_id": rows[0]["prompt_id"], "text": text}) + "\n")
    out = tmp_path / "rewards.parquet"
    result = runner.invoke(app, ["reward", "--prompts", str(prompts), "--completions", str(completions),
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    row = read_artifact(out, "rewards").to_pylist()[0]
    assert (row["reward"], row["status"]) == (0.0, "no_code")


# ---------------------------------------------------------------- a hang is a timeout


@needs_sandbox
def test_a_function_that_hangs_on_every_call_is_a_timeout():
    hangs = "import time\ndef f(x):\n    time.sleep(1e9)\n"
    v = run_tests(hangs, "f", [[1], [2]], [1, 2], default_sandbox())
    assert (v.reward, v.status, v.passed) == (0.0, "timeout", 0)
    some = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(1e9)\n    return x\n"
    v = run_tests(some, "f", [[1], [2]], [1, 2], default_sandbox())
    assert (v.reward, v.status, v.passed) == (pytest.approx(0.9 * 1 / 2), "timeout", 1)
