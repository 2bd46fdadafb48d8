"""Rollout-correction rules: small named functions of the per-token log ratio, combined as verl does.

`log_ratio` [N, T] = logp_dense_old - logp_rollout, `mask` [N, T] bool; the rules, their presets and the
conventions they follow are in docs/training.md (design notes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
REJECTION_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Rejection:
    """One verl rollout_rs option and its bounds (k1: ratio bounds; k2, k3: `upper` on the statistic)."""

    option: str
    upper: float
    lower: float | None = None  # k1 only; None = 1 / upper


@dataclass(frozen=True)
class Rules:
    """The resolved correction: which rules run, with what thresholds (see the module docstring)."""

    is_level: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    is_mode: str = "truncate"
    batch_normalize: bool = False
    rejections: tuple[Rejection, ...] = ()
    veto: float | None = None
    opsm: float | None = None
    rejection: str | None = None  # stochastic rejection level
    rejection_c: float = 1.0
    alpha_weight: bool = False

    @property
    def stochastic(self) -> bool:
        return self.rejection is not None


def preset(name: str, tis_cap: float = 2.0, mis: tuple[float, float] = (0.5, 2.0), veto: float = 1e-4,
           sparse_rl: tuple[float, float] = (0.5, 1.5)) -> Rules:
    """The rules of a `--correction` preset."""
    token_k1 = lambda lo, hi: (Rejection("token_k1", hi, lo),)
    return {
        "none": Rules(),
        "tis": Rules(is_level="token", is_upper=tis_cap),
        "mis": Rules(rejections=token_k1(*mis)),
        "veto": Rules(veto=veto),
        "sparse-rl": Rules(veto=veto, rejections=token_k1(*sparse_rl), is_level="token",
                           is_upper=sparse_rl[1], batch_normalize=True),
        "icepop": Rules(is_level="token", is_mode="mask", is_lower=0.5, is_upper=5.0),
        "seq-mask-tis": Rules(is_level="token", is_upper=2.0,
                              rejections=(Rejection("seq_mean_k1", 2.0, 0.5),)),
        "opsm": Rules(opsm=0.5),
        "sparrow": Rules(is_level="token", is_upper=2.0, rejection="token", rejection_c=1.0,
                         alpha_weight=True),
    }[name]


PRESETS = ("none", "tis", "mis", "veto", "sparse-rl", "icepop", "seq-mask-tis", "opsm", "sparrow")


def parse_bounds(text: str, option: str) -> tuple[float | None, float]:
    """verl's threshold text: "U" or "L_U" -> (L or None, U); ValueError with the option's name."""
    parts = str(text).split("_")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{option} must be a positive number U or bounds L_U (e.g. 0.5_2.0), got {text!r}")
    if len(values) == 2 and not values[0] < values[1]:
        raise ValueError(f"{option} bounds L_U must satisfy L < U, got {text!r}")
    return (values[0] if len(values) == 2 else None), values[-1]


def parse_rejections(options: str, thresholds: str) -> tuple[Rejection, ...]:
    """verl's comma lists, e.g. "token_k1,seq_max_k2" with "0.5_2.0,2.5" (one threshold is broadcast)."""
    names = [o.strip() for o in options.split(",") if o.strip()]
    if names in ([], ["none"]):
        return ()
    bad = [n for n in names if n not in RS_OPTIONS]
    if bad:
        raise ValueError(f"--rollout-rs must be a comma list of {', '.join(RS_OPTIONS)}, got {bad[0]!r}")
    values = [t.strip() for t in str(thresholds).split(",")]
    if len(values) == 1:
        values = values * len(names)
    if len(values) != len(names):
        raise ValueError(f"--rollout-rs-threshold needs one value, or one per option ({len(names)}), "
                         f"got {len(values)}")
    out = []
    for name, value in zip(names, values):
        lower, upper = parse_bounds(value, "--rollout-rs-threshold")
        if lower is not None and not name.endswith("k1"):
            raise ValueError(f"--rollout-rs {name} bounds its statistic from above: give one number, "
                             f"not {value!r}")
        if name.endswith("k1") and lower is None and upper <= 1:
            raise ValueError(f"--rollout-rs {name} takes ratio bounds with U > 1 (L defaults to 1/U), "
                             f"got {value!r}")
        out.append(Rejection(name, upper, lower))
    return tuple(out)


# ---------------------------------------------------------------------------- statistics


def safe_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """r_t = exp(clamp(log r_t)), 1 at padding [N, T]."""
    return torch.where(mask, log_ratio, 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def k3(d: Tensor) -> Tensor:
    """The k3 estimator exp(d) - 1 - d of a KL from the log ratio d of the two policies, never negative:
    expm1 keeps the small d of nearly equal policies exact, and the clamp takes the last rounding below 0."""
    return (torch.expm1(d) - d).clamp(min=0)


def token_statistic(log_ratio: Tensor, k: str) -> Tensor:
    """verl's k1 / k2 / k3 of each token's log ratio."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if k == "k1":
        return -lr
    if k == "k2":
        return 0.5 * lr.square()
    return k3(lr)


def sequence_statistic(values: Tensor, mask: Tensor, how: str) -> Tensor:
    """[N, T] -> [N]: sum, mean or max over each sequence's tokens (0 for an empty sequence)."""
    if how == "sum":
        return torch.where(mask, values, 0.0).sum(1)
    if how == "mean":
        return torch.where(mask, values, 0.0).sum(1) / mask.sum(1).clamp(min=1)
    return torch.where(mask, values, float("-inf")).amax(1).clamp(min=0.0)


# ---------------------------------------------------------------------------- rules


def reject(log_ratio: Tensor, mask: Tensor, rule: Rejection) -> Tensor:
    """The tokens a verl rollout_rs option keeps [N, T] (padding: False)."""
    level, k = rule.option.rsplit("_", 1)
    stat = token_statistic(torch.where(mask, log_ratio, 0.0), k)
    if level != "token":
        stat = sequence_statistic(stat, mask, level.split("_")[1])[:, None].expand_as(mask)
    if k == "k1":  # ratio bounds on exp(-k1)
        lower = rule.lower if rule.lower is not None else 1.0 / rule.upper
        keep = (-stat >= math.log(lower)) & (-stat <= math.log(rule.upper))
    else:
        keep = stat <= rule.upper
    return keep & mask


def veto(log_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """[N] bool: the sequences with a token of r_t < threshold."""
    return ((safe_ratio(log_ratio, mask) < threshold) & mask).any(1)


def off_policy_mask(log_ratio: Tensor, mask: Tensor, advantages: Tensor, delta: float) -> Tensor:
    """[N] bool, OPSM: the sequences with A < 0 and mean_t log(p_rollout / p_dense) > delta."""
    mean_gap = sequence_statistic(-log_ratio, mask, "mean")
    return (advantages < 0) & (mean_gap > delta) & mask.any(1)


def stochastic_rejection(log_ratio: Tensor, mask: Tensor, level: str, c: float,
                         generator: torch.Generator) -> Tensor:
    """The tokens kept by a draw u < min(1, r / C) per token, or per sequence on its geometric mean
    ratio [N, T]; `generator` on the CPU, uniform draws [N, T] or [N]."""
    if level == "token":
        accept = (safe_ratio(log_ratio, mask) / c).clamp(max=1.0)
        u = torch.rand(mask.shape, generator=generator, dtype=torch.float64)
        return (u < accept.double().cpu()).to(mask.device) & mask
    geo = sequence_statistic(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND), mask, "mean").exp()
    accept = (geo / c).clamp(max=1.0)
    u = torch.rand(mask.shape[0], generator=generator, dtype=torch.float64)
    return (u < accept.double().cpu()).to(mask.device)[:, None] & mask


def is_ratios(log_ratio: Tensor, mask: Tensor, rules: Rules) -> Tensor:
    """The IS ratios [N, T] before their bounds: exp of each token's log ratio (token IS) or of its
    sequence's summed log ratios (sequence IS, on every token of the sequence), the log clamped to the
    safety bound; 1 without IS."""
    if rules.is_level is None:
        return torch.ones_like(log_ratio)
    lr = torch.where(mask, log_ratio, 0.0)
    if rules.is_level == "sequence":
        lr = lr.sum(1, keepdim=True).expand_as(lr)
    return lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def inside_bounds(ratios: Tensor, rules: Rules) -> Tensor:
    """[N, T] bool: the ratios that the mask mode keeps, in [lower (0 when not given), upper]."""
    return (ratios <= rules.is_upper) & (ratios >= (rules.is_lower or 0.0))


def is_weights(log_ratio: Tensor, mask: Tensor, rules: Rules) -> Tensor:
    """IS weights [N, T] before rejection: token or sequence ratio, truncated or masked to the bounds."""
    w = is_ratios(log_ratio, mask, rules)
    if rules.is_level is None:
        return w
    if rules.is_mode == "truncate":
        return w.clamp(min=rules.is_lower, max=rules.is_upper)
    return torch.where(inside_bounds(w, rules), w, 0.0)


def batch_normalized(weights: Tensor, keep: Tensor, level: str | None) -> Tensor:
    """Weights divided by their mean over the kept tokens (sequence IS: over kept sequences)."""
    if not bool(keep.any()):
        return weights
    if level == "sequence":  # each kept sequence's mean kept weight, averaged over those sequences
        kept = keep.any(1)
        seq = torch.where(keep, weights, 0.0).sum(1) / keep.sum(1).clamp(min=1)
        mean = seq[kept].mean()
    else:
        mean = weights[keep].mean()
    return weights / mean if float(mean) > 0 else weights


@dataclass
class Correction:
    weights: Tensor  # [N, T] float, 0 where not kept
    mask: Tensor  # [N, T] bool, tokens kept in the loss
    vetoed: Tensor  # [N] bool, sequences dropped whole (veto, OPSM, sequence-level rejections)
    stats: dict[str, float]
    bounded_weights: Tensor | None = None  # [N, T] the IS weights truncated or masked, before rejection and
    # normalisation (0 at padding)


def apply(rules: Rules, log_ratio: Tensor, mask: Tensor, advantages: Tensor | None = None,
          alpha: Tensor | None = None, generator: torch.Generator | None = None) -> Correction:
    """Every rule of `rules` on one batch: advantages [N] (OPSM), alpha [N, T] (alpha weighting), a
    seeded CPU generator (stochastic rejection)."""
    keep = mask.clone()
    dropped = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    per_rule = {}
    if rules.veto is not None:
        vetoed = veto(log_ratio, mask, rules.veto)
        per_rule["veto"], dropped = mask & ~vetoed[:, None], dropped | vetoed
    if rules.opsm is not None:
        if advantages is None:
            raise ValueError("OPSM needs the advantages")
        masked = off_policy_mask(log_ratio, mask, advantages.to(mask.device), rules.opsm)
        per_rule["opsm"], dropped = mask & ~masked[:, None], dropped | masked
    keep &= ~dropped[:, None]
    for rule in rules.rejections:
        kept = reject(log_ratio, mask, rule)
        per_rule[rule.option] = kept
        keep &= kept
        if not rule.option.startswith("token"):
            dropped |= ~kept.any(1) & mask.any(1)
    if rules.stochastic:
        if generator is None:
            raise ValueError("the stochastic rejection needs a seeded generator")
        kept = stochastic_rejection(log_ratio, mask, rules.rejection, rules.rejection_c, generator)
        per_rule["rejection"] = kept
        keep &= kept
        if rules.rejection == "sequence":
            dropped |= ~kept.any(1) & mask.any(1)
    raw = is_weights(log_ratio, mask, rules)
    weights = raw
    if rules.alpha_weight:
        if alpha is None:
            raise ValueError("alpha weighting needs each token's alpha")
        weights = weights * alpha.to(weights.dtype).clamp(0.0, 1.0)
    if rules.batch_normalize:
        weights = batch_normalized(weights, keep, rules.is_level)
    weights = torch.where(keep, weights, 0.0).detach()
    n = max(int(mask.sum()), 1)
    stats = {"masked_fraction": float((mask & ~keep).sum()) / n,
             "vetoed_fraction": float(dropped.float().mean()) if len(dropped) else 0.0,
             "mean_weight": float(weights[keep].mean()) if bool(keep.any()) else 0.0,
             **{f"rollout_rs_{k}_masked_fraction": float((mask & ~v).sum()) / n for k, v in per_rule.items()}}
    return Correction(weights, keep, dropped, stats, bounded_weights=torch.where(mask, raw, 0.0))


def with_overrides(rules: Rules, **changes) -> Rules:
    """`rules` with the fields given (not None) replaced."""
    return replace(rules, **{k: v for k, v in changes.items() if v is not None})


# ---------------------------------------------------------------------------- metrics

PREFIX = "rollout_corr/"


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float(x[mask].double().mean()) if bool(mask.any()) else float("nan")


def is_metrics(log_ratio: Tensor, mask: Tensor, rules: Rules) -> dict[str, float]:
    """verl's rollout_is_{mean,std,min,max,eff_sample_size} (its compute_is_metrics), taken where verl
    takes them: on the ratios before truncation or masking, over the response tokens (sequence IS: each
    token carries its sequence's ratio). Token IS: min and max of the tokens' ratios; sequence IS: of the
    sequences', from their summed log ratios (max capped at exp of the safety bound, min not). std and
    the effective sample size E[w]^2 / E[w^2] are those of the ratios clamped to [lower or 1/upper,
    upper], as verl clamps them for stability. The weights the loss reads are `bounded_metrics`'."""
    if rules.is_level is None or not bool(mask.any()):
        return {}
    values = is_ratios(log_ratio.double(), mask, rules)[mask]
    if rules.is_level == "sequence":
        rows = mask.any(1)
        sums = torch.where(mask, log_ratio.double(), 0.0).sum(1)[rows]
        high, low = float(sums.max().clamp(max=SAFETY_BOUND).exp()), float(sums.min().exp())
    else:
        high, low = float(values.max()), float(values.min())
    clamped = values.clamp(min=_lower(rules), max=rules.is_upper)
    mean_c = clamped.mean()
    square = clamped.square().mean()
    std = float((square - mean_c.square()).clamp(min=0).sqrt()) if len(values) > 1 else 0.0
    return {"rollout_is_mean": float(values.mean()), "rollout_is_std": std, "rollout_is_min": low,
            "rollout_is_max": high, "rollout_is_eff_sample_size": float(mean_c.square() / square)}


def _lower(rules: Rules) -> float:
    """The lower IS bound the metrics read: the one given, else 1 / upper (verl's)."""
    return rules.is_lower if rules.is_lower is not None else 1.0 / rules.is_upper


def bounded_metrics(corr: Correction, mask: Tensor, rules: Rules) -> dict[str, float]:
    """Sparrow's is_bounded_{mean,std,min,max,eff_sample_size}: the same statistics of the IS weights as
    the loss reads them, truncated or masked (a masked token's 0 included), before rejection and
    normalisation; over tokens (token IS) or sequences (sequence IS), std the population's and the
    effective sample size E[w]^2 / E[w^2]."""
    if rules.is_level is None or corr.bounded_weights is None or not bool(mask.any()):
        return {}
    w = corr.bounded_weights.double()
    values = w.amax(1)[mask.any(1)] if rules.is_level == "sequence" else w[mask]
    ess = 1.0 / float(((values / values.mean().clamp(min=1e-12)) ** 2).mean())
    return {"is_bounded_mean": float(values.mean()), "is_bounded_std": float(values.std(unbiased=False)),
            "is_bounded_min": float(values.min()), "is_bounded_max": float(values.max()),
            "is_bounded_eff_sample_size": ess}


def mask_metrics(log_ratio: Tensor, mask: Tensor, rules: Rules) -> dict[str, float]:
    """Under the mask mode (IcePop), verl's rollout_is_masked_fraction (the response tokens whose IS weight
    the bounds zero) and rollout_is_seq_masked_fraction (the sequences with such a token). The tokens stay
    in the loss's denominator with weight 0, so masked_fraction and rollout_rs_* do not count them."""
    if rules.is_level is None or rules.is_mode != "mask" or not bool(mask.any()):
        return {}
    zeroed = ~inside_bounds(is_ratios(log_ratio, mask, rules), rules) & mask
    rows = mask.any(1)
    return {"rollout_is_masked_fraction": float(zeroed.sum()) / int(mask.sum()),
            "rollout_is_seq_masked_fraction": float(zeroed.any(1)[rows].double().mean())}


def ratio_fractions(log_ratio: Tensor, mask: Tensor, rules: Rules) -> dict[str, float]:
    """The share of tokens (sequence IS: sequences) whose unbounded ratio lies above / below the IS bounds."""
    if rules.is_level is None or not bool(mask.any()):
        return {}
    lr = torch.where(mask, log_ratio, 0.0).double()
    if rules.is_level == "sequence":
        rows = mask.any(1)
        lr, mask = lr.sum(1, keepdim=True)[rows], torch.ones(int(rows.sum()), 1, dtype=torch.bool)
    lower = _lower(rules)
    return {"rollout_is_ratio_fraction_high": _masked_mean((lr > math.log(rules.is_upper)).double(), mask),
            "rollout_is_ratio_fraction_low": _masked_mean((lr < math.log(lower)).double(), mask)}


def off_policy_metrics(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics of the sampled tokens: kl = E[log p_rollout - log p_old] and k3_kl =
    E[r - 1 - log r] (estimates of KL(rollout || old)), per-sequence perplexities exp(-mean log p) and
    their ratio, log-ppl differences (train - rollout), chi2_token = E[r^2] - 1 and chi2_seq =
    E_seq[(prod r)^2] - 1; r clamped by the safety bound."""
    rows = mask.any(1)
    if not bool(rows.any()):
        return {}
    old, roll, m = logp_old.double(), logp_rollout.double(), mask[rows]
    old, roll = old[rows], roll[rows]
    lr = torch.where(m, old - roll, 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    count = m.sum(1).double()
    mean_old = torch.where(m, old, 0.0).sum(1) / count
    mean_roll = torch.where(m, roll, 0.0).sum(1) / count
    diff = mean_roll - mean_old  # log ppl_train - log ppl_rollout
    seq_lr = torch.where(m, old - roll, 0.0).sum(1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"kl": _masked_mean(-lr, m), "k3_kl": _masked_mean(k3(lr), m),
            "training_ppl": float((-mean_old).exp().mean()), "rollout_ppl": float((-mean_roll).exp().mean()),
            "ppl_ratio": float(diff.exp().mean()), "log_ppl_diff": float(diff.mean()),
            "log_ppl_abs_diff": float(diff.abs().mean()), "log_ppl_diff_max": float(diff.max()),
            "log_ppl_diff_min": float(diff.min()), "chi2_token": _masked_mean((2 * lr).exp(), m) - 1,
            "chi2_seq": float((2 * seq_lr).exp().mean()) - 1}


def metrics(corr: Correction, log_ratio: Tensor, logp_old: Tensor, logp_rollout: Tensor, mask: Tensor,
            rules: Rules) -> dict[str, float]:
    """One step's rollout_corr/ family: verl's diagnostics under verl's names (each verl's quantity), and
    the statistics of the weights as the loss reads them under names of their own (is_bounded_*)."""
    n_seq = max(int(mask.any(1).sum()), 1)
    out = {**is_metrics(log_ratio, mask, rules), **bounded_metrics(corr, mask, rules),
           **mask_metrics(log_ratio, mask, rules), **ratio_fractions(log_ratio, mask, rules),
           "rollout_rs_masked_fraction": corr.stats["masked_fraction"],
           "rollout_rs_seq_masked_fraction": float((mask & ~corr.mask).any(1).sum()) / n_seq,
           **{k: v for k, v in corr.stats.items() if k.startswith("rollout_rs_")},
           **off_policy_metrics(logp_old, logp_rollout, mask)}
    return {PREFIX + k: v for k, v in out.items()}
