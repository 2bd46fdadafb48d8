"""What a run logs: RUN/metrics.parquet (one row per step; the label and configuration in its metadata),
RUN/mismatch/step=NNNNN.parquet (every generated token's mismatch), RUN/completions/step=NNNNN.parquet
(every sampled completion's text, reward and advantage) and RUN/schedule.parquet."""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.artifacts import TRAIN_CORRECTION_METRICS

from ..core.definitions import TAIL_QUANTILE
from ..core.schedule import Schedule
from ..core.token_budgets import mean_sparse_budget
from ..engine import draft_acceptance
from . import corrections as rc
from . import objective as grpo
from .config import TrainConfig
from .detectors import InitialEval, collapse_reasons, mismatch_warnings, signal_warnings
from .experience import Experience
from .run_dir import COMPLETIONS_DIR, MISMATCH_DIR


def repetition(tokens: Sequence[int], n: int = 4) -> bool:
    """A completion loops when fewer than half of its n-grams are distinct (only from 16 tokens on)."""
    if len(tokens) < 16:
        return False
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) < 0.5 * len(grams)


def global_step(exp: Experience) -> int:
    """The step a row or a log names: the updates done once this step's update is applied (TRL's and verl's
    global_step), so step 0 is before any update (the initial eval) and the first step's rows are step 1."""
    return exp.step + 1


def metrics_row(run_id: str, exp: Experience, update: dict, update_seconds: float, cfg: TrainConfig,
                loss: grpo.LossConfig, sync_seconds: float | None) -> dict:
    """A step's row of metrics.parquet (every column, the eval's and the collapse's still empty)."""
    s, flat, rewards, correction = exp.scores, exp.completions, exp.rewards, exp.correction
    mask = s.mask
    alpha = s.alpha_lb[mask]
    generated = sum(len(c.token_ids) for c in flat)
    t_roll, t_score = exp.rollout_seconds, exp.scoring_seconds
    row = {
        "run_id": run_id, "step": global_step(exp), "reward_mean": float(rewards.mean()),
        "reward_std": reward_std(rewards), "frac_reward_zero_std": frac_reward_zero_std(exp),
        "accuracy": float((rewards >= 1.0 - 1e-9).mean()),
        "eval_accuracy": None, "eval_accuracy_sparse": None, "sampler_gap": None,
        "draft_acceptance": draft_acceptance(flat), "oversample_acceptance_kept": None,
        "oversample_acceptance_dropped": None, "loss": update.get("loss"),
        "policy_loss": update.get("policy_loss"), "kl": update.get("kl"),
        **{k: update.get(k) for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                                      "dual_clip_fraction")},
        "grad_norm": update["grad_norm"], "entropy": float(s.entropy[mask].mean()),
        "mismatch_kl": float(grpo.k3(s.log_ratio[mask]).mean()),
        "masked_fraction": correction.stats["masked_fraction"],
        "vetoed_fraction": correction.stats["vetoed_fraction"],
        "alpha_lb_mean": float(alpha.mean()), "alpha_lb_p5": float(torch.quantile(alpha, TAIL_QUANTILE)),
        **exact_alpha_stats(exp, cfg.bin_width, cfg.speculate > 0),
        "mean_budget": mean_sparse_budget(s.budgets[mask]),
        "truncation_rate": float(np.mean([c.finish_reason == "length" for c in flat])),
        "repetition_rate": float(np.mean([repetition(c.token_ids) for c in flat])),
        "response_length": generated / len(flat), "lr": cfg.lr,
        "rollout_seconds": t_roll, "scoring_seconds": t_score, "update_seconds": update_seconds,
        "seconds": t_roll + t_score + update_seconds, "tokens_per_second": generated / max(t_roll, 1e-9),
        "weight_sync_seconds": sync_seconds,  # part of rollout_seconds; None without workers
        "update_skipped": update.get("update_skipped"), "alpha_lb_p5_by_bin": alpha_tail(exp, cfg.bin_width),
        **dict.fromkeys(TRAIN_CORRECTION_METRICS),  # every row has every column (the table's schema)
        **rc.metrics(correction, s.log_ratio, s.logp, s.logp_rollout, mask, loss.rules()),
    }
    row.update(exp.selection or {})
    row["reward_seconds"] = exp.reward_seconds
    row["reward_extra"] = json.dumps(exp.reward_extra) if exp.reward_extra else None
    return row


def reward_std(rewards: np.ndarray) -> float:
    """`reward_std`: the standard deviation of all the step's rewards with Bessel's correction (ddof 1), as
    TRL's GRPOTrainer logs it; not the mean of the groups' standard deviations."""
    return float(np.std(np.asarray(rewards, dtype=float), ddof=1))


def frac_reward_zero_std(exp: Experience) -> float:
    """The share of the step's groups whose samples all got the same reward (TRL's metric): their
    advantages are zero, so they give the policy gradient nothing."""
    groups = np.asarray(exp.rewards, dtype=float).reshape(len(exp.prompts), -1)
    return float(np.isclose(groups.std(axis=1), 0.0).mean())


def _positions(exp: Experience) -> Tensor:
    """[N, T] each token's cache length when it was produced (prompt length + index)."""
    prompt_len = torch.tensor([len(c.prompt_token_ids) for c in exp.completions])
    return prompt_len[:, None] + torch.arange(exp.scores.mask.shape[1])[None, :]


def alpha_tail(exp: Experience, bin_width: int, exact: bool = False) -> list[float | None]:
    """The p5 of alpha per position bin (index = bin; None where a bin has no token), binned as the
    mismatch log bins positions: of the top-20 lower bound, or with `exact` of the exact alpha of the
    subsample that has it."""
    mask = exp.scores.mask
    values = exp.scores.alpha if exact else exp.scores.alpha_lb
    if exact:
        mask = mask & ~values.isnan()
    bins = (_positions(exp) // bin_width)[mask]
    alpha = values[mask]
    return [float(torch.quantile(alpha[bins == b], TAIL_QUANTILE)) if bool((bins == b).any())
            else None for b in range(int(bins.max()) + 1)] if len(alpha) else []


def exact_alpha_stats(exp: Experience, bin_width: int, drafted: bool = False) -> dict:
    """alpha_mean, alpha_p5 (the min over bins of the per-bin p5: the tail the criterion reads) and
    alpha_p5_by_bin of the exactly scored tokens; 1 for a dense sampler, None where none was scored.
    `drafted`: speculative rollouts, whose tokens record budget 0 although a sparse policy drafted them."""
    s = exp.scores
    if s.alpha is None:
        dense = not drafted and bool((s.budgets[s.mask] == 0).all())
        one = 1.0 if dense else None
        return {"alpha_mean": one, "alpha_p5": one, "alpha_p5_by_bin": None}
    values = s.alpha[s.mask & ~s.alpha.isnan()]
    if not len(values):
        return {"alpha_mean": None, "alpha_p5": None, "alpha_p5_by_bin": None}
    by_bin = alpha_tail(exp, bin_width, exact=True)
    return {"alpha_mean": float(values.mean()), "alpha_p5": min(t for t in by_bin if t is not None),
            "alpha_p5_by_bin": by_bin}


def write_mismatch(run_dir: Path, exp: Experience, cfg: TrainConfig) -> None:
    """RUN/mismatch/step=NNNNN.parquet: one row per generated token of the step."""
    s, flat, correction = exp.scores, exp.completions, exp.correction
    seq, pos_in = s.mask.nonzero(as_tuple=True)
    prompt_ids = [exp.prompts[i // cfg.samples].prompt_id for i in range(len(flat))]
    position = _positions(exp)[seq, pos_in]
    log_ratio = (s.logp - s.logp_rollout)[seq, pos_in]  # log r_t, as the corrections read it
    rows, cols = seq.tolist(), pos_in.tolist()
    table = {
        "step": [global_step(exp)] * len(seq), "prompt_id": [prompt_ids[i] for i in rows],
        "sample": [flat[i].sample for i in rows], "position": position.tolist(),
        "bin": (position // cfg.bin_width).tolist(), "budget": s.budgets[seq, pos_in].tolist(),
        "token_id": [flat[i].token_ids[j] for i, j in zip(rows, cols)],
        "logp_rollout": s.logp_rollout[seq, pos_in].tolist(),
        "logp_dense": s.logp[seq, pos_in].clamp(max=0).tolist(),
        "log_ratio": log_ratio.tolist(), "k3": grpo.k3(log_ratio).tolist(),
        "alpha_top20_lb": s.alpha_lb[seq, pos_in].clamp(0, 1).tolist(),
        "alpha": [None] * len(rows) if s.alpha is None else
        [None if a != a else a for a in s.alpha[seq, pos_in].clamp(0, 1).tolist()],
        "weight": correction.weights[seq, pos_in].tolist(),
        "masked": (~correction.mask[seq, pos_in]).tolist(), "vetoed": correction.vetoed[seq].tolist(),
    }
    write_artifact(table, run_dir / MISMATCH_DIR / f"step={global_step(exp):05d}.parquet", "train_mismatch",
                   metadata={"bin_width": cfg.bin_width, "sparsity": cfg.sparsity})


def write_completions(run_dir: Path, exp: Experience, cfg: TrainConfig, tokenizer) -> None:
    """RUN/completions/step=NNNNN.parquet: one row per sampled completion of the step, as the learner saw
    it (its text, its reward, its group-relative advantage)."""
    flat = exp.completions
    rewards = exp.rewards.reshape(-1).tolist()
    table = {
        "step": [global_step(exp)] * len(flat),
        "prompt_id": [exp.prompts[i // cfg.samples].prompt_id for i in range(len(flat))],
        "sample": [c.sample for c in flat],
        "text": [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat],
        "tokens": [len(c.token_ids) for c in flat], "finish_reason": [c.finish_reason for c in flat],
        "reward": [float(r) for r in rewards], "advantage": exp.advantages.tolist(),
        "mean_budget": [mean_sparse_budget(c.budgets) for c in flat],
    }
    write_artifact(table, run_dir / COMPLETIONS_DIR / f"step={global_step(exp):05d}.parquet",
                   "train_completions", metadata={"sparsity": cfg.sparsity})


def collapse(history: list[dict], initial: InitialEval | None = None) -> str | None:
    """The collapse reasons that hold for the run so far (the run's label is those of its last step)."""
    start = initial.accuracy if initial else None
    return "; ".join(collapse_reasons(pa.Table.from_pylist(history), start_eval=start)) or None


def label(history: list[dict]) -> dict:
    """stable | collapsed by the reasons over the whole run (its last row's), the first step of the
    streak of flagged rows that ends the run, and the mismatch warnings (never part of the label)."""
    last = history[-1].get("collapse") if history else None
    reasons = last.split("; ") if last else []
    first = None
    for r in reversed(history if reasons else []):
        if not r.get("collapse"):
            break
        first = r["step"]
    table = pa.Table.from_pylist(history) if history else None
    warnings = mismatch_warnings(table) + signal_warnings(table) if table is not None else []
    return {"label": "collapsed" if reasons else "stable", "reasons": reasons,
            "first_collapse_step": first, "warnings": warnings}


def write_metrics(run_dir: Path, history: list[dict], cfg: TrainConfig, initial: InitialEval | None) -> None:
    run = label(history)
    meta = {"config": json.dumps(asdict(cfg)), "label": run["label"],
            "reasons": "; ".join(run["reasons"]), "first_collapse_step": run["first_collapse_step"],
            "warnings": "; ".join(run["warnings"]) or None, **(initial.metadata() if initial else {})}
    meta = {k: v for k, v in meta.items() if v is not None}
    write_artifact(history, run_dir / "metrics.parquet", "metrics", metadata=meta)


def write_schedule(run_dir: Path, schedule: Schedule, source: str) -> None:
    """The schedule the rollouts used, as a `schedule` artifact (dense: one bin, null budget)."""
    n = len(schedule.budgets)
    ends = [*schedule.bin_starts[1:], None]
    write_artifact({"bin": list(range(n)), "bin_start": list(schedule.bin_starts), "bin_end": ends,
                    "budget": [b or None for b in schedule.budgets], "tail": [None] * n,
                    "predicted_step_seconds": [None] * n},
                   run_dir / "schedule.parquet", "schedule",
                   metadata={"page_size": schedule.page_size, "source": source})


def read_metrics(run_dir: str | Path) -> tuple[list[dict], dict]:
    path = Path(run_dir) / "metrics.parquet"
    return read_artifact(path, "metrics").to_pylist(), artifact_metadata(path)


def reward_extra_means(extras: Sequence[dict | None], logged: dict[str, float]) -> dict[str, float] | None:
    """A step's means of what a user's reward function reported beside its scores: each numeric or boolean
    field of its returned dicts (verl's reward_extra_info) or of its log_extra columns, over the
    completions that have it, a boolean counting as 0 or 1 (verl averages its `acc` so), and each
    log_metric name's mean over what was logged (TRL's); non-finite values left out; None when there is
    nothing."""
    sums: dict[str, list[float]] = {}
    for extra in extras:
        for name, value in (extra or {}).items():
            if isinstance(value, numbers.Real | np.bool_) and np.isfinite(value):
                sums.setdefault(name, []).append(float(value))
    means = {name: float(np.mean(values)) for name, values in sums.items()}
    means.update({name: value for name, value in logged.items() if np.isfinite(value)})
    return dict(sorted(means.items())) or None
