#!/usr/bin/env bash
# The GPU checklist in one command, for a CUDA machine whose Python already has torch, triton and
# transformers (no install step needs a network): compiled kernels vs their torch references, the CUDA
# graph engine vs eager, transformers and teacher-forced scoring, bench/kernels.py, and bench/rollout.py
# on Qwen3-4B shapes with random bf16 weights. Each step runs under its own time limit and goes on
# after a failure; logs go to $OUT (default bench/results/gpu), a summary is printed last.
#
#   bash bench/gpu_checks.sh [all|tests|engine|kernels|rollout|profile|train|learner] [extra args for bench/rollout.py]
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/gpu}
mkdir -p "$OUT"
WHAT=${1:-all}
shift || true
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
    step kernel-tests 200 $PY -m pytest -q -x -p no:cacheprovider -m "slow or not slow" tests/test_kernels_triton.py
fi
if [[ $WHAT == all || $WHAT == tests || $WHAT == engine ]]; then
    step engine-tests 150 $PY -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
        "tests/test_rollout.py::test_cuda_graph_step_equals_eager_step"
fi
if [[ $WHAT == all || $WHAT == kernels ]]; then
    step bench-kernels 150 $PY bench/kernels.py
    cp bench/results/kernels.parquet "$OUT/" 2>/dev/null
fi
if [[ $WHAT == all || $WHAT == rollout ]]; then
    for ctx in 16384 32768; do
        step "rollout-$ctx" 280 $PY bench/rollout.py --model qwen3-4b --random-weights --context "$ctx" \
            --samples 32 --budget 2048 --schedule published:qwen3-4b:0.86 "$@"
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
if [[ $WHAT == scale || $WHAT == learner ]]; then  # issue 24, the learner's side, Qwen3-4B shapes, random bf16
    LONG=$OUT/long_rollouts.parquet  # four random 32K-token trajectories (1K prompt + 31K generated)
    $PY bench/learner_scale.py rollouts --model qwen3-4b --trajectories 4 --length 32768 --output "$LONG"
    step profile-32k 590 $PY -c "from sparrow.cli.app import main; main()" profile --device cuda \
        --model qwen3-4b --random-weights --rollouts "$LONG" --budgets 1024,2048,3072,4096 --bin-width 2000 \
        -o "$OUT/profile-32k.parquet"
    step score-32k 590 $PY bench/learner_scale.py score --model qwen3-4b --device cuda --trajectories 4 \
        --length 32768 --budgets 1024,2048,3072,4096  # the same scoring, with its peak memory
    step update-16k 590 $PY bench/learner_scale.py update --model qwen3-4b --device cuda --prompts 2 \
        --samples 4 --prompt-tokens 1024 --new-tokens 16384 --micro-batch 1
fi
if [[ $WHAT == profile ]]; then  # not in "all": a breakdown to read, not a check
    for budget in ${PROFILE_BUDGETS:-2048 0}; do
        step "profile-$budget" 200 $PY bench/step_profile.py --budget "$budget"
    done
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
