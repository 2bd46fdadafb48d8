"""A step's experience as typed records: its rollouts, rewards, the learner's dense scores of the sampled
tokens (the "old" logprobs, and alpha's lower bound from the sampler's top-20) and the correction."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from ..core.token_budgets import dense_alpha_is_one, token_positions
from ..engine import Completion
from ..model.llama import Transformer
from ..model.lora import adapters_disabled
from .config import TrainConfig
from .corrections import Correction
from .data import PromptRow
from .distributed import World
from .policy import completion_logprobs, completion_mask

TOP_LOGPROBS = 20


@dataclass
class Scores:
    """Per sampled token, N sequences x T (the longest completion), right-padded; on the CPU."""

    logp: Tensor  # [N, T] the dense learner's logprobs ("old")
    entropy: Tensor  # [N, T] the dense learner's entropy
    mask: Tensor  # [N, T] bool, a generated token
    logp_rollout: Tensor  # [N, T] the sampler's logprobs
    budgets: Tensor  # [N, T] int32, the budget each token was sampled at (0: dense)
    positions: Tensor  # [N, T] each token's position: the cache length it was produced at
    alpha_lb: Tensor  # [N, T] the top-20 lower bound of alpha; 1 where sampled densely (budget 0, or a cache
    # within the budget: the sampler's distribution is the learner's, so alpha is 1 exactly), 0 at padding
    ref: Tensor | None  # [N, T] the reference policy's logprobs (with a KL term)
    alpha: Tensor | None = None  # [N, T] exact alpha of a subsample of sequences, NaN elsewhere
    # (exact_alpha.py; None: a dense sampler, or not computed)

    @property
    def log_ratio(self) -> Tensor:
        """[N, T] log(p_dense / p_rollout)."""
        return self.logp - self.logp_rollout

    def acceptance(self) -> Tensor:
        """Each token's acceptance rate alpha [N, T]: 1 where it was sampled densely (the sampler's
        distribution is the learner's), else the top-20 lower bound (padding: 1, budget 0)."""
        return dense_alpha_is_one(self.alpha_lb, self.budgets, self.positions)

    def select(self, rows: Tensor, width: int) -> Scores:
        pick = lambda x: None if x is None else x[rows][:, :width]
        return Scores(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})


@dataclass
class Experience:
    """Steps 1-4 of a GRPO step: what the update, the metrics and the mismatch log read."""

    step: int
    prompts: list[PromptRow]  # P
    completions: list[Completion]  # N = P x samples, prompt-major
    rewards: np.ndarray  # [P, samples]
    advantages: Tensor  # [N]
    scores: Scores
    correction: Correction
    rollout_seconds: float
    scoring_seconds: float
    reward_seconds: float
    selection: dict[str, float] | None = None  # oversampling's mean acceptance kept / dropped
    reward_extra: dict[str, float] | None = None  # the step's means of what a user's reward reported


def pad_rows(rows: Sequence[Sequence[float]], fill: float = 0.0, dtype=torch.float32) -> Tensor:
    """Ragged rows -> [N, longest] right-padded with `fill`."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def score(model: Transformer, completions: list[Completion], cfg: TrainConfig, world: World,
          reference: Transformer | None = None) -> Scores:
    """The dense scores of every sampled token; each rank scores its shard of the sequences and every rank
    gets all of them. `reference`: a frozen copy for the KL term (None: the model without its LoRA)."""
    width = max(len(c.token_ids) for c in completions)
    mine = completions[world.shard(len(completions))]
    parts = world.gather(_score_rows(model, mine, width, cfg, reference))
    logp, entropy, alpha_lb, ref = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
    mask = completion_mask([len(c.token_ids) for c in completions], "cpu")
    budgets = pad_rows([c.budgets for c in completions], 0, torch.int32)
    positions = torch.from_numpy(token_positions([len(c.prompt_token_ids) for c in completions], width))
    return Scores(logp=logp, entropy=entropy, mask=mask,
                  logp_rollout=pad_rows([c.logprobs for c in completions]), budgets=budgets,
                  positions=positions,
                  alpha_lb=torch.where(mask, dense_alpha_is_one(alpha_lb, budgets, positions), 0.0), ref=ref)


def _top_logprobs(completions: list[Completion], width: int) -> tuple[Tensor, Tensor]:
    """The sampler's top-20 ids [N, width, 20] and logprobs (-inf where none)."""
    top_ids = torch.zeros(len(completions), width, TOP_LOGPROBS, dtype=torch.long)
    top_lp = torch.full((len(completions), width, TOP_LOGPROBS), float("-inf"))
    for i, c in enumerate(completions):
        if c.top_logprobs:
            pairs = torch.tensor(c.top_logprobs, dtype=torch.float64)  # [T, 20, (id, logp)]
            top_ids[i, : len(pairs)] = pairs[..., 0].long()
            top_lp[i, : len(pairs)] = pairs[..., 1].float()
    return top_ids, top_lp


@torch.no_grad()
def _score_rows(model: Transformer, completions: list[Completion], width: int, cfg: TrainConfig,
                reference: Transformer | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`score`'s logp, entropy, alpha_lb and ref of some sequences, in micro-batches, padded to `width`."""
    prompts = [c.prompt_token_ids for c in completions]
    comps = [c.token_ids for c in completions]
    top_ids, top_lp = _top_logprobs(completions, width)
    logp, entropy, dense_top, ref = [], [], [], []
    mb = cfg.micro_batch
    for s in range(0, len(completions), mb):
        part = completion_logprobs(model, prompts[s:s + mb], comps[s:s + mb], cfg.temperature,
                                   extra_ids=top_ids[s:s + mb, : max(len(c) for c in comps[s:s + mb])])
        logp.append(part.logp.cpu()), entropy.append(part.entropy.cpu())
        dense_top.append(part.extra_logp.cpu())
        if cfg.kl_coef > 0:
            ref.append(reference_logprobs(model, reference, prompts[s:s + mb], comps[s:s + mb],
                                          cfg.temperature).cpu())
    pad = lambda parts: torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    dense_top_all = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1])) for p in dense_top])
    alpha_lb = torch.minimum(dense_top_all.exp(), top_lp.exp()).sum(-1).clamp(max=1.0)
    return pad(logp), pad(entropy), alpha_lb, pad(ref) if ref else None


def reference_logprobs(model: Transformer, reference: Transformer | None, prompts, comps,
                       temperature: float) -> Tensor:
    """The reference policy's logprobs: `reference`, or the model with its LoRA switched off."""
    with nullcontext() if reference is not None else adapters_disabled(model):
        return completion_logprobs(model if reference is None else reference, prompts, comps, temperature,
                                   entropy=False).logp


def select_oversampled(completions: list[Completion], rewards: np.ndarray, scores: Scores, k: int
                       ) -> tuple[list[Completion], np.ndarray, Scores, dict[str, float]]:
    """Of each prompt's k' samples, the `k` of highest mean alpha (ties to the earlier sample), in their
    sampled order: the kept completions, rewards [P, k], scores, and the mean acceptance kept / dropped."""
    k_all = rewards.shape[1]
    mask = scores.mask
    acceptance = torch.where(mask, scores.acceptance(), 0.0).sum(1) / mask.sum(1).clamp(min=1)  # [N]
    keep = []
    for p in range(len(completions) // k_all):
        group = acceptance[p * k_all:(p + 1) * k_all]
        order = sorted(range(k_all), key=lambda i: (-float(group[i]), i))[:k]
        keep += [p * k_all + i for i in sorted(order)]
    idx = torch.tensor(keep)
    dropped = torch.ones(len(completions), dtype=torch.bool)
    dropped[idx] = False
    stats = {"oversample_acceptance_kept": float(acceptance[idx].mean()),
             "oversample_acceptance_dropped": float(acceptance[dropped].mean())}
    kept = scores.select(idx, int(mask[idx].sum(1).max()))
    return [completions[i] for i in keep], rewards.reshape(-1)[keep].reshape(-1, k), kept, stats


def rejection_generator(seed: int, step: int) -> torch.Generator:
    """The stochastic rejection's draws: a CPU generator seeded from (seed, step) alone, so a resumed step
    draws what the uninterrupted one drew."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step, 29]).generate_state(1)[0]))


__all__ = ["Experience", "Scores", "TOP_LOGPROBS", "pad_rows", "rejection_generator", "score",
           "select_oversampled"]
