"""The rollout engine: requests, scheduler, paged KV pool, continuous batching, over a device runner.

`Engine` (engine.py) is device-agnostic: the `Scheduler` (scheduler.py), the `BlockManager`
(block_manager.py) and each sample's `Sequence` (sequence.py). A runner owns the device: the plain
`ModelRunner` (runner.py), `cpu/` (C++ kernels, packed weights, cascade attention) and `gpu/` (Triton
kernels, CUDA graphs, the pool sized from device memory).
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562), so that a light submodule (memory.py, sequence.py) does not pull the
# engine, torch and the kernels into a command that only needs it, such as `sparrow --help`.
_EXPORTS = {"Engine": ".engine", "EngineStats": ".engine", "EngineConfig": ".config", "DecodeStep": ".config",
            "Completion": ".sequence", "SamplingParams": ".sequence"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
