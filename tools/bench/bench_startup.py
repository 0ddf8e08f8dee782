"""Benchmark: what a short DDP job pays before its first step and after its last, on THIS machine.

Rows, each the wall time of one whole command (median of --repeats interleaved runs):
  python -c "import torch"         one interpreter that imports torch and exits: the floor
  the script, as it starts ranks   mnist_ddp_cpu.py --nprocs 2 --max-steps 5 (forked where safe)
  the script, spawned ranks        the same with DDP_START_METHOD=spawn (what GPU machines get)
The 5 steps themselves take a fraction of a second; the rest is start-up, evaluation and exit.
Writes build/bench/startup.json.

    python tools/bench/bench_startup.py [--repeats 5] [--steps 5]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import cores, cpu_name, positive

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"


def wall_seconds(command, env):
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"bench_startup: {' '.join(map(str, command))} failed:\n{result.stderr}")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive(int), default=5)
    parser.add_argument("--steps", type=positive(int), default=5)
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    parser.add_argument("--json", type=Path, default=REPO / "build" / "bench" / "startup.json")
    args = parser.parse_args()

    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts
    import torch

    dataset = mnist_parts.prepare_data("auto", args.data_dir, verbose=False)
    job = ["--nprocs", "2", "--max-steps", str(args.steps), "--model", "convnet", "--dataset", dataset,
           "--data-dir", args.data_dir, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "DDP_START_METHOD")}
    configs = [
        ('python -c "import torch"', [sys.executable, "-c", "import torch"], env),
        ("the script, as it starts ranks", [sys.executable, str(SCRIPTS / "mnist_ddp_cpu.py"), *job], env),
        ("the script, spawned ranks", [sys.executable, str(SCRIPTS / "mnist_ddp_cpu.py"), *job],
         {**env, "DDP_START_METHOD": "spawn"}),
    ]
    machine = f"{cpu_name()}, {cores()} cores, torch {torch.__version__}"
    date = datetime.date.today().isoformat()
    print(f"machine: {machine}, {date}\n{dataset}, 2 processes, {args.steps} steps, median of "
          f"{args.repeats} interleaved runs\n", flush=True)
    samples = {name: [] for name, *_ in configs}
    for repeat in range(args.repeats):
        for name, command, run_env in configs:
            samples[name].append(wall_seconds(command, run_env))
            print(f"  run {repeat + 1}/{args.repeats}  {name:<32} {samples[name][-1]:6.2f} s", flush=True)
    rows = [{"name": name, "seconds": statistics.median(runs), "runs": runs}
            for name, runs in samples.items()]
    reference = rows[1]["seconds"]
    print(f"\n{'command':<34} {'seconds':>8} {'vs the script':>14}   spread of runs")
    for row in rows:
        print(f"{row['name']:<34} {row['seconds']:>8.2f} {row['seconds'] / reference:>13.2f}x   "
              f"{min(row['runs']):.2f} to {max(row['runs']):.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "date": date, "dataset": dataset,
                                     "steps": args.steps, "rows": rows}, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
