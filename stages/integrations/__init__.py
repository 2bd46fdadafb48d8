"""Sparrow inside other trainers: `trl` (TRL's GRPOTrainer, through its `rollout_func` hook), and our
tasks as their datasets and rewards: `verl` (a verl dataset, verl's custom reward function) and
`trl_tasks` (a TRL dataset, a TRL reward function).

Each integration imports its trainer lazily, so the core package never needs it installed.
"""
