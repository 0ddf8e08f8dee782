"""tools/bench_netlab.py's report and figures, from a run's JSON (the measurement itself needs root
and about ten minutes: `make bench`; tests/cluster/test_netlab.py checks the lab it runs on)."""
import subprocess
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_netlab  # noqa: E402


def a_run(rates=("none", "1gbit")):
    """The shape of build/bench/netlab.json, with numbers chosen so that every ratio is known."""
    data = {"date": "2026-01-01T00:00:00", "machine": "a test machine", "micro_batches": 4, "rates": []}
    for i, rate in enumerate(rates):
        slow = 10 ** i  # the second rate: everything ten times slower
        rows = [{"bytes": n, "sent_bytes": n, "ring_s": slow * (1e-3 + n / 1e8),
                 "torch_s": slow * (5e-4 + n / 2e8)} for n in (4, 4096, 4 << 20)]
        training = {name: {"flags": flags, "images_per_second": 100.0 * (k + 1) / slow, "seconds": 1.0,
                           "allreduce_ms": 1.0, "gradient_mb": 23.0}
                    for k, (name, flags, _) in enumerate(bench_netlab.TRAINING)}
        data["rates"].append({"rate": rate, "label": rate, "training": training, "all_reduce": {
            "rows": rows, "fit": {"ring": {"alpha_s": slow * 1e-3, "beta_bytes_per_s": 1e8 / slow},
                                  "torch": {"alpha_s": slow * 5e-4, "beta_bytes_per_s": 2e8 / slow}}}})
    return data


def test_the_report_gives_each_configuration_relative_to_plain_ddp_at_the_same_rate(capsys):
    bench_netlab.report(a_run())
    out = capsys.readouterr().out
    names = [name for name, _, _ in bench_netlab.TRAINING]
    plain = next(line for line in out.splitlines() if line.startswith(names[0]))
    assert plain.split()[-2:] == ["(100)", "(10)"], out  # plain DDP: its own images/s, per rate
    last = next(line for line in out.splitlines() if line.startswith(names[-1]))
    assert last.split()[-2:] == [f"{len(names)}.00x"] * 2, out  # k+1 times plain DDP at both rates
    assert "1.60 Gbit/s" in out and "0.16 Gbit/s" in out, out  # Gloo's beta, 2e8 B/s then 2e7 B/s


def test_draw_writes_both_figures_from_a_runs_json(tmp_path):
    run = tmp_path / "netlab.json"
    run.write_text(__import__("json").dumps(a_run()))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench_netlab.py"), "--draw", str(run),
                        "--figures", str(tmp_path / "figures")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("netlab_allreduce.png", "netlab_training.png"):
        png = tmp_path / "figures" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
