"""What the test modules share: paths, running a script as a user would (a subprocess with a time
limit, or in-process), comparing weights, two torchrun agents standing for two machines, a job
interrupted or killed. Fixtures live in conftest.py."""
import contextlib
import importlib.util
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks"))  # the launcher, the notebooks' helpers: tests use them
from course_helpers import COURSE_MODULES, free_port  # noqa: E402, F401  (free_port: for the tests)
from launcher import Launcher  # noqa: E402

SCRIPTS = REPO / "ddp_scripts"
MODULES = set(COURSE_MODULES)  # what the scripts import; no script
DATA_DIR = REPO / "data"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpu(test):
    """A test that needs CUDA: marked `gpu` (pytest -m gpu runs them on a GPU machine), skipped with
    the reason elsewhere."""
    skip = pytest.mark.skipif(GPUS == 0, reason="no CUDA device on this machine: GPU runs skipped")
    return pytest.mark.gpu(skip(test))


# Offline for urllib (pass as script_env(**OFFLINE)): every download goes to a proxy on a port
# where nothing listens.
OFFLINE = {k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
LIMIT_S = 30  # "within seconds", for a refusal: generous for a loaded 2-core machine, far from a hang


def sampler_missing():
    """Why lesson 4's scripts cannot run here, or None: they need torch_geometric and a neighbour
    sampler for its NeighborLoader, pyg-lib or torch-sparse (a GPU machine's image may have PyG
    without either)."""
    if importlib.util.find_spec("torch_geometric") is None:
        return "torch_geometric is not installed (make graph installs it)"
    if not any(importlib.util.find_spec(name) for name in ("pyg_lib", "torch_sparse")):
        return "PyG's neighbour sampler is not installed: NeighborLoader needs pyg-lib or torch-sparse " \
               "(make graph installs it)"
    return None


def needs_sampler():
    """Skip the calling test where lesson 4's scripts cannot run (sampler_missing() says why)."""
    reason = sampler_missing()
    if reason:
        pytest.skip(reason)


def load_script(name):
    """Import a script from ddp_scripts/ as a module (they are files to copy, not a package)."""
    if str(SCRIPTS) not in sys.path:  # where a script finds the modules it imports, as when run
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launching(module):
    """(worker, check_setup) that a script's main runs: its own, or those of the lesson whose
    launching it runs (lesson 2's or 3's), the worker running the script's own train()."""
    import functools

    base = getattr(module, "lesson3", None) or getattr(module, "lesson2", None)
    if base is None:
        return module.worker, module.check_setup
    check_setup = getattr(module, "check_setup", base.check_setup)
    return functools.partial(base.worker, train=module.train), check_setup


def script_env(**extra):
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)  # each run picks its own free port
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(nprocs):
    """run_script's `launcher` for torchrun with nprocs processes on this machine."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs)]


def run_script(script, *args, timeout=240, env=None, launcher=None, cwd=REPO, fresh=False):
    """Run ddp_scripts/<script> (or under `launcher`, e.g. torchrun) as `python ...` would, and return
    the result (a CompletedProcess). The process is forked from a Python with torch already imported
    (notebooks/launcher.py), which saves each launch 2-3 s; fresh=True (or COURSE_PRELOADED=0 for the
    whole suite) starts a new interpreter instead."""
    command = (launcher or []) + [str(SCRIPTS / script)] + [str(a) for a in args]
    env = env or script_env()
    if fresh or os.environ.get("COURSE_PRELOADED") == "0":
        return subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)
    with PRELOADED.popen(command, env, cwd) as child:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()  # the child and every process it started
            raise subprocess.TimeoutExpired([sys.executable, *command], timeout) from None
        out, err = child.output()
    return subprocess.CompletedProcess([sys.executable, *command], child.returncode, out, err)


PRELOADED = Launcher()


def course_session():
    """The session's defaults, for tests and notebooks alike (both conftest.py files call it): the
    notebooks run in smoke mode, tiny runs, unless COURSE_SMOKE=0 (their kernels inherit this
    environment); every launch (course_helpers.run, run_script) is forked from one Python with
    torch imported already (notebooks/launcher.py), unless COURSE_PRELOADED=0."""
    os.environ.setdefault("COURSE_SMOKE", "1")
    os.environ.setdefault("COURSE_PRELOADED", "1")


def start_preloaded():
    """pytest_sessionstart: one preloaded Python for the whole session, the notebooks' kernels
    included (they find it through COURSE_LAUNCHER)."""
    if os.environ.get("COURSE_PRELOADED") == "1":
        os.environ["COURSE_LAUNCHER"] = PRELOADED.ensure_started()


def kernels_on_unix_sockets():
    """pytest_configure, where notebooks run: nbmake's Jupyter kernels listen on Unix sockets, not on
    TCP ports that another process may take before the kernel binds them (tools/generate/kernels.py
    says how that fails). nbmake builds nbclient's NotebookClient with no way to configure it: its
    module's name for the class is replaced by one whose kernel manager is kernels.py's."""
    import nbclient
    import nbmake.nb_run
    from traitlets import default

    sys.path.insert(0, str(REPO / "tools" / "generate"))
    from kernels import UnixSocketKernelManager

    class CourseNotebookClient(nbclient.NotebookClient):
        @default("kernel_manager_class")
        def _unix_socket_kernels(self):
            return UnixSocketKernelManager

    if nbmake.nb_run.NotebookClient is nbclient.NotebookClient:  # (once in a process)
        nbmake.nb_run.NotebookClient = CourseNotebookClient


# The runs that compare weights (conftest's `trained`): the linear model, 25 steps on unshuffled
# data, nothing random: far enough for a wrong average to show, short.
EQUALITY_FLAGS = ["--model", "linear", "--no-shuffle", "--max-steps", "25", "--quiet"]

# Lesson 5's reference run (the `uninterrupted` fixture) and the runs compared with it.
RESUME_LINEAR = ["--backend", "gloo", "--device", "cpu", "--model", "linear", "--epochs", 3]


def read_metrics(path):
    with open(path) as f:
        return json.load(f)


def max_abs_diff(a, b):
    """The largest absolute difference between two state_dicts, over every weight."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def max_difference(path_a, path_b):
    """max_abs_diff of two saved state_dicts."""
    return max_abs_diff(torch.load(path_a), torch.load(path_b))


def write_idx(path, tensor):
    """Write a uint8 tensor in the IDX format of the MNIST files (magic, sizes, bytes)."""
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, tensor.dim()))
        f.write(struct.pack(f">{tensor.dim()}I", *tensor.shape))
        f.write(tensor.numpy().tobytes())


# --------------------------------------------------------------------------- refusals
def refused(script, *args, env=None, launcher=None):
    """Launch a script as a user would, in a new interpreter: it must refuse in one line on stderr
    (no traceback), with a non-zero exit, within seconds. Returns the line."""
    start = time.monotonic()
    r = run_script(script, *args, env=env, timeout=LIMIT_S + 30, launcher=launcher, fresh=True)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    assert elapsed < LIMIT_S
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error" in lines[0]
    return lines[0]


def refused_in_process(module, argv, monkeypatch=None, gpus=None):
    """A script's command line run in this process (run_main), with nothing spawned (and, with
    `gpus`, that many GPUs faked): it must refuse in one line on stderr, within seconds, with a
    non-zero exit. Returns the line."""
    if monkeypatch is not None:
        if gpus is not None:
            monkeypatch.setattr(module.torch.cuda, "is_available", lambda: gpus > 0)
            monkeypatch.setattr(module.torch.cuda, "device_count", lambda: gpus)
        if hasattr(module, "hardening") or hasattr(module, "mp"):  # it starts processes: none may
            import torch.multiprocessing as mp

            monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned despite the refusal"))
            monkeypatch.setattr(mp, "start_processes",
                                lambda *a, **k: pytest.fail("spawned despite the refusal"))
        elif hasattr(module, "train"):  # a one-process script: no training
            monkeypatch.setattr(module, "train", lambda *a, **k: pytest.fail("trained despite the refusal"))
        monkeypatch.delenv("RANK", raising=False)
    start = time.monotonic()
    stderr = io.StringIO()
    # run_main ends its process through leave() (os._exit): here it raises SystemExit instead
    hardening = sys.modules["ddp_hardening"]  # the module the script imported (load_script's sys.path)
    argv = [str(a) for a in argv]
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(stderr), \
            mock.patch.object(hardening, "leave", sys.exit):
        if hasattr(module, "main") and hasattr(module, "run_main") or hasattr(module, "hardening"):
            hardening.run_main(module.main, module.parse_args, argv)  # its __main__ block's call
        elif hasattr(module, "run_plainly"):  # a by-hand script
            hardening.run_plainly(module.worker, lambda: module.parse_args(argv))
        else:  # a plain script: its __main__ block does this
            try:
                module.main(module.parse_args(argv))
            except hardening.UsageError as err:
                sys.exit(f"{module.__name__}.py: error: {err}")
    assert time.monotonic() - start < 5
    assert exit_info.value.code not in (0, None)
    message = stderr.getvalue().strip() or str(exit_info.value.code)
    assert "\n" not in message and "error" in message, message
    return message


# Kept for the GPU checks' tests: a name they know.
def refused_before_spawn(module, monkeypatch, argv, gpus):
    return refused_in_process(module, argv, monkeypatch, gpus=gpus)


# --------------------------------------------------------------------------- two machines
def two_machines(script, node_args, procs=(1, 1), env=None, timeout=180, torchrun_args=(), c10d=False,
                 envs=None):
    """Start one torchrun agent per entry of node_args (its node rank is its index, under the static
    rendezvous; with c10d=True, the c10d rendezvous hosted by the first, node ranks chosen by torchrun) and
    wait for both. envs: extra environment per machine. Returns [(returncode, stdout + stderr),
    ...] and the seconds until both had ended."""
    port, agents = free_port(), []
    for node, (args, nprocs) in enumerate(zip(node_args, procs)):
        if c10d:
            rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "job"]
        else:
            rendezvous = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        launcher = ["-m", "torch.distributed.run", "--nnodes", "2", *rendezvous,
                    "--nproc-per-node", str(nprocs), *torchrun_args]
        script_args = [SCRIPTS / script, *args] if script else args  # None: args start with a path
        command = [sys.executable, *launcher, *map(str, script_args)]
        machine_env = {**(env or {}), **(envs[node] if envs else {})}
        if os.environ.get("COURSE_PRELOADED") == "0":
            agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, cwd=REPO, env=script_env(**machine_env)))
        else:  # the agent forked from the preloaded Python (its ranks are new interpreters anyway)
            agents.append(PRELOADED.popen(command[1:], script_env(**machine_env), REPO, merge=True))
        if c10d and node == 0:
            time.sleep(1)  # the first machine hosts the rendezvous: let it bind the port first
    start, results = time.monotonic(), []
    try:
        for agent in agents:
            output, _ = agent.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
            results.append((agent.returncode, output))
    finally:
        for agent in agents:
            agent.kill()
    return results, time.monotonic() - start


def assert_one_line_error(results, script, message):
    """Both agents failed; exactly one rank printed the error, with no Python traceback of a rank."""
    assert all(code != 0 for code, _ in results), results
    lines = [line for _, out in results for line in out.splitlines() if line.startswith(f"{script}: error:")]
    assert len(lines) == 1, lines
    assert message in lines[0], lines[0]
    assert not any("]: Traceback" in out for _, out in results), results  # "[rank1]: Traceback"
    return lines[0]


# --------------------------------------------------------------------------- jobs interrupted
JOBS = {
    "mnist_ddp_cpu.py": lambda data: ["--model", "convnet", "--epochs", "1000", *map(str, data)],
    # two sampling workers per rank: forked by the ranks, they must not outlive them
    "gcn_ddp.py": lambda data: ["--device", "cpu", "--dataset", "synthetic", "--num-nodes", "50000",
                                "--epochs", "1000", "--num-workers", "2"],
}


def command_line(process):
    """A process's command line; "" once it has ended, zombie (exited, not yet reaped) or gone."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # psutil.ZombieProcess included
        return ""


def ranks_of(launcher):
    """The launcher's worker processes: its live Python children but multiprocessing's resource
    tracker. Not every child is a rank: importing torch runs `/sbin/ldconfig -p` (cuda-pathfinder's
    ctypes.util.find_library("dl")), a child that is a zombie for a moment after it exits."""
    return [p for p in psutil.Process(launcher.pid).children()
            if "python" in os.path.basename(command_line(p).split(" ")[0])
            and "resource_tracker" not in command_line(p)]


@contextlib.contextmanager
def training_job(script, data, under_torchrun=False, starting=False, start_method=None, args=None,
                 cwd=None):
    """Start a 2-rank job as a terminal would (own session, SIGINT not ignored) and yield
    (launcher, its two ranks, all its processes) once both ranks train, or with starting=True as
    soon as both exist (spawned ones still importing torch). Kills what is left after. The launcher
    is the script itself (mp.spawn), or torchrun. start_method: DDP_START_METHOD (default: the
    script's own choice, fork on a machine without GPUs). script: a name in ddp_scripts/ (its
    flags from JOBS, with `data`, the data flags), or a path with its flags in `args`."""
    if script == "gcn_ddp.py":
        needs_sampler()
    path = str(SCRIPTS / script)
    start = [*torchrun(2), path] if under_torchrun else [path, "--nprocs", "2"]
    launcher = subprocess.Popen(
        [sys.executable, *start, "--timeout", "60", *(args if args is not None else JOBS[script](data))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        env=script_env(**({"DDP_START_METHOD": start_method} if start_method else {})),
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    family = []
    try:
        if starting:
            deadline = time.monotonic() + 60
            while len(ranks_of(launcher)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        else:  # rank 0 announces training once both workers are inside the process group
            header = launcher.stdout.readline()
            assert header.startswith("training"), header + launcher.stderr.read()
            time.sleep(1.5)
        ranks = ranks_of(launcher)
        if len(ranks) != 2 or launcher.poll() is not None:  # say what was there, for a rare failure
            ended = launcher.poll() is not None
            raise AssertionError(f"ranks {[(p.pid, command_line(p)[-60:]) for p in ranks]}, launcher "
                                 + (f"ended with {launcher.returncode}: {launcher.communicate()}" if ended
                                    else "running"))
        family = psutil.Process(launcher.pid).children(recursive=True)
        if script == "gcn_ddp.py":
            assert sum(len(rank.children()) for rank in ranks) >= 4, "the sampling workers did not start"
        yield launcher, ranks, family
    finally:  # a failed check leaves nothing running either
        if launcher.poll() is None:
            launcher.kill()
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def ends_promptly_and_whole(launcher, family, since, tracebacks_allowed=False):
    """tracebacks_allowed: torchrun prints its own when interrupted."""
    _, stderr = launcher.communicate(timeout=60)
    assert time.monotonic() - since < 20
    _, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, f"left behind: {[(p.pid, command_line(p)[:80]) for p in alive]}"
    if not tracebacks_allowed:
        assert "Traceback" not in stderr, stderr
    return stderr


def write_tiny_mnist(data_dir, n_train=96, n_test=40):
    """Learnable fake MNIST files: the label is which quarter of the image is bright."""
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8)
        images = torch.randint(0, 60, (n, 28, 28), generator=g, dtype=torch.uint8)
        for i, label in enumerate(labels.tolist()):
            r, c = divmod(label, 2)
            images[i, 14 * r:14 * r + 14, 14 * c:14 * c + 14] += 180
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
