"""`code`: write a small Python function; the reward runs it on hidden tests inside the sandbox.

These problems are generated (`humaneval.py` has OpenAI's HumanEval, which the embedded model rarely
solves): each *family* is a function to write (name, signature, one-sentence specification, a
canonical solution, a seeded input generator). A prompt names the function, states what it must do,
shows one worked example, and asks for one ```python block. Its hidden tests are `tests` (default 6)
further inputs drawn from the family's generator; their expected outputs are the canonical solution's,
computed here when the prompt is made and stored in the prompt's metadata (never shown to the model
and never copied into the sandbox, so a program cannot read its way to them). The answer column holds
the canonical solution.

Difficulty: `level` 1 families are one-liners over one argument (sum, maximum, reverse a string...);
`level` 2 families need a loop or a condition (second largest, running totals, primes...); `level 0`
mixes both. Both levels were measured to start inside [0.05, 0.6] on the embedded SmolLM2-135M-Instruct
(sampled at temperature 1, dense; docs/tasks.md gives the numbers); the default is level 2, the one with
more to learn.

Reward rule (`score`), deterministic and in [0, 1]:
- The code is extracted from the completion after any `</think>` (`extract_code`): the last fenced
  block (```python, ``` or an unclosed last fence) that defines the function, else the unfenced text
  from the function's `def` (with the imports above it); either is cut at the end to the longest part
  that parses. None found: 0, and nothing runs. Extraction runs in our process, outside the sandbox, so
  its work is bounded: the fences are found in one pass over the text (`fenced_blocks`: a fence opens at
  ``` and runs to the end of its line, its block to the next line that starts with ``` after spaces,
  or to the end); after a failed parse the cut goes straight to the line the error names (an unclosed
  bracket or string is never closed further down, and the tokens up to an invalid one are the same in
  every longer cut), and one completion's blocks parse at most `PARSE_BUDGET` characters in all (blocks
  tried after the budget is spent count as not parsing: a completion whose later blocks use it all up
  scores as one without code). Only
  the first `MAX_CODE_CHARS` characters (whole lines) of a block are read, and a parse that fails by
  nesting too deep or running out of memory (`---...-x`, a kind of degenerate repetition models produce)
  is a failed parse like a syntax error, never a crash of the command.
- The program runs in the sandbox (`sandbox.Sandbox`, limits `LIMITS`) and its function is called on
  each hidden input from the host, one second per call (`calls.py`). A run that does not end by itself
  with status 0 within its limits, or stops answering (a timeout, too much output, a crash, an early
  exit, a kill) scores 0.
- Otherwise reward = (1 - w) * passed / tests + w * clean, with w = `FORMAT_WEIGHT` (0.1), the
  published rule (docs/tasks.md): a test passes when the call returned a value whose canonical JSON
  equals the expected one (so `True` is not `1`), and `clean` is 1 when every call returned (no
  exception): a parsable, runnable function that gets nothing right earns w, a correct one 1. Accuracy
  is reward == 1, so only a function that passes every test counts. A prompt's metadata may carry
  `format_weight` (Sparrow writes the constant there, for readers of the file), but a prompts file that
  holds any other value is refused before any work (`check_metadata`): the weight is the task's, not the
  dataset's, or a shared file could make a wrong function earn 1. A status of `timeout` covers a call
  that ran out of its second as well as a run that ran out of its limit.
The program in the sandbox receives each hidden input and hands back only a plain value, which is
compared here, so nothing the program does in the sandbox can report a test as passed. Each test ends in
one of the host's own categories (`Result`), decided by the host's comparison and clock: an exception
the function raised is `RAISED` whatever its class is called (a class named `passed`, `AssertionError` or
`_Timeout` is only a name the program chose), and the format credit and the `timeout` status are read
from these categories, never from a name that crossed from the sandbox.
"""

from __future__ import annotations

import ast
import enum
import functools
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .base import Example, Judgement, Measure, Task, TaskError
from .calls import Raised, Remote, call_tests
from .sandbox import UNSAFE_ENV, Limits, Outcome, Sandbox, bwrap_binary

DEFAULT_TESTS = 6
DEFAULT_LEVEL = 2
FORMAT_WEIGHT = 0.1
SECONDS_PER_TEST = 1.0
LIMITS = Limits(seconds=8.0, cpu_seconds=8, memory_mb=512, processes=6, file_mb=8, open_files=64,
                output_kb=256, tmp_mb=32)


@dataclass(frozen=True)
class Family:
    name: str
    params: str  # the parameter list, as in the signature
    returns: str
    spec: str  # completes "that ..."
    solution: str  # the canonical solution's body (indented), under `def name(params):`
    inputs: Callable[[random.Random], tuple]
    level: int

    @property
    def source(self) -> str:
        return f"def {self.name}({self.params}) -> {self.returns}:\n{self.solution}\n"

    @property
    def reference(self) -> Callable:
        namespace: dict[str, Any] = {}
        exec(compile(self.source, f"<{self.name}>", "exec"), namespace)  # our own canonical source
        return namespace[self.name]


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (1, 8)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


WORDS = ("apple", "river", "stone", "light", "cloud", "green", "tiger", "music", "paper", "house", "sun",
         "moon", "tree", "bird", "road", "blue", "fast", "cat", "dog", "sky", "level", "noon", "radar")


PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _word(rng: random.Random) -> str:
    if rng.random() < 0.4:
        half = "".join(rng.choice("abcde") for _ in range(rng.randint(1, 3)))
        return half + half[::-1][rng.randint(0, 1):]
    return rng.choice(WORDS)


FAMILIES = (
    Family("add", "a: int, b: int", "int", "returns the sum of a and b", "    return a + b",
           lambda r: (r.randint(-50, 50), r.randint(-50, 50)), 1),
    Family("largest", "numbers: list[int]", "int", "returns the largest number in the non-empty list numbers",
           "    return max(numbers)", lambda r: (_ints(r),), 1),
    Family("total", "numbers: list[int]", "int", "returns the sum of the numbers in the list numbers",
           "    return sum(numbers)", lambda r: (_ints(r, n=(0, 8)),), 1),
    Family("reverse_string", "text: str", "str", "returns the string text reversed",
           "    return text[::-1]", lambda r: (_sentence(r),), 1),
    Family("square_all", "numbers: list[int]", "list[int]",
           "returns a list of the squares of the numbers in numbers, in the same order",
           "    return [x * x for x in numbers]", lambda r: (_ints(r, n=(0, 6)),), 1),
    Family("count_words", "sentence: str", "int",
           "returns the number of words in sentence (words are separated by single spaces)",
           "    return len(sentence.split())", lambda r: (_sentence(r),), 1),
    Family("is_even", "n: int", "bool", "returns True if the integer n is even, and False otherwise",
           "    return n % 2 == 0", lambda r: (r.randint(-100, 100),), 1),
    Family("double", "n: int", "int", "returns twice the integer n", "    return 2 * n",
           lambda r: (r.randint(-1000, 1000),), 1),
    Family("sum_of_evens", "numbers: list[int]", "int",
           "returns the sum of the even numbers in the list numbers",
           "    return sum(x for x in numbers if x % 2 == 0)", lambda r: (_ints(r, n=(0, 8)),), 2),
    Family("count_vowels", "text: str", "int",
           "returns how many vowels (a, e, i, o, u) the lower-case string text contains",
           "    return sum(c in 'aeiou' for c in text)", lambda r: (_sentence(r),), 2),
    Family("is_palindrome", "word: str", "bool",
           "returns True if word reads the same forwards and backwards, and False otherwise",
           "    return word == word[::-1]", lambda r: (_word(r),), 2),
    Family("factorial", "n: int", "int", "returns n! (the product 1 * 2 * ... * n, and 1 for n = 0)",
           "    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result",
           lambda r: (r.randint(0, 12),), 2),
    Family("fibonacci", "n: int", "int",
           "returns the n-th Fibonacci number, where fibonacci(0) = 0 and fibonacci(1) = 1",
           "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
           lambda r: (r.randint(0, 25),), 2),
    Family("remove_duplicates", "numbers: list[int]", "list[int]",
           "returns numbers without repeated values, keeping the first occurrence of each, in order",
           "    return list(dict.fromkeys(numbers))", lambda r: (_ints(r, -4, 4, (0, 10)),), 2),
    Family("second_largest", "numbers: list[int]", "int",
           "returns the second largest distinct value in numbers (which has at least two distinct values)",
           "    return sorted(set(numbers))[-2]",
           lambda r: ([*_ints(r), 21, 22][:: r.choice((1, -1))],), 2),
    Family("is_prime", "n: int", "bool", "returns True if n is a prime number, and False otherwise",
           "    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
           lambda r: (r.choice(PRIMES) if r.random() < 0.5 else r.randint(0, 60),), 2),
    Family("digit_sum", "n: int", "int",
           "returns the sum of the decimal digits of the non-negative integer n",
           "    return sum(int(d) for d in str(n))", lambda r: (r.randint(0, 10 ** r.randint(1, 6)),), 2),
    Family("running_total", "numbers: list[int]", "list[int]",
           "returns the running totals of numbers: element i is the sum of numbers[0] to numbers[i]",
           "    out, s = [], 0\n    for x in numbers:\n        s += x\n        out.append(s)\n    return out",
           lambda r: (_ints(r, n=(0, 7)),), 2),
    Family("longest_word", "sentence: str", "str",
           "returns the longest word of sentence (words are separated by single spaces; the first one "
           "on a tie)", "    return max(sentence.split(), key=len)", lambda r: (_sentence(r),), 2),
    Family("count_positive", "numbers: list[int]", "int",
           "returns how many numbers in the list numbers are greater than zero",
           "    return sum(x > 0 for x in numbers)", lambda r: (_ints(r, n=(0, 8)),), 2),
)
LEVELS = (0, 1, 2)
MAX_TESTS = 50

PROMPT = (
    "Write a Python function `{name}({params}) -> {returns}` that {spec}.\n\n"
    "Example: {name}({example_args}) == {example_out}\n\n"
    "Reply with the complete function in one ```python code block."
)


def _call_text(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _example(rng: random.Random, level: int, tests: int) -> Example:
    family = rng.choice([f for f in FAMILIES if level in (0, f.level)])
    reference = family.reference
    shown = family.inputs(rng)
    for _ in range(10):  # the worked example is not an empty list
        if all(a != [] for a in shown):
            break
        shown = family.inputs(rng)
    cases = [family.inputs(rng) for _ in range(tests)]
    user = PROMPT.format(name=family.name, params=family.params, returns=family.returns, spec=family.spec,
                         example_args=_call_text(shown), example_out=repr(reference(*shown)))
    metadata = {"function": family.name, "cases": [list(c) for c in cases],
                "expected": [reference(*c) for c in cases], "format_weight": FORMAT_WEIGHT}
    return Example(user, family.source, metadata)


def check_options(n: int, level: int = DEFAULT_LEVEL, tests: int = DEFAULT_TESTS) -> None:
    """The task's `check`: a level it has and a test count it can run, before any work."""
    if level not in LEVELS:
        raise TaskError(f"--level must be one of {', '.join(map(str, LEVELS))}, got {level}")
    if not 1 <= tests <= MAX_TESTS:
        raise TaskError(f"--tests must be in [1, {MAX_TESTS}], got {tests}")


def generate(n: int, seed: int, measure: Measure, level: int = DEFAULT_LEVEL,
             tests: int = DEFAULT_TESTS) -> Iterator[Example]:
    """`n` problems at `level` with `tests` hidden tests each (checked first by `check_options`, the task's
    `check`, which make_prompts runs)."""
    for i in range(n):
        yield _example(random.Random(f"code/{seed}/{i}"), level, tests)


# ---------------------------------------------------------------- extraction

_FENCE = "```"
_LANGUAGE = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_CLOSING = re.compile(r"\n[ \t]*```")


@dataclass(frozen=True)
class Fenced:
    language: str  # the word after the opening fence ("python", "py", ""...)
    code: str


def fenced_blocks(text: str) -> list[Fenced]:
    """The fenced blocks of `text`, in order (module docstring), found in time linear in its length: each
    search starts where the last block ended, and a fence with no newline after it opens nothing."""
    blocks, at = [], 0
    while (start := text.find(_FENCE, at)) >= 0 and (newline := text.find("\n", start + len(_FENCE))) >= 0:
        language = _LANGUAGE.match(text, start + len(_FENCE), newline).group(1)
        closing = _CLOSING.search(text, newline + 1)
        end = len(text) if closing is None else closing.start()
        blocks.append(Fenced(language, text[newline + 1:end]))
        at = len(text) if closing is None else closing.end()
    return blocks


def _defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
               for node in tree.body)


PARSE_BUDGET = 1_000_000  # characters parsed in all while cutting one completion's blocks (module docstring)
MAX_CODE_CHARS = 100_000  # characters of a block read at most (module docstring)
PARSE_FAILURES = (SyntaxError, ValueError, RecursionError, MemoryError)  # what ast.parse fails with


def _bounded_lines(code: str) -> list[str]:
    """The whole lines of `code` within its first `MAX_CODE_CHARS` characters."""
    if len(code) <= MAX_CODE_CHARS:
        return code.rstrip().splitlines()
    return code[:MAX_CODE_CHARS].splitlines()[:-1]


def parses(text: str) -> ast.Module | None:
    """`text`'s syntax tree, or None when it does not parse: a syntax error, a null byte, nesting too deep
    for the parser or a tree too large for memory all count as not parsing."""
    try:
        return ast.parse(text)
    except PARSE_FAILURES:
        return None


class _Cut:
    """Cuts the blocks of one completion to what parses, all of them within one `PARSE_BUDGET`."""

    def __init__(self, name: str):
        self.name, self.budget = name, PARSE_BUDGET

    def __call__(self, code: str) -> str | None:
        """`code`, or its longest prefix of whole lines that parses, if that defines the function at top
        level. A failed parse of lines[:end] moves the cut to the error's line (never past end - 1)."""
        lines = _bounded_lines(code)
        end = len(lines)
        while end > 0 and self.budget > 0:
            text = "\n".join(lines[:end])
            self.budget -= len(text)
            try:
                tree = ast.parse(text)
            except SyntaxError as e:
                end = min(end - 1, e.lineno or end)
                continue
            except PARSE_FAILURES:  # a null byte, too deep a nesting, too large a tree
                end -= 1
                continue
            return text.rstrip() + "\n" if _defines(tree, self.name) else None
        return None


def _parsable_prefix(code: str, name: str) -> str | None:
    """One block cut on a budget of its own."""
    return _Cut(name)(code)


def _unfenced(text: str, name: str) -> str | None:
    """The text from the function's first `def` (with the import lines just above it) to the end."""
    match = re.search(rf"(?<![\w.])(async\s+)?def\s+{re.escape(name)}\s*\(", text)
    if match is None:
        return None
    above = text[: match.start()].split("\n")
    start = len(above) - 1
    if not above[-1].strip():  # the def starts its line: take the imports just above it too
        while start > 0 and re.match(r"(import|from)\s+\w", above[start - 1]):
            start -= 1
    return "\n".join(above[start:-1] + [text[match.start():]])


def extract_code(completion: str, name: str) -> str | None:
    """The program a completion gives for function `name` (see the module docstring), or None."""
    text = completion.rsplit("</think>", 1)[-1]
    cut = _Cut(name)
    for block in reversed(fenced_blocks(text)):
        code = cut(block.code)
        if code is not None:
            return code
    unfenced = _unfenced(text, name)
    return cut(unfenced) if unfenced is not None else None


# ---------------------------------------------------------------- running


class Result(enum.Enum):
    """How one test ended, in the host's own words (module docstring)."""

    PASSED = "passed"
    FAILED = "failed"  # the host's check failed: a wrong value or output, a failed assert
    NOT_JSON = "not_json"  # returned a value with no canonical JSON (a set, bytes) where one is compared
    RAISED = "raised"  # the function raised or returned no plain data, or the test raised on its value
    TIMED_OUT = "timed_out"  # by the host's clock, the call ran out of its time

    @classmethod
    def of(cls, raised: Raised) -> Result:
        return cls.TIMED_OUT if raised.timed_out else cls.RAISED


CLEAN = frozenset({Result.PASSED, Result.FAILED})  # tests whose calls all returned: the format credit


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: int
    tests: int
    clean: bool  # the run exited 0 and every call returned
    outcome: Outcome | None  # None: no code was found, nothing ran
    status: str  # base.CODE_STATUSES

    @classmethod
    def judged(cls, results: list[Result] | None, outcome: Outcome, tests: int,
               format_weight: float) -> Verdict:
        """The verdict on a run whose tests gave `results` (None: the run was over before the tests were
        done): 0 unless the run also ended by itself with status 0. `clean`: every test in `CLEAN`."""
        if results is None or not outcome.ok:
            status = outcome.status if outcome.status in ("timeout", "output_limit") else "error"
            return cls(0.0, 0, tests, False, outcome, status)
        if not 0.0 <= format_weight < 1.0:  # below 1, a function that fails a test never earns 1
            raise ValueError(f"format_weight must be in [0, 1), got {format_weight}")
        passed = min(results.count(Result.PASSED), tests)
        clean = all(r in CLEAN for r in results)
        reward = min(1.0, (1 - format_weight) * (passed / max(tests, 1)) + format_weight * clean)
        status = "passed" if passed == tests else "timeout" if Result.TIMED_OUT in results else "failed"
        return cls(reward, passed, tests, clean, outcome, status)

    @classmethod
    def no_code(cls, tests: int) -> Verdict:
        return cls(0.0, 0, tests, False, None, "no_code")

    @property
    def judgement(self) -> Judgement:
        return Judgement(self.reward, self.status, self.passed, self.tests)


def format_weight_of(metadata: dict[str, Any]) -> float:
    """The format credit of a prompt: `FORMAT_WEIGHT`; TaskError when its metadata names another value
    (module docstring: the weight is the task's published constant, not a dataset's)."""
    given = metadata.get("format_weight", FORMAT_WEIGHT)
    if isinstance(given, bool) or not isinstance(given, (int, float)) or given != FORMAT_WEIGHT:
        raise TaskError(f"its metadata's format_weight is {given!r}, but the code tasks' reward gives a "
                        f"runnable function {FORMAT_WEIGHT} (docs/tasks.md); leave the key out or set it to "
                        f"{FORMAT_WEIGHT}")
    return FORMAT_WEIGHT


def check_metadata(metadata: dict[str, Any]) -> None:
    """TaskError for a prompt's metadata this task will not score, before any work: a function that is not
    a Python name, hidden tests that are not a non-empty list of argument lists with one expected value
    each, another format weight."""
    name, cases, expected = (metadata.get(k) for k in ("function", "cases", "expected"))
    if not (isinstance(name, str) and name.isidentifier()):
        raise TaskError(f"its metadata's function {name!r} is not a Python name")
    if not isinstance(cases, list) or not all(isinstance(c, list) for c in cases):
        raise TaskError("its metadata's cases are not a list of argument lists (one list of arguments per "
                        "hidden test)")
    if not cases:
        raise TaskError("its metadata's cases are an empty list, so no completion could pass a test")
    if not isinstance(expected, list) or len(expected) != len(cases):
        got = f"{len(expected)} expected values" if isinstance(expected, list) else f"expected {expected!r}"
        raise TaskError(f"its metadata has {len(cases)} cases and {got}: one expected value per case")
    format_weight_of(metadata)


def _same(value: Any, expected: Any) -> bool | None:
    """Whether `value`'s canonical JSON is `expected`'s; None when `value` has none (a set, bytes, a nesting
    too deep to write)."""
    try:
        return _canonical(value) == _canonical(expected)
    except (TypeError, ValueError, RecursionError):
        return None


def _call_cases(cases: list[list], expected: list) -> Callable[[Remote], list[Result]]:
    """The hidden tests, run here: each case's call, its value compared with the expected one."""
    def run(remote: Remote) -> list[Result]:
        results = []
        for args, want in zip(cases, expected):
            remote.begin(SECONDS_PER_TEST)
            try:
                same = _same(remote(*args), want)
            except Raised as e:
                results.append(Result.of(e))
                continue
            results.append({True: Result.PASSED, False: Result.FAILED, None: Result.NOT_JSON}[same])
        return results
    return run


def run_tests(code: str, name: str, cases: list[list], expected: list, sandbox: Sandbox,
              format_weight: float = FORMAT_WEIGHT) -> Verdict:
    """Run `code` in `sandbox`, call its function on the hidden tests from here and score it (module
    docstring)."""
    results, outcome = call_tests(sandbox, code, name, _call_cases(cases, expected))
    return Verdict.judged(results, outcome, len(cases), format_weight)


def default_sandbox() -> Sandbox:
    """The process's sandbox, with `LIMITS`; unsafe where SPARROW_UNSAFE_CODE_EXECUTION=1 (the CLI's
    --unsafe-code-execution sets it, so workers started from it inherit it). Raises SandboxUnavailable."""
    return _sandbox(os.environ.get(UNSAFE_ENV) == "1", bwrap_binary())


@functools.cache
def _sandbox(unsafe: bool, bwrap: str | None) -> Sandbox:  # one per setting (bwrap: Sandbox finds it again)
    return Sandbox(LIMITS, unsafe=unsafe)


def verdict(completion: str, answer: str, metadata: dict[str, Any],
            sandbox: Sandbox | None = None) -> Verdict:
    name = metadata["function"]
    code = extract_code(completion, name)
    if code is None:
        return Verdict.no_code(len(metadata["cases"]))
    return run_tests(code, name, metadata["cases"], metadata["expected"], sandbox or default_sandbox(),
                     format_weight_of(metadata))


def judge(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> Judgement:
    return verdict(completion, answer, metadata or {}).judgement


def score(completion: str, answer: str, metadata: dict[str, Any] | None = None) -> float:
    return verdict(completion, answer, metadata or {}).reward


def tasks() -> list[Task]:
    return [Task("code", "code", "write a small Python function; reward = the fraction of hidden tests it "
                 "passes when run in a sandbox, plus a little for a runnable function",
                 generate, score, ("level", "tests"), runs_code=True,
                 metadata_keys=("function", "cases", "expected"), judge=judge, check_metadata=check_metadata,
                 check=check_options)]
