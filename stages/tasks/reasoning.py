"""Math tasks from `reasoning-gym` generators, scored by reasoning-gym's own scorer and math-verify.

The reward is binary: 1 when reasoning-gym's scorer for the dataset gives full credit to the
extracted answer, or when math-verify finds it equivalent to the reference; 0 otherwise.
reasoning-gym's partial credits (0.01 for "a number, but wrong", substring credit) are dropped:
a verifiable reward should not pay for format alone. reasoning-gym is imported lazily (it takes
seconds to import). One of its dependencies, cellpylib, has `is` with a literal in its source: Python
prints a SyntaxWarning for each whenever it compiles that source (every run where bytecode is not
written), so those warnings, and only those, are filtered when this module is imported.

Seeds: reasoning-gym draws item i of a dataset of seed s from `random.Random(s + i)`, so seeds s and
s + 1 would share all but one item. Our seed 0 is reasoning-gym's seed 0 (unchanged); any other seed is
a 56-bit hash of it (`rg_seed`), so two seeds' item streams overlap only when their hashes fall within
the prompt count of each other (odds about n / 2**55). Not a stride such as s * 2**32: Python's Random
seeds from the 32-bit words of an integer with each word's index added, so s * 2**32 + s + 1 seeds as
s + 1 does and seed 0's items would come back. Prompt texts can still coincide where a dataset's space
of problems is small ("1 + 5"), as two items of one seed can.
"""

from __future__ import annotations

import functools
import hashlib
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


def rg_seed(seed: int) -> int:
    """reasoning-gym's seed for our `seed`: 0 for 0, else a 56-bit hash (module docstring)."""
    if seed == 0:
        return 0
    digest = hashlib.sha256(f"sparrow/reasoning-gym/{seed}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def _generate(dataset: str, n: int, seed: int, measure: Measure | None = None) -> Iterator[Example]:
    import reasoning_gym

    data = reasoning_gym.create_dataset(dataset, size=n, seed=rg_seed(seed))
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
