"""`sparrow train`: GRPO on sparse rollouts, corrected toward the dense learner (see trainer.py)."""

from .objective import CORRECTIONS, LossConfig, group_advantages, policy_loss, rollout_correction
from .trainer import PromptRow, TrainConfig, Trainer, load_prompts, read_metrics

__all__ = ["CORRECTIONS", "LossConfig", "PromptRow", "TrainConfig", "Trainer", "group_advantages",
           "load_prompts", "policy_loss", "read_metrics", "rollout_correction"]
