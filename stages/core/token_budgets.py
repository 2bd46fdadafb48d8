"""What a token's recorded budget means, for every stage that reads the engine's per-token budgets
(`rollout`'s summary, `train`'s scores and metrics, the TRL integration). Torch-free: the helpers take
numpy arrays, or tensors through the methods they share with them.

- Budget 0 means the token was produced densely, with no budget (not a budget of 0 tokens); budget B > 0
  means block top-k attention at B tokens produced it.
- A token is also produced densely when its cache fits within its budget (its position, the cache length
  it was produced at, at most B): block top-k then keeps every page, and an eviction policy has evicted
  nothing yet. A densely produced token's sampler is the dense policy, so its acceptance rate alpha (and
  any bound on it) is 1 exactly.
- The mean budget of a set of tokens is over the tokens sampled with a budget (B > 0) only; None when
  there are none.
"""

from __future__ import annotations

import numpy as np


def produced_densely(budgets, positions):
    """Whether each token was produced by dense attention: budget 0, or a position (the cache length it was
    produced at) within its budget B, where the cache's pages number at most B / page."""
    return (budgets == 0) | (positions <= budgets)


def dense_alpha_is_one(alpha, budgets, positions):
    """`alpha` (a tensor of a bound on each token's acceptance rate) with 1 at the densely produced tokens;
    `budgets` and `positions` have alpha's shape."""
    return alpha.masked_fill(produced_densely(budgets, positions), 1.0)


def mean_sparse_budget(budgets) -> float | None:
    """The mean budget of the sparse tokens (budget > 0) of `budgets` (any shape: a numpy array, a
    sequence or a CPU tensor), in float64; None when no token had a budget (or there is no token)."""
    budgets = np.asarray(budgets)
    sparse = budgets[budgets > 0]
    return float(sparse.mean(dtype=np.float64)) if sparse.size else None


def token_positions(prompt_lengths, width: int) -> np.ndarray:
    """[N, width] int64: token i of sequence n is produced at cache length prompt_lengths[n] + i."""
    return np.asarray(prompt_lengths, dtype=np.int64)[:, None] + np.arange(width, dtype=np.int64)[None, :]
