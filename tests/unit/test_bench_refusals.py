"""The benchmarks (tools/bench/, `make bench`) refuse a count they cannot measure with in one line and
exit code 2, before they start anything: a median of no runs, or quartiles of one, would otherwise
end in a traceback after minutes of measuring."""
import runpy
import subprocess
import sys

import pytest
from helpers import REPO

BENCH = REPO / "tools" / "bench"
# A benchmark, and a count it cannot work with.
ZERO_COUNTS = [("bench.py", "--repeats"), ("bench_comm.py", "--repeats"), ("bench_fsdp.py", "--steps"),
               ("bench_pipeline.py", "--runs"), ("bench_gcn.py", "--repeats"),
               ("bench_startup.py", "--repeats"), ("bench_by_hand.py", "--rounds"),
               ("bench_netlab.py", "--runs"), ("bench_ring_order.py", "--rounds")]


def run(script, *args):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


@pytest.mark.parametrize("script, flag", ZERO_COUNTS, ids=[s for s, _ in ZERO_COUNTS])
def test_a_count_of_zero_is_refused_in_one_line(script, flag, monkeypatch, capsys):
    """Each benchmark run as a script in this process (its folder first on the path, as Python puts
    it), so that torch is imported once for all of them."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), flag, "0"])
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    with pytest.raises(SystemExit) as end:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert end.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{script}: error: argument {flag}: must be positive, got 0")


def test_a_refusal_is_one_line_from_the_command_line():
    """The same, as `make bench` starts it: a fresh Python, exit code 2, no traceback."""
    r = run("bench.py", "--repeats", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "bench.py: error: argument --repeats: must be positive, got 0"


def test_the_by_hand_benchmark_refuses_a_single_round():
    """Its ratios' quartiles need two rounds; one launch of one round is refused before it starts."""
    r = run("bench_by_hand.py", "--repeats", "1", "--rounds", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("bench_by_hand: the ratios' quartiles need two rounds or more "
                                "(--repeats x --rounds at least 2)")


def test_a_count_that_works_is_taken():
    """The control: a positive count passes the check (--help after it: nothing is measured)."""
    r = run("bench_comm.py", "--repeats", "1", "--help")
    assert r.returncode == 0 and "--repeats" in r.stdout
