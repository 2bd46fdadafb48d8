"""The work behind every `sparrow` subcommand.

Flat modules are the stages the CLI calls (rollout, profile, calibrate, cost, plan, distill, sql,
report); sub-packages are what they are built from. Imports point down: model/ < attention/ <
kv_policies/ < engine/ < scoring/, tasks/ < train/, backends/ < the stages; core/ is the shared
vocabulary (definitions, schedules, sparsity specs, trajectories, prompt files) that any of them reads.
"""
