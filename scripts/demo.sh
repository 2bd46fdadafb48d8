#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M, CPU, no network): prompts -> profile ->
# threshold -> schedule -> sparse rollouts -> a few GRPO steps on sparse rollouts -> SQL -> report.
# Artifacts land in demo-run/ (the training run in demo-run/train/, the figures in demo-run/report/).
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW=.venv/bin/sparrow
RUN=${RUN:-demo-run}
rm -rf "$RUN"
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

echo "== GRPO on sparse rollouts: 3 steps of passkey retrieval (1K-token prompts), budget 256, truncated IS"
$SPARROW prompts --task passkey --n 16 --seed 0 --context-tokens 1000 -o "$RUN/train-prompts.parquet"
$SPARROW prompts --task passkey --n 8 --seed 1 --context-tokens 1000 -o "$RUN/eval-prompts.parquet"
$SPARROW train --prompts "$RUN/train-prompts.parquet" --eval-prompts "$RUN/eval-prompts.parquet" \
    --budget 256 --correction tis --steps 3 --prompts-per-step 2 --samples 4 --max-new-tokens 12 \
    --eval-every 3 -o "$RUN/train"

echo "== SQL over the training run: per step, and the sparse actor's mismatch per step and budget"
$SPARROW sql "SELECT step, round(reward_mean, 3) AS reward, eval_accuracy, round(mismatch_kl, 5) AS mismatch_kl,
                     round(alpha_lb_p5, 3) AS alpha_lb_p5, round(seconds, 1) AS seconds FROM metrics ORDER BY step" \
    --run "$RUN/train"
$SPARROW sql "SELECT step, budget, count(*) AS tokens, round(avg(k3), 5) AS mean_k3
              FROM train_mismatch GROUP BY ALL ORDER BY ALL" --run "$RUN/train"

echo "== report: the figures of the whole run"
$SPARROW report "$RUN"
