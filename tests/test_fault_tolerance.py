"""A worker that dies takes the whole job down promptly, with a clear message and no orphans
(sampling worker processes of the GCN's ranks included)."""
import contextlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import DATA_DIR, SCRIPTS, script_env

JOBS = {
    "mnist_ddp_cpu.py": lambda dataset: ["--model", "convnet", "--max-steps", "100000", "--dataset", dataset,
                                         "--data-dir", str(DATA_DIR)],
    # two sampling workers per rank: forked by the ranks, they must not outlive them
    "gcn_ddp.py": lambda dataset: ["--device", "cpu", "--dataset", "synthetic", "--num-nodes", "50000",
                                   "--epochs", "1000", "--num-workers", "2"],
}


@pytest.mark.parametrize("script", sorted(JOBS))
def test_killed_worker_stops_the_job(script, dataset):
    if script == "gcn_ddp.py":
        pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
    launcher = subprocess.Popen(
        [sys.executable, str(SCRIPTS / script), "--nprocs", "2", "--timeout", "60", *JOBS[script](dataset)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=script_env())
    family = []
    try:
        # Wait until rank 0 announces training: both workers are inside the process group.
        header = launcher.stdout.readline()
        assert header.startswith("training"), header + launcher.stderr.read()
        time.sleep(3)
        ranks = [p for p in psutil.Process(launcher.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        family = psutil.Process(launcher.pid).children(recursive=True)
        if script == "gcn_ddp.py":
            assert sum(len(rank.children()) for rank in ranks) >= 4, "the sampling workers did not start"
        ranks[-1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 20
        assert launcher.returncode != 0
        assert "ended with signal SIGKILL" in stderr and "other workers were stopped" in stderr
        assert "Traceback" not in stderr
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"left behind: {[(p.pid, ' '.join(p.cmdline())[:80]) for p in alive]}"
    finally:  # a failed check leaves nothing running either
        if launcher.poll() is None:
            launcher.kill()
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
