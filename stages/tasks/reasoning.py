"""Math tasks from `reasoning-gym` generators, scored by reasoning-gym's own scorer and math-verify.

The reward is binary: 1 when reasoning-gym's scorer for the dataset gives full credit to the
extracted answer, or when math-verify finds it equivalent to the reference; 0 otherwise.
reasoning-gym's partial credits (0.01 for "a number, but wrong", substring credit) are dropped:
a verifiable reward should not pay for format alone. reasoning-gym is imported lazily (it takes
seconds to import). One of its dependencies, cellpylib, has `is` with a literal in its source: Python
prints a SyntaxWarning for each whenever it compiles that source (every run where bytecode is not
written), so those warnings, and only those, are filtered when this module is imported.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Iterator
from typing import Any

from .answers import extract_answer
from .base import Example, Measure, Task

# a compile-time warning's module is its file path without ".py"
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]cellpylib[/\\]")

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

DATASETS = {
    "gsm_symbolic": "grade-school math word problems (GSM8K templates with fresh numbers)",
    "basic_arithmetic": "integer expressions with + - * / and parentheses",
    "chain_sum": "chains of additions and subtractions",
}


def _generate(dataset: str, n: int, seed: int, measure: Measure | None = None) -> Iterator[Example]:
    import reasoning_gym

    data = reasoning_gym.create_dataset(dataset, size=n, seed=seed)
    for i in range(n):
        entry = data[i]
        metadata = json.loads(json.dumps(entry.get("metadata", {}), default=str))
        yield Example(f"{entry['question']}\n\n{INSTRUCTION}", str(entry["answer"]), metadata)


@functools.cache
def _rg_scorer(dataset: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def _math_verify(answer: str, given: str) -> bool:
    from math_verify import parse, verify

    try:
        return bool(verify(parse(answer), parse(given)))
    except Exception:
        return False


def _score(dataset: str, completion: str, answer: str, metadata: dict[str, Any]) -> float:
    given = extract_answer(completion)
    if not given:
        return 0.0
    try:
        rg = float(_rg_scorer(dataset)(given, {"answer": answer, "metadata": metadata or {}}))
    except Exception:
        rg = 0.0
    return 1.0 if rg >= 1.0 or _math_verify(answer, given) else 0.0


def tasks() -> list[Task]:
    return [
        Task(name, "math", description, functools.partial(_generate, name), functools.partial(_score, name),
             given=extract_answer)
        for name, description in DATASETS.items()
    ]
