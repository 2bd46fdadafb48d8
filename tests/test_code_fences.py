"""Finding the fenced blocks of a completion, on the host, in time linear in its length.

A completion is model output: a long run of backticks with no newline (degenerate repetition) must cost
what its length costs, not its square, and one completion's cuts share one parse budget however many
blocks it holds. Expected blocks are written out by hand, or come from the pattern the docs describe (a
regular expression written here, run on small texts where its backtracking does not matter).
"""

from __future__ import annotations

import ast
import random
import re

import pytest

from sparrow.stages.tasks import code as code_task
from sparrow.stages.tasks import rewards
from sparrow.stages.tasks.code import Fenced, extract_code, fenced_blocks
from sparrow.stages.tasks.humaneval import program

DEF = "def f(x):\n    return x + 1\n"
TICKS = "`" * 150_000

# A fence opens at ``` (its language: the word after it), runs to the end of its line; the block runs to
# the next line that starts with ``` after spaces or tabs, or to the end of the text.
DOCUMENTED = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)


@pytest.mark.parametrize("text, blocks", [
    (f"Here:\n```python\n{DEF}```\nDone.", [Fenced("python", DEF.rstrip("\n"))]),
    (f"```py title\n{DEF}", [Fenced("py", DEF)]),  # unclosed: to the end
    (f"say ```python3\n{DEF}  ```\n", [Fenced("python3", DEF.rstrip("\n"))]),  # mid-line, indented close
    ("```\na\n```\ntext\n```c++\nb\n```", [Fenced("", "a"), Fenced("c++", "b")]),
    ("no fence at all", []),
    (TICKS, []),  # no newline after any fence: nothing opens
    (TICKS + "\n", [Fenced("", "")]),
    ("```" + " " * 150_000 + "\n" + DEF, [Fenced("", DEF)]),
    (f"```python\n{DEF}{TICKS}", [Fenced("python", DEF.rstrip("\n"))]),  # closed by the run's first ```
    (f"{TICKS}\n```python\n{DEF}```", [Fenced("", "```python\n" + DEF.rstrip("\n"))]),
])
def test_fenced_blocks(text, blocks):
    assert fenced_blocks(text) == blocks


def test_fenced_blocks_are_the_documented_patterns_matches():
    rng = random.Random(0)
    pieces = ["```", "`", "``", "\n", " ", "\t", "python", "py ", "x", "def f(x):", "  ```", "\n```", "c++"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        expected = [Fenced(m.group(1), m.group(2)) for m in DOCUMENTED.finditer(text)]
        assert fenced_blocks(text) == expected, repr(text)


@pytest.mark.parametrize("completion, expected", [
    (TICKS, None),
    (f"```python\n{DEF}{TICKS}", DEF),
    (f"{TICKS}\n```python\n{DEF}```", DEF),  # the block holds the fence line; the unfenced def is found
    (f"```{' ' * 150_000}\n{DEF}", DEF),
])
def test_a_long_run_of_backticks_is_extracted_like_any_text(completion, expected):
    assert extract_code(completion, "f") == expected
    assert program(completion, "def f(x):\n    \"\"\"Add one.\"\"\"\n", "f") == (
        None if expected is None else f"def f(x):\n    \"\"\"Add one.\"\"\"\n\n\n{expected}")


@pytest.mark.parametrize("completion, expected", [
    (TICKS, None),
    (f"```python\nprint(1)\n{TICKS}", "print(1)"),
    (f"```text\nnot python\n```\n```\nprint(2)\n```\n{TICKS}", "print(2)"),
])
def test_a_stdio_program_next_to_a_long_run_of_backticks(completion, expected):
    assert rewards._program(completion) == expected


def test_the_blocks_of_one_completion_share_one_parse_budget(monkeypatch):
    """Blocks whose every cut fails one line before the last (a function, then stray decorators) are cut
    one line at a time until the budget is spent: spent once for the whole completion, not per block."""
    budget = 200_000
    monkeypatch.setattr(code_task, "PARSE_BUDGET", budget)
    parsed = []
    real = ast.parse
    monkeypatch.setattr(code_task.ast, "parse", lambda text, *a, **k: parsed.append(len(text)) or real(text))
    block = "```python\n" + DEF + "@decorator\n" * 2_000 + "```\n"
    assert extract_code(block * 3, "f") is None
    assert budget <= sum(parsed) < budget + len(block)
