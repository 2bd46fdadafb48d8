"""The rollout engine: paged KV cache, continuous batching, block top-k sparse decode.

A small engine in the spirit of nano-vllm, written for this project: `Engine` (engine.py) runs the
step loop over `Scheduler` (scheduler.py: waiting / ready / running queues) and `BlockManager`
(block_manager.py: pages, reference counts, reservations); a device runner (runner.py, cpu_runner.py,
gpu_runner.py) runs the model and owns the KV pool (`PagedKVCache`, kv_cache.py; its size from
memory.py), the static decode step and its CUDA graphs (static_decode.py) and the sampler call; the
model sees the cache through per-step `Attention` objects (attention.py) that call the kernels of
`sparrow.kernels.ops`. `merge_lora` (lora.py) merges a sparse-actor LoRA into the weights;
`run_rollouts` (stage.py) is the `sparrow rollout` stage.
"""

from ..sparsity import budget_fn
from .engine import Engine, EngineStats
from .lora import LoraWeights, load_lora, lora_merged, merge_lora, unmerge_lora
from .sequence import Completion, SamplingParams
from .stage import RolloutOptions, run_rollouts

__all__ = [
    "Completion",
    "Engine",
    "EngineStats",
    "LoraWeights",
    "RolloutOptions",
    "SamplingParams",
    "budget_fn",
    "load_lora",
    "lora_merged",
    "merge_lora",
    "run_rollouts",
    "unmerge_lora",
]
