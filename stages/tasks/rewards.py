"""Rewards for users' own datasets: `math` (math-verify), `code` (the dataset's tests in our sandbox) and a
user's function (`--reward-fn path.py:function`), each a `Task` found by `get_task` beside the tasks.

Design decisions:
- `math`, as verl's math-verify reward: the ground truth is read as LaTeX inside \\boxed{}, the completion
  by math-verify's expression and LaTeX extraction; reward 1 when math-verify finds them equal, else 0
  (status unparsed when nothing was extracted from the completion).
- `code`: the ground truth is the tests, JSON as verl's and the APPS/TACO datasets keep them: `inputs` and
  `outputs` lists, with `fn_name` for call tests (the completion's function called on each input list,
  its value compared with the output as JSON) and without it for stdin/stdout tests (the completion's
  program, its last Python block, run on each input as stdin, its stdout compared line by line, trailing
  spaces ignored). The
  program runs in the code tasks' sandbox (`code.py`), one run per completion; reward = tests passed /
  tests, as `code.Verdict` judges a run (0 for a run that times out, crashes or floods its output).
- A user's function runs in this process, as verl and TRL run theirs. Which convention it follows is read
  from its signature: a `solution_str` parameter is verl's `compute_score(data_source, solution_str,
  ground_truth, extra_info)`, called once per completion with keyword arguments; else a `completions`
  parameter (or **kwargs) is TRL's `f(prompts, completions, **columns) -> list[float]`, called once per
  batch with the dataset's other columns as lists. A verl function may return a number (a bool or a numpy
  scalar too, as verl takes them) or a dict with a numeric `score` (the dict's other fields are kept as
  the completion's `extra`); anything else, a non-finite number, or a TRL list of the wrong length is
  refused in one sentence, a dict without `score` naming the keys it has. A function that raises, or
  exits (SystemExit: sys.exit() in a script's scorer would otherwise end the command silently, with
  nothing written), is named with the dataset row of the completion (a TRL batch that raises is called
  again one item at a time to find it); KeyboardInterrupt still interrupts. Importing the file is held
  to the same rule.
- User code's output goes to stderr while it runs (imported or called): the command's stdout may be
  carrying its data (`-o -` Parquet, `-f json`), and verl's reward functions print. Python's sys.stdout
  is redirected, and so is descriptor 1 (C extensions, child processes) where it is open.
- Rows reach a reward in the users' dataset layout (`core/user_data.py`): metadata {"format", "file",
  "row", "prompt", "columns"}, so a function sees the columns its trainer would pass.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import Judgement, RewardError, Task, TaskError, row_of

MATH, CODE = "math-verify", "code-tests"
STDIO_FUNCTION = "__sparrow_stdio_main"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)

Item = tuple[str, "str | None", dict[str, Any]]  # (completion, answer, metadata)


def _no_prompts(*args, **kwargs):
    raise TaskError("a dataset reward scores prompts; it does not generate them")


# ---------------------------------------------------------------- math


def math_judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    """1 when math-verify finds the completion's answer equal to the ground truth (module docstring)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse("\\boxed{" + str(answer) + "}", extraction_config=[LatexExtractionConfig()])
    given = parse(completion, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])
    if not given:
        return Judgement(0.0, "unparsed")
    correct = bool(verify(gold, given))
    return Judgement(float(correct), "correct" if correct else "incorrect")


# ---------------------------------------------------------------- code


@dataclass(frozen=True)
class CodeTests:
    inputs: list
    outputs: list
    fn_name: str | None  # None: stdin/stdout tests

    @classmethod
    def parse(cls, answer: str | None) -> CodeTests:
        """The tests of a row's ground truth; TaskError in one phrase when they are not tests."""
        try:
            tests = json.loads(answer) if isinstance(answer, str) else None
        except ValueError:
            tests = None
        lists = isinstance(tests, dict) and isinstance(tests.get("inputs"), list) \
            and isinstance(tests.get("outputs"), list)
        if not lists or len(tests["inputs"]) != len(tests["outputs"]):
            raise TaskError("its ground truth is not code tests: a JSON object with lists 'inputs' and "
                            "'outputs' of one length (and 'fn_name' for call tests)")
        fn_name = tests.get("fn_name")
        if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
            raise TaskError(f"its tests' fn_name {fn_name!r} is not a Python name")
        if fn_name is not None and not all(isinstance(x, list) for x in tests["inputs"]):
            raise TaskError("its call tests' inputs are not lists of arguments")
        if fn_name is None and not all(isinstance(x, str) for x in tests["inputs"] + tests["outputs"]):
            raise TaskError("its stdin/stdout tests' inputs and outputs are not all strings")
        return cls(tests["inputs"], tests["outputs"], fn_name)


STDIO_WRAPPER = '''\
import contextlib, io, sys
_SOURCE = {source!r}
def {name}(stdin):
    out = io.StringIO()
    sys.stdin = io.StringIO(stdin)
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(_SOURCE, "solution.py", "exec"), {{"__name__": "__main__"}})
        except SystemExit:
            pass
    return out.getvalue()
'''


def _parses(code: str) -> bool:
    import ast

    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return bool(code.strip())


def _program(completion: str) -> str | None:
    """A stdin/stdout program in a completion (after any </think>): the last fenced block marked Python (or
    unmarked) that parses, else the whole text when it parses; None when there is none."""
    text = completion.rsplit("</think>", 1)[-1]
    python = ("", "python", "py", "python3")
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in python]
    return next((b for b in reversed(blocks) if _parses(b)), text if not blocks and _parses(text) else None)


def _same_lines(got: Any, want: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return isinstance(got, str) and lines(got) == lines(want)


def code_judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    """The completion's program on the row's tests, in the sandbox (module docstring)."""
    from .calls import Raised, Remote, call_tests
    from .code import SECONDS_PER_TEST, Verdict, default_sandbox, extract_code, run_tests

    tests = CodeTests.parse(answer)
    if tests.fn_name is not None:
        code = extract_code(completion, tests.fn_name)
        if code is None:
            return Verdict.no_code(len(tests.inputs)).judgement
        return run_tests(code, tests.fn_name, tests.inputs, tests.outputs, default_sandbox(), 0.0).judgement
    code = _program(completion)
    if code is None:
        return Verdict.no_code(len(tests.inputs)).judgement

    def run(remote: Remote) -> list[str]:
        results = []
        for stdin, want in zip(tests.inputs, tests.outputs):
            remote.begin(SECONDS_PER_TEST)
            try:
                results.append("passed" if _same_lines(remote(stdin), want) else "wrong")
            except Raised as e:
                results.append(e.name)
        return results

    wrapper = STDIO_WRAPPER.format(source=code, name=STDIO_FUNCTION)
    results, outcome = call_tests(default_sandbox(), wrapper, STDIO_FUNCTION, run)
    clean = results is not None and all(r in ("passed", "wrong") for r in results)
    return Verdict.judged(results, outcome, len(tests.inputs), clean, 0.0).judgement


def check_code_tests(answer: str | None) -> None:
    CodeTests.parse(answer)


# ---------------------------------------------------------------- a user's function

USER_ERRORS = (Exception, SystemExit)  # what user code may end with, named; KeyboardInterrupt is not


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While user code runs, what it writes to stdout goes to stderr (module docstring)."""
    if sys.stdout is not None:
        sys.stdout.flush()  # the command's own pending output stays ahead, on stdout
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2: Python's stdout is still redirected
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward function, loaded from `path` (`spec` is how the command line named it)."""

    spec: str
    path: Path
    name: str
    fn: Callable
    style: str  # "verl" or "trl"

    @property
    def task_name(self) -> str:
        return f"reward-fn:{self.path.name}:{self.name}"

    def where(self, metadata: dict[str, Any]) -> str:
        row, file = metadata.get("row"), metadata.get("file")
        return f"{row_of(row)} of {file}" if row is not None else "a row"

    def judge_many(self, items: list[Item]) -> list[Judgement]:
        with stdout_to_stderr():
            return self._verl(items) if self.style == "verl" else self._trl(items)

    def _verl(self, items: list[Item]) -> list[Judgement]:
        out = []
        for completion, answer, meta in items:
            columns = meta.get("columns") or {}
            try:
                value = self.fn(data_source=columns.get("data_source"), solution_str=completion,
                                ground_truth=answer, extra_info=columns.get("extra_info"))
            except USER_ERRORS as e:  # the user's error, named with its row
                raise self._raised(e, meta) from None
            out.append(self._judgement(value, meta))
        return out

    def _trl(self, items: list[Item]) -> list[Judgement]:
        try:
            values = self._call_trl(items)
        except USER_ERRORS as e:  # named with its row: the batch's items again, one at a time
            if len(items) == 1:
                raise self._raised(e, items[0][2]) from None
            return [j for item in items for j in self._trl([item])]
        if not isinstance(values, list | tuple) or len(values) != len(items):
            sized = isinstance(values, list | tuple)
            got = f"a {type(values).__name__}" + (f" of {len(values)}" if sized else "")
            raise RewardError(f"--reward-fn {self.spec} returned {got} for {len(items)} completions; a TRL "
                              "reward function returns a list of one number per completion")
        return [self._judgement(v, meta) for v, (_, _, meta) in zip(values, items)]

    def _call_trl(self, items: list[Item]) -> Any:
        prompts, completions, columns = [], [], {}
        keys = list(dict.fromkeys(k for _, _, meta in items for k in (meta.get("columns") or {})))
        for completion, _, meta in items:
            prompt = meta.get("prompt")
            prompts.append(prompt)
            conversational = isinstance(prompt, list)
            completions.append([{"role": "assistant", "content": completion}] if conversational
                               else completion)
            for k in keys:
                columns.setdefault(k, []).append((meta.get("columns") or {}).get(k))
        return self.fn(prompts=prompts, completions=completions, **columns)

    def _raised(self, e: BaseException, meta: dict[str, Any]) -> RewardError:
        exited = isinstance(e, SystemExit)
        advice = "; a reward function returns its score instead of exiting" if exited else ""
        return RewardError(f"--reward-fn {self.spec} {_ended(e)} on {self.where(meta)}{advice}")

    def _judgement(self, value: Any, meta: dict[str, Any]) -> Judgement:
        returned = value
        extra = None
        if isinstance(value, dict):
            if "score" not in value:
                keys = _cut(", ".join(map(repr, value))) or "none"
                raise RewardError(f"--reward-fn {self.spec} returned a dict without a 'score' key (its keys: "
                                  f"{keys}) on {self.where(meta)}; a verl reward function returns a finite "
                                  "number or a dict with a numeric 'score'")
            extra = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"--reward-fn {self.spec} returned {_shown(returned)} on {self.where(meta)}; "
                              "a reward function returns a finite number or a dict with a numeric 'score'")
        return Judgement(float(value), None, extra=extra)


def _ended(e: BaseException) -> str:
    """How user code ended: "exited (sys.exit(0))" or "raised ValueError (its message's first line)"."""
    if isinstance(e, SystemExit):
        return f"exited (sys.exit({'' if e.code is None else repr(e.code)}))"
    message = (str(e).strip().splitlines() or [""])[0]
    return f"raised {type(e).__name__}" + (f" ({message})" if message else "")


def _shown(value: Any) -> str:
    return _cut(repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def load_reward_function(spec: str) -> RewardFunction:
    """`path.py:function` loaded and its convention read from its signature; RewardError in one sentence."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise RewardError(f"--reward-fn {spec!r} is not path.py:function (a Python file and the name of a "
                          "function in it)")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise RewardError(f"--reward-fn {spec}: no such file {path}")
    module_name = f"sparrow_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"--reward-fn {spec}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        with stdout_to_stderr():
            module_spec.loader.exec_module(module)
    except USER_ERRORS as e:  # the user's file, named
        sys.modules.pop(module_name, None)
        raise RewardError(f"--reward-fn {spec}: importing {path} {_ended(e)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"--reward-fn {spec}: {path} has no function {name!r}")
    return RewardFunction(spec, path, name, fn, _style(fn, spec))


def _style(fn: Callable, spec: str) -> str:
    params = inspect.signature(fn).parameters
    if "solution_str" in params:
        return "verl"
    if "completions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "trl"
    raise RewardError(f"--reward-fn {spec} takes ({', '.join(params)}), neither verl's compute_score("
                      "data_source, solution_str, ground_truth, extra_info) nor TRL's "
                      "f(completions, **kwargs)")


# ---------------------------------------------------------------- the registry


def _reward(name: str, description: str, **fields: Any) -> Task:
    return Task(name, "reward", description, _no_prompts, lambda *a: 0.0, **fields)


REWARDS: dict[str, Task] = {
    MATH: _reward(MATH, "math-verify of the completion against the ground truth", judge=math_judge),
    CODE: _reward(CODE, "the dataset's code tests run on the completion's program in the sandbox",
                  judge=code_judge, runs_code=True, check_answer=check_code_tests),
}
CHOICES = {"math": MATH, "code": CODE}
_LOADED: dict[str, str] = {}  # --reward-fn spec -> its task name


def register_function(spec: str) -> str:
    """The task name of a user's reward function, loaded once per process (`--reward-fn`)."""
    if spec not in _LOADED:
        reward = load_reward_function(spec)
        REWARDS[reward.task_name] = _reward(reward.task_name, f"the user's function {spec}",
                                            judge_many=reward.judge_many, clamp=False, needs_answer=False)
        _LOADED[spec] = reward.task_name
    return _LOADED[spec]
