"""Collapse detectors over a run's metrics: each a rule on the history up to a step, named in the
`collapse` column of the step where it fires and in the run's label.

Rules (a step's value against the run's own history; nothing fires before `WARMUP` steps):
- `reward_drop`: the reward mean, averaged over the last 3 steps, is below half of the best such
  average so far, and that best was at least 0.1 (a run that never learned cannot fall).
- `grad_explosion`: the grad norm exceeds 10x the median of the earlier steps' grad norms.
- `mismatch_kl_spike`: the mismatch KL (sampled k3 of the sparse actor vs the dense learner) exceeds
  max(10x the median of the earlier steps, 0.05).
- `entropy_blowup`: the mean token entropy exceeds 2x the mean of the first `WARMUP` steps.
- `truncation_surge` / `repetition_surge`: the rate is at least 0.5 and at least twice the mean of the
  first `WARMUP` steps (plus 0.1, so that a zero start does not make any rise a surge).
A run is `collapsed` if any rule fired at any step, else `stable`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WARMUP = 3


def _values(history: Sequence[dict], key: str) -> np.ndarray:
    return np.array([np.nan if h.get(key) is None else float(h[key]) for h in history], dtype=float)


def detect(history: Sequence[dict]) -> list[str]:
    """The rules that fire at the last step of `history` (a list of metrics rows, oldest first)."""
    if len(history) <= WARMUP:
        return []
    fired = []
    reward = _values(history, "reward_mean")
    smooth = np.convolve(reward, np.ones(3) / 3, mode="valid")
    if len(smooth) and np.nanmax(smooth) >= 0.1 and smooth[-1] < 0.5 * np.nanmax(smooth):
        fired.append("reward_drop")
    grad = _values(history, "grad_norm")
    if np.isfinite(grad[-1]) and grad[-1] > 10 * np.nanmedian(grad[:-1]):
        fired.append("grad_explosion")
    kl = _values(history, "mismatch_kl")
    if np.isfinite(kl[-1]) and kl[-1] > max(10 * np.nanmedian(kl[:-1]), 0.05):
        fired.append("mismatch_kl_spike")
    entropy = _values(history, "entropy")
    if np.isfinite(entropy[-1]) and entropy[-1] > 2 * np.nanmean(entropy[:WARMUP]):
        fired.append("entropy_blowup")
    for key, name in (("truncation_rate", "truncation_surge"), ("repetition_rate", "repetition_surge")):
        rate = _values(history, key)
        if np.isfinite(rate[-1]) and rate[-1] >= 0.5 and rate[-1] >= 2 * np.nanmean(rate[:WARMUP]) + 0.1:
            fired.append(name)
    return fired


def label(history: Sequence[dict]) -> dict:
    """{"label": stable|collapsed, "first_collapse_step": int|None, "detectors": [...]} of a run."""
    first, names = None, []
    for h in history:
        for name in (h.get("collapse") or "").split(","):
            if name:
                first = h["step"] if first is None else first
                names.append(name)
    return {"label": "collapsed" if names else "stable", "first_collapse_step": first,
            "detectors": sorted(set(names))}
