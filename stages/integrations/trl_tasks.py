"""Sparrow's tasks in TRL: a prompt set as TRL's `GRPOTrainer` reads it, and their scorer as a TRL reward.

`sparrow prompts --layout trl` writes `trl_dataset`'s table: `prompt` as chat messages (TRL applies the
model's chat template to a conversational prompt), and `task`, `answer`, `metadata` and `prompt_id`
columns, which TRL hands every reward function as keyword lists; `task_reward` is such a function:

    data = datasets.load_dataset("parquet", data_files="run/passkey-trl.parquet", split="train")
    trainer = GRPOTrainer(model=..., reward_funcs=task_reward, train_dataset=data, ...)

Decisions:
- A completion is text, or (for a conversational prompt) the assistant's messages, whose contents are
  joined; each is scored by its row's task (the task's own scorer, in [0, 1]).
- The module needs neither TRL nor torch: it is a plain function of the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa


def trl_dataset(rows: list[dict]) -> pa.Table:
    """Rows of `make_prompts(..., messages=True)` as TRL's conversational dataset rows."""
    return pa.Table.from_pylist([{"prompt": r["messages"], "task": r["task"], "answer": r["answer"],
                                  "metadata": r["metadata"], "prompt_id": r["prompt_id"]} for r in rows])


def _text(completion: Any) -> str:
    """A completion's text: text as it is, messages' contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))


def task_reward(completions: Sequence[Any], task: Sequence[str], answer: Sequence[Any],
                metadata: Sequence[str | None], **_: Any) -> list[float]:
    """TRL's reward function over the columns of `trl_dataset`: each completion scored by its task."""
    from sparrow.stages.tasks import TASKS, score

    unknown = sorted({t for t in task if t not in TASKS})
    if unknown:
        raise ValueError(f"task {unknown[0]!r} is not one of Sparrow's ({', '.join(TASKS)})")
    return [score(t, _text(c), a, m or "{}") for c, t, a, m in zip(completions, task, answer, metadata)]
