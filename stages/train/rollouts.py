"""Where a run's samples come from: the sparse engine in this process, or Ray rollout workers.

One engine serves the whole run, evaluation included: it is made at the first rollout (after the LoRA is
injected and a checkpoint loaded), samples with the live weights (the LoRA sits in the model, so there
is nothing to reload) and is told of every update. Ray workers get each step's weights pushed instead.
Under torchrun each rank samples its share of the prompts and every rank gets all of the completions.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..backends.ray_pool import RolloutPool
from ..engine import Completion, Engine, EngineConfig, SamplingParams
from ..kv_policies import KVPolicy
from ..model.adapter import lora_state
from .distributed import World


def make_engine(model: nn.Module, policy: KVPolicy, max_batch: int, gpu_memory_utilization: float,
                speculate: int = 0) -> Engine:
    config = EngineConfig(max_batch=max_batch, gpu_memory_utilization=gpu_memory_utilization,
                          speculate=speculate)
    return Engine(model, policy, config)


class Rollouts:
    def __init__(self, model: nn.Module, policy: KVPolicy, world: World, pool: RolloutPool | None = None,
                 gpu_memory_utilization: float = 0.9, speculate: int = 0, max_num_seqs: int | None = None):
        """`gpu_memory_utilization`: on CUDA, the share of device memory the engine may take (its KV pool,
        graphs and activations; the learner's update needs the rest). `speculate` = K: exact speculative
        rollouts, the policy drafting (in this process's engine only). `max_num_seqs`: the most samples an
        engine decodes together (vLLM's max_num_seqs); the others wait their turn (None: no bound)."""
        self.model, self.policy, self.world, self.pool = model, policy, world, pool
        self.gpu_memory_utilization, self.speculate = gpu_memory_utilization, speculate
        self.max_num_seqs = max_num_seqs
        self.engine: Engine | None = None
        self.sync_seconds: float | None = None  # the last weight push to the workers

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams, prompts_per_step: int,
               lora: bool) -> list[list[Completion]]:
        """Each prompt's `params.n` completions under the run's policy, in prompt order."""
        self.model.eval()
        if self.pool is not None:
            state = (lora_state(self.model) if lora
                     else {k: v.detach().cpu() for k, v in self.model.state_dict().items()})
            self.sync_seconds = self.pool.push_weights(state, lora)
            results = self.pool.map("generate", list(prompts), params, self.policy,
                                    self._batch(len(prompts) * params.n), self.gpu_memory_utilization)
            return [group for r in results for group in r.value]
        shard = self.world.shard(len(prompts))  # a prompt's group stays on one rank
        mine = self.run_engine(prompts_per_step, params.n).generate(
            list(prompts[shard]), params, request_ids=range(shard.start, shard.stop))
        return [group for part in self.world.gather(mine) for group in part]

    def run_engine(self, prompts_per_step: int, n: int) -> Engine:
        """The run's engine, made once; its batch is this rank's share of a step's samples."""
        if self.engine is None:
            mine = self.world.shard(prompts_per_step)
            batch = self._batch(max(mine.stop - mine.start, 1) * n)
            self.engine = make_engine(self.model, self.policy, batch, self.gpu_memory_utilization,
                                      self.speculate)
        return self.engine

    def _batch(self, samples: int) -> int:
        """An engine's batch for `samples` samples: all of them, or --max-num-seqs where that is fewer."""
        return samples if self.max_num_seqs is None else min(samples, self.max_num_seqs)

    def updated(self) -> None:
        """The next rollouts sample with the updated weights."""
        if self.engine is not None:
            self.engine.update_weights()

    def close(self) -> None:
        """The engine's pool and graphs go now; a later rollout makes them again."""
        if self.engine is not None:
            self.engine.close()
