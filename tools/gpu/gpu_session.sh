#!/usr/bin/env bash
# The course's GPU checks on an offline GPU machine that starts bare (docs/MAINTAINERS.md, "GPU
# checks"), in one run:
#
#   bash tools/gpu/gpu_session.sh prepare   # on a set-up machine: the data, PyG's sampler sources in .device/
#   bash tools/gpu/gpu_session.sh run       # on the GPU machine, with data/ and .device/ copied beside it
#
# `run` takes the machine's Python as it is (PY=..., default python3): torch, PyG, pytest, psutil
# and matplotlib are all it needs; nbmake, pytest-xdist, papermill, ogb, pyg-lib and torch-sparse
# may be missing. Where neither pyg-lib nor torch-sparse can be imported, it first builds
# torch-scatter and torch-sparse from .device/ (CPU-only: the sampler runs on the CPU), both at once
# on every core, before anything else runs (built beside the tests, the build took minutes longer);
# then lessons 5, 6, 9 and 10's GPU checks, lesson 4's GPU tests and tools/gpu/gpu_check.py --lesson 4,
# then notebook 03's code cells. About 8 minutes on a 16-core machine with one GPU. Logs go to $OUT
# when it is set, else build/gpu-session. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}

case "${1:-}" in
prepare)
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >>.git/info/exclude
    mkdir -p .device
    # Sources, not wheels: no wheel here fits the GPU machine's Python and torch. Their metadata step
    # imports torch, hence the venv's Python without build isolation.
    .venv/bin/python -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: \
        -d .device torch-scatter torch-sparse || exit 1
    .venv/bin/python -c "import sys; sys.path.insert(0, 'ddp_scripts'); import mnist_parts; \
print('dataset in data/:', mnist_parts.prepare_data('auto', 'data', verbose=False))" || exit 1
    du -sh .device data
    echo 'next: copy .device/ and data/ to the GPU machine and run "bash tools/gpu/gpu_session.sh run" there'
    ;;
run)
    out=${OUT:-build/gpu-session}
    mkdir -p "$out"
    failed=()
    # pytest as the machine has it: none of pyproject.toml's options (--nbmake, -n auto need plugins
    # that such an image lacks); -p no:cacheprovider writes nothing into the tree.
    pytest=($PY -m pytest -o addopts= -q -rs -p no:cacheprovider)
    have_sampler='import sys, torch_geometric.typing as t; sys.exit(not (t.WITH_PYG_LIB or t.WITH_TORCH_SPARSE))'
    if ! $PY -c "$have_sampler" 2>/dev/null; then
        cores=$(nproc)
        echo "== $(date +%T) building torch-scatter and torch-sparse from .device/ (CPU-only), $cores cores"
        # Each package is a dozen small extensions, which setuptools builds one after the other,
        # ninja (if present) two files at a time. Build each package's extensions in parallel
        # instead (setuptools' build_ext --parallel, set through DIST_EXTRA_CONFIG), half the cores
        # each, with torch's plain compiler backend: a ninja that fails its version check makes
        # torch fall back to it (parallel ninja builds would share one build.ninja).
        mkdir -p /tmp/no-ninja
        printf '#!/bin/sh\nexit 1\n' >/tmp/no-ninja/ninja
        chmod +x /tmp/no-ninja/ninja
        printf '[build_ext]\nparallel = %d\n' $(((cores + 1) / 2)) >/tmp/build-parallel.cfg
        builds=()
        for sdist in .device/torch_scatter-*.tar.gz .device/torch_sparse-*.tar.gz; do
            name=$(basename "$sdist" .tar.gz)
            PATH=/tmp/no-ninja:$PATH DIST_EXTRA_CONFIG=/tmp/build-parallel.cfg FORCE_ONLY_CPU=1 \
                $PY -m pip install --no-deps --no-build-isolation --no-index --no-cache-dir \
                --target "/tmp/site-$name" "$sdist" >"$out/build-$name.log" 2>&1 &
            builds+=($!)
        done
        wait "${builds[@]}"
        for site in /tmp/site-*; do PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}; done
        export PYTHONPATH
        echo "== $(date +%T) sampler built"
    fi
    # Lesson 3's GPU tests (tests/e2e/test_gpu_script.py) have passed on a GPU before and are left
    # out, to keep the run short.
    echo "== $(date +%T) lesson 5 on the GPU (a crash, a torchrun restart, the resumed weights)"
    PYTHONUNBUFFERED=1 timeout 150 "${pytest[@]}" -s tests/e2e/test_resume.py -k gpus \
        2>&1 | tee "$out/pytest-resume.log" || failed+=(pytest-resume)
    echo "== $(date +%T) lesson 6 on the GPU (NCCL, accumulation, bf16 gradients)"
    PYTHONUNBUFFERED=1 timeout 90 "${pytest[@]}" tests/e2e/test_comm.py -k gpus \
        2>&1 | tee "$out/pytest-comm.log" || failed+=(pytest-comm)
    echo "== $(date +%T) synchronisations per GPU step, counted by the profiler (lessons 3, 5, 6)"
    PYTHONUNBUFFERED=1 timeout 120 "${pytest[@]}" tests/unit/test_gpu_checks.py \
        -k synchronisations 2>&1 | tee "$out/pytest-syncs.log" || failed+=(pytest-syncs)
    echo "== $(date +%T) sharding on one GPU (NCCL, CUDA's peak memory), FSDP then ZeRO"
    for shard in fsdp zero; do
        PYTHONUNBUFFERED=1 timeout 120 $PY ddp_scripts/mnist_fsdp.py --shard $shard --max-steps 50 \
            --metrics-json "$out/fsdp-$shard.json" 2>&1 | tee "$out/fsdp-$shard.log" || failed+=(fsdp-$shard)
    done
    echo "== $(date +%T) lesson 9's by-hand classes on CUDA tensors with NCCL, against DDP"
    PYTHONUNBUFFERED=1 timeout 150 "${pytest[@]}" tests/e2e/test_by_hand.py -k gpus \
        2>&1 | tee "$out/pytest-by-hand.log" || failed+=(pytest-by-hand)
    echo "== $(date +%T) lesson 12's BatchNorm by hand against torch's SyncBatchNorm (two Gloo ranks, one GPU)"
    PYTHONUNBUFFERED=1 timeout 90 "${pytest[@]}" tests/e2e/test_practice.py -k syncbatchnorm_on_a_gpu \
        2>&1 | tee "$out/pytest-syncbn.log" || failed+=(pytest-syncbn)
    echo "== $(date +%T) --profile on the GPU: a trace with NCCL's all-reduces (lessons 6 and 9)"
    PYTHONUNBUFFERED=1 timeout 90 $PY ddp_scripts/mnist_ddp_comm.py --model mlp --max-steps 6 --quiet \
        --profile "$out/trace-gpu" 2>&1 | tee "$out/profile-gpu.log" || failed+=(profile-gpu)
    $PY -c "import json, sys; names = {e.get('name', '') for e in json.load(open(sys.argv[1]))['traceEvents']}; \
nccl = sorted(n for n in names if 'nccl' in n.lower()); print('NCCL events in the trace:', nccl[:8]); \
sys.exit(not nccl)" "$out/trace-gpu/rank0.json" || failed+=(profile-gpu-trace)
    # Lesson 4 needs the sampler. Time limits keep the whole run within about 10 minutes.
    if $PY -c "$have_sampler"; then
        echo "== $(date +%T) GPU tests (lesson 4)"
        PYTHONUNBUFFERED=1 timeout 200 "${pytest[@]}" tests/e2e/test_gcn.py -k nccl_on_gpus \
            2>&1 | tee "$out/pytest-gcn.log" || failed+=(pytest-gcn)
        echo "== $(date +%T) tools/gpu/gpu_check.py --lesson 4"
        PYTHONUNBUFFERED=1 timeout 200 $PY tools/gpu/gpu_check.py --lesson 4 2>&1 | tee "$out/gpu_check.log" \
            || failed+=(gpu_check)
    else
        failed+=(sampler-build)
        tail -n 5 "$out"/build-*.log
    fi
    # Last: notebook 03's cells (they have passed on a GPU before), so that they cannot delay the rest.
    echo "== $(date +%T) notebook 03, code cells in plain Python"
    PYTHONUNBUFFERED=1 timeout 200 $PY tools/generate/run_notebook_plain.py notebooks/03_ddp_gpu_nccl.ipynb \
        2>&1 | tee "$out/notebook03.log" || failed+=(notebook03)
    if ((${#failed[@]})); then
        echo "gpu-session: failed: ${failed[*]} (logs in $out)"
        exit 1
    fi
    echo "gpu-session: $(date +%T) all passed (logs in $out)"
    ;;
*)
    echo "usage: bash tools/gpu/gpu_session.sh prepare|run" >&2
    exit 2
    ;;
esac
