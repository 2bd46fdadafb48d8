"""The learner's update: PPO epochs over micro-batches of a step's experience, clipping, AdamW; the loss is
the global batch's token mean, so micro-batches and ranks (DDP sums the gradients) add up to it."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from . import objective as grpo
from .config import TrainConfig
from .distributed import World
from .experience import Experience

SKIPPED = "the rollout correction rejected every token of the batch"


@dataclass
class Learner:
    """The weights being trained and what steps them; `policy` is the model as the update calls it
    (wrapped for data parallelism under torchrun)."""

    model: nn.Module
    policy: nn.Module
    optimizer: torch.optim.Optimizer
    loss: grpo.LossConfig
    cfg: TrainConfig
    world: World

    def update(self, exp: Experience) -> dict[str, float | str]:
        """The step's optimizer steps; the loss statistics and grad norm. A batch whose every token the
        correction rejected takes no step (not even the optimizer's momentum): `update_skipped` says why."""
        if not bool((exp.correction.mask & exp.scores.mask).any()):
            return {"grad_norm": 0.0, "loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "update_skipped": SKIPPED}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.model.train()
        stats: dict[str, float] = {}
        grad_norm = 0.0
        for _ in range(self.cfg.ppo_epochs):
            stats = self.gradients(exp)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
            self.optimizer.step()
        self.model.eval()
        stats["grad_norm"] = grad_norm
        return stats

    def gradients(self, exp: Experience) -> dict[str, float]:
        """The gradient of the global batch's loss in the parameters' .grad; the loss statistics."""
        cfg, world, scores, correction = self.cfg, self.world, exp.scores, exp.correction
        flat = exp.completions
        keep = correction.mask & scores.mask
        normalizer = grpo.loss_normalizer(keep, self.loss, cfg.max_new_tokens)  # of the global batch
        shard = world.shard(len(flat))
        starts = list(range(shard.start, shard.stop, cfg.micro_batch))
        shards = [world.shard(len(flat), r) for r in range(world.size)]
        n_micro = sum(-(-(s.stop - s.start) // cfg.micro_batch) for s in shards)  # bnpo: micro-batches
        logp_old = scores.logp_rollout if self.loss.bypass_mode else scores.logp
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for s in starts:
            sl = slice(s, min(s + cfg.micro_batch, shard.stop))
            sync = s == starts[-1] or not world.distributed
            with nullcontext() if sync else self.policy.no_sync():
                logp = self.policy([c.prompt_token_ids for c in flat[sl]], [c.token_ids for c in flat[sl]],
                                   cfg.temperature)
                t, dev = logp.shape[1], logp.device
                ref = None if scores.ref is None else scores.ref[sl, :t].to(dev)
                if self.loss.aggregation == "bnpo":
                    normalizer = grpo.loss_normalizer(keep[sl], self.loss) * n_micro
                loss, part = grpo.policy_loss(
                    logp, logp_old[sl, :t].to(dev), exp.advantages[sl].to(dev),
                    correction.weights[sl, :t].to(dev), keep[sl, :t].to(dev), self.loss, ref_logp=ref,
                    normalizer=normalizer)
                loss.backward()
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return world.sum(sums)
