"""tools/bench/bench_netlab.py's report and figures, from a run's JSON (the measurement itself needs root
and about thirty minutes: `make bench`; tests/cluster/test_netlab.py checks the lab it runs on)."""
import subprocess
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "bench"))
import bench_netlab  # noqa: E402


def runs(median):
    """Three runs around a median: 0.9x, 1x and 1.1x of it."""
    return [{"images_per_second": median * f, "seconds": 1.0} for f in (0.9, 1.0, 1.1)]


def a_run(rates=("none", "1gbit")):
    """The shape of docs/measured/netlab.json, with numbers chosen so that every ratio is known:
    training's k-th configuration k+1 times plain DDP, sharding (at the second rate only) ZeRO
    half DDP and FSDP a quarter; each configuration's runs 0.9x, 1x and 1.1x its median."""
    data = {"date": "2026-01-01T00:00:00", "machine": "a test machine", "micro_batches": 4, "runs": 3,
            "rates": []}
    for i, rate in enumerate(rates):
        slow = 10 ** i  # the second rate: everything ten times slower
        rows = [{"bytes": n, "sent_bytes": n, "ring_s": slow * (1e-3 + n / 1e8),
                 "torch_s": slow * (5e-4 + n / 2e8)} for n in (4, 4096, 4 << 20)]
        training = {name: {"flags": flags, "images_per_second": 100.0 * (k + 1) / slow,
                           "runs": runs(100.0 * (k + 1) / slow)}
                    for k, (name, flags, _) in enumerate(bench_netlab.TRAINING)}
        entry = {"rate": rate, "label": rate, "training": training, "all_reduce": {"rows": rows}}
        if i == 1:
            entry["sharding"] = {name: {"flags": ["--shard", shard], "images_per_second": 80.0 / 2 ** k,
                                        "runs": runs(80.0 / 2 ** k)}
                                 for k, (name, shard) in enumerate(bench_netlab.SHARDING)}
        data["rates"].append(entry)
    return data


def test_the_report_gives_each_configuration_relative_to_plain_ddp_at_the_same_rate(capsys):
    bench_netlab.report(a_run())
    lines = capsys.readouterr().out.splitlines()
    names = [name for name, _, _ in bench_netlab.TRAINING]
    plain = next(line for line in lines if line.startswith(names[0]))
    assert plain.split()[-2:] == ["(100)", "(10)"], lines  # plain DDP: its own images/s, per rate
    last = next(line for line in lines if line.startswith(names[-1]))
    n = len(names)  # k+1 times plain DDP at both rates, its runs 0.9x to 1.1x of that
    assert last.split()[-4:] == [f"{n:.2f}x", f"({0.9 * n:.2f}-{1.1 * n:.2f})"] * 2, lines
    out = "\n".join(lines)
    assert "1.60 Gbit/s" in out and "0.16 Gbit/s" in out, out  # Gloo's B, 2e8 B/s then 2e7 B/s
    # alpha a step: half the small messages' median time (2 ranks: 2 steps), (0.500 + 0.520) / 2 / 2 ms
    assert " 255 us" in out and "2551 us" in out, out
    sharding = lines[lines.index(next(line for line in lines if line.startswith("sharding"))):]
    assert sharding[0].split() == ["sharding", "1gbit"], sharding  # only the rate it ran at
    assert sharding[2].split() == ["ZeRO", "0.50x", "(0.45-0.55)"], sharding
    assert sharding[3].split() == ["FSDP", "0.25x", "(0.23-0.28)"], sharding


def test_a_run_from_before_the_rounds_reads_as_one_run_each(capsys):
    data = a_run()
    for rate in data["rates"]:
        rate.pop("sharding", None)
        for result in rate["training"].values():
            del result["runs"]
    del data["runs"]
    bench_netlab.report(data)
    last = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith(bench_netlab.TRAINING[-1][0]))
    n = len(bench_netlab.TRAINING)
    assert last.split()[-2:] == [f"{n:.2f}x", f"({n:.2f}-{n:.2f})"], last


def test_draw_writes_the_three_figures_from_a_runs_json(tmp_path):
    run = tmp_path / "netlab.json"
    run.write_text(__import__("json").dumps(a_run()))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_netlab.py"), "--draw", str(run),
                        "--figures", str(tmp_path / "figures")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("netlab_allreduce.png", "netlab_training.png", "netlab_sharding.png"):
        png = tmp_path / "figures" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name


def test_the_back_to_back_all_reduce_reports_every_round_and_their_median():
    """--all-reduce-only's measurement (BACK_TO_BACK), run as it runs on the lab's two hosts but over
    loopback: every size from 4 bytes up, each with its rounds and their median, a time each."""
    import json

    from helpers import free_port

    port, rounds = str(free_port()), 3
    script = str(REPO / "ddp_scripts" / "allreduce_by_hand.py")
    procs = [subprocess.Popen([sys.executable, "-c", bench_netlab.BACK_TO_BACK, rank, "127.0.0.1", port,
                               "0.001", str(rounds), script], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in ("0", "1")]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    data = json.loads(outs[0].strip().splitlines()[-1])
    assert data["sizes"] == [4, 16, 64, 256, 1024]  # powers of 4 up to 0.001 MiB
    assert [len(r) for r in data["rounds"]] == [rounds] * len(data["sizes"])
    for (median,), each in zip(data["medians"], data["rounds"]):
        assert median == sorted(each)[1] and 0 < median < 1, (median, each)
    assert outs[1].strip() == ""  # rank 1 prints nothing
