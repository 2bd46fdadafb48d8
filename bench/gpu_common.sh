# What bench/gpu_checks.sh and bench/gpu_window.sh share; sourced, not run. It sets
#   ROOT, OUT (logs and results, default bench/results/gpu), PY (python3 or $PYTHON), SPARROW (the CLI);
#   gpu_site      the package mirrored in a private site folder (links, no install) plus the wheels
#                 carried in .whl/, on PYTHONPATH; WORK, a scratch folder whose files do not come back;
#   step NAME LIMIT CMD...   CMD (a command or an exported function) under its time limit, its output
#                 appended to $OUT/${LOG:-NAME}.log and its last lines printed. With BUDGET (seconds, from
#                 when this file is sourced; 0 = none) a step gets at most what is left of it and is
#                 skipped, with the reason, when less than half its limit is left;
#   keep SRC NAME a result file copied to $OUT/NAME;
#   summary [FILE] the steps' table, printed last (and written to FILE); its status, the script's last,
#                 is 1 when a step failed or was cut off (a skipped step is not a failure);
#   need_gpu      one sentence and exit 2 where no CUDA device or no torch that sees one is found;
#   PLAN=1        step and keep only print what they would do: no torch, no GPU, nothing written.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/gpu}
PY=${PYTHON:-python3}
SPARROW=("$PY" -c "from sparrow.cli.app import main; main()")
PLAN=${PLAN:-0}
BUDGET=${BUDGET:-0}
T0=$SECONDS
PLANNED=0
FAILED=0
WORK='$WORK'  # a real folder once gpu_site has run
export PY
declare -a SUMMARY=()

gpu_site() {
    [[ $PLAN == 1 ]] && return 0
    mkdir -p "$OUT"
    WORK=$(mktemp -d)
    # The package maps four top-level folders under one namespace (pyproject's package-dir): mirror that
    # with links instead of an install, so nothing is built or fetched on the machine.
    local site=$WORK/site pair
    mkdir -p "$site/sparrow"
    for pair in cli:sparrow_cli stages:stages kernels:kernels schemas:schemas; do
        ln -s "$ROOT/${pair#*:}" "$site/sparrow/${pair%%:*}"
    done
    if compgen -G ".whl/*.whl" >/dev/null; then  # wheels carried for packages the machine lacks
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
    fi
    export PYTHONPATH="$site:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
}

versions() {  # the card, its clocks and driver, and the Python stack's versions
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    nvidia-smi
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
}
export -f versions

shown() {  # a command as the plan prints it: the CLI as `sparrow`
    local cmd="$*"
    printf '%s' "${cmd//"${SPARROW[*]}"/sparrow}"
}

step() {  # step NAME LIMIT CMD...
    local name=$1 limit=$2
    shift 2
    if [[ $PLAN == 1 ]]; then
        printf '  %-16s %4s s  %s\n' "$name" "$limit" "$(shown "$@")"
        PLANNED=$((PLANNED + limit))
        return 0
    fi
    local allowed=$limit left
    if ((BUDGET > 0)); then
        left=$((BUDGET - (SECONDS - T0)))
        if ((2 * left < limit)); then
            echo "=== $name: skipped: ${left}s of the ${BUDGET}s budget left, under half its ${limit}s limit"
            SUMMARY+=("$(printf '%-16s %-10s %5s %6s' "$name" skipped - "$limit")")
            return 0
        fi
        ((left < limit)) && allowed=$left
    fi
    local t0=$SECONDS log=$OUT/${LOG:-$name}.log
    local from=$(($(cat "$log" 2>/dev/null | wc -l) + 2))  # this step's lines of a shared log
    echo "=== $name (limit ${allowed}s): $(shown "$@")" | tee -a "$log"
    timeout -k 10 "$allowed" bash -c '"$@"' _ "$@" >>"$log" 2>&1
    local rc=$? status
    case $rc in
        0) status=ok ;;
        124|137) status="cut off"; echo "=== $name: cut off at its ${allowed}s limit" >>"$log" ;;
        *) status="rc=$rc" ;;
    esac
    tail -n "+$from" "$log" | tail -n 25
    SUMMARY+=("$(printf '%-16s %-10s %5s %6s' "$name" "$status" $((SECONDS - t0)) "$allowed")")
    [[ $status == ok ]] || FAILED=1
}

keep() {  # keep SRC NAME: a result file to $OUT
    if [[ $PLAN == 1 ]]; then
        printf '  %-16s %6s  %s -> $OUT/%s\n' "" "" "$1" "$2"
        return 0
    fi
    cp "$1" "$OUT/$2" 2>/dev/null || echo "=== no $1 to keep"
}

summary() {  # summary [FILE]
    [[ $PLAN == 1 ]] && return 0
    local table
    table=$(printf '%-16s %-10s %5s %6s\n' step status s limit; printf '%s\n' "${SUMMARY[@]}")
    echo "=== summary (${SECONDS}s in all)"
    echo "$table"
    if [[ -n ${1:-} ]]; then echo "$table" >"$1"; fi
    return $FAILED
}

need_gpu() {
    [[ $PLAN == 1 ]] && return 0
    if ! nvidia-smi -L >/dev/null 2>&1; then
        echo "$(basename "$0"): no NVIDIA GPU here (nvidia-smi -L failed); run it on a CUDA machine, or with" \
             "PLAN=1 to print its steps" >&2
        exit 2
    fi
    if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        echo "$(basename "$0"): $PY has no torch that sees a CUDA device (set PYTHON to one that has)" >&2
        exit 2
    fi
}
