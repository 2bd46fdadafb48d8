"""The rollout engine: requests, scheduler, paged KV pool, continuous batching, over a device runner.

`Engine` (engine.py) is device-agnostic: the `Scheduler` (scheduler.py), the `BlockManager`
(block_manager.py) and each sample's `Sequence` (sequence.py). A runner owns the device: the plain
`ModelRunner` (runner.py), `cpu/` (C++ kernels, packed weights, cascade attention) and `gpu/` (Triton
kernels, CUDA graphs, the pool sized from device memory).
"""

from __future__ import annotations

from ..core.lazy import lazy_getattr

_EXPORTS = {"Engine": ".engine", "EngineStats": ".engine", "EngineConfig": ".config", "DecodeStep": ".config",
            "Completion": ".sequence", "SamplingParams": ".sequence", "draft_acceptance": ".sequence"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
