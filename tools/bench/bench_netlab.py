"""Benchmark for lessons 6, 9 and 10 across the network lab (root only): two hosts, each a network
namespace with its own address and hostname, joined by one link capped at a set bandwidth
(tools/lab/netlab.py), so that communication costs what it costs between two machines, which loopback
never shows.

At each rate of the link (uncapped, then 10 Gbit/s, 1 Gbit/s, 100 Mbit/s by default):
1. **the all-reduce**, one rank per host: Gloo's and the ring by hand (`ring_all_reduce` and
   `measure` of ddp_scripts/allreduce_by_hand.py), from 4 bytes to 16 MiB; lesson 6's cost model
   t = 2 (N - 1) alpha + 2 (N - 1) / N x n / B fitted to each (N = 2 ranks, n the tensor's bytes,
   alpha the latency of one step of the ring from the small messages, B the bandwidth from the
   large ones: fit());
2. **2-rank training** of lesson 6's MLP (23 MB of gradients per step), one torchrun per host
   running ddp_scripts/mnist_ddp_comm.py unchanged, one rank each: plain DDP (default buckets), one
   bucket of 100 MB (nothing overlaps with backward), 1 MB buckets, gradient accumulation over 4
   micro-batches, and the fp16 and bf16 compression hooks; the same number of micro-batches each;
3. **sharding** (lesson 10), at the rates of --shard-rates: ddp_scripts/mnist_fsdp.py on the same
   MLP with AdamW, --shard ddp, zero and fsdp (FSDP all-gathers the parameters in forward and in
   backward and reduce-scatters the gradients: on Gloo, whose reduce-scatter all-reduces the whole
   tensor and keeps a chunk, twice DDP's bytes; 1.5x on NCCL).
At each rate the configurations of 2 and 3 run in --runs rounds, each round every configuration
once, in turn (so that a slow moment of the machine falls on all of them); a configuration's
images/s is the median of its runs, reported as a ratio to plain DDP at the same rate, with the
spread of its runs. Writes docs/measured/netlab.json and figures/netlab_allreduce.png,
figures/netlab_training.png, figures/netlab_sharding.png.

With --all-reduce-only (make bench's netlab-allreduce): Gloo's all-reduce alone at each rate, issued
back to back, as nccl-tests times collectives (BACK_TO_BACK: 9 rounds per size, each the mean of up to
64 all-reduces, every round kept), written to docs/measured/netlab_allreduce.json, the run lesson
13's planner is checked against (tests/unit/test_plan_parallelism.py). One at a time after a
barrier, as in 1, an all-reduce finds the link's token bucket refilled by the pause and the
mid-sized ones pass at the hosts' speed; back to back, the bucket stays spent.

    sudo .venv/bin/python tools/bench/bench_netlab.py [--rates none,10gbit,1gbit,100mbit] [--runs 3]
    sudo .venv/bin/python tools/bench/bench_netlab.py --all-reduce-only   # lesson 13's check, below
    python tools/bench/bench_netlab.py --draw docs/measured/netlab.json    # the figures again, from a run

Needs root (network namespaces, tc); without it, one line saying so and exit code 77 (make bench
counts it as skipped).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "lab"))
import netlab  # noqa: E402
from bench import positive  # noqa: E402

PREFIX = "ddpbench"
# What both all-reduce measurements start with, one rank per host: allreduce_by_hand.py loaded (its
# message_sizes() and measure()), the process group over the lab's link, the sizes.
SETUP = """
import importlib.util, json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, master, port, max_mb, repeats, script = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))  # the modules it imports (ddp_hardening) lie beside it
spec = importlib.util.spec_from_file_location("allreduce_by_hand", script)
by_hand = importlib.util.module_from_spec(spec)
spec.loader.exec_module(by_hand)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=int(rank), world_size=2,
                        timeout=timedelta(seconds=300))
sizes = by_hand.message_sizes(float(max_mb))
"""
# allreduce_by_hand.py's measure(), ring and Gloo's in turn; rank 0 prints the medians as JSON.
ALL_REDUCE = SETUP + """
medians = by_hand.measure(int(rank), 2, sizes, int(repeats), quiet=True)
if rank == "0":
    print(json.dumps({"sizes": sizes, "medians": medians.tolist()}), flush=True)
dist.destroy_process_group()
"""
# Gloo's all-reduce alone, back to back (as nccl-tests times collectives): after a barrier, a round
# of all-reduces (4 MiB in all, 4 to 64 of them) timed together (their mean); a warm-up round, then
# `repeats` rounds; rank 0 prints each size's median round and every round, the slower rank's, as
# JSON. A link capped by a token bucket shows here the rate its bucket refills at, once the warm-up
# has spent the burst it saved while idle.
BACK_TO_BACK = SETUP + """
def iterations(size):
    return max(4, min(64, 2**22 // size))
means = torch.zeros(len(sizes), int(repeats), dtype=torch.float64)
for i, size in enumerate(sizes):
    x = torch.zeros(size // 4)  # zeros: the sums stay zero (no overflow, no denormals)
    for k in range(-1, int(repeats)):  # k = -1: the warm-up round, not counted
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations(size)):
            dist.all_reduce(x)
        if k >= 0:
            means[i, k] = (time.perf_counter() - start) / iterations(size)
dist.all_reduce(means, op=dist.ReduceOp.MAX)
if rank == "0":
    print(json.dumps({"sizes": sizes, "medians": [[m] for m in means.quantile(0.5, dim=1).tolist()],
                      "rounds": means.tolist()}), flush=True)
dist.destroy_process_group()
"""
# (name, flags of mnist_ddp_comm.py, micro-batches per optimizer step)
TRAINING = [
    ("DDP, default buckets", [], 1),  # the MLP: 1 MiB first (its last layer), then 25 MiB
    ("one 100 MB bucket (no overlap)", ["--bucket-cap-mb", "100"], 1),
    ("1 MB buckets", ["--bucket-cap-mb", "1"], 1),  # the MLP: the default's 2 buckets again (a noise check)
    ("accumulation, K=4", ["--accum-steps", "4"], 4),
    ("fp16 hook", ["--comm-hook", "fp16"], 1),
    ("bf16 hook", ["--comm-hook", "bf16"], 1),
]
# (name, --shard of mnist_fsdp.py)
SHARDING = [("DDP", "ddp"), ("ZeRO", "zero"), ("FSDP", "fsdp")]


def python():
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


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


def measure_all_reduce(lab, max_mb, repeats, back_to_back=False):
    """Gloo's all-reduce and the ring by hand, one at a time, in turn, `repeats` of each per size;
    back_to_back: Gloo's alone, `repeats` rounds of BACK_TO_BACK per size."""
    master, port = lab.address(lab.hosts[0]), lab.port()
    keys = ("torch",) if back_to_back else ("ring", "torch")
    script = REPO / "ddp_scripts" / "allreduce_by_hand.py"  # message_sizes(), and measure() in turn
    results = both_hosts(lab, [[python(), "-c", BACK_TO_BACK if back_to_back else ALL_REDUCE, rank, master,
                                port, max_mb, repeats, script] for rank in (0, 1)], timeout=900)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"the all-reduce across the lab failed:\n{out}")
    data = json.loads(results[0][1].strip().splitlines()[-1])
    rows = [{"bytes": size, "sent_bytes": size, **{f"{key}_s": t for key, t in zip(keys, times)}}
            for size, times in zip(data["sizes"], data["medians"])]  # N = 2: sent = bytes
    for row, rounds in zip(rows, data.get("rounds", [])):
        row["torch_rounds_s"] = rounds  # back to back: each round's mean, the spread of the median
    return {"rows": rows, "fit": {key: fit(rows, key) for key in keys}}


def fit(rows, key, n=2):
    """Lesson 6's model of a ring all-reduce over n ranks, t = 2 (n - 1) alpha + sent / B (sent: the
    bytes each rank sends, 2 (n - 1) / n x the tensor's), each term from the sizes where it
    dominates: alpha from the median time of the messages of at most 4 KiB (2 (n - 1) steps of
    alpha), B from the messages of 1 MiB or more (least squares on t - 2 (n - 1) alpha against the
    bytes). A fit of every point at once (allreduce_by_hand.fit, on relative errors) lets the noisy
    small messages of a shared machine pull B off what the large ones show."""
    import statistics

    steps = 2 * (n - 1)
    small = [r[f"{key}_s"] for r in rows if r["sent_bytes"] <= 4096]
    fixed = statistics.median(small) if small else 0.0
    large = [(r["sent_bytes"], r[f"{key}_s"] - fixed) for r in rows if r["sent_bytes"] >= 1 << 20]
    seconds_per_byte = (sum(b * t for b, t in large) / sum(b * b for b, _ in large)) if large else 0
    return {"alpha_s": fixed / steps, "steps": steps,
            "bandwidth_bytes_per_s": 1 / seconds_per_byte if seconds_per_byte > 0 else None}


def train(lab, script, flags, steps, data_dir, timeout):
    """A course script (lesson 6's, or lesson 10's) across the two hosts, one rank each, on the MLP:
    its metrics (rank 0's)."""
    master, port = lab.address(lab.hosts[0]), lab.port()
    metrics = Path(tempfile.mkdtemp(prefix="bench-netlab-")) / "m.json"
    common = ["--model", "mlp", "--device", "cpu", "--backend", "gloo", "--threads-per-proc", "1",
              "--max-steps", str(steps), "--data-dir", str(data_dir), "--quiet", "--timeout", "300", *flags]
    commands = []
    for node in (0, 1):
        torchrun = [python(), "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--master-addr", master, "--master-port", str(port), "--nproc-per-node", "1"]
        argv = [str(REPO / "ddp_scripts" / script), *common]
        commands.append(torchrun + argv + (["--metrics-json", str(metrics)] if node == 0 else []))
    results = both_hosts(lab, commands, timeout)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"training across the lab failed ({script} {' '.join(flags)}):\n{out}")
    result = json.loads(metrics.read_text())
    metrics.unlink()
    metrics.parent.rmdir()
    return result


def machine():
    from bench import cores, cpu_name

    import torch

    return f"{cpu_name()}, {cores()} cores, torch {torch.__version__}"


def speed(rate, name, part="training"):
    """images/s of a configuration at one rate of a run (the median of its runs)."""
    return rate[part][name]["images_per_second"]


def ratios(rate, name, part="training"):
    """(median, lowest, highest) of a configuration's images/s relative to the first configuration
    of its part (plain DDP) at the same rate: each run against that median."""
    names = [n for n, *_ in (TRAINING if part == "training" else SHARDING)]
    base = speed(rate, names[0], part)
    runs = rate[part][name].get("runs") or [rate[part][name]]  # a run before --runs: one each
    values = [r["images_per_second"] / base for r in runs]
    return speed(rate, name, part) / base, min(values), max(values)


def bars(ax, rates, names, part):
    """Grouped bars of ratios to plain DDP, one group per rate, lines from the lowest to the highest run."""
    import matplotlib.pyplot as plt

    width = 0.8 / len(names)
    for j, name in enumerate(names):
        values = [ratios(rate, name, part) for rate in rates]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rates))]
        ax.bar(xs, [v[0] for v in values], width, label=name, color=plt.cm.tab10(j),
               yerr=[[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]],
               error_kw={"lw": 0.8, "capsize": 2, "ecolor": "0.2"})
    ax.axhline(1, color="0.3", lw=0.8)
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([f"{rate['label']}\n(DDP: {speed(rate, names[0], part):,.0f} img/s)"
                        for rate in rates], fontsize=8)
    ax.set_ylabel("images/s relative to plain DDP at that rate")
    ax.legend(fontsize=7.5)


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
        bandwidth = fitted["bandwidth_bytes_per_s"]
        label = f"{rate['label']}: alpha {fitted['alpha_s'] * 1e6:.0f} us a step, " + (
            f"B {bandwidth * 8 / 1e9:.2f} Gbit/s" if bandwidth else "B not fitted")
        if bandwidth:
            ax.loglog(sent, [(fitted["steps"] * fitted["alpha_s"] + s / bandwidth) * 1e3 for s in sent], "-",
                      color=colour, label=label, lw=1.2)
        else:
            ax.plot([], [], "-", color=colour, label=label)
    ax.set_xlabel("bytes each rank sends (2 ranks: the tensor's bytes)")
    ax.set_ylabel("one all-reduce, ms (median)")
    ax.set_title("All-reduce across two lab hosts: o Gloo, x ring by hand,\n"
                 "lines: t = 2 (N - 1) alpha + 2 (N - 1) / N x n / B, N = 2", fontsize=9)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(True, which="both", alpha=0.25)
    fig.text(0.01, 0.005, f"{data['machine']}, {data['date'][:10]}", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    first = out_dir / "netlab_allreduce.png"
    fig.savefig(first, dpi=120)
    plt.close(fig)

    runs = data.get("runs", 1)
    spread = f"median of {runs} runs, lines: lowest to highest run" if runs > 1 else "one run each"
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    bars(ax, rates, [name for name, *_ in TRAINING], "training")
    ax.set_title(f"Lesson 6's MLP (23 MB of gradients) on 2 ranks, one per lab host\n({spread})", fontsize=9)
    fig.text(0.01, 0.005, f"{data['machine']}, {data['date'][:10]}", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    second = out_dir / "netlab_training.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    figures = [first, second]

    sharded = [rate for rate in rates if rate.get("sharding")]
    if sharded:
        fig, ax = plt.subplots(figsize=(6, 4.0))
        bars(ax, sharded, [name for name, _ in SHARDING], "sharding")
        ax.set_title(f"Lesson 10: mnist_fsdp.py, the MLP + AdamW, 2 ranks, one per lab host\n({spread})",
                     fontsize=9)
        fig.text(0.01, 0.005, f"{data['machine']}, {data['date'][:10]}", fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.02, 1, 1))
        third = out_dir / "netlab_sharding.png"
        fig.savefig(third, dpi=120)
        plt.close(fig)
        figures.append(third)
    return figures


def report(data):
    names = [name for name, _, _ in TRAINING]
    print(f"\nmeasured on {data['machine']}, {data['date']}")
    print(f"{'link':>10} {'Gloo alpha (a step)':>20} {'Gloo B':>12} {'ring B':>12}")
    for rate in data["rates"]:
        fits = {key: fit(rate["all_reduce"]["rows"], key) for key in ("ring", "torch")}

        def gbit(fitted):
            bandwidth = fitted["bandwidth_bytes_per_s"]
            return f"{bandwidth * 8 / 1e9:.2f} Gbit/s" if bandwidth else "-"

        print(f"{rate['label']:>10} {fits['torch']['alpha_s'] * 1e6:17.0f} us {gbit(fits['torch']):>12} "
              f"{gbit(fits['ring']):>12}")
    print(f"\nimages/s relative to plain DDP at the same rate, median of {data.get('runs', 1)} run(s) and "
          "the lowest to the highest run (plain DDP's images/s in brackets)")
    for part, names in (("training", names), ("sharding", [name for name, _ in SHARDING])):
        rates = [rate for rate in data["rates"] if rate.get(part)]
        if not rates:
            continue
        print(f"{part:32}" + "".join(f"{rate['label']:>22}" for rate in rates))
        for name in names:
            cells = []
            for rate in rates:
                value, low, high = ratios(rate, name, part)
                cells.append(f"({speed(rate, name, part):,.0f})" if name == names[0]
                             else f"{value:.2f}x ({low:.2f}-{high:.2f})")
            print(f"{name:32}" + "".join(f"{c:>22}" for c in cells))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rates", default="none,10gbit,1gbit,100mbit",
                   help="the link's bandwidths, in turn (tc's units; none: uncapped)")
    p.add_argument("--micro-batches", type=positive(int), default=12,
                   help="per training run (of 64 images per rank)")
    p.add_argument("--runs", type=positive(int), default=3,
                   help="runs of each training configuration per rate")
    p.add_argument("--shard-rates", default="none,1gbit",
                   help="the rates at which mnist_fsdp.py's ddp, zero and fsdp also run ('': none)")
    p.add_argument("--max-mb", type=positive(float), default=16, help="the largest all-reduce, MiB")
    p.add_argument("--repeats", type=positive(int), default=None,
                   help="all-reduces per size, the median kept (default 3); with --all-reduce-only, rounds "
                        "per size (default 9)")
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--json", default=None,
                   help="where the run is written (committed: the figures, MEASURED and lesson 13 read it; "
                        "default docs/measured/netlab.json, with --all-reduce-only netlab_allreduce.json)")
    p.add_argument("--draw", metavar="JSON", help="only redraw the figures from a run's JSON")
    p.add_argument("--all-reduce-only", action="store_true",
                   help="only Gloo's all-reduce at each rate, back to back, no figures: the run lesson 13's "
                        "planner is checked against")
    p.add_argument("--figures", default=str(REPO / "figures"), help="where the figures go")
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 9 if args.all_reduce_only else 3
    if args.json is None:
        args.json = str(REPO / "docs" / "measured" / ("netlab_allreduce.json" if args.all_reduce_only
                                                       else "netlab.json"))
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
        shard_rates = [netlab.format_rate(netlab.parse_rate(r)) for r in args.shard_rates.split(",") if r]
    except netlab.LabError as err:
        sys.exit(f"bench_netlab: error: {err}")
    if args.runs < 1:
        sys.exit("bench_netlab: error: --runs must be at least 1")
    data = {"date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "link": "a veth pair between two network namespaces, capped by tc tbf on both ends",
            "statistic": (
                f"all-reduce: Gloo's alone, back to back, the median of {args.repeats} rounds of 4 MiB "
                "(4 to 64 all-reduces), the slower rank's mean of a round" if args.all_reduce_only else
                f"all-reduce: median of --repeats ({args.repeats}), the slower rank's, Gloo's and the ring "
                f"by hand in turn; training and sharding: median images/s of {args.runs} runs, in rounds"),
            "micro_batches": args.micro_batches, "runs": args.runs, "rates": []}
    with netlab.Lab(prefix=PREFIX) as lab:
        for number, rate in enumerate(rates, 1):
            lab.set_rate(rate)
            label = "uncapped" if rate == "none" else rate.replace("gbit", " Gbit/s").replace(
                "mbit", " Mbit/s")
            where = f"[{number}/{len(rates)}] link {label}"
            print(f"{where}: the all-reduce, 4 B to {args.max_mb:g} MiB", flush=True)
            bits = netlab.parse_rate(rate)
            entry = {"rate": rate, "label": label, "burst_bytes": netlab.burst_bytes(bits) if bits else None,
                     "all_reduce": measure_all_reduce(lab, args.max_mb, args.repeats,
                                                      back_to_back=args.all_reduce_only)}
            configs = [("training", name, "mnist_ddp_comm.py", flags, args.micro_batches // accum)
                       for name, flags, accum in TRAINING] if not args.all_reduce_only else []
            if rate in shard_rates and not args.all_reduce_only:
                configs += [("sharding", name, "mnist_fsdp.py", ["--shard", shard], args.micro_batches)
                            for name, shard in SHARDING]
            entry.update({part: {} for part, *_ in configs})
            for round_ in range(1, args.runs + 1):
                for part, name, script, flags, steps in configs:
                    print(f"{where}, round {round_}/{args.runs}: {part}, {name}", flush=True)
                    metrics = train(lab, script, flags, steps, args.data_dir, timeout=900)
                    epoch = metrics["epochs"][-1]
                    run = {"images_per_second": epoch["images_per_second"], "seconds": epoch["seconds"]}
                    for key in ("allreduce_ms", "gradient_mb", "state_mib_per_rank", "peak_mib_per_rank"):
                        if key in metrics:
                            run[key] = metrics[key]
                    result = entry[part].setdefault(name, {"flags": flags, "runs": []})
                    result["runs"].append(run)
                    result["images_per_second"] = statistics.median(
                        r["images_per_second"] for r in result["runs"])
            data["rates"].append(entry)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1))
    if args.all_reduce_only:
        print(f"wrote {args.json}")
        return
    report(data)
    for path in draw(data, args.figures):
        print(f"wrote {path}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
