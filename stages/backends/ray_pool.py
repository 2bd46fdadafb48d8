"""Data-parallel rollouts on Ray: `sparrow rollout --workers N [--ray-address ADDR]`.

Design decisions:
- One Ray actor per worker, each a real process that loads the model once and keeps it for every
  shard (and, in training, every step) it is given; `num_cpus` / `num_gpus` per actor say what it owns.
  Without --ray-address a local Ray is started on demand, with a small object store (rollouts are
  token ids and logprobs, not tensors of activations).
- Shards: the prompt set split by prompt index into contiguous ranges, one per worker
  (`World(k, N).shard`). A prompt's samples are seeded from (seed, its global index, sample), the
  engine's request ids, so the union of the shards is exactly what one process samples, for any N.
- Faults are handled by the driver, not by Ray's restarts: shards wait in a queue and go to idle
  workers; when a worker dies (`RayActorError`) its shard goes back to the queue for another worker
  and a replacement actor is started. A shard's result is taken once, from the first worker that
  finishes it, so nothing is lost or counted twice. A shard that kills `max_attempts` workers is an
  error. Tests make a worker exit once on a given shard (SPARROW_TEST_FAULT_ONCE=SHARD:MARKER_FILE).
- Results come back to the driver through the object store and the driver writes one Parquet part
  per shard (`write_artifact_parts`), so a cluster needs no shared filesystem.
- Weight sync (`push_lora`): the learner's LoRA state goes into the object store once (`ray.put`)
  and every worker takes it from there; the seconds are returned so training can report them.
- Ray is an optional dependency (`.[ray]`); `require_ray` says how to install it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from ..rollout import RolloutOptions, RolloutSummary, summarize

OBJECT_STORE_MB = 500


class RayMissing(RuntimeError):
    pass


def require_ray():
    try:
        import ray
    except ImportError:
        raise RayMissing("--workers needs Ray, which is not installed: install it with "
                         "`pip install 'sparrow-rl[ray]'` (or `pip install ray`)") from None
    return ray


class RolloutWorker:
    """The body of a Ray actor: a model loaded once, rollouts of the shards it is given."""

    def __init__(self, model: str, device: str = "cpu", threads: int = 1, fault_once: str | None = None,
                 random_weights: bool = False, dtype: str = "auto"):
        import torch

        from ..model.loading import load_model, resolve_dtype

        torch.set_num_threads(threads)
        self.loaded = load_model(model, device=device, random_weights=random_weights,
                                 dtype=resolve_dtype(dtype, device))
        self.fault_once = fault_once  # tests: "SHARD:MARKER", exit once on that shard
        self.engine = None  # the trainer's rollout engine, kept across steps

    def pid(self) -> int:
        return os.getpid()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(self.loaded.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]

    def work(self, method: str, shard: int, items: list, indices: list[int], *args) -> tuple[object, int]:
        """`method`'s result on one shard (items with their global indices), and this process's pid."""
        self._maybe_die(shard)
        return getattr(self, method)(items, indices, *args), os.getpid()

    def rollouts(self, rows: list[dict], indices: list[int], opts: RolloutOptions
                 ) -> tuple[pa.Table, RolloutSummary]:
        """`sparrow rollout` on prompt rows."""
        from ..rollout import run_rollouts

        return run_rollouts(self.loaded, rows, opts, request_ids=indices)

    def generate(self, prompts: list[list[int]], indices: list[int], params, sparsity, max_batch: int,
                 gpu_memory_utilization: float = 0.9):
        """The trainer's rollout phase: the engine's completions of each prompt. One engine serves every
        step (made again only if the batch size changes or a LoRA is injected)."""
        from ..core.sparsity import as_policy
        from ..engine.engine import Engine, EngineConfig

        self.loaded.model.eval()
        if self.engine is None or self.engine.max_batch != max_batch:
            self._drop_engine()
            self.engine = Engine(self.loaded.model, None, EngineConfig(
                max_batch=max_batch, gpu_memory_utilization=gpu_memory_utilization))
        return self.engine.generate(prompts, params, request_ids=indices, policy=as_policy(sparsity))

    def _drop_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def profile(self, items: list, indices: list[int], opts, sample: bool) -> pa.Table:
        """`sparrow profile` on (prompt id, prompt ids) pairs (sample first) or on trajectories."""
        from ..profile import profile_trajectories, sample_trajectories

        if sample:
            ids, prompts = [i for i, _ in items], [p for _, p in items]
            items = sample_trajectories(self.loaded, ids, prompts, opts, request_ids=indices)
        return profile_trajectories(self.loaded, items, opts)

    def load_weights(self, state: dict, lora: bool) -> None:
        """Weight sync: the learner's LoRA tensors (peft names) into this worker's injected LoRA, or a
        full state dict."""
        from ..train.adapter import load_lora_state

        if lora:
            load_lora_state(self.loaded.model, state)
        else:
            self.loaded.model.load_state_dict(state)
        if self.engine is not None:
            self.engine.update_weights()

    def add_lora(self, rank: int, alpha: float) -> None:
        from ..train.adapter import add_lora

        self._drop_engine()  # its packed weights and graphs belong to the modules the LoRA wraps
        add_lora(self.loaded.model, rank, alpha)

    def _maybe_die(self, shard: int) -> None:
        if self.fault_once is None:
            return
        which, marker = self.fault_once.split(":", 1)
        if int(which) == shard and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os._exit(1)  # a hard crash: no exception reaches Ray, the process is gone


@dataclass
class ShardResult:
    shard: int
    value: object  # what the worker method returned
    worker_pid: int
    attempts: int

    @property
    def table(self) -> pa.Table:  # rollouts: (table, summary)
        return self.value[0]

    @property
    def summary(self) -> RolloutSummary:
        return self.value[1]


class RolloutPool:
    """N rollout workers on Ray; `run` shards a prompt set over them and returns one result per shard."""

    def __init__(self, model: str, workers: int, *, address: str | None = None, device: str = "cpu",
                 threads: int = 1, max_attempts: int = 3, fault_once: str | None = None,
                 random_weights: bool = False, dtype: str = "auto"):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        ray = require_ray()
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=workers * threads, object_store_memory=OBJECT_STORE_MB * 2**20,
                         include_dashboard=False, log_to_driver=False)
        gpus = 1 if device == "cuda" else 0
        self._actor_cls = ray.remote(num_cpus=threads, num_gpus=gpus, max_restarts=0)(RolloutWorker)
        fault_once = fault_once or os.environ.get("SPARROW_TEST_FAULT_ONCE")  # tests through the CLI
        self._args = (model, device, threads, fault_once, random_weights, dtype)
        self.max_attempts = max_attempts
        self.workers = [self._new_worker() for _ in range(workers)]
        self.replaced = 0

    def _new_worker(self):
        """A worker in the pool's current state: the LoRA injected and the last weights pushed (calls
        on an actor run in order, so its first task sees them)."""
        worker = self._actor_cls.remote(*self._args)
        if getattr(self, "_lora", None):
            worker.add_lora.remote(*self._lora)
        if getattr(self, "_weights", None):
            worker.load_weights.remote(*self._weights)
        return worker

    def pids(self) -> list[int]:
        ray = require_ray()
        return ray.get([w.pid.remote() for w in self.workers])

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return require_ray().get(self.workers[0].tokenize.remote(texts))

    def run(self, rows: Sequence[dict], opts: RolloutOptions,
            on_shard: Callable[[ShardResult], None] | None = None) -> list[ShardResult]:
        """Rollouts of `rows` in len(workers) shards by prompt index, in shard order."""
        return self.map("rollouts", rows, opts, on_shard=on_shard)

    def map(self, method: str, items: Sequence, *args,
            on_shard: Callable[[ShardResult], None] | None = None) -> list[ShardResult]:
        """`RolloutWorker.<method>` over len(workers) contiguous shards of `items`, in shard order."""
        from sparrow.stages.train.distributed import World

        ray = require_ray()
        n = len(self.workers)
        shards = [World(k, n).shard(len(items)) for k in range(n)]
        pending, idle = deque(range(n)), list(self.workers)
        running: dict = {}
        attempts = [0] * n
        results: dict[int, ShardResult] = {}
        while pending or running:
            while pending and idle:
                k, worker = pending.popleft(), idle.pop(0)
                attempts[k] += 1
                fut = worker.work.remote(method, k, list(items[shards[k]]),
                                         list(range(len(items)))[shards[k]], *args)
                running[fut] = (k, worker)
            done, _ = ray.wait(list(running), num_returns=1)
            k, worker = running.pop(done[0])
            try:
                value, pid = ray.get(done[0])
            except ray.exceptions.RayActorError:
                if attempts[k] >= self.max_attempts:
                    raise RuntimeError(f"rollout shard {k} failed on {attempts[k]} workers; "
                                       "giving up") from None
                pending.append(k)  # redone by another worker
                self.workers[self.workers.index(worker)] = replacement = self._new_worker()
                self.replaced += 1
                idle.append(replacement)
                continue
            results[k] = ShardResult(k, value, pid, attempts[k])
            idle.append(worker)
            if on_shard is not None:
                on_shard(results[k])
        return [results[k] for k in range(n)]

    def push_weights(self, state: dict, lora: bool) -> float:
        """Weight sync: every worker loads `state` (LoRA tensors, or a full state dict) from one copy
        in the object store; returns the seconds until all have it. Replacement workers started later
        get the last state pushed."""
        ray = require_ray()
        t0 = time.perf_counter()
        self._weights = (ray.put(state), lora)
        ray.get([w.load_weights.remote(*self._weights) for w in self.workers])
        return time.perf_counter() - t0

    def add_lora(self, rank: int, alpha: float) -> None:
        ray = require_ray()
        self._lora = (rank, alpha)
        ray.get([w.add_lora.remote(rank, alpha) for w in self.workers])

    def close(self) -> None:
        ray = require_ray()
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.started_ray:
            ray.shutdown()


def merge_summaries(results: Sequence[ShardResult], wall_seconds: float) -> RolloutSummary:
    """One summary for the whole prompt set: counts and reward over every part; `seconds` is the
    wall-clock time of the parallel run (so tokens/s is the pool's throughput) and prefill/decode
    seconds are summed over workers."""
    table = pa.concat_tables([r.table for r in results])
    cols = {k: table.column(k).to_pylist() for k in ("budgets", "reward", "finish_reason", "sample",
                                                      "kv_policy")}
    merged = summarize(cols, _Stats(sum(r.summary.prefill_seconds for r in results),
                                    sum(r.summary.decode_seconds for r in results),
                                    sum(r.summary.preemptions for r in results),
                                    sum(r.summary.compactions for r in results)))
    # each worker has its own pool: the KV held is each pool's, so the peaks and means are the largest
    # worker's (a sum over pools that never ran at the same step would mean nothing)
    kv = {k: max((getattr(r.summary, k) for r in results if getattr(r.summary, k) is not None), default=None)
          for k in ("kv_tokens_peak", "kv_tokens_mean", "dense_kv_tokens_peak", "dense_kv_tokens_mean",
                    "peak_pages")}
    return replace(merged, seconds=wall_seconds, **kv)


@dataclass
class _Stats:
    prefill_s: float
    decode_s: float
    preemptions: int
    compactions: int = 0

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s
