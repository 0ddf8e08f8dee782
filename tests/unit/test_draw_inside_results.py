"""Lesson 9's measured figure (tools/figures/draw_inside_results.py) draws from the committed data, and
--collect reads what the benchmarks write, never mixing two sizes of all-reduce; the lab benchmark
of the ring's order (tools/bench/bench_ring_order.py, root only) swaps exactly the two posts of the
script's ring."""
import inspect
import json
import subprocess
import sys

import pytest
from helpers import REPO, load_script

sys.path.insert(0, str(REPO / "tools" / "bench"))
sys.path.insert(0, str(REPO / "tools" / "figures"))
import bench_ring_order  # noqa: E402
import draw_inside_results  # noqa: E402


def test_the_committed_data_draws_the_lessons_figure(tmp_path):
    png = tmp_path / "figure.png"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "figures" / "draw_inside_results.py"),
                        "--out", str(png)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    ignored = subprocess.run(["git", "check-ignore", "-q", str(draw_inside_results.DATA)], cwd=REPO)
    assert ignored.returncode == 1, f"{draw_inside_results.DATA} is git-ignored: a fresh clone would lack it"
    data = json.loads(draw_inside_results.DATA.read_text())
    parts = [data["all_reduce"]["one_machine"], data["fixed_cost"], data["step"], data["lab_training"]]
    assert all("20" in part["source"] for part in parts) and "20" in data["all_reduce"]["lab_source"]  # dated
    lesson = (REPO / "notebooks" / "09_ddp_from_the_inside.ipynb").read_text()
    assert "../figures/ddp_inside_results.png" in lesson


def test_collect_takes_in_what_the_benchmarks_write(tmp_path):
    machine = {"cpu": "a CPU", "cores": 2}
    row = {"sent_bytes": 0}

    def allreduce(sizes, seconds):
        return {"date": "2026-01-02T00:00:00", "machine": machine, "repeats": 5,
                "rows": [{**row, "bytes": b, "ring_s": 2 * t, "torch_s": t} for b, t in zip(sizes, seconds)]}

    files = {"allreduce.json": allreduce([4, 16 << 20], [0.001, 0.02])}
    for n in (2, 3, 4):  # the fixed cost: the median over the sizes, n ms for Gloo
        files[f"latency_n{n}.json"] = allreduce([4, 16, 64], [n * 1e-3 - 1e-4, n * 1e-3, n * 1e-3 + 1e-3])
    files["ring_order.json"] = {"date": "2026-01-03T00:00:00", "machine": "a lab", "mib": 16,
                                "statistic": "s", "rates": [{"rate": "1gbit", "wire_s": 0.134, "median_s": {
                                    "gloo": 0.14, "ring": 0.15, "ring, send first": 0.27}}]}
    files["by_hand.json"] = {"machine": {**machine, "date": "2026-01-04T00:00"}, "repeats": 3, "rounds": 8,
                             "rows": [{"key": f"{model} {way}", "vs_ddp": 1.5, "vs_ddp_quartiles": [1.4, 1.6]}
                                      for model in ("mlp", "convnet") for way in draw_inside_results.WAYS]}
    runs = [{"images_per_second": v} for v in (90.0, 100.0, 110.0)]
    files["netlab.json"] = {"date": "2026-01-05T00:00:00", "machine": "a lab", "runs": 3, "rates": [{
        "label": "1 Gbit/s", "training": {"DDP, default buckets": {"images_per_second": 50.0, "runs": runs},
                                          **{c: {"images_per_second": 100.0, "runs": runs}
                                             for c in draw_inside_results.CONFIGS}}}]}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    data = {"all_reduce": {"mib": 16}}
    replaced = draw_inside_results.collect(data, tmp_path, netlab=tmp_path / "netlab.json")
    assert len(replaced) == 5, replaced
    assert data["all_reduce"]["one_machine"]["gloo_ms"] == 20.0  # the 16 MiB row
    assert [p["gloo_ms"] for p in data["fixed_cost"]["points"]] == [2.0, 3.0, 4.0]
    assert data["all_reduce"]["lab"] == [{"link": "lab, 1 Gbit/s", "gloo_ms": 140.0, "ring_ms": 150.0,
                                          "ring_send_first_ms": 270.0, "wire_ms": 134.0}]
    assert {r["ratio"] for r in data["step"]["rows"]} == {1.5} and len(data["step"]["rows"]) == 8
    assert data["lab_training"]["rows"][0] == {"link": "1 Gbit/s", "config": draw_inside_results.CONFIGS[0],
                                               "ratio": 2.0, "low": 1.8, "high": 2.2}
    assert "2026-01-05" in data["lab_training"]["source"]
    draw_inside_results.draw(data, tmp_path / "figure.png")
    # the lab benchmark's run is committed, under docs/measured/, not build/bench/
    assert draw_inside_results.NETLAB == REPO / "docs" / "measured" / "netlab.json"

    # a lab run of another size: the one-machine bar must be of that size too, or nothing changes
    files["ring_order.json"]["mib"] = 8
    (tmp_path / "ring_order.json").write_text(json.dumps(files["ring_order.json"]))
    before = json.dumps(data)
    with pytest.raises(ValueError, match="8 MiB"):
        draw_inside_results.collect(data, tmp_path, netlab=tmp_path / "netlab.json")
    (tmp_path / "allreduce.json").unlink()
    with pytest.raises(ValueError, match="mix"):
        draw_inside_results.collect(data, tmp_path, netlab=tmp_path / "netlab.json")
    assert json.dumps(data) == before
    (tmp_path / "allreduce.json").write_text(json.dumps(allreduce([4, 8 << 20], [0.001, 0.01])))
    draw_inside_results.collect(data, tmp_path, netlab=tmp_path / "netlab.json")
    assert data["all_reduce"]["mib"] == 8 and data["all_reduce"]["one_machine"]["gloo_ms"] == 10.0


def test_the_ring_posts_its_receive_first_and_the_lab_benchmark_swaps_only_that(one_rank_group):
    """Posting the send first made many steps across a capped link, with two ranks, up to twice as
    long (docs/MEASURED.md, lesson 9); bench_ring_order times that variant from the script's own source."""
    by_hand = load_script("allreduce_by_hand")
    source = inspect.getsource(by_hand.ring_all_reduce)
    assert bench_ring_order.RECEIVE + bench_ring_order.SEND in source  # the receive, then the send
    variant = bench_ring_order.send_first_ring(by_hand)
    import torch

    x = torch.arange(5.0)
    assert variant(x) == 0 and torch.equal(x, torch.arange(5.0))  # one rank: nothing to send

    class Edited:  # a ring whose step no longer reads as the benchmark expects: refused, not timed wrong
        ring_all_reduce = staticmethod(lambda tensor, group=None: 0)

    with pytest.raises((ValueError, TypeError, OSError)):
        bench_ring_order.send_first_ring(Edited)
