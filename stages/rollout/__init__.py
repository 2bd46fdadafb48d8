"""The rollout engine: paged KV cache, continuous batching, block top-k sparse decode, KV eviction.

A small engine in the spirit of nano-vllm, written for this project: `Engine` (engine.py) runs the
step loop over `Scheduler` (scheduler.py: waiting / ready / running queues) and `BlockManager`
(block_manager.py: pages, reference counts, reservations); a device runner (runner.py, cpu_runner.py,
gpu_runner.py) runs the model and owns the KV pool (`PagedKVCache`, kv_cache.py; its size from
memory.py), the static decode step and its CUDA graphs (static_decode.py) and the sampler call; the
model sees the cache through per-step `Attention` objects (attention.py) that call the kernels of
`sparrow.kernels.ops`. What a request's decode steps attend to is its KV policy (stages/kv_policies);
eviction policies compact caches between steps (compaction.py). `merge_lora` (lora.py) merges a
sparse-actor LoRA into the weights; `run_rollouts` (stage.py) is the `sparrow rollout` stage.
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562), so that a light submodule (memory.py, sequence.py) does not pull the
# engine, torch and the kernels into a command that only needs it, such as `sparrow --help`.
_EXPORTS = {"budget_fn": "..sparsity", "Engine": ".engine", "EngineStats": ".engine", "LoraWeights": ".lora",
            "load_lora": ".lora", "lora_merged": ".lora", "merge_lora": ".lora", "unmerge_lora": ".lora",
            "Completion": ".sequence", "SamplingParams": ".sequence", "RolloutOptions": ".stage",
            "run_rollouts": ".stage"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
