"""Collapse detectors: what training did to a run, read from its per-step metrics.

A run is labelled by its dense held-out accuracy falling below its own start, its own reward falling
from its best, an exploding gradient norm, an entropy blow-up, a surge in truncation or repetition, or a
NaN or infinity in its loss, gradient norm, reward or entropy;
a gap between the dense and the sparse sampler's reward that was there at step 0 is the sampler's, not
training's (`InitialEval.sampler_gap`), and never a reason; the mismatch KL is a warning, never the label
(`calibrate-threshold` fits the threshold to these labels, so a label made of mismatch would be circular).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Detectors:
    """Collapse detectors; each fires on the smoothed per-step metrics (window `window` steps)."""

    window: int = 5
    reward_drop: float = 0.5  # final reward below (1 - reward_drop) x best reward
    grad_norm_factor: float = 10.0  # grad norm above factor x median of the first window
    mismatch_kl_limit: float = 0.05  # smoothed mismatch KL above this: a warning, not a collapse
    truncation_limit: float = 0.5  # final truncation rate above this, having risen by `surge`
    repetition_limit: float = 0.5  # final repetition rate above this, having risen by `surge`
    surge: float = 0.25  # rise over the first window's mean: a rate that was high from the start (a tight
    # --max-new-tokens cap truncates every sample) says nothing about training
    entropy_factor: float = 3.0  # final entropy above factor x initial entropy
    reward_margin: float = 0.1  # final smoothed reward below the dense reference's by more than
    # max(this, the dense runs' seed spread)
    eval_margin: float = 0.1  # last eval accuracy below the dense reference's by more than
    # max(this, the dense runs' seed spread)


def smooth(x: np.ndarray, w: int) -> np.ndarray:
    if len(x) < w:
        return np.array([x.mean()]) if len(x) else x
    return np.convolve(x, np.ones(w) / w, mode="valid")


def metric(metrics: pa.Table, name: str) -> np.ndarray | None:
    if name not in metrics.column_names:
        return None
    x = metrics.column(name).to_numpy(zero_copy_only=False).astype(float)
    x = x[np.isfinite(x)]  # nulls (steps without it) and what `_diverged` reports
    return x if len(x) else None


def collapse_reasons(metrics: pa.Table, det: Detectors = Detectors(), start_eval: float | None = None
                     ) -> list[str]:
    """Why a run collapsed ([] = stable). `start_eval`: the dense held-out accuracy before any update."""
    metrics = metrics.sort_by("step")
    w, reasons = det.window, _diverged(metrics)
    if start_eval is not None and (e := metric(metrics, "eval_accuracy")) is not None:
        if e[-1] < start_eval - det.eval_margin:
            reasons.append(f"dense eval accuracy fell from {start_eval:.3f} at step 0 to {e[-1]:.3f} (more "
                           f"than {det.eval_margin:g})")
    if (r := metric(metrics, "reward_mean")) is not None:
        s = smooth(r, w)
        best, final = s.max(), s[-1]
        if best > 0 and final < (1 - det.reward_drop) * best:
            reasons.append(f"reward fell from {best:.3f} to {final:.3f}")
    if (g := metric(metrics, "grad_norm")) is not None and len(g) > w:
        base = np.median(g[:w])
        if base > 0 and g.max() > det.grad_norm_factor * base:
            reasons.append(f"gradient norm exploded to {g.max():.3g} ({g.max() / base:.0f}x)")
    for name, limit in (("truncation", det.truncation_limit), ("repetition", det.repetition_limit)):
        if (x := metric(metrics, f"{name}_rate")) is not None:
            first, last = x[:w].mean(), smooth(x, w)[-1]
            if last > limit and last - first >= det.surge:
                reasons.append(f"{name} rate rose from {first:.2f} to {last:.2f}")
    if (e := metric(metrics, "entropy")) is not None and len(e) > w:
        first, last = e[:w].mean(), smooth(e, w)[-1]
        if first > 0 and last > det.entropy_factor * first:
            reasons.append(f"entropy blew up from {first:.3g} to {last:.3g}")
    return reasons


WATCHED = ("loss", "grad_norm", "reward_mean", "entropy")  # a NaN or infinity in one: training diverged


def _diverged(metrics: pa.Table) -> list[str]:
    """A NaN or infinite value (not a null: a step without that measurement) in a WATCHED column."""
    import pyarrow.compute as pc

    reasons = []
    for name in WATCHED:
        if name not in metrics.column_names or not pa.types.is_floating(metrics.schema.field(name).type):
            continue
        column = metrics.column(name)
        bad = pc.fill_null(pc.or_(pc.is_nan(column), pc.is_inf(column)), False).to_numpy(zero_copy_only=False)
        if bad.any():
            first = int(np.argmax(bad))
            step = metrics.column("step")[first].as_py()
            reasons.append(f"{name} is {column[first].as_py()} at step {step} (training diverged)")
    return reasons


def signal_warnings(metrics: pa.Table) -> list[str]:
    """No learning signal: at every step, every group's samples got one reward (TRL's frac_reward_zero_std
    is 1), so every advantage was zero. A diagnostic, never a collapse reason."""
    if (z := metric(metrics, "frac_reward_zero_std")) is not None and bool((z >= 1.0).all()):
        return [f"no learning signal: at each of the {len(z)} steps every group's samples got the same "
                "reward (frac_reward_zero_std 1), so every advantage was zero and the policy gradient "
                "had nothing to follow"]
    return []


def mismatch_warnings(metrics: pa.Table, det: Detectors = Detectors()) -> list[str]:
    """Diagnostics that do not label a run: the smoothed mismatch KL above its warning level."""
    if (k := metric(metrics.sort_by("step"), "mismatch_kl")) is not None:
        peak = smooth(k, det.window).max()
        if peak > det.mismatch_kl_limit:
            return [f"mismatch KL reached {peak:.3g} (smoothed; warning level {det.mismatch_kl_limit:g}, "
                    "a diagnostic, not a collapse)"]
    return []


@dataclass(frozen=True)
class InitialEval:
    """Step 0, before any update, on the held-out prompts: greedy accuracy and sampled reward (the run's
    samples per prompt and temperature) of the dense sampler and, for a sparse run, of the run's sampler.
    The gap between the two rewards is the sampler's own (`sampler_gap`): present before training did
    anything, so a collapse label never counts it."""

    accuracy: float
    accuracy_sparse: float | None = None
    reward: float | None = None
    reward_sparse: float | None = None

    @property
    def sampler_gap(self) -> float | None:
        """Dense reward minus the run's sampler's (0 for a dense run)."""
        if self.reward is None:
            return None
        return 0.0 if self.reward_sparse is None else self.reward - self.reward_sparse

    def metadata(self) -> dict[str, float]:
        return {k: v for k, v in {
            "initial_eval_accuracy": self.accuracy, "initial_eval_accuracy_sparse": self.accuracy_sparse,
            "initial_eval_reward": self.reward, "initial_eval_reward_sparse": self.reward_sparse,
            "initial_sampler_gap": self.sampler_gap}.items() if v is not None}

    @classmethod
    def from_metadata(cls, meta: dict) -> InitialEval | None:
        get = lambda k: None if meta.get(k) in (None, "") else float(meta[k])
        if get("initial_eval_accuracy") is None:
            return None
        return cls(get("initial_eval_accuracy"), get("initial_eval_accuracy_sparse"),
                   get("initial_eval_reward"), get("initial_eval_reward_sparse"))
