"""A worker that dies takes the whole job down promptly, with a clear message and no orphans."""
import signal
import subprocess
import sys
import time

import psutil
from conftest import DATA_DIR, SCRIPTS, script_env


def test_killed_worker_stops_the_job(dataset):
    launcher = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "mnist_ddp_cpu.py"), "--nprocs", "2", "--model", "convnet",
         "--max-steps", "100000", "--dataset", dataset, "--data-dir", str(DATA_DIR), "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=script_env())
    try:
        # Wait until rank 0 announces training: both workers are inside the process group.
        header = launcher.stdout.readline()
        assert header.startswith("training"), header + launcher.stderr.read()
        time.sleep(2)
        family = psutil.Process(launcher.pid).children(recursive=True)
        workers = [p for p in family if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[-1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 20
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "ended with signal SIGKILL" in stderr and "other workers were stopped" in stderr
    assert "Traceback" not in stderr
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"left behind: {alive}"
