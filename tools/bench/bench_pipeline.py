"""Benchmark for lesson 11's pipeline: its step against the number of micro-batches, on THIS machine.

mnist_model_parallel.py --mode pp on 2 stages, lesson 11's section 2 in full (the MLP at width 512,
a global batch of 64, 20 steps, --no-shuffle), GPipe, for M = 1, 2, 4, 8 and 16 micro-batches, --runs
times in rounds (every M once per round). For each run: the median step (the first left out) and,
from the script's timeline, the slowest stage's median forward + backward of one micro-batch.
Writes docs/measured/pipeline.json (committed: lesson 13's planner is checked against it).

    python tools/bench/bench_pipeline.py [--runs 3]
"""
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from bench import cores, cpu_name, positive, run_metrics

REPO = Path(__file__).resolve().parents[2]
MICRO = [1, 2, 4, 8, 16]
CONFIG = ["--mode", "pp", "--nprocs", "2", "--width", "512", "--batch-size", "64", "--lr", "0.01",
          "--max-steps", "20", "--no-shuffle", "--quiet"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive(int), default=3)
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "measured" / "pipeline.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "ddp_scripts"))
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", str(REPO / "data"), verbose=False)
    data = ["--dataset", dataset, "--data-dir", str(REPO / "data")]
    machine, date = f"{cpu_name()}, {cores()} cores", datetime.date.today().isoformat()
    print(f"{machine}, {date}: mnist_model_parallel.py {' '.join(CONFIG)}, {args.runs} runs in rounds",
          flush=True)
    runs = {m: [] for m in MICRO}
    for round_ in range(args.runs):
        for m in MICRO:
            metrics = run_metrics("mnist_model_parallel.py", ["--microbatches", str(m)], [*CONFIG, *data])
            step = statistics.median(metrics["seconds_per_step"][1:])
            runs[m].append({"step_s": step, "slot_s": metrics["slot_seconds"],
                            "idle_shares": metrics["idle_shares"]})
            print(f"  round {round_ + 1}  M = {m:2d}: {step * 1e3:6.1f} ms a step, slot "
                  f"{runs[m][-1]['slot_s'] * 1e3:.2f} ms", flush=True)
    rows = [{"microbatches": m, "stages": 2, "step_s": statistics.median(r["step_s"] for r in runs[m]),
             "runs": runs[m]} for m in MICRO]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "date": date, "dataset": dataset,
                                     "config": CONFIG, "statistic": "median step of each run (the first "
                                     "left out); step_s: the median of the runs", "rows": rows}, indent=2))
    for row in rows:
        print(f"M = {row['microbatches']:2d}: {row['step_s'] * 1e3:6.1f} ms a step (median of {args.runs})")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
