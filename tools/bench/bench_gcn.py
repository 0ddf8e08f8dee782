"""Benchmark for lesson 4: the GCN under DDP on CPU, 1 rank against 2, measured in one run.

For each configuration: training time and sampled nodes/s (all ranks, training only, from the
script's metrics) and the peak memory of the whole job, launcher and ranks together, counting
shared pages once (the sum of PSS over the process tree, sampled every 0.5 s): over the whole run,
and while the ranks run (the launcher alone builds the graph first, which can be the overall peak).
Each run trains --steps optimizer steps per rank (so 2 ranks see twice the seed nodes) and
scores --eval-nodes val and test nodes, which keeps a 1M-node graph to about a minute a run.

    python tools/bench/bench_gcn.py [--num-nodes 1000000] [--steps 100] [--repeats 3]

Writes build/bench/gcn.json. Goals from the lesson's issue, on 2 cores: 2 ranks at least 1.6x the
throughput of 1 rank x 1 thread, and the 2-rank job's peak memory under 1.3x the 1-rank job's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "notebooks"))
from bench import positive  # noqa: E402
from course_helpers import PeakMemory  # noqa: E402


def run(nprocs, threads, args):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [sys.executable, str(REPO / "ddp_scripts" / "gcn_ddp.py"), "--device", "cpu",
               "--nprocs", str(nprocs), "--threads-per-proc", str(threads), "--dataset", "synthetic",
               "--num-nodes", str(args.num_nodes), "--epochs", "1", "--max-steps", str(args.steps),
               "--eval-nodes", str(args.eval_nodes), "--quiet", "--metrics-json", str(metrics)]
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        memory = PeakMemory(workers=nprocs)  # the same measurement as notebook 04's
        memory.watch(proc)
        _, err = proc.communicate()
        memory.join()
        if proc.returncode != 0:
            sys.exit(f"bench_gcn: {' '.join(cmd)} failed:\n{err}")
        epoch = json.loads(metrics.read_text())["epochs"][-1]
        return {"seconds": epoch["seconds"], "nodes_per_second": epoch["sampled_nodes_per_second"],
                "peak_pss_bytes": memory.peak, "peak_ranks_pss_bytes": memory.peak_with_workers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-nodes", type=positive(int), default=1_000_000)
    parser.add_argument("--steps", type=positive(int), default=100, help="optimizer steps per rank")
    parser.add_argument("--eval-nodes", type=positive(int), default=5000)
    parser.add_argument("--repeats", type=positive(int), default=3)
    parser.add_argument("--json", type=Path, default=REPO / "build" / "bench" / "gcn.json")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    configs = [("1 rank x 1 thread", 1, 1), (f"1 rank x {cores} threads", 1, cores),
               ("2 ranks x 1 thread", 2, 1)]
    print(f"GCN on a synthetic graph of {args.num_nodes:,} nodes, {args.steps} steps of 512 seed nodes "
          f"per rank, {cores} cores, median of {args.repeats} interleaved runs\n", flush=True)
    samples = {name: [] for name, *_ in configs}
    for repeat in range(args.repeats):
        for name, nprocs, threads in configs:
            r = run(nprocs, threads, args)
            samples[name].append(r)
            print(f"  run {repeat + 1}/{args.repeats}  {name:<20} {r['seconds']:6.1f} s  "
                  f"{r['nodes_per_second']:>10,.0f} sampled nodes/s  peak {r['peak_pss_bytes'] / 2**20:6.0f} "
                  f"MiB, {r['peak_ranks_pss_bytes'] / 2**20:6.0f} MiB while training", flush=True)
    rows = []
    for name, *_ in configs:
        runs = samples[name]
        rows.append({"name": name, "runs": runs,
                     **{k: statistics.median(r[k] for r in runs)
                        for k in ("seconds", "nodes_per_second", "peak_pss_bytes", "peak_ranks_pss_bytes")}})
    ref, fair, two = rows
    print(f"\n{'configuration':<22} {'train s':>8} {'sampled nodes/s':>16} {'vs 1x1':>7} "
          f"{'vs 1x' + str(cores):>7} {'peak MiB':>9} {'training':>9}")
    for row in rows:
        print(f"{row['name']:<22} {row['seconds']:>8.1f} {row['nodes_per_second']:>16,.0f} "
              f"{row['nodes_per_second'] / ref['nodes_per_second']:>6.2f}x "
              f"{row['nodes_per_second'] / fair['nodes_per_second']:>6.2f}x "
              f"{row['peak_pss_bytes'] / 2**20:>9.0f} {row['peak_ranks_pss_bytes'] / 2**20:>9.0f}")
    speedup = two["nodes_per_second"] / ref["nodes_per_second"]
    fair_speedup = two["nodes_per_second"] / fair["nodes_per_second"]
    memory = two["peak_pss_bytes"] / ref["peak_pss_bytes"]
    memory_ranks = two["peak_ranks_pss_bytes"] / ref["peak_ranks_pss_bytes"]
    print(f"\n2 ranks vs 1 rank x 1 thread: {speedup:.2f}x throughput (goal >= 1.6x), "
          f"{memory:.2f}x peak memory of the job (goal < 1.3x), {memory_ranks:.2f}x while training; "
          f"vs 1 rank x {cores} threads (every core in one process): {fair_speedup:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"num_nodes": args.num_nodes, "steps": args.steps, "cores": cores,
                                     "rows": rows, "speedup": speedup, "speedup_vs_all_cores": fair_speedup,
                                     "memory_ratio": memory,
                                     "memory_ratio_training": memory_ranks}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
