"""GRPO's numbers: group advantages, rollout correction toward the dense learner, the clipped loss.

Shapes: N sequences (P prompts x K samples, prompt-major), T tokens (right-padded), `mask` [N, T] bool.
The conventions (clip bounds, aggregation modes, clip statistics): docs/training.md (design notes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import corrections as rc
from .clip import CLIP_HIGH, CLIP_LOW
from .corrections import Correction, k3

CORRECTIONS = rc.PRESETS
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "bnpo")
AGG_ALIASES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


@dataclass
class LossConfig:
    correction: str = "tis"
    kl_coef: float = 0.0
    clip_low: float = CLIP_LOW  # --epsilon
    clip_high: float = CLIP_HIGH  # --epsilon-high
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
    # verl / TRL options over the preset (None: the preset's); corrections.py
    rollout_is: str | None = None  # token | sequence | none
    rollout_is_threshold: str | None = None  # "U" or "L_U"
    rollout_is_mode: str | None = None  # truncate | mask
    rollout_is_batch_normalize: bool | None = None
    rollout_rs: str | None = None  # comma list of corrections.RS_OPTIONS, or none
    rollout_rs_threshold: str | None = None  # comma list, one per option or one for all
    off_policy_mask_threshold: float | None = None  # OPSM's delta
    rejection: str | None = None  # the Sparrow recipe's stochastic rejection: token | sequence | none
    rejection_c: float | None = None
    alpha_weight: bool | None = None
    bypass_mode: bool = False

    @property
    def aggregation(self) -> str:
        return AGG_ALIASES.get(self.loss_agg, self.loss_agg)

    def rules(self) -> rc.Rules:
        """The preset's rules with the explicit options in place of the parts they name."""
        rules = rc.preset(self.correction, self.tis_cap, (self.mis_low, self.mis_high), self.veto_threshold,
                          (self.sparse_rl_low, self.sparse_rl_high))
        if self.rollout_is is not None:
            rules = replace(rules, is_level=None if self.rollout_is == "none" else self.rollout_is)
        if self.rollout_is_threshold is not None:
            lower, upper = rc.parse_bounds(self.rollout_is_threshold, "--rollout-is-threshold")
            rules = replace(rules, is_lower=lower, is_upper=upper)
        if self.rollout_rs is not None:
            threshold = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else "2.0"
            rules = replace(rules, rejections=rc.parse_rejections(self.rollout_rs, threshold))
        if self.rejection is not None:
            rules = replace(rules, rejection=None if self.rejection == "none" else self.rejection)
        return rc.with_overrides(rules, is_mode=self.rollout_is_mode,
                                 batch_normalize=self.rollout_is_batch_normalize,
                                 opsm=self.off_policy_mask_threshold, rejection_c=self.rejection_c,
                                 alpha_weight=self.alpha_weight)

    def validate(self) -> LossConfig:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"--correction must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"--loss-agg must be one of {', '.join(AGGREGATIONS)} (or TRL's "
                             f"{', '.join(AGG_ALIASES)}), got {self.loss_agg!r}")
        self._validate_rules()
        if not 0 < self.clip_low < 1:
            raise ValueError(f"--epsilon must be between 0 and 1 (the ratio is cut at 1 - epsilon), "
                             f"got {self.clip_low}")
        if not self.clip_high > 0:
            raise ValueError(f"--epsilon-high must be positive, got {self.clip_high}")
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

    def _validate_rules(self) -> None:
        choices = (("rollout_is", (*rc.IS_LEVELS, "none")), ("rollout_is_mode", rc.IS_MODES),
                   ("rejection", (*rc.REJECTION_LEVELS, "none")))
        for name, allowed in choices:
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                 f"got {value!r}")
        if self.rollout_rs_threshold is not None and self.rollout_rs is None:
            raise ValueError("--rollout-rs-threshold needs --rollout-rs (the options it bounds)")
        for name in ("off_policy_mask_threshold", "rejection_c"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        self._refuse_idle_options(self.rules())  # the thresholds parse

    def _refuse_idle_options(self, rules: rc.Rules) -> None:
        """An option given that the resolved `rules` never read is refused, as --rollout-rs-threshold
        without --rollout-rs is: the run's config.json would record a correction that does not run. As in
        verl, the IS threshold, mode and batch normalisation act only with IS on (the normalisation also
        divides alpha weights, so --alpha-weight gives it weights too) and --rejection-c only with the
        stochastic rejection on; an option left unset or set to off is never refused."""
        if rules.is_level is None:
            no_is = self._turned_off("rollout_is", "IS", lambda r: r.is_level is not None)
            for name, does in (("rollout_is_threshold", "bounds the IS weights"),
                               ("rollout_is_mode", "picks how the IS weights are bounded")):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} {does}, but {no_is}")
            if self.rollout_is_batch_normalize and not rules.alpha_weight:
                raise ValueError(f"--rollout-is-batch-normalize divides the IS or alpha weights by their "
                                 f"mean, but {no_is}, or add --alpha-weight")
        if self.rejection_c is not None and rules.rejection is None:
            no_rejection = self._turned_off("rejection", "stochastic rejection", lambda r: r.stochastic)
            raise ValueError(f"--rejection-c is the stochastic rejection's C, but {no_rejection}")
        if self.rollout_rs_threshold is not None and not rules.rejections:
            raise ValueError(f"--rollout-rs-threshold needs --rollout-rs options to bound, and --rollout-rs "
                             f"{self.rollout_rs} names none")

    def _turned_off(self, name: str, what: str, has: Callable[[rc.Rules], bool]) -> str:
        """Why `what` is off (option `name` set to none, or a preset without it) and how to turn it on."""
        flag = f"--{name.replace('_', '-')}"
        if getattr(self, name) == "none":
            return f"{flag} none turns {what} off: give {flag} token or sequence"
        presets = ", ".join(p for p in rc.PRESETS if has(rc.preset(p)))
        return (f"--correction {self.correction} has no {what}: add {flag} token or sequence, or pick a "
                f"--correction with it ({presets})")


def group_advantages(rewards: Tensor, cfg: LossConfig) -> Tensor:
    """rewards [P, K] -> advantages [P, K]."""
    centred = rewards - rewards.mean(1, keepdim=True)
    if not cfg.scale_std:
        return centred
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(1, keepdim=True) + cfg.eps)


def rollout_correction(log_ratio: Tensor, mask: Tensor, cfg: LossConfig, advantages: Tensor | None = None,
                       alpha: Tensor | None = None, generator: torch.Generator | None = None) -> Correction:
    """log_ratio [N, T] = logp_dense_old - logp_rollout (any value at padding), mask [N, T]; advantages
    [N], alpha [N, T] and a seeded CPU generator where the rules need them (corrections.apply)."""
    return rc.apply(cfg.rules(), log_ratio, mask, advantages, alpha, generator)


def loss_normalizer(keep: Tensor, cfg: LossConfig, max_tokens: int | None = None) -> int:
    """The batch-wide denominator of the loss (`keep` [N, T]): kept tokens (token-mean, and bnpo for one
    micro-batch), sequences that kept any (seq-mean-token-mean), or sequences x `max_tokens` (default
    T) for seq-mean-token-sum-norm."""
    agg = cfg.aggregation
    if agg == "seq-mean-token-sum-norm":
        return max(keep.shape[0] * (max_tokens or keep.shape[1]), 1)
    count = keep.any(1).sum() if agg == "seq-mean-token-mean" else keep.sum()
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
    if cfg.aggregation == "seq-mean-token-mean":
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
