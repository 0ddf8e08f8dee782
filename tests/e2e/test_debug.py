"""Lesson 8: the debugging aids find what they are for. The watchdog shows where every rank is when
one stalls (the stuck one outside the collectives, the others waiting in DDP's all-reduce); the
replica check stops a job whose ranks' weights have drifted apart, which otherwise ends as if all
were well."""
import time

import pytest
from helpers import read_metrics, run_script

SCRIPT = "mnist_ddp_debug.py"
QUICK = ["--model", "linear", "--max-steps", 30, "--nprocs", 2]


def test_a_healthy_run_passes_its_checks_quietly(tmp_path, data_args):
    out = tmp_path / "m.json"
    r = run_script(SCRIPT, *QUICK, "--check-sync-every", 10, "--watchdog", 30, "--metrics-json", out,
                   *data_args)
    assert r.returncode == 0, r.stderr
    assert "replicas compared 3 times (every 10 steps): equal" in r.stdout
    assert "watchdog" not in r.stderr
    assert read_metrics(out)["replica_checks"] == 3


def test_a_rank_that_changes_its_own_weights_is_caught_at_the_next_check(tmp_path, data_args):
    start = time.monotonic()
    r = run_script(SCRIPT, *QUICK, "--bug", "diverge", "--bug-step", 10, "--check-sync-every", 5,
                   *data_args)
    assert r.returncode == 1 and time.monotonic() - start < 60
    assert r.stderr.splitlines() == [  # one line, from rank 0; the launcher adds nothing
        f"{SCRIPT}: error: the replicas differ after step 10: 1.weight is not the same on ranks 0 and 1 "
        f"(something changed one rank's copy outside DDP: a load, an update or a random draw on some "
        f"ranks only)"]
    assert "done:" not in r.stdout


def test_without_the_check_the_same_mistake_goes_unnoticed(tmp_path, data_args):
    """The control: why the check exists. Training ends 'successfully' with ranks that disagree."""
    r = run_script(SCRIPT, *QUICK, "--bug", "diverge", "--bug-step", 10, "--check-sync-every", 0,
                   *data_args)
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout and "error" not in r.stderr


@pytest.mark.slow  # it waits out a watchdog and a timeout
def test_the_watchdog_shows_the_stuck_rank_and_where_the_others_wait(data_args):
    start = time.monotonic()
    r = run_script(SCRIPT, *QUICK, "--bug", "stall", "--bug-step", 5, "--watchdog", 3, "--timeout", 10,
                   *data_args, timeout=120)
    assert r.returncode == 1 and time.monotonic() - start < 60
    reports = r.stderr.split("watchdog: ")[1:]
    by_rank = {report.split()[1]: report for report in reports}
    assert set(by_rank) == {"0", "1"}, r.stderr
    assert "has made no progress for" in by_rank["0"]
    assert "time.sleep(10 * args.timeout)" in by_rank["1"]  # the stuck rank: the line it is stuck on
    assert "loss.backward()" in by_rank["0"]  # the other: waiting in the gradients' all-reduce
    assert "Timed out waiting 10000ms" in r.stderr  # then the group's timeout ends the job


