"""`sparrow train`: GRPO on sparse rollouts, corrected toward the dense learner (see trainer.py)."""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): a light submodule (detectors.py, config.py) does not pull the
# trainer, torch and the engine into a command that only needs it, such as `sparrow --help`.
_EXPORTS = {"TrainConfig": ".config", "PromptRow": ".data", "load_prompts": ".data",
            "read_metrics": ".metrics",
            "CORRECTIONS": ".objective", "LossConfig": ".objective", "group_advantages": ".objective",
            "policy_loss": ".objective", "rollout_correction": ".objective",
            "TrainingInterrupted": ".run_dir", "check_run_dir": ".run_dir", "with_fingerprints": ".run_dir",
            "RunOptions": ".trainer", "Trainer": ".trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
