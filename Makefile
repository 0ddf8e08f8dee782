# The course's two commands, `make demo` and `make test`, work from a fresh clone:
# each creates .venv, installs the pinned requirements and prepares what it needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Prebuilt wheels (torch-scatter, torch-sparse for lesson 4) when this folder exists; else they
# are built from PyPI's sources (16 minutes for the whole `make setup` on 2 cores, measured).
WHEELS := ../shared/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)/*.whl),--find-links $(WHEELS))

.PHONY: setup demo test test-quick notebooks bench gpu-check kaggle minimal figures clean

$(STAMP): requirements.txt requirements-dev.txt requirements-graph.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check \
		-r requirements-dev.txt -c constraints.txt $(FIND_LINKS)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation \
		-r requirements-graph.txt -c constraints.txt $(FIND_LINKS)
	touch $(STAMP)

setup: $(STAMP)  ## virtual environment, packages, offline dataset fallback
	@bash tools/install_system_data.sh

demo: setup  ## the main job: 2-process CPU DDP training of the ConvNet, one epoch
	$(PY) ddp_scripts/mnist_ddp_cpu.py --nprocs 2 --model convnet --epochs 1 --data-dir data

test: setup  ## the whole test suite (what .ci/run runs)
	$(PY) -m pytest

test-quick: setup  ## the test suite without the notebook runs (for development)
	$(PY) -m pytest -m "not slow"

notebooks: setup  ## execute every notebook with papermill into build/notebooks/ (SMOKE=1: tiny runs)
	$(PY) tools/run_notebooks.py $(if $(filter 1,$(SMOKE)),--smoke)

bench: setup  ## measured speed-ups on this machine (prints ratios, writes figures/ and build/bench/)
	$(PY) tools/bench.py
	$(PY) tools/bench_comm.py
	$(PY) tools/bench_gcn.py

gpu-check: setup  ## lessons 3 and 4 on the GPUs present: 1 and 2 GPUs, amp off/bf16/fp16 (a few minutes)
	$(PY) tools/gpu_check.py

kaggle: setup  ## regenerate kaggle/ddp_t4x2.ipynb from ddp_scripts/ (a test fails when it is stale)
	$(PY) tools/build_kaggle_notebook.py

minimal: setup  ## rewrite ddp_scripts/minimal/ from the DDP scripts (a test fails when it is stale)
	$(PY) tools/make_minimal.py --sync-hardening

figures: setup  ## redraw the figures that do not need a benchmark run
	$(PY) tools/draw_data_flow.py
	$(PY) tools/draw_ddp_diagram.py
	$(PY) tools/draw_sampled_batch.py

clean:
	rm -rf build notebooks/output .pytest_cache
