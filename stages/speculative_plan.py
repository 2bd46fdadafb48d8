"""Planning exact speculative rollouts (`plan-schedule --speculate`): a draft budget per position bin and
one K for the run, those that minimise the predicted seconds per generated token.

A cycle of K drafts at budget b emits (1 - a^(K+1)) / (1 - a) tokens on average, with a the profile's
mean alpha of the bin at b: for speculation the mean sets the speed, not the tail, since a rejected draft
costs time and never correctness. The cycle costs K decode steps at b and one dense forward of K + 1
tokens per sample; on the engine's static step (a GPU's) K - 1 of the drafts attend to the pages the first
one kept and score none, so a cost model of a GPU prices them without the page term (`drafts_keep_pages`),
and a CPU's measured one with it (its plain step selects at every draft). A cost artifact that `fit-cost
--speculate` wrote prices the forward from its timed verifications; otherwise, since it reads the weights
and every sample's KV once, it is priced as a dense decode step whose per-row term is paid K + 1 times.
Only profiled budgets are candidates, and budgets are made non-decreasing across bins, as every
schedule's are. A bin without profiled tokens is
priced at its nearest profiled neighbour's mean alpha (as the lossy plan's thin bins take a neighbour's
budget) and shown as thin, with no mean or tokens per cycle of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import VERIFY_FEATURES, CostModel

MAX_SPECULATE = 8


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a cycle of k drafts emits on average when each draft is kept with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class MeanAlpha:
    """The profile's mean alpha per position bin [n] and profiled budget [m]."""

    budgets: np.ndarray  # [m] increasing
    mean: np.ndarray  # [n, m]; nan where a bin has no token at a budget
    bin_width: int


def mean_alpha(mismatch, bin_width: int, num_bins: int) -> MeanAlpha:
    """Mean alpha per bin (position // bin_width) and budget from a `mismatch` table."""
    import duckdb

    con = duckdb.connect()
    con.register("mismatch", mismatch)
    rows = con.execute("""SELECT position // ? AS bin, budget, avg(alpha::DOUBLE) FROM mismatch
                          GROUP BY ALL ORDER BY bin, budget""", [bin_width]).fetchall()
    budgets = np.array(sorted({int(r[1]) for r in rows}), dtype=np.int64)
    mean = np.full((num_bins, len(budgets)), np.nan)
    for b, budget, value in rows:
        if b < num_bins:
            mean[b, np.searchsorted(budgets, budget)] = value
    return MeanAlpha(budgets, mean, bin_width)


def drafts_keep_pages(cost: CostModel) -> bool:
    """Whether the engine the cost model prices keeps a cycle's first draft's pages for its later drafts:
    the static step does (a GPU's, which the analytic presets describe); a CPU's plain step does not."""
    return cost.source != "measured:cpu"


def cycle_seconds(cost: CostModel, batch: int, context, budget: int, k: int,
                  kept: bool | None = None) -> np.ndarray:
    """Predicted seconds of one cycle at each context: k drafts at `budget`, the later ones on the first
    one's pages when `kept` (None: `drafts_keep_pages`), and the verification of k + 1 tokens per sample."""
    kept = drafts_keep_pages(cost) if kept is None else kept
    later = cost.step_seconds(batch, context, budget, scored=not kept)
    first = cost.step_seconds(batch, context, budget)
    return first + (k - 1) * later + verify_seconds(cost, batch, context, k)


def verify_seconds(cost: CostModel, batch: int, context, k: int) -> np.ndarray:
    """Predicted seconds of one dense forward of k + 1 tokens for each of `batch` samples at `context`:
    the fitted verification coefficients where `fit-cost --speculate` measured them, else from the decode
    step's."""
    if cost.verify is not None:
        coefficients = np.array([cost.verify[f] for f in VERIFY_FEATURES])
        return cost.verify_features(batch, context, k + 1) @ coefficients
    features = cost.features(batch, context, 0).copy()
    features[..., 1] *= k + 1  # the per-row term; weights and the KV are read once
    return features @ cost.vector


@dataclass
class SpeculativePlan:
    k: int
    budgets: list[int]  # draft budget per bin
    mean_alpha: list[float | None]  # per bin, at its draft budget; None: the profile has no token there
    tokens_per_cycle: list[float | None]  # per bin: expected tokens a sample's cycle emits (None as above)
    speedup: float  # predicted over dense decoding, over the planned positions
    speedups_by_k: dict[int, float]  # the best plan's predicted speedup for each K tried


def plan_speculation(cost: CostModel, alpha: MeanAlpha, batch: int, prompt_len: int, gen_len: int,
                     max_k: int = MAX_SPECULATE) -> SpeculativePlan:
    """The K in 1..max_k and the per-bin draft budgets that minimise the predicted decode seconds of
    `gen_len` tokens after `prompt_len`; positions as `CostModel.rollout_seconds` counts them."""
    contexts = np.arange(prompt_len + 1, prompt_len + gen_len)
    bins = np.minimum(contexts // alpha.bin_width, alpha.mean.shape[0] - 1)
    dense = float(cost.step_seconds(batch, contexts, 0).sum())
    thin = np.isnan(alpha.mean)
    priced = MeanAlpha(alpha.budgets, borrowed(alpha.mean), alpha.bin_width)
    best: SpeculativePlan | None = None
    by_k = {}
    for k in range(1, max_k + 1):
        plan = _plan_for_k(cost, priced, thin, batch, contexts, bins, k, dense)
        by_k[k] = plan.speedup
        if best is None or plan.speedup > best.speedup:
            best = plan
    best.speedups_by_k = by_k
    return best


def borrowed(mean: np.ndarray) -> np.ndarray:
    """`mean` [bins, budgets] where a bin without tokens at a budget takes the value of the nearest earlier
    bin with some (the first later one, for leading bins), as the lossy plan's thin bins take a trusted
    neighbour's budget: its positions are priced, never free or impossible. A budget no bin has stays nan."""
    out = mean.copy()
    for j in range(out.shape[1]):
        have = ~np.isnan(out[:, j])
        if have.any():
            last = np.maximum.accumulate(np.where(have, np.arange(len(have)), -1))
            out[:, j] = out[np.where(last < 0, np.argmax(have), last), j]
    return out


def _plan_for_k(cost: CostModel, alpha: MeanAlpha, thin: np.ndarray, batch: int, contexts: np.ndarray,
                bins: np.ndarray, k: int, dense: float) -> SpeculativePlan:
    """The non-decreasing per-bin budgets of the fewest predicted seconds (dynamic programming over bins:
    best[i, j] is the least time of bins 0..i with bin i at budget j). `thin` [bins, budgets]: no profiled
    token there (its value `borrowed`), shown as None."""
    n, m = alpha.mean.shape
    seconds = np.zeros((n, m))  # [bin, budget] predicted decode seconds of the bin's positions
    for i in range(n):
        at = bins == i
        for j, b in enumerate(alpha.budgets):
            a = alpha.mean[i, j]
            if np.isnan(a):
                seconds[i, j] = np.inf if at.any() else 0.0
                continue
            cycle = cycle_seconds(cost, batch, contexts[at], int(b), k)
            seconds[i, j] = float(cycle.sum()) / expected_tokens(float(a), k)
    best = seconds.copy()
    for i in range(1, n):
        best[i] += np.minimum.accumulate(best[i - 1])
    choice = [int(np.argmin(best[-1]))]
    for i in range(n - 2, -1, -1):
        choice.append(int(np.argmin(best[i, : choice[-1] + 1])))
    choice.reverse()
    total = float(best[-1, choice[-1]])
    # a bin without profiled tokens has no mean of its own to show: None (a thin bin), never a made-up 0
    means = [None if thin[i, j] or np.isnan(alpha.mean[i, j]) else float(alpha.mean[i, j])
             for i, j in enumerate(choice)]
    return SpeculativePlan(k, [int(alpha.budgets[j]) for j in choice], means,
                           [None if a is None else expected_tokens(a, k) for a in means],
                           dense / total if total > 0 else 1.0, {})
