# mpidp developer Makefile.
#
#   make, make venv          .venv with torch (CPU pin) first, then dev deps, then `pip install -e .`
#   make test                unit, mpi at NPS world sizes, variants (gloo, hierarchical, TCP),
#                            then integration; summary at the end
#   make test-unit | test-mpi | test-variants | test-integration
#   make run                 2-rank demo: mpiexec -n 2 python examples/train.py
#   make bench               benchmarks/allreduce.py at np=2
#   make chaos               100 trials of one fault each (kill, term, raise, datapath, stall,
#                            full disk, corrupt checkpoint) at 3-4 ranks; a table (CHAOS_TRIALS=N)
#   make chaos-hosts         the same across the two hosts of the multi-host test cluster (root)
#   make gpu-check           on a GPU machine: what is found, the device-parametrized MPI tests on
#                            CUDA tensors per data path at n=1 and 2, examples/train.py on cuda,
#                            benchmarks/cuda_paths.py; one table (without a GPU: says so, exit 0).
#                            Runs under GPU_PYTHON (default: .venv's python if there, else python3,
#                            e.g. a GPU image's own torch), no venv needed
#   make gpu-wheels          what gpu-check brings where nothing can be downloaded (the pytest-mpi
#                            and mpich wheels, the example's digits) into .whl/ (WHL=dir), to
#                            carry to the GPU machine with the checkout
#   make clean | distclean   build junk | build junk and .venv
#
# Overrides: NPS="2 3" (mpi-stage sizes), RUN_NP, BENCH_NP, PYTHON (interpreter that makes the venv).

SHELL := /bin/bash
.DEFAULT_GOAL := venv

VENV   ?= .venv
PYTHON ?= python3
NPS    ?= 1 2 3 4
RUN_NP ?= 2
BENCH_NP ?= 2
RUN_TIMEOUT ?= 300
BENCH_TIMEOUT ?= 600

# The venv's bin/ first in PATH for every recipe, so `python`, `pytest` and `mpiexec` are the
# venv's (mpiexec = the mpich wheel's hydra).
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export NPS

# The stamp's name records whether mpidp/__init__.py existed at install time, so an editable
# install made before the package existed is redone once it appears.
STAMP := $(VENV)/.installed$(if $(wildcard mpidp/__init__.py),,-nopkg)
PIP   := $(BIN)/python -m pip

.PHONY: venv test test-unit test-mpi test-variants test-integration run bench chaos chaos-hosts gpu-check gpu-wheels clean \
	distclean

venv: $(STAMP)

# Re-runs only when the stamp is missing (fresh or deleted venv) or a packaging file changed.
$(STAMP): setup.cfg pyproject.toml requirements-torch.txt requirements-dev.txt
	@if [ ! -x "$(BIN)/python" ]; then \
		echo "creating $(VENV) with $(PYTHON) ($$($(PYTHON) -V 2>&1))"; \
		$(PYTHON) -m venv "$(VENV)"; \
	fi
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-torch.txt
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q -e .
	@rm -f "$(VENV)"/.installed*
	@touch "$@"

test: $(STAMP)
	bash tests/run_suite.sh unit mpi variants integration

test-unit: $(STAMP)
	bash tests/run_suite.sh unit

test-mpi: $(STAMP)
	bash tests/run_suite.sh mpi

test-variants: $(STAMP)
	bash tests/run_suite.sh variants

test-integration: $(STAMP)
	bash tests/run_suite.sh integration

run: $(STAMP)
	timeout -k 30 $(RUN_TIMEOUT) $(BIN)/mpiexec -n $(RUN_NP) $(BIN)/python examples/train.py

CHAOS_TRIALS ?= 100
chaos: $(STAMP)
	$(BIN)/python -m tests.integration.chaos --trials $(CHAOS_TRIALS)

chaos-hosts: $(STAMP)
	$(BIN)/python -m tests.integration.chaos --hosts 2 --trials $(CHAOS_TRIALS)

bench: $(STAMP)
	timeout -k 30 $(BENCH_TIMEOUT) $(BIN)/mpiexec -n $(BENCH_NP) $(BIN)/python benchmarks/allreduce.py

GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=

gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py $(GPU_CHECK_ARGS)

# Pure Python and manylinux wheels: the same files serve the GPU image's Python 3.12. The image
# has no scikit-learn: the example's digits go along as an .npz (integers 0-16, exact as uint8).
WHL ?= .whl
gpu-wheels: $(STAMP)
	$(PIP) download -q --no-deps -d "$(WHL)" pytest-mpi mpich
	$(BIN)/python -c "import numpy as np, sklearn.datasets as d; x = d.load_digits(); \
	np.savez_compressed('$(WHL)/digits.npz', images=x.images.astype(np.uint8), target=x.target)"

clean:
	rm -rf build dist .eggs *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf "$(VENV)"
