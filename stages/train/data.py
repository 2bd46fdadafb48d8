"""What a run trains on: the prompts it can score, and the order it visits them in."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.prompt_set import PromptError, PromptSet
from ..core.user_data import DataOptions
from ..tasks import get_task, has_scorer, no_scorer


@dataclass
class PromptRow:
    prompt_id: str
    task: str
    token_ids: list[int]
    answer: str | None  # None only for a reward that needs none (a user's function)
    metadata: str | None


def load_prompts(path: str | os.PathLike, tokenizer=None, chat_template: bool = True,
                 data: DataOptions | None = None, model: str | None = None,
                 fit: Callable[[PromptSet], None] | None = None) -> list[PromptRow]:
    """Rows of a prompts file (or a user's dataset, scored by `data`'s reward) that training can use:
    token ids (or text to tokenize), an answer and a known task or reward; anything else is refused with
    one sentence (a PromptError, a ValueError). Ids made by another tokenizer than `tokenizer` (that of
    --model `model`, which the messages name) are made again from the text (`PromptSet.match_model`).
    `fit` checks the tokenized set against the model (and cuts or leaves out prompts too long for it)."""
    prompt_set = PromptSet.read(path, data)
    for r in prompt_set.rows:
        where = f"{path}: prompt {r['prompt_id']!r}"
        if not has_scorer(r.get("task")):
            raise PromptError(f"{where} {no_scorer(r.get('task'))}")
        if r.get("answer") is None and get_task(r["task"]).needs_answer:
            raise PromptError(f"{where} has no answer, so its reward cannot be verified")
    prompt_set.check_rewards()
    prompt_set.match_model(model, tokenizer, chat_template)
    prompt_set.tokenize(tokenizer, chat_template, model)
    if fit is not None:
        fit(prompt_set)
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
