"""`sparrow train`: GRPO on sparse rollouts, corrected toward the dense learner (see trainer.py)."""

from __future__ import annotations

from ..core.lazy import lazy_getattr

_EXPORTS = {"TrainConfig": ".config", "PromptRow": ".data", "load_prompts": ".data",
            "read_metrics": ".metrics",
            "CORRECTIONS": ".objective", "LossConfig": ".objective", "group_advantages": ".objective",
            "policy_loss": ".objective", "rollout_correction": ".objective",
            "TrainingInterrupted": ".run_dir", "check_run_dir": ".run_dir", "with_fingerprints": ".run_dir",
            "RunOptions": ".trainer", "Trainer": ".trainer"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
