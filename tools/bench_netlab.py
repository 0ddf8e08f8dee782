"""Benchmark for lessons 6 and 9 across the network lab (root only): two hosts, each a network
namespace with its own address and hostname, joined by one link capped at a set bandwidth
(tools/netlab.py), so that communication costs what it costs between two machines, which loopback
never shows.

At each rate of the link (uncapped, then 10 Gbit/s, 1 Gbit/s, 100 Mbit/s by default):
1. **the all-reduce**, one rank per host: Gloo's and the ring by hand (`ring_all_reduce` and
   `measure` of ddp_scripts/allreduce_by_hand.py), from 4 bytes to 16 MiB; lesson 6's cost model
   T = alpha + n / beta fitted to each (n: the bytes each rank sends; alpha from the small
   messages, beta from the large ones: fit());
2. **2-rank training** of lesson 6's MLP (23 MB of gradients per step), one torchrun per host
   running ddp_scripts/mnist_ddp_comm.py unchanged, one rank each: plain DDP (default buckets), one
   bucket of 100 MB (nothing overlaps with backward), 1 MB buckets, gradient accumulation over 4
   micro-batches, and the fp16 and bf16 compression hooks; the same number of micro-batches each.
Every configuration runs once per rate, the rates in turn; images/s are reported as ratios to
plain DDP at the same rate, side by side. Writes build/bench/netlab.json and
figures/netlab_allreduce.png, figures/netlab_training.png.

    sudo .venv/bin/python tools/bench_netlab.py [--rates none,10gbit,1gbit,100mbit] [--micro-batches 12]
    python tools/bench_netlab.py --draw build/bench/netlab.json      # the figures again, from a run

Needs root (network namespaces, tc); without it, one line saying so and exit code 77 (make bench
counts it as skipped).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402

PREFIX = "ddpbench"
# One rank per host: the all-reduce of allreduce_by_hand.py's measure(), ring and Gloo's, over the
# lab's link; rank 0 prints the medians as JSON.
ALL_REDUCE = """
import importlib.util, json, sys
from datetime import timedelta
import torch, torch.distributed as dist
rank, master, port, max_mb, repeats, script = sys.argv[1:]
spec = importlib.util.spec_from_file_location("allreduce_by_hand", script)
by_hand = importlib.util.module_from_spec(spec)
spec.loader.exec_module(by_hand)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=int(rank), world_size=2,
                        timeout=timedelta(seconds=300))
sizes = by_hand.message_sizes(float(max_mb))
medians = by_hand.measure(int(rank), 2, sizes, int(repeats), quiet=True)
if rank == "0":
    print(json.dumps({"sizes": sizes, "medians": medians.tolist()}), flush=True)
dist.destroy_process_group()
"""
# (name, flags of mnist_ddp_comm.py, micro-batches per optimizer step)
TRAINING = [
    ("DDP, default buckets", [], 1),  # the MLP: 1 MiB first (its last layer), then 25 MiB
    ("one 100 MB bucket (no overlap)", ["--bucket-cap-mb", "100"], 1),
    ("1 MB buckets", ["--bucket-cap-mb", "1"], 1),
    ("accumulation, K=4", ["--accum-steps", "4"], 4),
    ("fp16 hook", ["--comm-hook", "fp16"], 1),
    ("bf16 hook", ["--comm-hook", "bf16"], 1),
]


def python():
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def both_hosts(lab, commands, timeout):
    """Run one command per host at once (host0's first); wait for both. [(code, output), ...]"""
    procs = []
    env = {**os.environ, "GLOO_SOCKET_IFNAME": netlab.IFNAME, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    for host, argv in zip(lab.hosts, commands):
        procs.append(lab.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPO, env=env))
    results, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def measure_all_reduce(lab, max_mb, repeats):
    script = REPO / "ddp_scripts" / "allreduce_by_hand.py"
    master, port = lab.address(lab.hosts[0]), free_port()
    results = both_hosts(lab, [[python(), "-c", ALL_REDUCE, rank, master, port, max_mb, repeats, script]
                               for rank in (0, 1)], timeout=900)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"the all-reduce across the lab failed:\n{out}")
    data = json.loads(results[0][1].strip().splitlines()[-1])
    rows = [{"bytes": size, "sent_bytes": size, "ring_s": ring, "torch_s": gloo}  # N = 2: sent = bytes
            for size, (ring, gloo) in zip(data["sizes"], data["medians"])]
    return {"rows": rows, "fit": {key: fit(rows, key) for key in ("ring", "torch")}}


def fit(rows, key):
    """T = alpha + sent / beta, each term from the sizes where it dominates: alpha the median time
    of the messages of at most 4 KiB, beta from the messages of 1 MiB or more (least squares on
    T - alpha against the bytes). A fit of every point at once (allreduce_by_hand.fit, on relative
    errors) lets the noisy small messages of a shared machine pull beta off what the large ones show."""
    import statistics

    small = [r[f"{key}_s"] for r in rows if r["sent_bytes"] <= 4096]
    alpha = statistics.median(small) if small else 0.0
    large = [(r["sent_bytes"], r[f"{key}_s"] - alpha) for r in rows if r["sent_bytes"] >= 1 << 20]
    seconds_per_byte = (sum(n * t for n, t in large) / sum(n * n for n, _ in large)) if large else 0
    return {"alpha_s": alpha, "beta_bytes_per_s": 1 / seconds_per_byte if seconds_per_byte > 0 else None}


def train(lab, flags, micro_batches, accum, data_dir, timeout):
    """lesson 6's script across the two hosts, one rank each: its metrics (rank 0's)."""
    master, port = lab.address(lab.hosts[0]), free_port()
    metrics = Path(tempfile.mkdtemp(prefix="bench-netlab-")) / "m.json"
    common = ["--model", "mlp", "--device", "cpu", "--backend", "gloo", "--threads-per-proc", "1",
              "--max-steps", str(micro_batches // accum), "--data-dir", str(data_dir), "--quiet",
              "--timeout", "300", *flags]
    commands = []
    for node in (0, 1):
        torchrun = [python(), "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--master-addr", master, "--master-port", str(port), "--nproc-per-node", "1"]
        script = [str(REPO / "ddp_scripts" / "mnist_ddp_comm.py"), *common]
        commands.append(torchrun + script + (["--metrics-json", str(metrics)] if node == 0 else []))
    results = both_hosts(lab, commands, timeout)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"training across the lab failed ({' '.join(flags) or 'plain DDP'}):\n{out}")
    result = json.loads(metrics.read_text())
    metrics.unlink()
    metrics.parent.rmdir()
    return result


def machine():
    from bench import cores, cpu_name

    import torch

    return f"{cpu_name()}, {cores()} cores, torch {torch.__version__}"


def speed(rate, name):
    """images/s of training configuration `name` at one rate of a run."""
    return rate["training"][name]["images_per_second"]


def draw(data, out_dir=REPO / "figures"):
    """The two figures of a run: the all-reduce's time against its bytes at each rate (measured
    points, fitted lines), and training's images/s per configuration at each rate, relative to
    plain DDP at that rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = data["rates"]
    colours = plt.cm.viridis([i / max(1, len(rates) - 1) for i in range(len(rates))])

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for rate, colour in zip(rates, colours):
        result = rate["all_reduce"]
        sent = [r["sent_bytes"] for r in result["rows"]]
        ax.loglog(sent, [r["torch_s"] * 1e3 for r in result["rows"]], "o", color=colour, ms=4)
        ax.loglog(sent, [r["ring_s"] * 1e3 for r in result["rows"]], "x", color=colour, ms=4)
        fitted = fit(result["rows"], "torch")
        beta = fitted["beta_bytes_per_s"]
        label = f"{rate['label']}: alpha {fitted['alpha_s'] * 1e6:.0f} us, " + (
            f"beta {beta * 8 / 1e9:.2f} Gbit/s" if beta else "beta not fitted")
        if beta:
            ax.loglog(sent, [(fitted["alpha_s"] + s / beta) * 1e3 for s in sent], "-", color=colour,
                      label=label, lw=1.2)
        else:
            ax.plot([], [], "-", color=colour, label=label)
    ax.set_xlabel("bytes each rank sends (2 ranks: the tensor's bytes)")
    ax.set_ylabel("one all-reduce, ms (median)")
    ax.set_title("All-reduce across two lab hosts: o Gloo, x ring by hand, lines: T = alpha + n / beta",
                 fontsize=9)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(True, which="both", alpha=0.25)
    fig.text(0.01, 0.005, f"{data['machine']}, {data['date'][:10]}", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    first = out_dir / "netlab_allreduce.png"
    fig.savefig(first, dpi=120)
    plt.close(fig)

    names = [name for name, _, _ in TRAINING]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ratios = [speed(rate, name) / speed(rate, names[0]) for rate in rates]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rates))]
        ax.bar(xs, ratios, width, label=name, color=plt.cm.tab10(j))
    ax.axhline(1, color="0.3", lw=0.8)
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([f"{rate['label']}\n(DDP: {speed(rate, names[0]):,.0f} img/s)" for rate in rates],
                       fontsize=8)
    ax.set_ylabel("images/s relative to plain DDP at that rate")
    ax.set_title("Lesson 6's MLP (23 MB of gradients) on 2 ranks, one per lab host", fontsize=9)
    ax.legend(fontsize=7.5)
    fig.text(0.01, 0.005, f"{data['machine']}, {data['date'][:10]}", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    second = out_dir / "netlab_training.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return first, second


def report(data):
    names = [name for name, _, _ in TRAINING]
    print(f"\nmeasured on {data['machine']}, {data['date']}")
    print(f"{'link':>10} {'Gloo alpha':>11} {'Gloo beta':>12} {'ring beta':>12}")
    for rate in data["rates"]:
        fits = {key: fit(rate["all_reduce"]["rows"], key) for key in ("ring", "torch")}

        def gbit(fitted):
            beta = fitted["beta_bytes_per_s"]
            return f"{beta * 8 / 1e9:.2f} Gbit/s" if beta else "-"

        print(f"{rate['label']:>10} {fits['torch']['alpha_s'] * 1e6:8.0f} us {gbit(fits['torch']):>12} "
              f"{gbit(fits['ring']):>12}")
    print("\nimages/s relative to plain DDP at the same rate (plain DDP's images/s in brackets)")
    print(f"{'':32}" + "".join(f"{rate['label']:>14}" for rate in data["rates"]))
    for name in names:
        cells = []
        for rate in data["rates"]:
            value = rate["training"][name]["images_per_second"]
            base = rate["training"][names[0]]["images_per_second"]
            cells.append(f"({value:,.0f})" if name == names[0] else f"{value / base:.2f}x")
        print(f"{name:32}" + "".join(f"{c:>14}" for c in cells))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rates", default="none,10gbit,1gbit,100mbit",
                   help="the link's bandwidths, in turn (tc's units; none: uncapped)")
    p.add_argument("--micro-batches", type=int, default=12, help="per training run (of 64 images per rank)")
    p.add_argument("--max-mb", type=float, default=16, help="the largest all-reduce, MiB")
    p.add_argument("--repeats", type=int, default=3, help="all-reduces per size (the median is kept)")
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--json", default=str(REPO / "build" / "bench" / "netlab.json"))
    p.add_argument("--draw", metavar="JSON", help="only redraw the figures from a run's JSON")
    p.add_argument("--figures", default=str(REPO / "figures"), help="where the figures go")
    args = p.parse_args()
    if args.draw:
        data = json.loads(Path(args.draw).read_text())
        report(data)
        for path in draw(data, args.figures):
            print(f"wrote {path}")
        return
    reason = netlab.missing_requirements()
    if reason:
        print(f"bench_netlab: skipped: {reason} (run it as root: sudo make bench BENCH=netlab)",
              file=sys.stderr)
        sys.exit(77)
    try:
        rates = [netlab.format_rate(netlab.parse_rate(r)) for r in args.rates.split(",")]
    except netlab.LabError as err:
        sys.exit(f"bench_netlab: error: {err}")
    data = {"date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "link": "a veth pair between two network namespaces, capped by tc tbf on both ends",
            "statistic": "all-reduce: median of --repeats, the slower rank's; training: one run each",
            "micro_batches": args.micro_batches, "rates": []}
    with netlab.Lab(prefix=PREFIX) as lab:
        for number, rate in enumerate(rates, 1):
            lab.set_rate(rate)
            label = "uncapped" if rate == "none" else rate.replace("gbit", " Gbit/s").replace(
                "mbit", " Mbit/s")
            where = f"[{number}/{len(rates)}] link {label}"
            print(f"{where}: the all-reduce, 4 B to {args.max_mb:g} MiB", flush=True)
            entry = {"rate": rate, "label": label,
                     "all_reduce": measure_all_reduce(lab, args.max_mb, args.repeats), "training": {}}
            for name, flags, accum in TRAINING:
                print(f"{where}: training, {name}", flush=True)
                metrics = train(lab, flags, args.micro_batches, accum, args.data_dir, timeout=900)
                epoch = metrics["epochs"][-1]
                entry["training"][name] = {
                    "flags": flags, "images_per_second": epoch["images_per_second"],
                    "seconds": epoch["seconds"], "allreduce_ms": metrics["allreduce_ms"],
                    "gradient_mb": metrics["gradient_mb"]}
            data["rates"].append(entry)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1))
    report(data)
    for path in draw(data, args.figures):
        print(f"wrote {path}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
