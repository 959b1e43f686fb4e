# Two commands on a fresh machine: `make train` and `make test`. Both create .venv on first use.
# TORCH_SPEC pins the CPU build found on this project's machines; GPU users override it,
# e.g. `make TORCH_SPEC=torch train`, since pyproject.toml only asks for a range.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
OUTPUT_DIR ?= runs/char_lm
ARGS ?=
BENCH_ARGS ?=

BIN := $(VENV)/bin

# The oldest torch of pyproject.toml's range, which `make test-torch-range` runs the fast suite on
# in a second virtualenv (`make test` runs the newest). PyPI's Linux wheel of it is the CUDA build,
# which needs its nvidia-* libraries even to import on a CPU-only machine: about 5.3 GB in all.
OLDEST_TORCH ?= 2.11.0
OLDEST_VENV ?= .venv-torch$(subst .,,$(basename $(OLDEST_TORCH)))

.PHONY: train test test-torch-range test-gpu test-all soak lint bench clean gpu-wheels gpu-check

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev,hf,lora]'
	touch $@

train: $(BIN)/.installed
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m recipes.char_lm $(OUTPUT_DIR) $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow" --durations=15

$(OLDEST_VENV)/bin/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/pip install --quiet "torch==$(OLDEST_TORCH)"
	$(OLDEST_VENV)/bin/pip install --quiet -e '.[dev,hf,lora]'
	touch $@

test-torch-range: $(OLDEST_VENV)/bin/.installed
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -m "not slow" --durations=15

# The CUDA suite (tests/cuda). Install a CUDA build of torch first: `make TORCH_SPEC=torch test-gpu`.
# -rP shows the figures the tests print (checkpoint GB/s, blocking time).
test-gpu: $(BIN)/.installed
	@cuda=$$($(BIN)/python -c "import torch; print(int(torch.cuda.is_available()))") || exit 1; \
	if [ "$$cuda" = 1 ]; then \
		$(BIN)/python -m pytest -q -rP -m cuda tests/cuda; \
	else \
		echo "test-gpu: no CUDA device here; skipping the CUDA suite."; \
	fi

# The first run on a GPU machine (docs/gpu.md): its own python3 and torch, no network. Fill
# wheels/ here first (`make gpu-wheels`), copy the repo with it, then `make gpu-check` there.
GPU_CHECK_DIR ?= gpu_check_out
gpu-wheels:
	scripts/gpu_wheels.sh

gpu-check:
	scripts/gpu_check.sh $(GPU_CHECK_DIR)

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest -q

# The multi-process tests SOAK_RUNS times in a row, counting aborts at exit (none expected).
SOAK_RUNS ?= 20
soak: $(BIN)/.installed
	PYTHON=$(BIN)/python scripts/soak_distributed.sh $(SOAK_RUNS)

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests recipes benchmarks docs/examples
	$(BIN)/ruff format --check src tests recipes benchmarks docs/examples
	$(BIN)/mypy

# The frameworks the suite compares against come from the `bench` extra.
$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[dev,hf,lora,bench]'
	touch $@

bench: $(BIN)/.bench-installed
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) runs
