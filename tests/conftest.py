"""Shared helpers: paths, running a script as a user would (a subprocess with a time limit),
and the dataset prepared once for the whole session."""
import contextlib
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "ddp_scripts"
DATA_DIR = REPO / "data"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA device on this machine: GPU runs skipped")

# The notebooks run as tests too (nbmake, testpaths in pyproject.toml): in smoke mode, tiny runs,
# unless COURSE_SMOKE=0 is set (the kernels inherit this environment). A notebook fails when a cell
# raises: its asserts, or course_helpers.run() finding a script failed or ended without "done:".
os.environ.setdefault("COURSE_SMOKE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)  # make test-quick leaves the notebooks out


# Offline for urllib (pass as script_env(**OFFLINE)): every download goes to a proxy on a port
# where nothing listens.
OFFLINE = {k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}


def load_script(name):
    """Import a script from ddp_scripts/ as a module (they are files to copy, not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env(**extra):
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)  # each run picks its own free port
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(nprocs):
    """run_script's `launcher` for torchrun with nprocs processes on this machine."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs)]


def run_script(script, *args, timeout=240, env=None, launcher=None):
    """Run ddp_scripts/<script> (or under `launcher`, e.g. torchrun) and return the result."""
    command = [sys.executable] + (launcher or []) + [str(SCRIPTS / script)] + [str(a) for a in args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=env or script_env(), cwd=REPO)


def refused_before_spawn(module, monkeypatch, argv, gpus):
    """Run a script's command line in-process with `gpus` faked GPUs: it must refuse in one line
    on stderr, within seconds, before anything is spawned. Returns the line."""
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(module.mp, "spawn", lambda *a, **k: pytest.fail("spawned despite the refusal"))
    monkeypatch.delenv("RANK", raising=False)
    start = time.monotonic()
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(stderr):
        module.run_main(argv)
    assert time.monotonic() - start < 5
    assert exit_info.value.code not in (0, None)
    message = stderr.getvalue().strip()
    assert "\n" not in message and "error" in message
    return message


def read_metrics(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def blocker(tmp_path):
    """A file where a folder would have to be created: no folder can be made below it (even as root)."""
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


@pytest.fixture(scope="session")
def dataset():
    """Prepare the data once (MNIST if present or downloadable, else Fashion-MNIST)."""
    return load_script("mnist_single").prepare_data("auto", str(DATA_DIR), verbose=False)


@pytest.fixture(scope="session")
def data_args(dataset):
    return ["--dataset", dataset, "--data-dir", DATA_DIR]


def write_idx(path, tensor):
    """Write a uint8 tensor in the IDX format of the MNIST files (magic, sizes, bytes)."""
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, tensor.dim()))
        f.write(struct.pack(f">{tensor.dim()}I", *tensor.shape))
        f.write(tensor.numpy().tobytes())


@pytest.fixture(scope="session")
def small_data_args(dataset, tmp_path_factory):
    """The first 6,000 training and 1,000 test images of the dataset, in its own files' format and
    layout: for tests that need whole epochs, at a tenth of the cost."""
    single = load_script("mnist_single")
    folder = tmp_path_factory.mktemp("small-data")
    raw = Path(single.raw_dir(dataset, str(folder)))
    raw.mkdir(parents=True)
    source = Path(single.raw_dir(dataset, str(DATA_DIR)))
    for name, count in (("train", 6000), ("t10k", 1000)):
        for kind in ("images-idx3", "labels-idx1"):
            values = single.read_idx(str(source / f"{name}-{kind}-ubyte"))
            write_idx(raw / f"{name}-{kind}-ubyte", values[:count])
    return ["--dataset", dataset, "--data-dir", folder]


@pytest.fixture
def one_rank_group():
    """A Gloo process group of one rank in this process, for calling a script's collectives
    in-process; destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
