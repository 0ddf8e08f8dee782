"""Benchmark: what DDP on CPU buys on THIS machine, measured in one run, reported as ratios.

Rows (ConvNet, same number of optimizer steps, batch 64 per process):
  single x 1 thread       mnist_single.py --threads-per-proc 1          (the reference)
  single x all cores      mnist_single.py --threads-per-proc <cores>
  DDP N x 1 thread        mnist_ddp_cpu.py --nprocs N --threads-per-proc 1
  DDP N x all cores       mnist_ddp_cpu.py --nprocs N --threads-per-proc <cores>  (oversubscribed)
plus the input pipeline alone: torchvision's per-image PIL transforms vs tensors decoded once,
and, when CUDA GPUs are visible, mnist_ddp_gpu.py (NCCL) on 1 GPU and on all of them.

Each configuration runs --repeats times, interleaved; the median images/s is reported.
Writes build/bench/cpu.json and figures/ddp_cpu_speedup.png.

    python tools/bench/bench.py [--steps 200] [--repeats 5] [--nprocs <cores>] [--gpu-only]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"
sys.path[:0] = [str(REPO / "notebooks"), str(SCRIPTS)]
from course_demos import input_pipeline_rates  # noqa: E402  (lesson 6 shows the same measurement)
from ddp_hardening import positive  # noqa: E402  (the scripts' own check of a count; the benchmarks use it)


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_metrics(script, args, common):
    """Run ddp_scripts/<script> once and return its metrics JSON (exit with its stderr if it fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [sys.executable, str(SCRIPTS / script), *args, *common, "--metrics-json", str(metrics)]
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if result.returncode != 0:
            sys.exit(f"{Path(sys.argv[0]).stem}: {' '.join(cmd)} failed:\n{result.stderr}")
        return json.loads(metrics.read_text())


def run_training(script, args, common):
    return run_metrics(script, args, common)["epochs"][-1]["images_per_second"]


def gpu_rates(common, repeats):
    """mnist_ddp_gpu.py on 1 GPU and on every visible GPU (NCCL), or a line saying why not."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("\nGPU rows skipped: no CUDA device is visible on this machine")
        return []
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    print(f"\nGPUs: {names}")
    rows = []
    for n in sorted({1, gpus}):
        runs = [run_training("mnist_ddp_gpu.py", ["--nprocs", str(n)], common) for _ in range(repeats)]
        rows.append({"name": f"DDP {n} GPU(s), NCCL", "images_per_second": statistics.median(runs),
                     "runs": runs})
    for row in rows:
        ratio = row["images_per_second"] / rows[0]["images_per_second"]
        print(f"{row['name']:<42} {row['images_per_second']:>10,.0f} {ratio:>7.2f}x vs 1 GPU")
    return rows


def plot(rows, machine, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = rows[0]["images_per_second"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r["name"] for r in rows][::-1]
    ratios = [r["images_per_second"] / ref for r in rows][::-1]
    bars = ax.barh(names, ratios, color=["#c0504d" if "oversubscribed" in n else "#4f81bd" for n in names])
    for bar, ratio, row in zip(bars, ratios, rows[::-1]):
        ax.text(bar.get_width() + 0.02, bar.get_y() + bar.get_height() / 2,
                f"{ratio:.2f}x  ({row['images_per_second']:,.0f} images/s)", va="center", fontsize=9)
    ax.axvline(1, color="#888", lw=0.8, ls="--")
    ax.set_xlim(0, max(ratios) * 1.6)
    ax.set_xlabel("training throughput relative to one process x 1 thread")
    runs = len(rows[0]["runs"])
    ax.set_title(f"ConvNet on CPU, median of {runs} runs each\nmeasured on {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive(int), default=200)
    parser.add_argument("--repeats", type=positive(int), default=5)
    parser.add_argument("--nprocs", type=positive(int), default=max(2, cores()))
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    parser.add_argument("--figure", type=Path, default=REPO / "figures" / "ddp_cpu_speedup.png")
    parser.add_argument("--json", type=Path, default=REPO / "build" / "bench" / "cpu.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --json")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows; writes nothing")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads(args.json.read_text())
        plot(saved["rows"], saved["machine"], args.figure)
        return

    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", args.data_dir)
    n, c = args.nprocs, cores()
    common = ["--model", "convnet", "--max-steps", str(args.steps), "--batch-size", "64",
              "--dataset", dataset, "--data-dir", args.data_dir, "--quiet"]
    if args.gpu_only:
        if not gpu_rates(common, args.repeats):
            sys.exit(1)
        return
    configs = [
        ("single x 1 thread", "mnist_single.py", ["--threads-per-proc", "1"]),
        (f"single x {c} threads", "mnist_single.py", ["--threads-per-proc", str(c)]),
        (f"DDP {n} procs x 1 thread", "mnist_ddp_cpu.py", ["--nprocs", str(n), "--threads-per-proc", "1"]),
        (f"DDP {n} procs x {c} threads (oversubscribed)", "mnist_ddp_cpu.py",
         ["--nprocs", str(n), "--threads-per-proc", str(c)]),
    ]
    machine = f"{cpu_name()}, {c} cores, torch {torch.__version__}"
    print(f"machine: {machine}\ndataset: {dataset}, {args.steps} steps of batch 64 per process, "
          f"median of {args.repeats} interleaved runs\n", flush=True)

    samples = {name: [] for name, *_ in configs}
    for repeat in range(args.repeats):
        for name, script, extra in configs:
            samples[name].append(run_training(script, extra, common))
            print(f"  run {repeat + 1}/{args.repeats}  {name:<40} {samples[name][-1]:>9,.0f} images/s",
                  flush=True)
    rows = [{"name": name, "images_per_second": statistics.median(samples[name]),
             "runs": samples[name]} for name, *_ in configs]

    ref, multi = rows[0]["images_per_second"], rows[1]["images_per_second"]
    print(f"\n{'configuration':<42} {'images/s':>10} {'vs 1x1':>8} {'vs 1x' + str(c):>8}   spread of runs")
    for row in rows:
        ips, runs = row["images_per_second"], row["runs"]
        print(f"{row['name']:<42} {ips:>10,.0f} {ips / ref:>7.2f}x {ips / multi:>7.2f}x   "
              f"{min(runs):,.0f} to {max(runs):,.0f}")

    pipeline = input_pipeline_rates(args.data_dir, dataset)
    print("\ninput pipeline alone, 1 thread (no model):")
    for name, rate in pipeline.items():
        print(f"  {name:<28} {rate:>10,.0f} images/s")

    gpu_rows = gpu_rates(common, args.repeats)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "dataset": dataset, "steps": args.steps,
                                     "rows": rows, "input_pipeline": pipeline, "gpu_rows": gpu_rows},
                                    indent=2))
    plot(rows, machine, args.figure)
    print(f"\nwrote {args.json} and {args.figure}")


if __name__ == "__main__":
    main()
