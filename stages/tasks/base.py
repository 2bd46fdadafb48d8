"""What a task is: a seeded generator of user messages with answers, and a scorer.

Generators know nothing about tokenizers or chat templates. Those that must hit a token length
receive `measure(user_text) -> int`, the length of the fully chat-formatted prompt, and fit to it;
the registry (`sparrow.stages.tasks`) does the formatting. Scorers are pure functions of the
completion text, the answer and the example's metadata, so rewards can be recomputed from a
prompts artifact alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Measure = Callable[[str], int]


class TaskError(ValueError):
    """A task asked for something it cannot do (unknown option, impossible length...)."""


@dataclass(frozen=True)
class Example:
    user: str  # the user message: the problem and the instruction on how to answer
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "math", "long-context" or "code"
    description: str
    generate: Callable[..., Iterator[Example]]  # (n, seed, measure, **options)
    score: Callable[[str, str, dict[str, Any]], float]  # (completion, answer, metadata) -> [0, 1]
    options: tuple[str, ...] = ()  # keyword options `generate` accepts
    runs_code: bool = False  # its scorer runs the completion's program (in the sandbox): scored in a pool
    metadata_keys: tuple[str, ...] = ()  # what its scorer reads from a prompt's metadata (checked up front)

    @property
    def long_context(self) -> bool:
        return self.kind == "long-context"
