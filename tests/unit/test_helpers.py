"""The suite's own helpers, in the rare states a loaded machine puts them in."""
import subprocess
import sys
import time

import psutil
from helpers import ranks_of


def test_ranks_of_passes_over_a_child_that_exited_and_was_not_yet_reaped():
    """Importing torch runs `/sbin/ldconfig -p`; for a moment after it exits, before the launcher
    waits for it, it is a zombie, whose command line psutil cannot read. Seen once on a loaded
    machine (psutil.ZombieProcess out of a test's start-up poll); here the zombie stays."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                               # never waited for; kept, for a dropped Popen reaps its child
                               # as it is collected if it has already exited (under load, it had)
                               "child = subprocess.Popen(['true'])\n"
                               "print('started', flush=True)\n"
                               "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "started\n"
        deadline = time.monotonic() + 10
        children = psutil.Process(parent.pid).children()
        while children and children[0].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [child.status() for child in children] == [psutil.STATUS_ZOMBIE]
        assert ranks_of(parent) == []
    finally:
        parent.kill()
        parent.wait()
