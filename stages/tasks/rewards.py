"""The built-in rewards for users' datasets: `math` (math-verify) and `code` (the dataset's tests in our
sandbox), each a `Task` found by `get_task` beside the tasks, and how each reads a row's ground truth
(`answer_for`). A user's own function (`--reward-fn path.py:function`) is `reward_function.py`'s; it
registers itself in `REWARDS` beside these.

Design decisions:
- `math`, as verl's math-verify reward: the ground truth is read as LaTeX inside \\boxed{}, the completion
  by math-verify's expression and LaTeX extraction; reward 1 when math-verify finds them equal, else 0
  (status unparsed when nothing was extracted from the completion). A ground truth in GSM8K's solution
  form ("... #### 72", the `answer` column of openai/gsm8k) is read as the number after ####, as verl's
  gsm8k preprocessing extracts it, since a verl user's gold is that number. A number in E notation (a
  float such as 1e-05 stored as a number, whose text Python writes so, or such text) is given as
  `1 \\times 10^{-5}`: read as LaTeX, `1e-05` is 1 * e - 5 with Euler's e. A ground truth that is empty,
  NaN, a missing-value mark as pandas writes them ("N/A", "nan", "None"...) or that math-verify reads no
  expression from would pay 0 for every completion (TRL's accuracy reward skips such a row): it is
  refused before any work, naming the row and the column (`check_math_gold`, which reads the row's
  columns), and at scoring too.
- `code`: the ground truth is the tests, JSON as verl's and the APPS/TACO datasets keep them: `inputs` and
  `outputs` lists, with `fn_name` for call tests (the completion's function called on each input list,
  its value compared with the output as JSON) and without it for stdin/stdout tests (the completion's
  program, its last Python block, run on each input as stdin, its stdout compared line by line, trailing
  spaces ignored). The program runs in the code tasks' sandbox (`code.py`), one run per completion;
  reward = tests passed / tests, as `code.Verdict` judges a run (0 for a run that times out, crashes or
  floods its output).
  Tests without a case are refused with the row, before any work: no completion could earn a reward.
- Rows reach a reward in the users' dataset layout (`core/user_data.py`): metadata {"format", "file",
  "row", "prompt", "columns", "answer_column"?}; a reward reads the ground truth from the row's columns
  (`answer_column_of`), as the Python values `datasets` gives (a datetime, a Decimal, bytes:
  `extras.column_value`).
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from .base import Judgement, RewardError, Task, TaskError, row_of
from .extras import column_value

MATH, CODE = "math-verify", "code-tests"
ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target")  # a TRL dataset's answer, the first found
STDIO_FUNCTION = "__sparrow_stdio_main"
GOLD_ADVICE = ("give the final answer alone (a number or LaTeX), leave the row out, or score such rows with "
               "--reward-fn")


def cut(text: str) -> str:
    """A text as a message quotes it: at most 60 characters, a longer one cut with "..."."""
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- math


# verl's examples/data_preprocess/gsm8k.py: the final answer of a GSM8K solution, commas dropped
_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")
# what pandas reads as a missing value in a CSV (read_csv's default na_values): a gold that is one of
# these arrived as a missing answer
MISSING_MARKS = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND",
                           "1.#QNAN", "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})
_NUMBER = re.compile(r"-?(\d[\d,]*(\.\d*)?|\.\d+)")


def math_text(answer: str) -> str:
    """The text math-verify compares with: a GSM8K solution ("... #### 72") gives the number after ####,
    as verl's gsm8k preprocessing extracts it; any other text is itself."""
    final = _GSM8K_FINAL.search(answer)
    return final.group(1).replace(",", "") if final else answer


_SCIENTIFIC = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)\s*")


def scientific_as_latex(text: str) -> str:
    """A number in E notation (`1e-05`, Python's text of a small or large float) as LaTeX, `1 \\times
    10^{-5}`: read as LaTeX, which is how the ground truth is read, `1e-05` is 1 * e - 5 (Euler's e)."""
    match = _SCIENTIFIC.fullmatch(text)
    if match is None:
        return text
    mantissa, exponent = match.groups()
    return f"{mantissa.rstrip('.')} \\times 10^{{{int(exponent)}}}"


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> tuple:
    """The ground truth as math-verify reads it: LaTeX inside \\boxed{} (parsed once per text)."""
    from math_verify import LatexExtractionConfig, parse

    return tuple(parse("\\boxed{" + answer + "}", extraction_config=[LatexExtractionConfig()]))


def unreadable_gold(answer: str) -> str | None:
    """Why math-verify cannot score against `answer` (a phrase), None when it can: an empty text, a
    missing-value mark, or a text it reads no expression from (it returns the text alone, which no
    completion verifies against)."""
    text = answer.strip()
    if not text:
        return "is empty"
    if text in MISSING_MARKS:
        return "is a missing-value mark (pandas reads it as NaN)"
    if _NUMBER.fullmatch(text) or any(not isinstance(g, str) for g in _gold(answer)):
        return None
    return "holds no answer math-verify can read"


def math_judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    """1 when math-verify finds the completion's answer equal to the ground truth (module docstring); a
    ground truth it cannot read (refused before any work, `check_math_gold`) is a RewardError, never a 0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    answer = str(answer)
    why = unreadable_gold(answer)
    if why is not None:
        meta = metadata or {}
        row = f" of {row_of(meta['row'])} of {meta.get('file')}" if isinstance(meta.get("row"), int) else ""
        raise RewardError(f"the math-verify reward's ground truth {cut(repr(answer))}{row} {why}; "
                          f"{GOLD_ADVICE}")
    given = parse(completion, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])
    if not given:
        return Judgement(0.0, "unparsed")
    correct = bool(verify(list(_gold(answer)), given))
    return Judgement(float(correct), "correct" if correct else "incorrect")


def answer_column_of(metadata: dict[str, Any], columns: dict[str, Any]) -> str:
    """The column a row's ground truth was read from: its --answer-column, else verl's
    reward_model.ground_truth, a TRL dataset's first ANSWER_COLUMNS, our prompts' answer."""
    if metadata.get("answer_column"):
        return metadata["answer_column"]
    if metadata.get("format") == "verl":
        return "reward_model.ground_truth"
    if metadata.get("format") == "trl":
        return next((c for c in ANSWER_COLUMNS if c in columns), "answer")
    return "answer"


def check_math_gold(metadata: dict[str, Any]) -> None:
    """TaskError in one phrase, naming the row and the column, when a row's ground truth is one math-verify
    cannot score against (`unreadable_gold`, or NaN): it would pay 0 for every completion. The ground truth
    is read from the row's columns (`answer_column_of`); a null one is refused where the rows are read."""
    columns = column_value(metadata.get("columns") or {})
    column = answer_column_of(metadata, columns)
    value: Any = columns
    for key in column.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return
    shown = cut(repr(value))
    row = f" of {row_of(metadata['row'])}" if isinstance(metadata.get("row"), int) else ""
    if isinstance(value, float) and not math.isfinite(value):
        why = "is NaN, a missing value" if math.isnan(value) else "is infinite"
    else:
        try:
            why = unreadable_gold(answer_for(MATH, value))
        except ValueError:  # not one answer: refused where the rows are read
            return
    if why is not None:
        raise TaskError(f"the ground truth {shown} in column {column!r}{row} {why}, so math-verify would "
                        f"score every completion 0; {GOLD_ADVICE}")


# ---------------------------------------------------------------- code


@dataclass(frozen=True)
class CodeTests:
    """A row's code tests: each input with the output it should give."""

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
        if not tests["inputs"]:
            raise TaskError("its tests have no cases ('inputs' and 'outputs' are empty lists), so no "
                            "completion could pass one")
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
    """Whether `code` is a program: not empty, at most `code.MAX_CODE_CHARS` characters, and parsing
    (`code.parses`: a nesting too deep or a tree too large counts as not parsing, never as a crash)."""
    from .code import MAX_CODE_CHARS, parses

    return bool(code.strip()) and len(code) <= MAX_CODE_CHARS and parses(code) is not None


def _program(completion: str) -> str | None:
    """A stdin/stdout program in a completion (after any </think>): the last fenced block marked Python (or
    unmarked) that parses, else the whole text when it parses; None when there is none."""
    from .code import fenced_blocks

    text = completion.rsplit("</think>", 1)[-1]
    python = ("", "python", "py", "python3")
    blocks = [b.code for b in fenced_blocks(text) if b.language.lower() in python]
    return next((b for b in reversed(blocks) if _parses(b)), text if not blocks and _parses(text) else None)


def _same_lines(got: Any, want: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return isinstance(got, str) and lines(got) == lines(want)


def code_judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    """The completion's program on the row's tests, in the sandbox (module docstring)."""
    from .code import Verdict, default_sandbox, extract_code, run_tests

    tests = CodeTests.parse(answer)
    code = extract_code(completion, tests.fn_name) if tests.fn_name is not None else _program(completion)
    if code is None:
        return Verdict.no_code(len(tests.inputs)).judgement
    if tests.fn_name is not None:
        return run_tests(code, tests.fn_name, tests.inputs, tests.outputs, default_sandbox(), 0.0).judgement
    return _stdio_judgement(code, tests)


def _stdio_judgement(code: str, tests: CodeTests) -> Judgement:
    """A stdin/stdout program run once in the sandbox, fed each test's input, its output compared with the
    test's line by line."""
    from .calls import Raised, Remote, call_tests
    from .code import SECONDS_PER_TEST, Result, Verdict, default_sandbox

    def run(remote: Remote) -> list[Result]:
        results = []
        for stdin, want in zip(tests.inputs, tests.outputs):
            remote.begin(SECONDS_PER_TEST)
            try:
                results.append(Result.PASSED if _same_lines(remote(stdin), want) else Result.FAILED)
            except Raised as e:  # whatever the program named its exception (code.Result)
                results.append(Result.of(e))
        return results

    wrapper = STDIO_WRAPPER.format(source=code, name=STDIO_FUNCTION)
    results, outcome = call_tests(default_sandbox(), wrapper, STDIO_FUNCTION, run)
    return Verdict.judged(results, outcome, len(tests.inputs), 0.0).judgement


def check_code_tests(answer: str | None) -> None:
    """TaskError in one phrase when a row's ground truth is not code tests (`CodeTests.parse`)."""
    CodeTests.parse(answer)


# ---------------------------------------------------------------- a row's ground truth


def answer_for(reward: str, answer: Any) -> Any:
    """The ground truth as the reward `reward` reads it (module docstring): a user's function gets it as
    stored; math-verify gets text (a GSM8K solution's final number, `math_text`), or a number, a decimal or
    a date as its text (a bool, bytes, list or struct is refused: it compares the completion with one
    answer); code gets its tests as JSON text. ValueError in one phrase."""
    if reward not in (MATH, CODE):
        return answer
    answer = column_value(answer)
    if isinstance(answer, decimal.Decimal | datetime.date | datetime.time | datetime.timedelta):
        answer = str(answer)
    if answer is None or isinstance(answer, str):
        return scientific_as_latex(math_text(answer)) if reward == MATH and answer is not None else answer
    if reward == MATH and (isinstance(answer, bool) or not isinstance(answer, int | float)):
        shown = cut(json.dumps(answer, default=str))
        kind = {bool: "a bool", list: "a list", dict: "a struct", bytes: "bytes"}.get(type(answer),
                                                                                  type(answer).__name__)
        fix = ("name the field that holds the answer with --answer-column column.field"
               if isinstance(answer, dict) else "score such rows with --reward-fn")
        raise ValueError(f"its ground truth is {kind} ({shown}), not text or a number, and math-verify "
                         f"compares the completion with one answer ({fix})")
    if isinstance(answer, dict | list):
        return json.dumps(answer, default=str)
    return scientific_as_latex(str(answer)) if reward == MATH else str(answer)


# ---------------------------------------------------------------- the registry


def _no_prompts(*args, **kwargs):
    raise TaskError("a dataset reward scores prompts; it does not generate them")


def dataset_reward(name: str, description: str, **fields: Any) -> Task:
    """A reward for users' datasets as a `Task`: it scores, it never generates prompts."""
    return Task(name, "reward", description, _no_prompts, lambda *a: 0.0, **fields)


REWARDS: dict[str, Task] = {
    MATH: dataset_reward(MATH, "math-verify of the completion against the ground truth", judge=math_judge,
                         check_metadata=check_math_gold),
    CODE: dataset_reward(CODE, "the dataset's code tests run on the completion's program in the sandbox",
                         judge=code_judge, runs_code=True, check_answer=check_code_tests),
}
CHOICES = {"math": MATH, "code": CODE}


def reward_choice(name: str) -> str | None:
    """The task of a --reward, given by its choice or by the task name its artifacts record (math-verify,
    code-tests; any case, _ for -); None for anything else."""
    key = name.strip().lower().replace("_", "-")
    return CHOICES.get(key) or (key if key in CHOICES.values() else None)
