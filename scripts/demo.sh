#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M, CPU, no network): prompts -> profile ->
# threshold -> SQL over the run directory. Artifacts land in demo-run/.
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
RUN=${RUN:-demo-run}
mkdir -p "$RUN"

echo "== model presets"
$SPARROW models

echo "== long-context prompts (key-value lookup, ~1.5K tokens) on SmolLM2's chat template"
$SPARROW prompts --task kv_lookup --n 2 --seed 0 --context-tokens 1500 -o "$RUN/prompts.parquet"

echo "== per-token mismatch: 2 samples per prompt, budgets 64..512, teacher-forced"
$SPARROW profile --prompts "$RUN/prompts.parquet" --budgets 64,128,256,512 --samples 2 \
    --max-new-tokens 96 --bin-width 512 -o "$RUN/mismatch.parquet"

echo "== critical threshold (no training runs yet: the published prior)"
$SPARROW calibrate-threshold --profile "$RUN/mismatch.parquet" -o "$RUN/threshold.parquet"

echo "== schedule: the cheapest budget per bin whose tail stays above the threshold"
$SPARROW plan-schedule --model smollm2-135m --profile "$RUN/mismatch.parquet" \
    --threshold-file "$RUN/threshold.parquet" --bin-width 512 -o "$RUN/schedule.parquet"

echo "== the same planner on a Qwen3 preset with the published reference profile (no flags needed)"
$SPARROW plan-schedule --model qwen3-4b --sweep 0.80,0.83,0.86,0.90,0.92

echo "== sparse rollouts with the planned schedule, rewards from the task's scorer"
$SPARROW rollout --prompts "$RUN/prompts.parquet" --schedule "$RUN/schedule.parquet" --samples 2 \
    --max-new-tokens 64 -o "$RUN/rollouts.parquet"

echo "== SQL: the 5th percentile of alpha per bin and budget"
$SPARROW sql "SELECT bin, budget, count(*) AS tokens, round(avg(alpha), 4) AS mean_alpha,
                     round(quantile_cont(alpha, 0.05), 4) AS p5_alpha
              FROM mismatch GROUP BY ALL ORDER BY ALL" --run "$RUN"
