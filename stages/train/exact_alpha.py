"""Exact alpha for a subsample of each step's sequences: the tail the stability criterion reads.

The sampler keeps only its top-20 logprobs, so the per-token alpha the learner can form from them is a
lower bound (`Scores.alpha_lb`). For `alpha_sequences` sequences per step, drawn from a generator seeded
by (seed, step) so a resumed step draws the same, every generated token is scored again by teacher
forcing, densely and under the run's KV policy, over the full vocabulary (stages/scoring/mismatch.py,
which reproduces incremental sparse decoding): alpha = sum_v min(p_dense, p_sparse), the sparse side with
DistillSparse's adapter where the run trains one. Those tokens carry the exact alpha in the metrics and
the mismatch log; the others carry none.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..engine import Completion
from ..kv_policies import KVPolicy
from ..model.llama import Transformer
from ..model.lora import LoraWeights
from ..scoring.mismatch import score_sequences


def chosen_sequences(n: int, k: int, seed: int, step: int) -> list[int]:
    """The `k` of `n` sequences scored exactly at `step` (sorted; all of them when k >= n)."""
    if k >= n:
        return list(range(n))
    state = int(np.random.SeedSequence([seed, step, 31]).generate_state(1)[0])
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(state))[:k].tolist())


def exact_alpha(model: Transformer, completions: list[Completion], policy: KVPolicy, k: int, seed: int,
                step: int, temperature: float, width: int, actor: LoraWeights | None = None) -> Tensor:
    """[N, width] alpha of every token of the chosen sequences, NaN elsewhere (and at padding). `actor`:
    the sparse actor's own adapter (DistillSparse), merged for the sparse side only."""
    out = torch.full((len(completions), width), float("nan"))
    rows = chosen_sequences(len(completions), k, seed, step)
    if not rows:
        return out
    was_training = model.training
    model.eval()
    try:
        scored = score_sequences(model, [completions[i].prompt_token_ids for i in rows],
                                 [completions[i].token_ids for i in rows], [policy], temperature,
                                 actor=actor)
    finally:
        model.train(was_training)
    alpha, _ = scored.sparse[policy]
    token = scored.position - np.array([len(completions[rows[s]].prompt_token_ids) for s in scored.seq])
    out[torch.tensor([rows[s] for s in scored.seq]), torch.from_numpy(token)] = torch.from_numpy(alpha)
    return out


__all__ = ["chosen_sequences", "exact_alpha"]
