"""GRPO's numbers: group advantages, rollout correction toward the dense learner, the clipped loss.

Shapes: N sequences (P prompts x K samples, prompt-major), T tokens (right-padded), `mask` [N, T] bool.
Design decisions, with the conventions they follow:
- Advantages (r - mean) / (std + eps) per prompt group, std with Bessel's correction and eps = 1e-4
  (TRL's GRPOTrainer); `scale_std=False` leaves r - mean (Dr. GRPO). A group of one sample, or of equal
  rewards, has advantage 0.
- Rollout correction acts on r_t = exp(logp_dense_old - logp_rollout), the learner's probability of
  the sampled token over the sparse actor's, with log r_t clamped to [-20, 20] before exp (verl's
  safety bound). Weights are constants (no gradient). `none`: the samples are taken as on-policy.
  `tis`: weight min(r_t, C), C = 2 (verl's rollout_is_threshold; TRL's vLLM importance-sampling cap is
  3). `mis`: tokens with r_t outside [0.5, 2] are masked out of the loss (verl's bounds: the threshold
  and its reciprocal). `veto`: a sequence with any r_t < 1e-4 is dropped whole (verl's veto threshold).
  `sparse-rl`: veto, then mask outside [0.5, 1.5], then weights min(r_t, 1.5) normalised to mean 1
  over the batch's kept tokens.
- Loss per token: PPO's clipped surrogate on ratio = exp(logp_new - logp_old), separate bounds
  [1 - 0.2, 1 + 0.28] (DAPO's clip-higher), dual clip at 3 for negative advantages, times the
  correction weight, plus kl_coef x k3(ref || new).
- Aggregation (verl's loss_agg_mode names): `token-mean` (default, DAPO's) sums over the batch's kept
  tokens and divides by their count, so long completions weigh more; `seq-mean-token-mean` (the GRPO
  paper's) averages each sequence's kept tokens, then the sequences that kept any. Either way the
  batch-wide denominator is `loss_normalizer`, so micro-batches add up to the batch's loss.
- Clip statistics: `clip_fraction_low` / `clip_fraction_high` are the kept tokens whose ratio was cut at
  1 - clip_low (negative advantage) / 1 + clip_high (positive advantage), `dual_clip_fraction` those
  held at the dual-clip bound; `clip_fraction` is the first two together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CORRECTIONS = ("none", "tis", "mis", "veto", "sparse-rl")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


@dataclass
class LossConfig:
    correction: str = "tis"
    kl_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    veto_threshold: float = 1e-4
    sparse_rl_low: float = 0.5
    sparse_rl_high: float = 1.5
    scale_std: bool = True
    eps: float = 1e-4
    loss_agg: str = "token-mean"

    def validate(self) -> LossConfig:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"--correction must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}")
        if self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"--loss-agg must be one of {', '.join(AGGREGATIONS)}, got {self.loss_agg!r}")
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(f"the clip bounds must satisfy 0 < clip_low < 1 and clip_high > 0, got "
                             f"{self.clip_low} and {self.clip_high}")
        if self.dual_clip <= 1:
            raise ValueError(f"the dual clip constant must be > 1, got {self.dual_clip}")
        for name in ("mis", "sparse_rl"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0 < low < 1 < high:
                raise ValueError(f"the {name} masking bounds must satisfy 0 < low < 1 < high, "
                                 f"got [{low}, {high}]")
        for name in ("tis_cap", "veto_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        return self


def k3(d: Tensor) -> Tensor:
    """The k3 estimator exp(d) - 1 - d (>= 0) of a KL from the log ratio d of the two policies."""
    return d.exp() - 1 - d


def group_advantages(rewards: Tensor, cfg: LossConfig) -> Tensor:
    """rewards [P, K] -> advantages [P, K]."""
    centred = rewards - rewards.mean(1, keepdim=True)
    if not cfg.scale_std:
        return centred
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(1, keepdim=True) + cfg.eps)


@dataclass
class Correction:
    weights: Tensor  # [N, T] float, 0 where not kept
    mask: Tensor  # [N, T] bool, tokens kept in the loss
    vetoed: Tensor  # [N] bool, sequences dropped whole
    stats: dict[str, float]


def rollout_correction(log_ratio: Tensor, mask: Tensor, cfg: LossConfig) -> Correction:
    """log_ratio [N, T] = logp_dense_old - logp_rollout (any value at padding), mask [N, T]."""
    ratio = torch.where(mask, log_ratio, 0.0).clamp(-20.0, 20.0).exp()
    keep = mask.clone()
    vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    weights = torch.ones_like(ratio)
    mode = cfg.correction
    if mode in ("veto", "sparse-rl"):
        vetoed = ((ratio < cfg.veto_threshold) & mask).any(1)
        keep &= ~vetoed[:, None]
    if mode == "tis":
        weights = ratio.clamp(max=cfg.tis_cap)
    elif mode == "mis":
        keep &= (ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)
    elif mode == "sparse-rl":
        keep &= (ratio >= cfg.sparse_rl_low) & (ratio <= cfg.sparse_rl_high)
        weights = ratio.clamp(max=cfg.sparse_rl_high)
        if bool(keep.any()):
            weights = weights / weights[keep].mean()
    weights = torch.where(keep, weights, 0.0).detach()
    n = max(int(mask.sum()), 1)
    stats = {"masked_fraction": float((mask & ~keep).sum()) / n,
             "vetoed_fraction": float(vetoed.float().mean()) if len(vetoed) else 0.0,
             "mean_weight": float(weights[keep].mean()) if bool(keep.any()) else 0.0}
    return Correction(weights, keep, vetoed, stats)


def loss_normalizer(keep: Tensor, cfg: LossConfig) -> int:
    """The batch-wide denominator of the loss: kept tokens, or sequences that kept any (`keep` [N, T])."""
    count = keep.any(1).sum() if cfg.loss_agg == "seq-mean-token-mean" else keep.sum()
    return max(int(count), 1)


def policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, weights: Tensor, mask: Tensor,
                cfg: LossConfig, ref_logp: Tensor | None = None, normalizer: int | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """The clipped, corrected GRPO loss of one (micro-)batch: [N, T] logprobs, advantages [N].
    Returns (loss, stats); every stat is this batch's share of the batch-wide aggregate over
    `normalizer` (default: this batch's own `loss_normalizer`), so the stats of micro-batches add up to
    the batch's."""
    norm = float(normalizer if normalizer is not None else loss_normalizer(mask, cfg))
    scale = torch.full_like(logp_new, 1.0 / norm)  # [N, T] each kept token's share of the aggregate
    if cfg.loss_agg == "seq-mean-token-mean":
        scale = scale / mask.sum(1, keepdim=True).clamp(min=1).to(scale.dtype)
    scale = torch.where(mask, scale, 0.0)
    adv = advantages[:, None].to(logp_new.dtype)
    ratio = (logp_new - logp_old).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    dual = (adv < 0) & (pg > -adv * cfg.dual_clip)
    pg = torch.where(dual, -adv * cfg.dual_clip, pg)
    token = pg * weights
    kl = torch.zeros_like(token)
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = k3(ref_logp - logp_new)
        token = token + cfg.kl_coef * kl
    loss = (token * scale).sum()
    with torch.no_grad():
        share = lambda x: float((x * scale).sum())
        cut = clipped > unclipped
        stats = {"loss": float(loss), "policy_loss": share(pg * weights), "kl": share(kl),
                 "clip_fraction": share(cut.to(scale.dtype)),
                 "clip_fraction_low": share((cut & (ratio < 1)).to(scale.dtype)),
                 "clip_fraction_high": share((cut & (ratio > 1)).to(scale.dtype)),
                 "dual_clip_fraction": share(dual.to(scale.dtype))}
    return loss, stats
