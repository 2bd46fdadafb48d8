"""The work behind every `sparrow` subcommand.

Flat modules are the stages the CLI calls (rollout, profile, calibrate, cost, plan, distill, sql,
report); sub-packages are what they are built from, and imports point down:
core/ (the shared vocabulary: definitions, schedules, sparsity specs, trajectories, prompt files)
and model/ < attention/ < kv_policies/ < engine/ < scoring/, train/, tasks/, backends/ < the stages.
"""
