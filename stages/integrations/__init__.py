"""Sparrow inside other trainers: `trl` (TRL's GRPOTrainer, through its `rollout_func` hook).

Each integration imports its trainer lazily, so the core package never needs it installed.
"""
