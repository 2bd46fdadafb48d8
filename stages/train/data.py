"""What a run trains on: the prompts it can score, and the order it visits them in."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..core.prompt_set import PromptError, PromptSet
from ..tasks import TASKS


@dataclass
class PromptRow:
    prompt_id: str
    task: str
    token_ids: list[int]
    answer: str
    metadata: str | None


def load_prompts(path: str | os.PathLike, tokenizer=None, chat_template: bool = True) -> list[PromptRow]:
    """Rows of a prompts file that training can use: token ids (or text to tokenize), an answer and a
    known task; anything else is refused with one sentence (a PromptError, a ValueError)."""
    prompt_set = PromptSet.read(path)
    for r in prompt_set.rows:
        where = f"{path}: prompt {r['prompt_id']!r}"
        if r.get("task") not in TASKS:
            raise PromptError(f"{where} has task {r.get('task')!r}, which has no scorer "
                              f"(known: {', '.join(TASKS)})")
        if r.get("answer") is None:
            raise PromptError(f"{where} has no answer, so its reward cannot be verified")
    prompt_set.check_rewards()
    prompt_set.tokenize(tokenizer, chat_template)
    return [PromptRow(r["prompt_id"], r["task"], list(r["prompt_token_ids"]), r["answer"], r.get("metadata"))
            for r in prompt_set.rows]


def epoch_order(n: int, seed: int, step: int, per_step: int) -> list[int]:
    """The indices of step `step`'s `per_step` items of `n`: epoch e visits them in the order of
    permutation(seed, e), so a resumed run reads what an uninterrupted one read."""
    orders: dict[int, np.ndarray] = {}
    out = []
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(int(orders[epoch][i]))
    return out
