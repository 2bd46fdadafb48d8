"""What a token's recorded budget means, for every stage that reads the engine's per-token budgets
(`rollout`'s summary, `train`'s scores and metrics, the TRL integration). Torch-free: the helpers take
numpy arrays, or tensors through the methods they share with them.

- Budget 0 means the token was produced densely, with no budget (not a budget of 0 tokens); budget B > 0
  means block top-k attention at B tokens produced it.
- A densely produced token's sampler is the dense policy, so its acceptance rate alpha (and any bound on
  it) is 1 exactly.
- The mean budget of a set of tokens is over its sparse tokens only; None when every token was produced
  densely.
"""

from __future__ import annotations

import numpy as np


def dense_alpha_is_one(alpha, budgets):
    """`alpha` (a tensor of a bound on each token's acceptance rate) with 1 at the tokens of `budgets` 0,
    the densely produced ones; same shape as `budgets`."""
    return alpha.masked_fill(budgets == 0, 1.0)


def mean_sparse_budget(budgets) -> float | None:
    """The mean budget of the sparse tokens (budget > 0) of `budgets` (any shape: a numpy array, a
    sequence or a CPU tensor), in float64; None when every token was produced densely (or none was)."""
    budgets = np.asarray(budgets)
    sparse = budgets[budgets > 0]
    return float(sparse.mean(dtype=np.float64)) if sparse.size else None
