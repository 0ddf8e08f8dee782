# The course's commands work from a fresh clone: each creates .venv and installs what it needs,
# in layers: `make demo` only what every lesson but lesson 4 needs; `make graph` adds PyG for lesson 4;
# `make test` everything. `make help` lists the targets.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed-base
DEV    := $(VENV)/.installed-dev
GRAPH  := $(VENV)/.installed-graph
LIBS   := $(VENV)/.installed-libraries
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# TORCH_INDEX=https://download.pytorch.org/whl/cpu: torch and torchvision from that wheel index first
# (PyTorch's CPU build, without the CUDA libraries), then the rest from PyPI. Empty: all from PyPI.
TORCH_INDEX ?=

.PHONY: help setup base graph data demo test test-quick lab notebooks pages bench gpu-check kaggle \
	figures study-times times netlab-up netlab-down clean
.DEFAULT_GOAL := help

$(BASE): requirements.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch and the lessons' packages into $(VENV) (a few minutes the first time) ..."
	$(if $(TORCH_INDEX),$(PIP) torch torchvision --index-url $(TORCH_INDEX))
	$(PIP) -r requirements.txt
	touch $(BASE)

$(DEV): $(BASE) requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $(DEV)

# Accelerate and Fabric, for docs/LIBRARIES.md's examples (optional: their tests skip without them).
$(LIBS): $(BASE) requirements-libraries.txt
	$(PIP) -r requirements-libraries.txt
	touch $(LIBS)

# PyG's sampler: prebuilt wheels from ../shared/wheels, else PyG's index, else compiled (announced).
$(GRAPH): $(BASE) requirements-graph.txt tools/setup/install_graph.py
	$(PY) tools/setup/install_graph.py
	touch $(GRAPH)

##@ The course
demo: $(BASE) data  ## the main job: 2-process CPU DDP training of the ConvNet, one epoch
	$(PY) ddp_scripts/mnist_ddp_cpu.py --nprocs 2 --model convnet --epochs 1 --data-dir data

# JupyterLab on the repository, opened at notebooks/: the lessons' links and figures point into
# ../ddp_scripts, ../figures, ..., which a server rooted at notebooks/ would not serve. Its kernel
# is the environment's own Python: the kernelspec "python3" is written into .venv with this
# interpreter's absolute path, and .venv's Jupyter folder goes first on JUPYTER_PATH, so that a
# "python3" kernelspec in the user's own folders (another Python) does not take its place. As root,
# Jupyter refuses to start without --allow-root: added only then.
# LAB_PORT=... picks the port (default 8888), LAB_FLAGS=... adds Jupyter's own options (e.g.
# --no-browser on a remote machine).
lab: $(BASE) $(DEV) data  ## open the course in JupyterLab (the notebooks, with this environment as kernel)
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course .venv)" >/dev/null
	JUPYTER_PATH="$(CURDIR)/$(VENV)/share/jupyter$${JUPYTER_PATH:+:$$JUPYTER_PATH}" \
		$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/notebooks \
		$(if $(LAB_PORT),--port=$(LAB_PORT)) \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS)

graph: $(GRAPH)  ## PyG and its neighbour sampler, for lesson 4

notebooks: setup  ## execute every notebook with papermill into build/notebooks/ (SMOKE=1: tiny runs)
	$(PY) tools/generate/run_notebooks.py $(if $(filter 1,$(SMOKE)),--smoke)

pages: setup  ## run every lesson and solution in full, render each with its outputs in docs/lessons/ (31 min on 2 cores; NB=05: those named)
	$(PY) tools/generate/render_lessons.py $(NB)

##@ Checks and measurements
test: setup  ## the whole test suite and every notebook (what CI runs)
	$(PY) -m pytest

test-quick: setup  ## the suite without the notebooks and the multi-process cluster tests (for development)
	$(PY) -m pytest -m "not slow and not cluster"

bench: setup  ## measure on this machine, each benchmark in turn (BENCH="gcn cpu": only those; ratios, figures/, build/bench/)
	$(PY) tools/bench/bench_all.py $(BENCH)

gpu-check: setup  ## lessons 3 and 4 on the GPUs present: 1 and 2 GPUs, amp off/bf16/fp16 (a few minutes)
	$(PY) tools/gpu/gpu_check.py

# Two machines on this one (root only, standard library): network namespaces host0 and host1
# (10.77.0.1, 10.77.0.2), each with its own hostname; `python3 tools/lab/netlab.py run host0 -- CMD`.
netlab-up:  ## two lab hosts joined by one link (RATE=1gbit caps its bandwidth; root only)
	$(PYTHON) tools/lab/netlab.py up $(if $(RATE),--rate $(RATE))

netlab-down:  ## remove the lab and every process still running in it
	$(PYTHON) tools/lab/netlab.py down

##@ Set-up
setup: $(BASE) $(DEV) $(GRAPH) $(LIBS) data  ## everything: virtual environment, packages, offline dataset, test browser
	@bash tools/setup/install_browser.sh

base: $(BASE)  ## torch and what the lessons need (what `make demo` installs)

data:  ## the offline dataset fallback (Debian's Fashion-MNIST, where apt-get runs as root)
	@bash tools/setup/install_system_data.sh

clean:  ## remove what the runs wrote (build/, notebooks/output/, caches)
	rm -rf build notebooks/output .pytest_cache

##@ Maintainers: regenerate what is generated (a test fails when one is stale)

kaggle: $(DEV)  ## rewrite kaggle/ddp_t4x2.ipynb from ddp_scripts/
	$(PY) tools/generate/build_kaggle_notebook.py

figures: $(BASE)  ## redraw the figures that need no benchmark run (the GCN batch needs `make graph`)
	$(PY) tools/figures/draw_data_flow.py
	$(PY) tools/figures/draw_ddp_diagram.py
	$(PY) tools/figures/draw_sampled_batch.py
	$(PY) tools/figures/draw_sharding.py
	$(PY) tools/figures/draw_parallelisms.py
	$(PY) tools/figures/draw_inside_results.py
	$(PY) tools/figures/draw_planner_checks.py

study-times: $(DEV)  ## rewrite each lesson's study-time estimate (and the README's) from its words and exercises
	$(PY) tools/generate/study_time.py --write

times: $(DEV)  ## rewrite each lesson's compute times (page, README) from its rendered run and docs/measured/smoke_times.json
	$(PY) tools/generate/compute_times.py --write

help:  ## this list
	@awk 'BEGIN {FS = ":.*## "} /^##@/ {printf "\n%s\n", substr($$0, 5)} \
		/^[a-z][a-z-]*:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
