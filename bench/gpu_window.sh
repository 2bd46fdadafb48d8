#!/usr/bin/env bash
# The GPU path checked in one lent window: two device calls run back to back, with nothing to decide in
# between, Qwen3-4B shapes with random bf16 weights. A lent session runs `bash bench/gpu_wheels.sh` here,
# then `run` with command `bash bench/gpu_window.sh a`, carry [".whl"], timeout_s 480, then the same with
# `b` and timeout_s 360, then `give_back` (docs/gpu.md, "Running the GPU window").
#
#   bash bench/gpu_window.sh a|b|--plan
#
# Each phase has a budget (a 405 s, b 255 s, together 660 s; the call's timeout leaves a minute or more
# for the wheels, the site folder and a warm start); a step gets at most what is left of it and is
# skipped, with the reason, when less than half its limit is left. Phase a is correctness, 32K memory and
# the decode step against its floor; phase b exact speculation on CUDA graphs (its correctness, no host
# sync in a cycle, then its speed at 16K), profiling at 32K and where a sparse step's time goes. Logs, at
# most 8 files with the results and summary.txt, go to $OUT; the summary table is printed last. `--plan`
# prints each phase's steps, limits and totals and runs nothing (no torch or GPU needed).
#
# Sizing: the limits follow the lent windows' logs (docs/gpu.md, "Running the GPU window"); kernel-tests'
# limit is mostly Triton's first compile of every kernel on a bare machine. From the CPU side:
# test_kernels_triton.py runs every kernel (slow sweeps included; the CPU-only ahead-of-time build test is
# left out: it compiles every kernel for sm80 and sm90 and needs no GPU) and test_sparse_paged.py adds
# about 15 compiles (six of them the prefill kernel's); the engine's GPU tests are 33. A 32K prompt's prefill
# is about 2 x 4e9 x 32768 = 2.6e14 FLOPs plus as much again in attention, about a second per engine at
# H100 rates: the engines step is pool sizing, graph capture and frees. The speculation bench is five
# engines of one 16K prefill and 512 steps or cycles each (warm-up, dense, budget 2048, K = 4 with the
# drafts on the first draft's kept pages and on their own) and two samples' teacher-forced scoring;
# `sparrow profile` scores 4 trajectories of 32K at 4 budgets (the target is a minute; the limit leaves
# the set-up).
set -u
case ${1:-} in
    a|b|--plan) ;;
    *) echo "bench/gpu_window.sh: unknown phase '${1:-}': expected a, b or --plan." >&2
       exit 2 ;;
esac
WHAT=$1
[[ $WHAT == --plan ]] && PLAN=1
# shellcheck source=bench/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
BUDGET_A=405 BUDGET_B=255
CPU_ONLY=tests/test_kernels_triton.py::test_kernels_compile_for_sm80_and_sm90

phase_a() {  # correctness, 32K memory, the decode step against its floor
    step versions 10 versions
    step kernel-tests 200 $PY -m pytest -q -p no:cacheprovider -m "slow or not slow" --deselect "$CPU_ONLY" \
        tests/test_kernels_triton.py tests/test_sparse_paged.py
    step engine-tests 75 $PY -m pytest -q -s -p no:cacheprovider -m "slow or not slow" tests/test_gpu.py \
        tests/test_gpu_layers.py "tests/test_rollout.py::test_cuda_graph_step_equals_eager_step"
    step engines-32k 45 $PY bench/scale_gpu.py engines --model qwen3-4b --context 32768 --samples 32 --engines 4
    step own-kv 75 $PY bench/rollout.py --model qwen3-4b --random-weights --own-kv 8x32768,32x8192 \
        --samplers dense,budget --budget 2048 --temperature 1
    keep bench/results/rollout-own-kv.parquet own-kv.parquet
}

phase_b() {  # exact speculation on CUDA graphs, profiling at 32K, where a sparse step's time goes
    step speculation-graphs 35 $PY -m pytest -q -s -p no:cacheprovider \
        "tests/test_speculative.py::test_speculation_with_cuda_graphs_equals_the_eager_static_step" \
        "tests/test_speculative.py::test_speculative_cycles_run_without_host_synchronisation"
    step speculation-16k 90 $PY bench/speculation.py --device cuda --model qwen3-4b --prompt-len 16384 \
        --samples 8 --new-tokens 512 --budget 2048 --speculate 4 --draft-pages both --alpha-samples 2 \
        --floor-context 16384 --floor-batch 8
    keep bench/results/speculation.parquet speculation-16k.parquet
    LOG=profile-32k step profile-inputs 10 $PY bench/learner_scale.py rollouts --model qwen3-4b \
        --trajectories 4 --length 32768 --output "$WORK/long_rollouts.parquet"
    step profile-32k 85 $PY bench/scale_gpu.py run -- sparrow profile --device cuda --model qwen3-4b \
        --random-weights --rollouts "$WORK/long_rollouts.parquet" --budgets 1024,2048,3072,4096 \
        --bin-width 2000 -o "$OUT/profile-32k.parquet" --force
    step step-profile-32k 35 $PY bench/scale_gpu.py run -- bench/step_profile.py --model qwen3-4b \
        --context 32768 --samples 8 --budget 2048
}

LEFT="  left to gpu_checks.sh (another call each): scale-train (one LoRA GRPO step, 2 x 4 x 16K new tokens,
  peak memory), rollout-8k (the whole rollout 4 x 8 x 8,192 after 256; fit-cost first,
  for the cost model's predicted speedups beside the measured ones; bench/predict_rollout.py gives them
  for this window's rollout-8k.parquet from any fit-cost artifact of the same card)."

if [[ $WHAT == --plan ]]; then
    echo "phase a (run: timeout_s 480; budget ${BUDGET_A} s):"
    phase_a
    echo "  total            $PLANNED s of $BUDGET_A"
    total=$PLANNED PLANNED=0
    echo "phase b (run: timeout_s 360; budget ${BUDGET_B} s):"
    phase_b
    echo "  total            $PLANNED s of $BUDGET_B"
    echo "both phases: $((total + PLANNED)) s of $((BUDGET_A + BUDGET_B))"
    echo "$LEFT"
    exit 0
fi

[[ $WHAT == a ]] && BUDGET=$BUDGET_A || BUDGET=$BUDGET_B
need_gpu
gpu_site
echo "=== phase $WHAT: budget ${BUDGET}s, logs in $OUT"
"phase_$WHAT"
[[ $WHAT == b ]] && echo "$LEFT"
summary "$OUT/summary.txt"
