"""Sparrow's tasks in verl: a prompt set as verl's RLHFDataset reads it, and their scorer as a verl reward.

`sparrow prompts --layout verl` writes `verl_dataset`'s table (the layout of verl's
examples/data_preprocess scripts); verl scores it with this file as its custom reward function
(`custom_reward_function.path` = this file, `.name` = compute_score), which verl loads by its path, so
the file imports Sparrow by absolute names only.

Decisions:
- `data_source` is `sparrow/<task>`, which names the scorer; the prompt is the chat messages (verl applies
  the model's template itself); `ability` is the task's kind; the ground truth is the task's answer.
- `extra_info` keeps the row's index and split (as verl's scripts write them), its Sparrow prompt id, and
  the task's metadata as JSON text (what some scorers read: a passkey's or a code task's details), text so
  that every task's rows have one struct type.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

SOURCE_PREFIX = "sparrow/"


def verl_dataset(rows: list[dict], split: str = "train") -> pa.Table:
    """Rows of `make_prompts(..., messages=True)` as verl's dataset rows."""
    from sparrow.stages.tasks import get_task

    return pa.Table.from_pylist([
        {"data_source": SOURCE_PREFIX + r["task"], "prompt": r["messages"],
         "ability": get_task(r["task"]).kind, "reward_model": {"style": "rule", "ground_truth": r["answer"]},
         "extra_info": {"split": split, "index": i, "prompt_id": r["prompt_id"], "metadata": r["metadata"]}}
        for i, r in enumerate(rows)])


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> float:
    """verl's reward for a row of `verl_dataset`: the task's own scorer (in [0, 1]) of the response text.
    Other data sources are refused (ValueError), as verl's default reward refuses those it does not know."""
    from sparrow.stages.tasks import TASKS, score

    task = data_source.removeprefix(SOURCE_PREFIX) if data_source.startswith(SOURCE_PREFIX) else None
    if task not in TASKS:
        raise ValueError(f"data_source {data_source!r} is not a Sparrow task's (sparrow/<task>: "
                         f"{', '.join(TASKS)})")
    metadata = (extra_info or {}).get("metadata") or "{}"
    if not isinstance(metadata, str):
        metadata = json.dumps(metadata)
    return score(task, solution_str, ground_truth, metadata)
