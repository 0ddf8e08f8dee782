"""The suite's fixtures, and its tiers. Each folder is a tier, marked as such: unit/ (in-process),
e2e/ (one launched run per contract), cluster/ (several agents, faults, the network lab, Slurm);
the notebooks run as tests too (nbmake), marked `slow` with the cluster tier and the longest e2e
tests. `pytest` runs everything; `make test-quick` leaves out what is marked `slow`."""
import os
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helpers.py, from every tier's folder
from helpers import (  # noqa: E402
    DATA_DIR, EQUALITY_FLAGS, REPO, RESUME_LINEAR, course_session, load_script, start_preloaded)

sys.path.insert(0, str(REPO / "notebooks"))
import course_helpers  # noqa: E402

# The notebooks run as tests too (nbmake, testpaths in pyproject.toml), in smoke mode; a notebook
# fails when a cell raises: its asserts, or course_helpers.run() finding a script failed or ended
# without "done:". The session's defaults and its preloaded Python: helpers.course_session().
course_session()


def pytest_sessionstart(session):
    start_preloaded()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: pytest without it runs the suite too
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core, at most 4. A test keeps about one core busy
    on average (its ranks compute while it waits), so on 2 cores two workers finish the suite in
    about two thirds of the time; more workers than cores would slow every timed wait.
    COURSE_WORKERS=N decides instead (0: no workers, the tests in this process, in order)."""
    chosen = os.environ.get("COURSE_WORKERS")
    if chosen is not None:
        return int(chosen)
    return min(4, len(os.sched_getaffinity(0)))


TIERS = ("unit", "e2e", "cluster")


def pytest_collection_modifyitems(items):
    """Mark each test with its tier; and order them for the workers, which take whole files in this
    order (--dist loadfile): the notebooks (the longest files) first, the unit tier last, so that
    no worker is left with a long file while the other has finished."""
    order = {"notebooks": 0, "cluster": 1, "e2e": 2, "unit": 3}

    def place(item):
        parts = item.path.relative_to(item.config.rootpath).parts
        return order.get(parts[0], order.get(parts[1] if len(parts) > 1 else "", 2))

    items.sort(key=place)  # stable: within a tier, the files' own order
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
            item.add_marker(pytest.mark.slow)
            continue
        tier = next((t for t in TIERS if t in item.path.parts), None)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "cluster":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def fresh_urllib_opener():
    """urllib.request.urlopen builds one opener on its first call in a process, with the proxies of
    that moment, and keeps it: a test that sets OFFLINE's proxies (monkeypatch.setenv) and reaches a
    download would send every later request in this worker to 127.0.0.1:9. Forgotten after each test."""
    yield
    urllib.request.install_opener(None)


@pytest.fixture(scope="session")
def dataset():
    """Prepare the data once (MNIST if present or downloadable, else Fashion-MNIST)."""
    return load_script("mnist_single").prepare_data("auto", str(DATA_DIR), verbose=False)


@pytest.fixture(scope="session")
def data_args(dataset):
    """The data flags of most runs: the first 6,000 training and 1,000 test images of the dataset,
    in its own files and layout (data/smoke, as the notebooks' smoke mode uses): every run loads
    and scores a tenth of the data."""
    return ["--dataset", dataset, "--data-dir", course_helpers.small_copy(dataset, DATA_DIR / "smoke")]


@pytest.fixture(scope="session")
def full_data_args(dataset):
    """The whole dataset, for the tests that are about it."""
    return ["--dataset", dataset, "--data-dir", DATA_DIR]


@pytest.fixture
def blocker(tmp_path):
    """A file where a folder would have to be created: no folder can be made below it (even as root)."""
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


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


@pytest.fixture
def in_process_rank(monkeypatch):
    """The environment of a script's worker run in this process as a one-rank job (worker(0, 1,
    args)): a free port, no torchrun variables; the thread count restored afterwards."""
    import torch
    from helpers import free_port

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, data_args):
    """trained(script, *flags, env=None, fresh=False) -> the state_dict that `script` saves after
    the steps of helpers.EQUALITY_FLAGS (the linear model, unshuffled data, nothing random): the
    runs that compare weights. Each distinct command runs once per session (per worker), whichever
    tests ask for it. fresh: in a new interpreter, its ranks too (helpers.run_script)."""
    import torch
    from helpers import run_script, script_env

    folder, cache = tmp_path_factory.mktemp("trained"), {}

    def train(script, *flags, env=None, fresh=False):
        key = (script, tuple(map(str, flags)), tuple(sorted((env or {}).items())), fresh)
        if key not in cache:
            path = folder / f"run{len(cache)}.pt"
            r = run_script(script, *EQUALITY_FLAGS, "--save", path, *flags, *data_args,
                           env=script_env(**env) if env else None, fresh=fresh)
            assert r.returncode == 0, r.stderr
            cache[key] = torch.load(path)
        return cache[key]

    return train


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, data_args):
    """Lesson 5's reference: the linear model trained 3 epochs by 2 spawned processes, never
    interrupted (RESUME_LINEAR). Its snapshot folder starts with .part files as earlier writers
    would have left them (test_a_part_left_by_a_killed_writer_is_removed). Returns its weights'
    path; its snapshot is s.pt beside it."""
    import socket
    import subprocess

    from helpers import read_metrics, run_script

    folder = tmp_path_factory.mktemp("uninterrupted")
    ended = subprocess.Popen(["true"])  # a process that has ended: its id names a dead writer
    ended.wait()
    host = socket.gethostname()
    for name in (f"s.pt.{host}.{ended.pid}.part", f"s.pt.{host}.{os.getpid()}.part",
                 f"s.pt.elsewhere.{ended.pid}.part"):
        (folder / name).write_bytes(b"half a snapshot")
    r = run_script("mnist_ddp_resume.py", *RESUME_LINEAR, *data_args, "--nprocs", 2, "--snapshot",
                   folder / "s.pt", "--save", folder / "w.pt", "--metrics-json", folder / "m.json")
    assert r.returncode == 0, r.stderr
    assert read_metrics(folder / "m.json")["resumed_after_epoch"] == 0
    return folder / "w.pt"
