"""Rewards for users' own datasets: `math` (math-verify), `code` (the dataset's tests in our sandbox) and a
user's function (`--reward-fn path.py:function`), each a `Task` found by `get_task` beside the tasks.

Design decisions:
- `math`, as verl's math-verify reward: the ground truth is read as LaTeX inside \\boxed{}, the completion
  by math-verify's expression and LaTeX extraction; reward 1 when math-verify finds them equal, else 0
  (status unparsed when nothing was extracted from the completion). A ground truth in GSM8K's solution
  form ("... #### 72", the `answer` column of openai/gsm8k) is read as the number after ####, as verl's
  gsm8k preprocessing extracts it, since a verl user's gold is that number. A ground truth that is empty,
  NaN, a missing-value mark as pandas writes them ("N/A", "nan", "None"...) or that math-verify reads no
  expression from would pay 0 for every completion (TRL's accuracy reward skips such a row): it is
  refused before any work, naming the row and the column (`check_math_gold`, which reads the row's
  columns), and at scoring too.
- `code`: the ground truth is the tests, JSON as verl's and the APPS/TACO datasets keep them: `inputs` and
  `outputs` lists, with `fn_name` for call tests (the completion's function called on each input list,
  its value compared with the output as JSON) and without it for stdin/stdout tests (the completion's
  program, its last Python block, run on each input as stdin, its stdout compared line by line, trailing
  spaces ignored). The
  program runs in the code tasks' sandbox (`code.py`), one run per completion; reward = tests passed /
  tests, as `code.Verdict` judges a run (0 for a run that times out, crashes or floods its output).
  Tests without a case are refused with the row, before any work: no completion could earn a reward.
- `--reward-fn` names a file and a function in it, `path.py:function`; a file named alone means its
  `compute_score`, as verl's `custom_reward_function.name` defaults to it. A module's dotted import path
  (TRL's `reward_funcs="my_lib.rewards.fn"`) is not taken: a file is, imported as a script.
- A user's function runs in this process, as verl and TRL run theirs. Which convention it follows is read
  from its signature: a `solution_str` parameter is verl's `compute_score(data_source, solution_str,
  ground_truth, extra_info)`, called once per completion with keyword arguments; else a `completions`
  parameter (or **kwargs) is TRL's `f(prompts, completions, **columns) -> list[float]`, called once per
  batch with the dataset's other columns as lists, but for `completion` and `completion_ids`, which
  GRPOTrainer leaves out as it does `prompt` (it passes its own completions). A verl function may return
  a number (a bool, a numpy scalar, or a 0-d array or tensor, whose `.item()` verl's reward manager
  takes) or a dict with a numeric `score` (the dict's other fields are kept as the completion's
  `extra`); anything else, a non-finite number (an int too large for a float is one), or a TRL result of
  the wrong length is refused in one sentence, a dict without `score` naming the keys it has. A function
  that raises, or exits (SystemExit: sys.exit() in a script's scorer would otherwise end the command
  silently, with nothing written), is named with the dataset row of the completion (a TRL batch that
  raises is called again one item at a time to find it); KeyboardInterrupt still interrupts. Importing
  the file is held to the same rule.
- A verl function's `extra_info` is what verl's reward manager passes: a copy of the row's extra_info
  as a dict (`{}` where the column is missing or null, as verl's RLHFDataset reads it) with the keys the
  manager adds: `num_turns` 2 (a prompt and its completion, as verl's single-turn agent loop counts them)
  and `rollout_reward_scores` {} (no tool scored the rollout). So a function written for verl's trainer
  runs here unchanged, and what it changes in the dict does not reach another sample.
- The signature is checked before any work, with `inspect.signature(...).bind` of what will be passed:
  verl's four keywords when the file is loaded; for TRL, prompts and completions when it is loaded, and
  the dataset's columns as each row is checked (`Task.check_metadata`, which rollout, train and reward
  run before any work). A parameter TRL fills and Sparrow does not (completion_ids, trainer_state) must
  have a default.
- TRL's `log_metric(name, value)` and `log_extra(column, values)` are passed as GRPOTrainer passes them,
  to a function that names them or takes **kwargs. What a call logs is kept with the completions it
  scored, in each one's extra fields (`reward_extra` in rollouts and rewards): a column's own value, and
  the call's mean of each metric. `logged_metrics` also gives the metrics' means since it was last read,
  for a command that reports them per step (TRL averages them over a logging step).
- A TRL function's result is any sequence, as TRL iterates it: a list, a tuple, a 1-d numpy array or
  tensor. TRL reads a None reward as "not applicable" and sums the other reward functions' rewards
  without it; Sparrow scores with one function, where that sum is empty (a NaN would spoil the group's
  advantage, a 0 would be a reward the function never gave), so None is refused in one sentence that
  says so.
- An async function (TRL accepts them) is awaited: each call's coroutine runs to its end in its own
  event loop (`asyncio.run`), one call at a time.
- The file is imported as `python file.py` would run it, with its folder first on sys.path, so it can
  import the modules beside it; the folder is on sys.path while the file is imported and while the
  function runs (it may import lazily), not after. A relative import fails there as in a script, and the
  refusal says to import the module by its name.
- User code's output goes to stderr while it runs (imported or called): the command's stdout may be
  carrying its data (`-o -` Parquet, `-f json`), and verl's reward functions print. Python's sys.stdout
  is redirected, and so is descriptor 1 (C extensions, child processes) where it is open.
- Rows reach a reward in the users' dataset layout (`core/user_data.py`): metadata {"format", "file",
  "row", "prompt", "columns", "answer_column"?}, so a function sees the columns its trainer would pass,
  as the Python values `datasets` gives (a datetime, a Decimal, bytes: `extras.column_value`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import functools
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import Judgement, RewardError, Task, TaskError, row_of
from .extras import column_value

MATH, CODE = "math-verify", "code-tests"
ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target")  # a TRL dataset's answer, the first found
STDIO_FUNCTION = "__sparrow_stdio_main"

Item = tuple[str, "str | None", dict[str, Any]]  # (completion, answer, metadata)


def _no_prompts(*args, **kwargs):
    raise TaskError("a dataset reward scores prompts; it does not generate them")


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
        raise RewardError(f"the math-verify reward's ground truth {_cut(repr(answer))}{row} {why}; "
                          f"{GOLD_ADVICE}")
    given = parse(completion, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()])
    if not given:
        return Judgement(0.0, "unparsed")
    correct = bool(verify(list(_gold(answer)), given))
    return Judgement(float(correct), "correct" if correct else "incorrect")


GOLD_ADVICE = ("give the final answer alone (a number or LaTeX), leave the row out, or score such rows with "
               "--reward-fn")


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
    shown = _cut(repr(value))
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
    from .calls import Raised, Remote, call_tests
    from .code import SECONDS_PER_TEST, Result, Verdict, default_sandbox, extract_code, run_tests

    tests = CodeTests.parse(answer)
    if tests.fn_name is not None:
        code = extract_code(completion, tests.fn_name)
        if code is None:
            return Verdict.no_code(len(tests.inputs)).judgement
        return run_tests(code, tests.fn_name, tests.inputs, tests.outputs, default_sandbox(), 0.0).judgement
    code = _program(completion)
    if code is None:
        return Verdict.no_code(len(tests.inputs)).judgement

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
        return math_text(answer) if reward == MATH and answer is not None else answer
    if reward == MATH and (isinstance(answer, bool) or not isinstance(answer, int | float)):
        shown = json.dumps(answer, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        kind = {bool: "a bool", list: "a list", dict: "a struct", bytes: "bytes"}.get(type(answer),
                                                                                  type(answer).__name__)
        fix = ("name the field that holds the answer with --answer-column column.field"
               if isinstance(answer, dict) else "score such rows with --reward-fn")
        raise ValueError(f"its ground truth is {kind} ({shown}), not text or a number, and math-verify "
                         f"compares the completion with one answer ({fix})")
    return json.dumps(answer, default=str) if isinstance(answer, dict | list) else str(answer)


VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ONLY = ("completion_ids", "trainer_state")  # what TRL passes its functions and Sparrow does not
TRL_UNPASSED = ("prompt", "completion", "completion_ids")  # dataset columns GRPOTrainer does not pass
DEFAULT_FUNCTION = "compute_score"  # verl's custom_reward_function.name default
TRL_LOGGERS = ("log_metric", "log_extra")  # what TRL passes its functions for logging, and so does Sparrow


@dataclass
class Logged:
    """What a TRL function logged in one call through the `log_metric(name, value)` and
    `log_extra(column, values)` keywords, as GRPOTrainer takes them: scalars by name (several in one call
    are averaged, as TRL averages them over a logging step), and per-completion columns."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(str(column), []).extend(values)

    def extras(self, n: int, spec: str) -> list[dict[str, Any]]:
        """The logged values as `n` completions' extra fields: a metric's mean on each of them, a column's
        own value on each; RewardError when a column does not have one value per completion."""
        for column, values in self.columns.items():
            if len(values) != n:
                raise RewardError(f"--reward-fn {spec} logged {len(values)} values for column {column!r} "
                                  f"with log_extra, for a batch of {n} completions; log_extra takes one "
                                  "value per completion")
        means = {name: sum(v) / len(v) for name, v in self.metrics.items()}
        for name, values in self.metrics.items():
            total = _METRICS.setdefault(name, [0.0, 0])
            total[0] += sum(values)
            total[1] += len(values)
        return [{**means, **{c: v[i] for c, v in self.columns.items()}} for i in range(n)]


_METRICS: dict[str, list] = {}  # name -> [sum, count] of what log_metric logged since `logged_metrics`


def logged_metrics() -> dict[str, float]:
    """The mean of each metric users' reward functions logged with log_metric since the last call (as TRL
    averages them over a logging step), then forgotten; for a command's step metrics or summary."""
    means = {name: total / count for name, (total, count) in _METRICS.items() if count}
    _METRICS.clear()
    return means


def verl_extra_info(value: Any) -> Any:
    """The `extra_info` verl's naive reward manager passes for a row's extra_info column (module
    docstring); a value that is not a struct is passed as it is."""
    if value is not None and not isinstance(value, Mapping):
        return value
    return {**(value or {}), "num_turns": 2, "rollout_reward_scores": {}}


def reward_fn_spec(spec: str) -> str:
    """A --reward-fn as path.py:function: a file named alone (or whose name holds a colon) means its
    DEFAULT_FUNCTION, as in verl; anything else as given (`load_reward_function` names what is wrong)."""
    path_text, sep, name = spec.rpartition(":")
    if sep and path_text and name.isidentifier():
        return spec
    if not sep or Path(spec).expanduser().is_file():
        return f"{spec}:{DEFAULT_FUNCTION}"
    return spec


def reward_fn_sha256(spec: str | None) -> str:
    """The sha256 of the file that a --reward-fn path.py:function names; "" for none, or for a file that
    cannot be read (loading the reward names it). Modules the file imports are not part of it."""
    if not spec:
        return ""
    import hashlib

    file = Path(reward_fn_spec(spec).rpartition(":")[0]).expanduser()
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError:
        return ""


def reward_provenance(reward: str | None, reward_fn: str | None) -> dict[str, str | None]:
    """What scored rewards, under the keys every artifact and run config records it by: `reward`
    (--reward's name), `reward_fn` (--reward-fn's path.py:function) and `reward_fn_sha256`. Both None:
    each prompt's own task scorer. The file is named by its absolute path."""
    if reward_fn:
        file, _, function = reward_fn_spec(reward_fn).rpartition(":")
        reward_fn = f"{Path(file).expanduser().absolute()}:{function}"
    return {"reward": reward, "reward_fn": reward_fn, "reward_fn_sha256": reward_fn_sha256(reward_fn)}


@contextlib.contextmanager
def working_directory_kept() -> Iterator[None]:
    """User code that changes the working directory (os.chdir) has it changed back when it returns, so
    the command's relative paths (its outputs, the run folder) still name what the user gave."""
    cwd = os.getcwd()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.chdir(cwd)


@contextlib.contextmanager
def folder_on_path(folder: Path) -> Iterator[None]:
    """The reward file's folder first on sys.path while user code runs, as `python file.py` has it."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward function, loaded from `path` (`spec` is how the command line named it)."""

    spec: str
    path: Path
    name: str
    fn: Callable
    style: str  # "verl" or "trl"
    loggers: tuple[str, ...] = ()  # the TRL_LOGGERS it takes (by name or through **kwargs)
    checked: set[frozenset[str]] = field(default_factory=set, compare=False, repr=False)  # TRL columns

    @property
    def task_name(self) -> str:
        return f"reward-fn:{self.path.name}:{self.name}"

    def where(self, metadata: dict[str, Any]) -> str:
        row, file = metadata.get("row"), metadata.get("file")
        return f"{row_of(row)} of {file}" if row is not None else "a row"

    def check_row(self, metadata: dict[str, Any]) -> None:
        """TaskError in one phrase when a TRL function cannot take a row's columns as keywords (verl's
        keywords are checked when the file loads); each set of columns is checked once."""
        columns = _passed(metadata.get("columns") or {})
        if self.style != "trl" or frozenset(columns) in self.checked:
            return
        try:
            inspect.signature(self.fn).bind(prompts=None, completions=None,
                                            **dict.fromkeys([*columns, *self.loggers]))
        except TypeError as e:
            shown = ", ".join(columns) or "none"
            advice = ("a TRL reward function takes **kwargs for the columns it does not read"
                      if "unexpected keyword" in str(e) else "TRL fills each parameter beyond prompts and "
                      "completions from the dataset's column of that name, or with its own "
                      f"{', '.join(TRL_LOGGERS + TRL_ONLY)}, of which Sparrow passes all but "
                      f"{' and '.join(TRL_ONLY)}")
            raise TaskError(f"--reward-fn {self.spec} takes ({_parameters(self.fn)}), which cannot take "
                            "what TRL passes it for this row: prompts, completions and the dataset's "
                            f"columns ({shown}) as keywords ({e}); {advice}") from None
        self.checked.add(frozenset(columns))

    def judge_many(self, items: list[Item]) -> list[Judgement]:
        with stdout_to_stderr(), working_directory_kept(), folder_on_path(self.path.resolve().parent):
            return self._verl(items) if self.style == "verl" else self._trl(items)

    def _verl(self, items: list[Item]) -> list[Judgement]:
        out = []
        for completion, answer, meta in items:
            columns = column_value(meta.get("columns") or {})
            try:
                value = _awaited(self.fn(data_source=columns.get("data_source"), solution_str=completion,
                                         ground_truth=column_value(answer),
                                         extra_info=verl_extra_info(columns.get("extra_info"))))
            except USER_ERRORS as e:  # the user's error, named with its row
                raise self._raised(e, meta) from None
            out.append(self._judgement(value, meta))
        return out

    def _trl(self, items: list[Item]) -> list[Judgement]:
        """One call for the batch (module docstring); what it logged lands in each completion's extra
        fields, and only a call that returned counts (a batch called again item by item logs again)."""
        logged = Logged()
        try:
            values = _awaited(self._call_trl(items, logged))
        except USER_ERRORS as e:  # named with its row: the batch's items again, one at a time
            if len(items) == 1:
                raise self._raised(e, items[0][2]) from None
            return [j for item in items for j in self._trl([item])]
        listed = _as_list(values)
        if listed is None or len(listed) != len(items):
            shape = getattr(values, "shape", None)
            got = f"a {type(values).__name__}" + (f" of {len(listed)}" if listed is not None else
                                                  f" of shape {tuple(shape)}" if shape is not None else "")
            raise RewardError(f"--reward-fn {self.spec} returned {got} for {len(items)} completions; a TRL "
                              "reward function returns a list of one number per completion")
        for v, (_, _, meta) in zip(listed, items):
            if v is None:
                raise RewardError(f"--reward-fn {self.spec} returned None on {self.where(meta)}; TRL reads "
                                  "None as 'not applicable' and leaves the completion to its other reward "
                                  "functions, but Sparrow scores with this one function alone, so it must "
                                  "return a number for every completion")
        judged = [self._judgement(v, meta) for v, (_, _, meta) in zip(listed, items)]
        extras = logged.extras(len(items), self.spec)
        return [Judgement(j.reward, j.status, j.tests_passed, j.tests_total,
                          {**(j.extra or {}), **extra} or None) for j, extra in zip(judged, extras)]

    def _call_trl(self, items: list[Item], logged: Logged) -> Any:
        """The function called as GRPOTrainer calls it: prompts, completions, each column it passes as a
        list of the batch's values (as `datasets` gives them, `column_value`), and the loggers it takes."""
        prompts, completions, columns = [], [], {}
        keys = list(dict.fromkeys(k for _, _, meta in items for k in _passed(meta.get("columns") or {})))
        for completion, _, meta in items:
            prompt = column_value(meta.get("prompt"))
            prompts.append(prompt)
            conversational = isinstance(prompt, list)
            completions.append([{"role": "assistant", "content": completion}] if conversational
                               else completion)
            row = column_value(meta.get("columns") or {})
            for k in keys:
                columns.setdefault(k, []).append(row.get(k))
        loggers = {name: getattr(logged, name) for name in self.loggers}
        return self.fn(prompts=prompts, completions=completions, **{**columns, **loggers})

    def _raised(self, e: BaseException, meta: dict[str, Any]) -> RewardError:
        exited = isinstance(e, SystemExit)
        advice = "; a reward function returns its score instead of exiting" if exited else ""
        return RewardError(f"--reward-fn {self.spec} {_ended(e)} on {self.where(meta)}{advice}")

    def _judgement(self, value: Any, meta: dict[str, Any]) -> Judgement:
        returned = value
        extra = None
        if isinstance(value, dict):
            if "score" not in value:
                keys = _cut(", ".join(map(_shown, value))) or "none"
                raise RewardError(f"--reward-fn {self.spec} returned a dict without a 'score' key (its keys: "
                                  f"{keys}) on {self.where(meta)}; a verl reward function returns a finite "
                                  "number or a dict with a numeric 'score'")
            extra = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        value = _scalar(value)
        if not isinstance(value, numbers.Real) or not _finite(value):
            raise RewardError(f"--reward-fn {self.spec} returned {_shown(returned)} on {self.where(meta)}; "
                              "a reward function returns a finite number or a dict with a numeric 'score'")
        return Judgement(float(value), None, extra=extra)


def _passed(columns: Mapping[str, Any]) -> list[str]:
    """The dataset columns a TRL function gets as keywords: all but TRL_UNPASSED."""
    return [c for c in columns if c not in TRL_UNPASSED]


def _scalar(value: Any) -> Any:
    """A 0-d numpy array or tensor as its Python number (`.item()`, as verl's reward manager reads a
    score); any other value as it is."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _awaited(value: Any) -> Any:
    """An async function's result, awaited to its end (module docstring); any other value as it is."""
    if not inspect.isawaitable(value):
        return value

    async def result() -> Any:
        return await value

    return asyncio.run(result())


def _as_list(values: Any) -> list | None:
    """A TRL function's result as a list: any sequence TRL can iterate (a list, a tuple, a 1-d numpy array
    or tensor, whose numbers become Python's); None for text, a dict, an iterator or a scalar."""
    if isinstance(values, str | bytes | Mapping):
        return None
    if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
        return values.tolist()
    return list(values) if isinstance(values, Sequence) else None


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is a finite float: an int or fraction too large for a float is not."""
    try:
        return math.isfinite(value)
    except (OverflowError, ValueError, TypeError):
        return False


def _ended(e: BaseException) -> str:
    """How user code ended: "exited (sys.exit(0))" or "raised ValueError (its message's first line)"."""
    if isinstance(e, SystemExit):
        return f"exited (sys.exit({'' if e.code is None else repr(e.code)}))"
    message = (str(e).strip().splitlines() or [""])[0]
    return f"raised {type(e).__name__}" + (f" ({message})" if message else "")


def _shown(value: Any) -> str:
    """A returned value as a message shows it: its repr, cut (a repr that fails names the type)."""
    try:
        return _cut(repr(value))
    except Exception:  # an int of more digits than Python prints, an object whose __repr__ raises
        if isinstance(value, int):
            return f"an int of {math.floor(abs(value).bit_length() * math.log10(2)) + 1:,} digits or so"
        return f"{_a(type(value).__name__)} that cannot be shown"


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _parameters(fn: Callable) -> str:
    """A function's parameter names as its def lists them (*args, **kwargs marked)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def load_reward_function(spec: str) -> RewardFunction:
    """`path.py:function` loaded, its convention read from its signature and the keywords it will be
    called with checked (module docstring); RewardError in one sentence."""
    spec = reward_fn_spec(spec)
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise RewardError(f"--reward-fn {spec!r} is not path.py:function (a Python file and the name of a "
                          "function in it)")
    path = Path(path_text).expanduser()
    if not path.is_file():
        dotted = "" if path.suffix == ".py" or "/" in path_text else (
            "; --reward-fn takes a file, not a module's dotted import path (give path/to/module.py:function)")
        raise RewardError(f"--reward-fn {spec}: no such file {path}{dotted}")
    module = _import(spec, path)
    fn = getattr(module, name, None)
    if fn is None and not hasattr(module, name):
        raise RewardError(f"--reward-fn {spec}: {path} has no function {name!r}")
    if not callable(fn):
        raise RewardError(f"--reward-fn {spec}: {name!r} in {path} is {_a(type(fn).__name__)} "
                          f"({_shown(fn)}), not a function")
    style = _style(fn, spec)
    _check_keywords(fn, spec, style)
    return RewardFunction(spec, path, name, fn, style, _loggers(fn) if style == "trl" else ())


def _loggers(fn: Callable) -> tuple[str, ...]:
    """The TRL_LOGGERS a TRL function takes: those it names, or all of them through **kwargs (TRL passes
    them to every function; Sparrow passes none to a function that could not take them)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return TRL_LOGGERS
    return tuple(name for name in TRL_LOGGERS if name in params)


def _import(spec: str, path: Path) -> Any:
    """The module of a reward file, imported with its folder on sys.path (module docstring)."""
    module_name = f"sparrow_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"--reward-fn {spec}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        with stdout_to_stderr(), working_directory_kept(), folder_on_path(path.resolve().parent):
            module_spec.loader.exec_module(module)
    except USER_ERRORS as e:  # the user's file, named
        sys.modules.pop(module_name, None)
        relative = isinstance(e, ImportError) and "relative import" in str(e)
        advice = ("; a reward file is imported as a script, with its folder on sys.path, so import the "
                  "modules beside it by their names (from helper import f, not from .helper import f)"
                  if relative else "")
        raise RewardError(f"--reward-fn {spec}: importing {path} {_ended(e)}{advice}") from None
    return module


def _style(fn: Callable, spec: str) -> str:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise RewardError(f"--reward-fn {spec} has no signature Python can read, so which keywords it takes "
                          "is unknown; define it with def") from None
    if "solution_str" in params:
        return "verl"
    if "completions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "trl"
    raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), neither verl's compute_score("
                      "data_source, solution_str, ground_truth, extra_info) nor TRL's "
                      "f(prompts, completions, **kwargs)")


def _check_keywords(fn: Callable, spec: str, style: str) -> None:
    """RewardError when the function cannot take the keywords it will be called with: verl's four, or
    TRL's prompts and completions (the dataset's columns are checked per row, `check_row`)."""
    signature = inspect.signature(fn)
    if style == "verl":
        try:
            signature.bind(**dict.fromkeys(VERL_KEYWORDS))
        except TypeError as e:
            raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), which cannot be called as verl "
                              f"calls compute_score, with the keywords {', '.join(VERL_KEYWORDS)} "
                              f"({e})") from None
        return
    try:
        signature.bind_partial(prompts=None, completions=None)
    except TypeError as e:
        raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), which cannot take the keywords TRL "
                          f"passes, prompts, completions and the dataset's columns ({e}); a TRL reward "
                          "function takes **kwargs for those it does not read") from None
    unfilled = [p.name for p in signature.parameters.values() if p.name in TRL_ONLY and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unfilled:
        raise RewardError(f"--reward-fn {spec} needs {', '.join(unfilled)}, which TRL passes and Sparrow "
                          "does not (it passes prompts, completions and the dataset's columns); give "
                          f"{'it a default' if len(unfilled) == 1 else 'them defaults'}")


# ---------------------------------------------------------------- the registry


def _reward(name: str, description: str, **fields: Any) -> Task:
    return Task(name, "reward", description, _no_prompts, lambda *a: 0.0, **fields)


REWARDS: dict[str, Task] = {
    MATH: _reward(MATH, "math-verify of the completion against the ground truth", judge=math_judge,
                  check_metadata=check_math_gold),
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
                                            judge_many=reward.judge_many, clamp=False, needs_answer=False,
                                            check_metadata=reward.check_row)
        _LOADED[spec] = reward.task_name
    return _LOADED[spec]
