"""`sparrow train`: GRPO whose rollouts come from the sparse engine, corrected toward the dense learner.

One step, for P prompts x K samples:
1. rollout: the engine samples with the current weights (a LoRA is injected in place, so there is
   nothing to reload; one engine serves the run, evaluation included, and is told of every update)
   under the sparsity spec, returning each token's logprob under the sparse actor and its top-20
   logprobs;
2. rewards from the task's scorer, group advantages (r - mean) / (std + eps) per prompt;
3. scoring: the learner's dense, teacher-forced logprobs of the same tokens with the same weights
   ("old" logprobs, no gradient), which also give the dense probabilities of the actor's top-20 tokens,
   hence a lower bound of alpha (sum over those 20 of min(p_dense, p_sparse); exact alpha needs the
   full vocabulary of the sparse actor, which the engine does not keep);
4. correction on r_t = exp(logp_dense_old - logp_rollout): importance weights, token masks, sequence
   vetoes (`grpo.rollout_correction`);
5. update: PPO-clipped loss on the new dense logprobs against the old ones, token mean over the batch,
   optional k3 KL to the reference policy, micro-batches with gradient accumulation, clipping, AdamW;
   with `gradient_checkpointing` (verl's enable_gradient_checkpointing; the CLI turns it on with
   --device cuda) each decoder layer is recomputed in the backward pass; memory then grows with
   micro_batch x sequence length x hidden size x layers (the layers' saved inputs). Scoring and the
   update compute the vocabulary-sized quantities in chunks of positions (`policy`), so a 32K-token
   sequence never holds its [T, V] logits.
With `distill_sparse` (DistillSparse, `distill.JointSparseActor`), step 1 samples with the learner plus a
second, sparse-actor-only adapter, and after step 5, the learner frozen, that adapter takes its own step
(PPO on the actor's logprobs plus the published k3 term toward the dense logprobs of step 3); the
learner's scoring and update never see it. It is saved to `RUN/sparse_adapter/` (peft format).
Every generated token of the step goes to `RUN/mismatch/step=NNNNN.parquet` (`train_mismatch`), one
metrics row per step to `RUN/metrics.parquet`, and the schedule the run sampled with to
`RUN/schedule.parquet`, so that `calibrate-threshold` reads a training run directory as it is. The
collapse detectors are `calibrate.collapse_reasons` (one definition for both stages): each step's row
records the reasons that hold for the history up to it, and the run's metadata its label. Checkpoints
(`RUN/checkpoint/`) hold the trainable weights, the optimizer, the data cursor and RNG states, so a
resumed run reaches bit-for-bit the weights and metrics of an uninterrupted one on the CPU in fp32: every
source of randomness is seeded per step (the engine's per-sample generators from (seed, step)), and the
prompt order per epoch from (seed, epoch). What a resume must agree on (the configuration and the content
of the prompts and schedule), what a run may write over, and how an interrupt leaves a checkpoint at the
last complete step: run_dir.py.
Under torchrun each rank rolls out, recomputes and differentiates its shard of the global batch, and
DDP sums the gradients (distributed.py); rank 0 alone writes.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from sparrow.schemas import artifact_metadata, read_artifact, write_artifact
from sparrow.schemas.artifacts import TRAIN_CORRECTION_METRICS

from ..backends.ray_pool import RolloutPool
from ..calibrate import collapse_reasons, mismatch_warnings
from ..core.definitions import TAIL_QUANTILE
from ..core.prompt_set import PromptError, PromptSet
from ..core.schedule import Schedule
from ..core.sparsity import as_policy, parse_sparsity
from ..engine import Engine, EngineConfig, SamplingParams
from ..kv_policies import Eviction
from ..model.loading import LoadedModel
from ..tasks import TASKS, score_batch
from . import corrections as rc
from . import objective as grpo
from .adapter import add_lora, load_lora_state, lora_state, save_adapter
from .distributed import World, current_world, data_parallel
from .policy import completion_logprobs, completion_mask
from .run_dir import (
    TrainingInterrupted,
    check_run_dir,
    checkpoint_step,
    clear_run,
    interrupts_deferred,
    prompts_fingerprint,
    sparsity_fingerprint,
)
from .tracking import Trackers

TOP_LOGPROBS = 20


@dataclass
class TrainConfig:
    """Everything that defines a run; a resumed run must agree on all of it but `steps`."""

    model: str
    steps: int = 20
    prompts_per_step: int = 4
    samples: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    ignore_eos: bool = False  # every sample generates max_new_tokens (fixed-length steps, for timing)
    lr: float = 1e-4
    lora_rank: int = 16  # 0 = full fine-tuning
    lora_alpha: float = 32.0
    correction: str = "tis"
    kl_coef: float = 0.0
    seed: int = 0
    micro_batch: int = 8
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    checkpoint_every: int = 10
    eval_every: int = 5
    bin_width: int = 512
    sparsity: str = "dense"  # "dense" | "budget:B" | "schedule:<path>" | "snapkv:B,..." | "rkv:B,..."
    device: str = "cpu"  # cuda: bf16 weights, the engine's Triton kernels and CUDA graphs
    random_weights: bool = False  # a shapes-only preset with random weights (timing the GPU path)
    gradient_checkpointing: bool = False  # recompute each layer in the update's backward (CLI: on for cuda)
    loss: dict = field(default_factory=dict)  # grpo.LossConfig overrides
    distill_sparse: bool = False  # DistillSparse: train a sparse-actor-only adapter jointly (stages.distill)
    distill_rank: int = 16
    distill_alpha: float = 16.0  # published
    distill_lr_ratio: float = 5.0  # published: the sparse adapter's lr = 5 x lr
    distill_kl_coef: float = 0.001  # published k3 coefficient
    raw_prompts: bool = False  # text prompts tokenized as they are, without the model's chat template
    oversample: int = 0  # k' > samples: roll out k' per prompt, keep the `samples` of highest mean alpha
    # what the run reads, by content (filled by the Trainer; run_dir.py): a resume must read the same
    prompts_sha256: str = ""
    eval_prompts_sha256: str = ""
    schedule_sha256: str = ""

    def validate(self) -> None:
        positive = ("steps", "prompts_per_step", "samples", "max_new_tokens", "micro_batch", "ppo_epochs",
                    "checkpoint_every", "eval_every", "bin_width")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        grpo.LossConfig(correction=self.correction, kl_coef=self.kl_coef, **self.loss).validate()
        if self.oversample and self.oversample <= self.samples:
            raise ValueError(f"--oversample must exceed --samples ({self.samples}) to select among the "
                             f"samples, got {self.oversample}")
        if self.distill_sparse:
            if self.sparsity == "dense":
                raise ValueError("--distill-sparse trains the sparse actor's adapter, so it needs a sparse "
                                 "sampler (--budget or --schedule)")
            if self.sparsity.split(":", 1)[0] in ("snapkv", "rkv"):
                raise ValueError("--distill-sparse trains a block top-k sparse actor (its teacher-forced "
                                 "passes select pages); it does not support --kv-compression")
            if not self.lora_rank:
                raise ValueError("--distill-sparse needs the learner to train a LoRA (not --full): the "
                                 "sparse adapter is a second peft adapter beside it")
            if self.distill_rank < 1 or self.distill_lr_ratio <= 0 or self.distill_kl_coef < 0:
                raise ValueError("--distill-rank must be >= 1, --distill-lr-ratio > 0 and --distill-kl-coef "
                                 ">= 0")


@dataclass
class PromptRow:
    prompt_id: str
    task: str
    token_ids: list[int]
    answer: str
    metadata: str | None


def load_prompts(path: str | os.PathLike, tokenizer=None, chat_template: bool = True) -> list[PromptRow]:
    """Rows of a prompts file that training can use: token ids (or text to tokenize), an answer and a
    known task; anything else is refused with one sentence (a PromptError, a ValueError)."""
    prompt_set = PromptSet.read(path)
    for r in prompt_set.rows:
        where = f"{path}: prompt {r['prompt_id']!r}"
        if r.get("task") not in TASKS:
            raise PromptError(f"{where} has task {r.get('task')!r}, which has no scorer "
                              f"(known: {', '.join(TASKS)})")
        if r.get("answer") is None:
            raise PromptError(f"{where} has no answer, so its reward cannot be verified")
    prompt_set.check_rewards()
    prompt_set.tokenize(tokenizer, chat_template)
    return [PromptRow(r["prompt_id"], r["task"], list(r["prompt_token_ids"]), r["answer"], r.get("metadata"))
            for r in prompt_set.rows]


def repetition(tokens: Sequence[int], n: int = 4) -> bool:
    """A completion loops when fewer than half of its n-grams are distinct (only from 16 tokens on)."""
    if len(tokens) < 16:
        return False
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) < 0.5 * len(grams)


def _pad_rows(rows: Sequence[Sequence[float]], fill=0.0, dtype=torch.float32) -> torch.Tensor:
    """Ragged rows -> [N, longest] right-padded with `fill`."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model: every injected LoRA switched off inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


class Trainer:
    def __init__(self, config: TrainConfig, loaded: LoadedModel, prompts: list[PromptRow],
                 run_dir: str | Path, eval_prompts: list[PromptRow] | None = None, resume: bool = False,
                 on_step: Callable[[dict], None] | None = None,
                 on_phase: Callable[[str], None] | None = None, world: World | None = None,
                 pool: RolloutPool | None = None, force: bool = False,
                 gpu_memory_utilization: float = 0.9,
                 on_rollouts: Callable[[int, list[int]], None] | None = None,
                 report_to: Sequence[str] = ()):
        """`gpu_memory_utilization`: on CUDA, the share of device memory the rollout engine may take (its
        KV pool, graphs and activations; the learner's update needs the rest). `report_to`: the live
        trackers of each step's row (tracking.py), beside metrics.parquet."""
        config.validate()
        self.world = world or current_world()
        if pool is not None and self.world.distributed:
            raise ValueError("Ray rollout workers and torchrun ranks cannot be combined; use one of them")
        if config.distill_sparse and (pool is not None or self.world.distributed):
            raise ValueError("--distill-sparse runs in one process for now: it cannot be combined with Ray "
                             "rollout workers or torchrun ranks")
        self.pool, self.sync_seconds = pool, None
        self.gpu_memory_utilization = gpu_memory_utilization
        self.engine: Engine | None = None  # one for the run, made at the first rollout (see `_engine`)
        if config.prompts_per_step * config.samples < self.world.size:
            raise ValueError(f"--prompts-per-step x --samples ({config.prompts_per_step * config.samples} "
                             f"sequences) must be at least the world size ({self.world.size}), so that "
                             "every rank has a share of the update")
        self.sparsity = parse_sparsity(config.sparsity, model=loaded.config)
        config = with_fingerprints(config, prompts, eval_prompts, self.sparsity)
        self.cfg, self.loaded, self.model = config, loaded, loaded.model
        self.prompts, self.eval_prompts = prompts, eval_prompts or []
        self.run_dir = Path(run_dir)
        self.on_step, self.on_phase = on_step or (lambda row: None), on_phase or (lambda phase: None)
        self.on_rollouts = on_rollouts or (lambda step, lengths: None)  # each step's completion lengths
        self.report_to = tuple(report_to)
        self.loss_cfg = grpo.LossConfig(correction=config.correction, kl_coef=config.kl_coef, **config.loss)
        self.run_id = self.run_dir.name
        self.history: list[dict] = []
        self.step = 0
        self.initial_eval: float | None = None
        check_run_dir(self.run_dir, config, resume, force)
        self.start_over = force
        self.applying = False  # inside a step's update and writes: an interrupt there leaves no checkpoint
        torch.manual_seed(config.seed)
        self.reference = None
        if config.lora_rank:
            self.lora_config = add_lora(self.model, config.lora_rank, config.lora_alpha)
        else:
            self.lora_config = None
            if config.kl_coef > 0:
                self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.model.gradient_checkpointing = config.gradient_checkpointing
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.sparse_actor = None
        self.sparse_history: list[dict] = []
        if config.distill_sparse:
            from ..core.sparsity import budget_fn
            from ..distill import JointSparseActor

            self.sparse_actor = JointSparseActor(
                self.model, config.distill_rank, config.distill_alpha, config.lr * config.distill_lr_ratio,
                config.distill_kl_coef, budget_fn(self.sparsity), config.temperature)
        if resume:
            self._load_checkpoint()
        self.policy = data_parallel(self.model, self.world)
        if pool is not None and self.lora_config is not None:
            pool.add_lora(config.lora_rank, config.lora_alpha)
        self.rng_at_step = _rng_states()  # the RNG states at the last step boundary
        self.world.barrier()  # no rank writes before every rank has checked the run directory

    # ------------------------------------------------------------------ run directory

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoint"

    # ------------------------------------------------------------------ data

    def _batch(self, step: int) -> list[PromptRow]:
        """Prompts of a step: epoch e visits the prompts in the order of permutation(seed, e)."""
        n, p = len(self.prompts), self.cfg.prompts_per_step
        orders: dict[int, np.ndarray] = {}
        out = []
        for k in range(step * p, (step + 1) * p):
            epoch, i = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
            out.append(self.prompts[int(orders[epoch][i])])
        return out

    # ------------------------------------------------------------------ one step

    def run(self) -> dict:
        """Train until `steps`; returns the run's summary (also in the metrics artifact's metadata). On an
        interrupt, a checkpoint at the last complete step (run_dir.py), then TrainingInterrupted."""
        trackers = None
        try:
            if self.start_over and self.world.main:
                clear_run(self.run_dir)
                self.start_over = False
            if self.world.main and self.report_to:
                trackers = Trackers(self.report_to, self.run_dir, self.step, asdict(self.cfg))
            if self.step == 0 and self.world.main:
                self._write_schedule()
                if self.eval_prompts:
                    self.initial_eval = self.evaluate()
            while self.step < self.cfg.steps:
                row = self.train_step()
                if trackers is not None:
                    trackers.log(row)
                self.on_step(row)
                if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self._save_checkpoint()
        except KeyboardInterrupt:
            self._interrupted()
        finally:
            if trackers is not None:
                trackers.close()
            if self.engine is not None:
                self.engine.close()  # its pool and graphs go now; a later rollout makes them again
        summary = self.summary()
        self.world.barrier()
        return summary

    def _interrupted(self):
        """Keep the last complete step resumable, say so, and go on interrupting."""
        if self.applying:  # a second SIGINT (or an interrupt raised by code) inside the update
            at = checkpoint_step(self.run_dir)
            raise TrainingInterrupted(
                f"a step was being applied, so {self.run_dir} keeps " + (
                    f"its checkpoint at step {at}; add --resume to the same command to continue from it"
                    if at is not None else "no checkpoint; add --force to the same command to start it over"))
        if self.world.main:
            self._save_checkpoint(self.rng_at_step)
        raise TrainingInterrupted(f"{self.run_dir}/checkpoint holds the {self.step} complete "
                                  f"step{'s' * (self.step != 1)} of {self.cfg.steps}; add --resume to the "
                                  "same command to continue") from None

    def experience(self, step: int) -> dict:
        """Steps 1-4 of a step: its prompts, rollouts (flat, prompt-major), rewards, advantages, the dense
        recompute ("old") and the rollout correction, with the seconds of the rollout and scoring."""
        batch = self._batch(step)
        t0 = time.perf_counter()
        self.on_phase("rollout")
        comps = self._rollout(batch, step)
        t_roll = time.perf_counter() - t0
        self.on_rollouts(step, [len(c.token_ids) for group in comps for c in group])
        tok = self.loaded.tokenizer
        t_reward = time.perf_counter()  # code tasks run each sample's program in a pool of sandboxes
        rewards = np.array(score_batch([(r.task, tok.decode(c.token_ids, skip_special_tokens=True), r.answer,
                                         r.metadata) for r, group in zip(batch, comps) for c in group]))
        rewards = rewards.reshape(len(batch), -1)
        t_reward = time.perf_counter() - t_reward
        flat = [c for group in comps for c in group]

        t1 = time.perf_counter()
        self.on_phase("scoring")
        old = self._score(flat)
        t_score = time.perf_counter() - t1
        selection = None
        if self.cfg.oversample:
            flat, rewards, old, selection = self._select(flat, rewards, old)
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = grpo.group_advantages(rewards_t, self.loss_cfg).flatten()
        correction = grpo.rollout_correction(old["logp"] - old["logp_rollout"], old["mask"], self.loss_cfg,
                                             advantages=advantages, alpha=acceptance(old),
                                             generator=self._rejection_generator(step))
        return {"batch": batch, "flat": flat, "rewards": rewards, "advantages": advantages, "old": old,
                "correction": correction, "seconds": (t_roll, t_score), "selection": selection,
                "reward_seconds": t_reward}

    def _rejection_generator(self, step: int) -> torch.Generator:
        """The stochastic rejection's draws: a CPU generator seeded from (seed, step) alone, so a resumed
        step draws what the uninterrupted one drew."""
        seed = int(np.random.SeedSequence([self.cfg.seed, step, 29]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)

    def _select(self, flat, rewards: np.ndarray, old: dict):
        """Oversample-and-select: of each prompt's k' samples, the `samples` of highest mean alpha (the
        top-20 lower bound of the acceptance rate; ties to the earlier sample), in their sampled order.
        Returns the kept completions, rewards [P, k], scores, and the mean acceptance kept / dropped."""
        k_all, k = self.cfg.oversample, self.cfg.samples
        mask = old["mask"]
        acceptance_ = torch.where(mask, acceptance(old), 0.0).sum(1) / mask.sum(1).clamp(min=1)  # [N]
        keep = []
        for p in range(len(flat) // k_all):
            group = acceptance_[p * k_all:(p + 1) * k_all]
            order = sorted(range(k_all), key=lambda i: (-float(group[i]), i))[:k]
            keep += [p * k_all + i for i in sorted(order)]
        idx = torch.tensor(keep)
        dropped = torch.ones(len(flat), dtype=torch.bool)
        dropped[idx] = False
        width = int(mask[idx].sum(1).max())
        picked = {key: None if v is None else v[idx][:, :width] for key, v in old.items()}
        kept_rewards = rewards.reshape(-1)[keep].reshape(-1, k)
        stats = {"oversample_acceptance_kept": float(acceptance_[idx].mean()),
                 "oversample_acceptance_dropped": float(acceptance_[dropped].mean())}
        return [flat[i] for i in keep], kept_rewards, picked, stats

    def train_step(self) -> dict:
        step = self.step
        exp = self.experience(step)
        with interrupts_deferred():  # the weights change from here to the end of the step's writes
            self.applying = True
            row = self._apply(step, exp)
            self.applying = False
        return row

    def _apply(self, step: int, exp: dict) -> dict:
        """Steps 5 and after of a step: the update, the metrics row, the eval and the step's logs."""
        cfg = self.cfg
        batch, flat, rewards, old, correction = (exp[k] for k in ("batch", "flat", "rewards", "old",
                                                                  "correction"))
        t_roll, t_score = exp["seconds"]
        t2 = time.perf_counter()
        self.on_phase("update")
        update = self._update(flat, exp["advantages"], old, correction)
        if self.sparse_actor is not None:  # the learner frozen, the sparse adapter's step
            self.sparse_history.append({"step": step, **self.sparse_actor.update(flat, exp["advantages"], old,
                                                                                 self.loss_cfg)})
        if self.engine is not None:
            self.engine.update_weights()  # the next rollouts sample with the updated weights
        t_update = time.perf_counter() - t2

        self.step = step + 1
        row = self._metrics(step, flat, rewards, old, correction, update, (t_roll, t_score, t_update))
        row.update(exp.get("selection") or {})
        row["reward_seconds"] = exp["reward_seconds"]
        last = self.step == cfg.steps  # the final eval is never left blank
        if self.eval_prompts and self.world.main and (self.step % cfg.eval_every == 0 or last):
            row["eval_accuracy"] = self.evaluate()
            if self.sparsity:  # the run's sampler too
                row["eval_accuracy_sparse"] = self.evaluate(sparse=True)
        self.history.append(row)
        # the reasons that hold for the run so far; the run's label is those of its last step
        row["collapse"] = "; ".join(collapse_reasons(pa.Table.from_pylist(self.history))) or None
        if self.world.main:
            self._write_mismatch(step, batch, flat, old, correction)
            self._write_metrics()
        self.rng_at_step = _rng_states()
        return row

    def _rollout(self, batch: list[PromptRow], step: int):
        cfg = self.cfg
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, n=cfg.oversample or cfg.samples,
                                temperature=cfg.temperature,
                                seed=cfg.seed * 1_000_003 + step, logprobs=TOP_LOGPROBS,
                                ignore_eos=cfg.ignore_eos)
        self.model.eval()
        if self.pool is not None:
            return self._rollout_on_workers(batch, params)
        shard = self.world.shard(len(batch))  # a prompt's group stays on one rank
        mine = self._engine().generate([r.token_ids for r in batch[shard]], params,
                                       request_ids=range(shard.start, shard.stop))
        return [group for part in self.world.gather(mine) for group in part]

    def _engine(self) -> Engine:
        """The run's rollout engine, made once (after the LoRA is injected and a checkpoint loaded) and
        updated in place after every optimizer step; its batch is this rank's share of a step's samples."""
        if self.engine is None:
            mine = self.world.shard(self.cfg.prompts_per_step)
            batch = max(mine.stop - mine.start, 1) * (self.cfg.oversample or self.cfg.samples)
            self.engine = Engine(self.model, as_policy(self.sparsity), EngineConfig(
                max_batch=batch, gpu_memory_utilization=self.gpu_memory_utilization))
        return self.engine

    def _score(self, flat) -> dict:
        """Dense old logprobs (+ reference, + top-20 lower bound of alpha) of every sampled token; each
        rank scores its shard of the sequences and every rank gets all of them."""
        width = max(len(c.token_ids) for c in flat)
        parts = self.world.gather(self._score_rows(flat[self.world.shard(len(flat))], width))
        rows = {k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]}
        mask = completion_mask([len(c.token_ids) for c in flat], "cpu")
        return {"logp": rows["logp"], "entropy": rows["entropy"], "mask": mask,
                "logp_rollout": _pad_rows([c.logprobs for c in flat]),
                "budgets": _pad_rows([c.budgets for c in flat], 0, torch.int32),
                "alpha_lb": torch.where(mask, rows["alpha_lb"], 0.0), "ref": rows["ref"]}

    def _rollout_on_workers(self, batch: list[PromptRow], params: SamplingParams):
        """The rollout phase on Ray workers: this step's weights pushed to them (timed), then the prompts
        shared by index with the seeds one process uses."""
        lora = self.lora_config is not None
        state = (lora_state(self.model) if lora
                 else {k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        self.sync_seconds = self.pool.push_weights(state, lora)
        results = self.pool.map("generate", [r.token_ids for r in batch], params, self.sparsity,
                                len(batch) * (self.cfg.oversample or self.cfg.samples),
                                self.gpu_memory_utilization)
        return [group for r in results for group in r.value]

    @torch.no_grad()
    def _score_rows(self, flat, width: int) -> dict:
        """`_score`'s per-sequence tensors for some sequences, padded to `width` tokens."""
        prompts = [c.prompt_token_ids for c in flat]
        comps = [c.token_ids for c in flat]
        top_ids = torch.zeros(len(flat), width, TOP_LOGPROBS, dtype=torch.long)
        top_lp = torch.full((len(flat), width, TOP_LOGPROBS), float("-inf"))
        for i, c in enumerate(flat):
            if c.top_logprobs:
                pairs = torch.tensor(c.top_logprobs, dtype=torch.float64)  # [T, 20, (id, logp)]
                top_ids[i, : len(pairs)] = pairs[..., 0].long()
                top_lp[i, : len(pairs)] = pairs[..., 1].float()
        logp, entropy, dense_top, ref = [], [], [], []
        mb = self.cfg.micro_batch
        for s in range(0, len(flat), mb):
            part = completion_logprobs(self.model, prompts[s:s + mb], comps[s:s + mb], self.cfg.temperature,
                                       extra_ids=top_ids[s:s + mb, : max(len(c) for c in comps[s:s + mb])])
            logp.append(part.logp.cpu()), entropy.append(part.entropy.cpu())
            dense_top.append(part.extra_logp.cpu())
            if self.cfg.kl_coef > 0:
                ref.append(self._reference_logprobs(prompts[s:s + mb], comps[s:s + mb]).cpu())
        pad = lambda parts: torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
        dense_top_all = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1]))
                                   for p in dense_top])
        alpha_lb = torch.minimum(dense_top_all.exp(), top_lp.exp()).sum(-1).clamp(max=1.0)
        return {"logp": pad(logp), "entropy": pad(entropy), "alpha_lb": alpha_lb,
                "ref": pad(ref) if ref else None}

    def _reference_logprobs(self, prompts, comps) -> torch.Tensor:
        model = self.reference if self.reference is not None else self.model
        with nullcontext() if self.reference is not None else adapters_disabled(self.model):
            return completion_logprobs(model, prompts, comps, self.cfg.temperature, entropy=False).logp

    def _update(self, flat, advantages: torch.Tensor, old: dict, correction) -> dict:
        """PPO epochs over micro-batches; the loss is the token mean over the whole batch. A batch whose
        every token the correction rejected takes no step (not even the optimizer's momentum): the row
        says why in `update_skipped`, and the run goes on."""
        if not bool((correction.mask & old["mask"]).any()):
            return {"grad_norm": 0.0, "loss": 0.0, "policy_loss": 0.0, "kl": 0.0,
                    "update_skipped": "the rollout correction rejected every token of the batch"}
        self.model.train()
        stats: dict[str, float] = {}
        grad_norm = 0.0
        for _ in range(self.cfg.ppo_epochs):
            stats = self._gradients(flat, advantages, old, correction)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            self.optimizer.step()
        self.model.eval()
        stats["grad_norm"] = grad_norm
        return stats

    def _gradients(self, flat, advantages: torch.Tensor, old: dict, correction) -> dict[str, float]:
        """The gradient of the global batch's loss in the parameters' .grad (this rank's shard of the
        sequences in micro-batches, summed over ranks by DDP at the last one); the loss statistics."""
        cfg = self.cfg
        keep = correction.mask & old["mask"]
        normalizer = grpo.loss_normalizer(keep, self.loss_cfg, cfg.max_new_tokens)  # of the global batch
        shard = self.world.shard(len(flat))
        starts = list(range(shard.start, shard.stop, cfg.micro_batch))
        shards = [self.world.shard(len(flat), r) for r in range(self.world.size)]
        n_micro = sum(-(-(s.stop - s.start) // cfg.micro_batch) for s in shards)  # bnpo: micro-batches
        logp_old = old["logp_rollout"] if self.loss_cfg.bypass_mode else old["logp"]
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for s in starts:
            sl = slice(s, min(s + cfg.micro_batch, shard.stop))
            sync = s == starts[-1] or not self.world.distributed
            with nullcontext() if sync else self.policy.no_sync():
                logp = self.policy([c.prompt_token_ids for c in flat[sl]], [c.token_ids for c in flat[sl]],
                                   cfg.temperature)
                t, dev = logp.shape[1], logp.device
                ref = None if old["ref"] is None else old["ref"][sl, :t].to(dev)
                if self.loss_cfg.aggregation == "bnpo":
                    normalizer = grpo.loss_normalizer(keep[sl], self.loss_cfg) * n_micro
                loss, part = grpo.policy_loss(
                    logp, logp_old[sl, :t].to(dev), advantages[sl].to(dev),
                    correction.weights[sl, :t].to(dev), keep[sl, :t].to(dev), self.loss_cfg, ref_logp=ref,
                    normalizer=normalizer)
                loss.backward()
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return self.world.sum(sums)

    # ------------------------------------------------------------------ logs

    def _metrics(self, step: int, flat, rewards: np.ndarray, old: dict, correction, update: dict,
                 seconds: tuple[float, float, float]) -> dict:
        mask = old["mask"]
        mismatch = grpo.k3((old["logp"] - old["logp_rollout"])[mask])
        alpha = old["alpha_lb"][mask]
        budgets = old["budgets"][mask].float()
        generated = sum(len(c.token_ids) for c in flat)
        t_roll, t_score, t_update = seconds
        return {
            "run_id": self.run_id, "step": step, "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()), "accuracy": float((rewards >= 1.0 - 1e-9).mean()),
            "eval_accuracy": None, "eval_accuracy_sparse": None, "oversample_acceptance_kept": None,
            "oversample_acceptance_dropped": None, "loss": update.get("loss"),
            "policy_loss": update.get("policy_loss"), "kl": update.get("kl"),
            **{k: update.get(k) for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                                          "dual_clip_fraction")},
            "grad_norm": update["grad_norm"], "entropy": float(old["entropy"][mask].mean()),
            "mismatch_kl": float(mismatch.mean()), "masked_fraction": correction.stats["masked_fraction"],
            "vetoed_fraction": correction.stats["vetoed_fraction"],
            "alpha_lb_mean": float(alpha.mean()), "alpha_lb_p5": float(torch.quantile(alpha, TAIL_QUANTILE)),
            "mean_budget": float(budgets.mean()),
            "truncation_rate": float(np.mean([c.finish_reason == "length" for c in flat])),
            "repetition_rate": float(np.mean([repetition(c.token_ids) for c in flat])),
            "response_length": generated / len(flat), "lr": self.cfg.lr,
            "rollout_seconds": t_roll, "scoring_seconds": t_score, "update_seconds": t_update,
            "seconds": t_roll + t_score + t_update, "tokens_per_second": generated / max(t_roll, 1e-9),
            "weight_sync_seconds": self.sync_seconds,  # part of rollout_seconds; None without workers
            "update_skipped": update.get("update_skipped"), "alpha_lb_p5_by_bin": self._alpha_tail(flat, old),
            **dict.fromkeys(TRAIN_CORRECTION_METRICS),  # every row has every column (the table's schema)
            **rc.metrics(correction, old["logp"] - old["logp_rollout"], old["logp"], old["logp_rollout"],
                         mask, self.loss_cfg.rules()),
        }

    def _alpha_tail(self, flat, old: dict) -> list[float]:
        """The p5 of the top-20 alpha lower bound per position bin (index = bin; null where a bin has no
        token), as the mismatch log bins positions (prompt length + index)."""
        mask = old["mask"]
        prompt_len = torch.tensor([len(c.prompt_token_ids) for c in flat])
        bins = ((prompt_len[:, None] + torch.arange(mask.shape[1])[None, :]) // self.cfg.bin_width)[mask]
        alpha = old["alpha_lb"][mask]
        return [float(torch.quantile(alpha[bins == b], TAIL_QUANTILE)) if bool((bins == b).any())
                else None for b in range(int(bins.max()) + 1)] if len(alpha) else []

    def _write_mismatch(self, step: int, batch, flat, old: dict, correction) -> None:
        mask = old["mask"]
        seq, pos_in = mask.nonzero(as_tuple=True)
        samples = [c.sample for c in flat]
        prompt_ids = [batch[i // self.cfg.samples].prompt_id for i in range(len(flat))]
        prompt_len = torch.tensor([len(c.prompt_token_ids) for c in flat])
        position = prompt_len[seq] + pos_in  # cache length when the token was produced
        log_ratio = (old["logp_rollout"] - old["logp"])[seq, pos_in]
        table = {
            "step": [step] * len(seq), "prompt_id": [prompt_ids[i] for i in seq.tolist()],
            "sample": [samples[i] for i in seq.tolist()], "position": position.tolist(),
            "bin": (position // self.cfg.bin_width).tolist(),
            "budget": old["budgets"][seq, pos_in].tolist(),
            "token_id": [flat[i].token_ids[j] for i, j in zip(seq.tolist(), pos_in.tolist())],
            "logp_rollout": old["logp_rollout"][seq, pos_in].tolist(),
            "logp_dense": old["logp"][seq, pos_in].clamp(max=0).tolist(),
            "log_ratio": log_ratio.tolist(), "k3": grpo.k3(-log_ratio).clamp(min=0).tolist(),
            "alpha_top20_lb": old["alpha_lb"][seq, pos_in].clamp(0, 1).tolist(),
            "weight": correction.weights[seq, pos_in].tolist(),
            "masked": (~correction.mask[seq, pos_in]).tolist(), "vetoed": correction.vetoed[seq].tolist(),
        }
        write_artifact(table, self.run_dir / "mismatch" / f"step={step:05d}.parquet", "train_mismatch",
                       metadata={"bin_width": self.cfg.bin_width, "sparsity": self.cfg.sparsity})

    def label(self) -> dict:
        """stable | collapsed by the reasons over the whole run (its last row's), the first step of the
        streak of flagged rows that ends the run, and the mismatch warnings (never part of the label)."""
        last = self.history[-1].get("collapse") if self.history else None
        reasons = last.split("; ") if last else []
        first = None
        for r in reversed(self.history if reasons else []):
            if not r.get("collapse"):
                break
            first = r["step"]
        warnings = mismatch_warnings(pa.Table.from_pylist(self.history)) if self.history else []
        return {"label": "collapsed" if reasons else "stable", "reasons": reasons,
                "first_collapse_step": first, "warnings": warnings}

    def _write_metrics(self) -> None:
        label = self.label()
        meta = {"config": json.dumps(asdict(self.cfg)), "label": label["label"],
                "reasons": "; ".join(label["reasons"]), "first_collapse_step": label["first_collapse_step"],
                "warnings": "; ".join(label["warnings"]) or None,
                "initial_eval_accuracy": self.initial_eval}
        meta = {k: v for k, v in meta.items() if v is not None}
        write_artifact(self.history, self.run_dir / "metrics.parquet", "metrics", metadata=meta)

    def _write_schedule(self) -> None:
        """The schedule the rollouts used, as a `schedule` artifact (dense: one bin, null budget). An
        eviction policy has no block top-k schedule: none is written (the metrics' config names it)."""
        if isinstance(self.sparsity, Eviction):
            return
        if isinstance(self.sparsity, Schedule):
            schedule = self.sparsity
        else:
            schedule = Schedule.constant(self.sparsity or 0)
        n = len(schedule.budgets)
        ends = [*schedule.bin_starts[1:], None]
        write_artifact({"bin": list(range(n)), "bin_start": list(schedule.bin_starts), "bin_end": ends,
                        "budget": [b or None for b in schedule.budgets], "tail": [None] * n,
                        "predicted_step_seconds": [None] * n},
                       self.run_dir / "schedule.parquet", "schedule",
                       metadata={"page_size": schedule.page_size, "source": self.cfg.sparsity})

    def summary(self) -> dict:
        h = self.history
        out = {"steps": len(h), **self.label(),
               "reward_first": h[0]["reward_mean"] if h else None,
               "reward_last": h[-1]["reward_mean"] if h else None,
               "initial_eval_accuracy": self.initial_eval,
               "final_eval_accuracy": next((r["eval_accuracy"] for r in reversed(h)
                                           if r.get("eval_accuracy") is not None), None),
               "final_eval_accuracy_sparse": next((r["eval_accuracy_sparse"] for r in reversed(h)
                                                  if r.get("eval_accuracy_sparse") is not None), None),
               "skipped_updates": sum(r.get("update_skipped") is not None for r in h),
               "seconds": sum(r["seconds"] for r in h), "adapter": None}
        if self.lora_config is not None and self.world.main:
            out["adapter"] = str(save_adapter(self.model, self.lora_config, self.run_dir / "adapter",
                                              self.cfg.model))
        if self.sparse_actor is not None:
            folder = save_adapter(self.model, self.sparse_actor.config, self.run_dir / "sparse_adapter",
                                  self.cfg.model, adapter=self.sparse_actor.ADAPTER)
            (folder / "sparrow_distill.json").write_text(json.dumps(
                {"mode": "joint (sparrow train --distill-sparse)", "sparsity": self.cfg.sparsity,
                 "history": self.sparse_history}, indent=2))
            out["sparse_adapter"] = str(folder)
        return out

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, sparse: bool = False) -> float:
        """Accuracy of greedy completions of the eval prompts (reward 1 counts as correct), dense or, with
        `sparse`, under the run's sparsity (the released recipe validates under both)."""
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0)
        self.model.eval()
        rows = self.eval_prompts
        out = self._engine().generate([r.token_ids for r in rows], params,
                                      policy=as_policy(self.sparsity if sparse else None))
        tok = self.loaded.tokenizer
        rewards = score_batch([(r.task, tok.decode(o[0].token_ids, skip_special_tokens=True), r.answer,
                                r.metadata) for r, o in zip(rows, out)])
        return float(np.mean([x >= 1.0 - 1e-9 for x in rewards]))

    # ------------------------------------------------------------------ checkpoints

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        if self.lora_config is not None:
            return lora_state(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _save_checkpoint(self, rng: tuple | None = None) -> None:
        """RUN/checkpoint/ replaced atomically: weights, optimizer, RNG states (now's, or `rng`), step,
        config (rank 0's: the ranks hold the same weights and optimizer state)."""
        if not self.world.main:
            return
        torch_rng, numpy_rng, python_rng = rng or _rng_states()
        tmp = self.run_dir / f".checkpoint.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        try:
            torch.save({"step": self.step, "weights": self._trainable_state(),
                        "optimizer": self.optimizer.state_dict(), "torch_rng": torch_rng,
                        "numpy_rng": numpy_rng, "python_rng": python_rng,
                        "history": self.history, "initial_eval": self.initial_eval,
                        "sparse": None if self.sparse_actor is None else {
                            "weights": lora_state(self.model, self.sparse_actor.ADAPTER),
                            "optimizer": self.sparse_actor.optimizer.state_dict(),
                            "history": self.sparse_history}},
                       tmp / "state.pt")
            (tmp / "config.json").write_text(json.dumps(asdict(self.cfg), indent=2))
            (tmp / "progress.json").write_text(json.dumps({"step": self.step, "steps": self.cfg.steps}))
            old = self.checkpoint_dir.with_name(f".checkpoint.old.{uuid.uuid4().hex[:8]}")
            if self.checkpoint_dir.exists():
                os.replace(self.checkpoint_dir, old)
            os.replace(tmp, self.checkpoint_dir)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _load_checkpoint(self) -> None:
        state = torch.load(self.checkpoint_dir / "state.pt", weights_only=False)
        if self.lora_config is not None:
            load_lora_state(self.model, state["weights"])
        else:
            self.model.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sparse_actor is not None:
            sparse = state["sparse"]
            load_lora_state(self.model, sparse["weights"], self.sparse_actor.ADAPTER)
            self.sparse_actor.optimizer.load_state_dict(sparse["optimizer"])
            self.sparse_history = sparse["history"]
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        self.step, self.history = state["step"], state["history"]
        self.initial_eval = state["initial_eval"]
        if not self.world.main:
            return
        for f in (self.run_dir / "mismatch").glob("step=*.parquet"):  # steps after the checkpoint
            if int(f.stem.split("=")[1]) >= self.step:
                f.unlink()
        self._write_metrics()


def acceptance(old: dict) -> torch.Tensor:
    """Each token's acceptance rate alpha [N, T]: 1 where it was sampled densely (budget 0: the sampler's
    distribution is the learner's), else the top-20 lower bound (the engine keeps no more of the sparse
    actor's distribution)."""
    return torch.where(old["budgets"] == 0, 1.0, old["alpha_lb"])


def _rng_states() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def with_fingerprints(cfg: TrainConfig, prompts: Sequence[PromptRow],
                      eval_prompts: Sequence[PromptRow] | None, sparsity) -> TrainConfig:
    """`cfg` with the content hashes of what the run reads (run_dir.py)."""
    return replace(cfg, prompts_sha256=prompts_fingerprint(prompts),
                   eval_prompts_sha256=prompts_fingerprint(eval_prompts),
                   schedule_sha256=sparsity_fingerprint(sparsity))


def read_metrics(run_dir: str | Path) -> tuple[list[dict], dict]:
    path = Path(run_dir) / "metrics.parquet"
    return read_artifact(path, "metrics").to_pylist(), artifact_metadata(path)


__all__ = ["PromptRow", "TrainConfig", "Trainer", "check_run_dir", "load_prompts", "read_metrics",
           "with_fingerprints"]
