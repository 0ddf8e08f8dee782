"""How the scripts start their workers (the hardening's spawn_workers): forked where that is safe,
which saves each worker the seconds of importing torch again, spawned (as plain mp.spawn does)
where it is not. The whole-job behaviour under both is in test_fault_tolerance.py and
test_equivalence.py; these check the choice itself, each in a fresh interpreter."""
import json
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS

pytestmark = pytest.mark.slow  # left out of make test-quick

CHOICE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import mnist_ddp_cpu as script
import torch
seen = {"fresh": script.hardening.start_method()}
torch.set_num_threads(2)
x = torch.randn(1000, 1000)
x @ x  # OpenMP starts its threads for this product and keeps them
seen["after a parallel product"] = script.hardening.start_method()
for chosen in ("spawn", "forkserver", "fork", "threads"):
    os.environ["DDP_START_METHOD"] = chosen
    try:
        seen[chosen] = script.hardening.start_method()
    except script.hardening.UsageError as err:
        seen[chosen] = f"error: {err}"
print(json.dumps(seen))
"""

HANG_AFTER_FORK = """
import multiprocessing, sys, torch
torch.set_num_threads(2)
x = torch.randn(1000, 1000)
x @ x
def product():
    torch.set_num_threads(2)
    y = torch.randn(1000, 1000)
    y @ y
child = multiprocessing.get_context("fork").Process(target=product)
child.start()
child.join(8)  # the product takes milliseconds: still running after 8 s is a hang
print("hung" if child.is_alive() else "finished")
child.kill()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is chosen on Linux only")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the scripts always spawn")
def test_fork_only_while_no_thread_has_started():
    r = subprocess.run([sys.executable, "-c", CHOICE, str(SCRIPTS)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["fresh"] == "fork"
    assert seen["after a parallel product"] == "spawn"
    assert (seen["spawn"], seen["forkserver"], seen["fork"]) == ("spawn", "forkserver", "fork")
    assert seen["threads"].startswith("error: DDP_START_METHOD=threads is not one of")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the hazard shown is Linux's libgomp")
def test_why_a_parallel_product_rules_fork_out():
    """The hazard the choice avoids, shown: a child forked after OpenMP has started its threads in
    the parent hangs at its own first parallel operation (the scripts' GCN launcher computes on
    the graph before it starts the ranks, so it spawns them)."""
    r = subprocess.run([sys.executable, "-c", HANG_AFTER_FORK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hung"


@pytest.mark.slow
def test_the_start_up_benchmark_runs_and_reports_every_row(tmp_path, dataset):
    """tools/bench/bench_startup.py (make bench) once per row: it measures, it does not judge."""
    from helpers import DATA_DIR, REPO

    out = tmp_path / "startup.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_startup.py"), "--repeats", "1",
                        "--data-dir", str(DATA_DIR), "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["name"] for row in rows][1:] == ["the script, as it starts ranks",
                                                 "the script, spawned ranks"]
    assert all(row["seconds"] > 0 for row in rows) and "vs the script" in r.stdout
