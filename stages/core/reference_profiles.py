"""Reference tail profiles for the Qwen3 presets, derived from the published schedules.

The published work gives, per model and target threshold t, the budget of every 2,000-token bin
(`published_schedules`), not the measured tails behind them. A planner that only needs "the smallest
budget whose tail reaches t" can use any tail curve tail(bin, budget) that is non-decreasing in the
budget and satisfies, for every published (t, b): tail(b) >= t and tail(b') < t for every b' < b.
This module builds the simplest such curve per bin, so that planning at a published threshold gives
exactly the published budget and planning between two published thresholds gives budgets between
the two published ones.

Construction, per bin (the published budgets of a bin never fall as t rises, which is checked):
- knots: each distinct published budget beta, with hi(beta) = the largest published t mapped to it
  and lo(beta) = the smallest;
- two anchors: three pages (the smallest legal budget) with tail 0, and the bin's end (the last bin:
  the model's context) with tail 1, because a budget that covers every cached position is dense and
  dense attention has alpha = 1 exactly;
- at a knot the tail is hi(knot); between knots k0 < k1 it rises linearly in log2(budget) from
  hi(k0) towards lo(k1), which it reaches only at k1 itself, where it jumps to hi(k1). So every budget
  below a published one stays strictly under the lowest threshold that published it;
- from the last knot up to the end anchor it rises to 1; at and above the end anchor it is 1.
Below the smallest published budget and above the largest published threshold the curve is an
assumption (the anchors), and the planner says so when a threshold falls outside the published range.
Candidate budgets are every page count from three pages to the model's context.
"""

from __future__ import annotations

import numpy as np

from .published_schedules import (
    BIN_TOKENS,
    CONTEXT,
    NUM_BINS,
    PAGE_SIZE,
    PUBLISHED_PAGES,
    published_models,
)
from .schedule import TailProfile

QUANTILE = 0.05  # the published tail statistic: the 5th percentile of alpha per bin
REFERENCE_PREFIX = "reference:"  # a reference profile's source: `reference:<model>`, no file


def has_reference(model: str) -> bool:
    return model.lower() in published_models()


def reference_profile(model: str) -> TailProfile | None:
    """The reference profile of a Qwen3 preset with published schedules, else None."""
    model = model.lower()
    entries = sorted((t, pages) for (m, t), pages in PUBLISHED_PAGES.items() if m == model)
    if not entries:
        return None
    thresholds = np.array([t for t, _ in entries])
    budgets = np.array([pages for _, pages in entries]) * PAGE_SIZE  # [thresholds, bins]
    candidates = np.arange(3 * PAGE_SIZE, CONTEXT + 1, PAGE_SIZE)
    tail = np.stack([_bin_curve(candidates, thresholds, budgets[:, i], _bin_end(i), model, i)
                     for i in range(NUM_BINS)])
    return TailProfile(np.arange(NUM_BINS) * BIN_TOKENS, BIN_TOKENS, candidates, tail, QUANTILE,
                       f"{REFERENCE_PREFIX}{model}", PAGE_SIZE,
                       threshold_range=(float(thresholds.min()), float(thresholds.max())))


def _bin_end(i: int) -> int:
    return CONTEXT if i == NUM_BINS - 1 else (i + 1) * BIN_TOKENS


def _bin_curve(candidates: np.ndarray, thresholds: np.ndarray, budgets: np.ndarray, end: int,
               model: str, bin_: int) -> np.ndarray:
    if (np.diff(budgets) < 0).any():
        raise ValueError(f"published schedules of {model} fall with the threshold in bin {bin_}")
    if budgets.max() >= end:
        raise ValueError(f"a published budget of {model} covers all of bin {bin_}")
    knots = [3 * PAGE_SIZE]
    hi, lo = [0.0], [0.0]
    for beta in np.unique(budgets):
        ts = thresholds[budgets == beta]
        knots.append(int(beta))
        hi.append(float(ts.max()))
        lo.append(float(ts.min()))
    knots.append(end)
    hi.append(1.0)
    lo.append(1.0)
    knots_a = np.array(knots, dtype=np.float64)
    seg = np.clip(np.searchsorted(knots_a, candidates, side="right") - 1, 0, len(knots) - 2)
    k0, k1 = knots_a[seg], knots_a[seg + 1]
    frac = np.log2(candidates / k0) / np.log2(k1 / k0)
    curve = np.array(hi)[seg] + (np.array(lo)[seg + 1] - np.array(hi)[seg]) * frac
    curve = np.where(candidates == k0, np.array(hi)[seg], curve)
    return np.where(candidates >= end, 1.0, curve)
