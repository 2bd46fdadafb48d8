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


COMPLETION_IDS = "completion_ids"  # where an item's metadata carries its completion's token ids, if known


class TaskError(ValueError):
    """A task asked for something it cannot do (unknown option, impossible length...)."""


class RewardError(ValueError):
    """A reward could not be computed (a user's function raised or returned something unusable); the
    message is one sentence naming the function and the row."""


def row_of(index: int) -> str:
    """How a message names a row of a user's file: counted from 0, as the `<file stem>-<row>` prompt ids,
    pyarrow and pandas count, and said so, since editors and line counters count from 1."""
    return f"row {index} (counting from 0)"


@dataclass(frozen=True)
class Example:
    user: str  # the user message: the problem and the instruction on how to answer
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


CODE_STATUSES = ("passed", "failed", "timeout", "output_limit", "error", "no_code")
ANSWER_STATUSES = ("correct", "incorrect", "unparsed")


@dataclass(frozen=True)
class Judgement:
    """A completion's reward and why. `status`, for code tasks: passed (every test), failed (the run ended
    well and some test did not pass), timeout (the program, or one call, ran past its time), output_limit,
    error (the program crashed, exited early or did not exit 0), no_code (no function found, or no
    parsable one, so nothing ran); for the others: correct (reward 1),
    incorrect (an answer was found; its reward may still be partial credit), unparsed (none was found);
    None for a user's reward function. `tests_passed` and `tests_total` are a code task's (None for the
    others)."""

    reward: float
    status: str | None
    tests_passed: int | None = None
    tests_total: int | None = None
    extra: dict[str, Any] | None = None  # fields a user's reward function returned beside its score


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
    judge: Callable[[str, str, dict[str, Any]], Judgement] | None = None  # code tasks: reward, status, tests
    given: Callable[[str], Any] | None = None  # the answer `score` reads in a completion (None: none found)
    check: Callable[..., None] | None = None  # (n, **options): TaskError for a request it cannot honour
    check_metadata: Callable[[dict[str, Any]], Any] | None = None  # TaskError for metadata it will not score
    # a reward for users' datasets (rewards.py, reward_function.py): judges many items at once
    # ((completion, answer, metadata) each), passes its rewards through unclamped and may need no answer
    judge_many: Callable[[list[tuple[str, str | None, dict[str, Any]]]], list[Judgement]] | None = None
    clamp: bool = True  # rewards clamped to [0, 1]
    needs_answer: bool = True
    check_answer: Callable[[str | None], Any] | None = None  # TaskError for a ground truth it cannot score

    @property
    def long_context(self) -> bool:
        return self.kind == "long-context"
