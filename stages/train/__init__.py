"""`sparrow train`: GRPO on sparse rollouts, corrected toward the dense learner (see trainer.py)."""

from .config import TrainConfig
from .data import PromptRow, load_prompts
from .metrics import read_metrics
from .objective import CORRECTIONS, LossConfig, group_advantages, policy_loss, rollout_correction
from .run_dir import TrainingInterrupted, check_run_dir, with_fingerprints
from .trainer import RunOptions, Trainer

__all__ = ["CORRECTIONS", "LossConfig", "PromptRow", "RunOptions", "TrainConfig", "Trainer",
           "TrainingInterrupted", "check_run_dir", "group_advantages", "load_prompts", "policy_loss",
           "read_metrics", "rollout_correction", "with_fingerprints"]
