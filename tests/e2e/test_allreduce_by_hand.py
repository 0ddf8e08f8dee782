"""ddp_scripts/allreduce_by_hand.py: the ring all-reduce built from point-to-point messages equals
dist.all_reduce, sends 2 (N - 1) / N of the tensor's bytes per rank, and its measurements draw."""
import ast
import json
import math
import re
import sys
import time

import pytest
import torch
from helpers import REPO, load_script, run_script

sys.path.insert(0, str(REPO / "tools" / "figures"))
import draw_allreduce_cost  # noqa: E402

SCRIPT = "allreduce_by_hand.py"
by_hand = load_script("allreduce_by_hand")
# "ok  float32 (9, 4)  max |ring - all_reduce| 2e-07, rank 0 sent   192 bytes of   144 (...)"
CHECK_LINE = re.compile(r"^(ok|MISMATCH)\s+(\w+)\s+(\([\d, ]*\)).*rank 0 sent\s+(\d+) bytes of\s+(\d+)")


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                ids=["2 ranks", "3 ranks"])
def checked(request):
    """The check mode with N ranks, run once for the tests below: (N, its result). 3 ranks: in a new
    interpreter, the ranks started by mp.spawn's real spawn (notebooks/launcher.py)."""
    return request.param, run_script(SCRIPT, "--nprocs", request.param, timeout=120, fresh=request.param == 3)


def test_ring_equals_all_reduce(checked):
    n, r = checked
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("done:")
    lines = [m for m in map(CHECK_LINE.match, r.stdout.splitlines()) if m]
    assert {m[2] for m in lines} == {"float32", "float64", "int64"}
    assert {1, n - 1} - {0} <= {math.prod(ast.literal_eval(m[3])) for m in lines}  # the awkward lengths
    assert all(m[1] == "ok" for m in lines)


def test_each_rank_sends_two_n_minus_one_over_n_of_the_bytes(checked):
    n, r = checked
    divisible = 0
    for m in filter(None, map(CHECK_LINE.match, r.stdout.splitlines())):
        numel, sent, nbytes = math.prod(ast.literal_eval(m[3])), int(m[4]), int(m[5])
        element = torch.empty(0, dtype=getattr(torch, m[2])).element_size()
        assert nbytes == numel * element
        if numel % n == 0:
            assert sent * n == 2 * (n - 1) * nbytes  # exactly 2 (N - 1) / N
            divisible += 1
        else:  # chunks of unequal sizes: within two elements of it
            assert abs(sent * n - 2 * (n - 1) * nbytes) <= 2 * element * n
    assert divisible >= 3


def test_one_rank_has_nothing_to_send(one_rank_group):
    x = torch.arange(5.0)
    assert by_hand.ring_all_reduce(x) == 0
    assert torch.equal(x, torch.arange(5.0))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_fit_recovers_lesson_6s_alpha_per_step_and_bandwidth(n):
    """t = 2 (N - 1) alpha + 2 (N - 1) / N x size / B: alpha is one step's latency, as in lesson 6."""
    sizes = [4.0 ** k for k in range(1, 12)]
    alpha, bandwidth = by_hand.fit(n, sizes, [2 * (n - 1) * 50e-6 + 2 * (n - 1) / n * s / 2e9 for s in sizes])
    assert alpha == pytest.approx(50e-6, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_measure_writes_json_that_draws(tmp_path):
    path, png = tmp_path / "allreduce.json", tmp_path / "figure" / "allreduce_cost.png"
    r = run_script(SCRIPT, "--mode", "measure", "--max-mb", "0.001", "--repeats", "3", "--quiet",
                   "--json", path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("done:")
    data = json.loads(path.read_text())
    assert [row["bytes"] for row in data["rows"]] == [4, 16, 64, 256, 1024]
    assert all(row["sent_bytes"] == row["bytes"] for row in data["rows"])  # N = 2: 2 (N - 1) / N = 1
    assert all(row["ring_s"] > 0 and row["torch_s"] > 0 for row in data["rows"])
    assert set(data["fit"]) == {"ring", "torch"} and data["machine"]["cpu"] and data["date"]
    assert all(f["steps"] == 2 and f["alpha_s"] > 0 for f in data["fit"].values())  # N = 2: 2 steps
    assert draw_allreduce_cost.draw(path, png) == png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, expected", [(["--nprocs", "0"], "--nprocs"),
                                            (["--mode", "x"], "invalid choice")])
def test_bad_flags_are_refused_in_one_line(args, expected):
    start = time.monotonic()
    r = run_script(SCRIPT, *args, timeout=60)
    assert time.monotonic() - start < 30  # within seconds, on a loaded 2-core machine too
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{SCRIPT}: error:") and expected in lines[0], r.stderr


@pytest.mark.parametrize("args", [["--mode", "measure", "--nprocs", "1"],
                                  ["--mode", "measure", "--max-mb", "1e-6"]])
def test_measure_needs_two_ranks_and_two_sizes(args):
    with pytest.raises(by_hand.UsageError):
        by_hand.parse_args(args)
