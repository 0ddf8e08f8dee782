"""Benchmark for lesson 6: what communicating less buys on THIS machine, measured in one run.

For each model (linear: 31 KB of gradients, convnet: 1.2 MB, mlp: 23 MB), mnist_ddp_comm.py with
1 and 2 processes (one thread each, Gloo on CPU, or NCCL with --gpu), without and with gradient
accumulation (--accum-steps 4, a quarter of the optimizer steps: the same micro-batches), and for
the MLP the fp16 and bf16 compression hooks. Every configuration runs --repeats times, interleaved;
the median images/s is reported, as ratios side by side, with the all-reduce of each model's
gradients timed alone (the script's start-up measurement, median over the runs).
Writes build/bench/comm.json and figures/ddp_comm_cost.png.

    python tools/bench/bench_comm.py [--repeats 3] [--gpu]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from bench import cores, cpu_name, positive, run_metrics

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"
# Micro-batches of 64 per process and run: enough for a few seconds of training per model.
MICRO_BATCHES = {"linear": 1200, "convnet": 200, "mlp": 200}


def machine_name(gpu):
    if gpu:
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{cpu_name()}, {cores()} cores, torch {torch.__version__}"


def configurations():
    """(model, name, flags); names are what the table and the figure show."""
    configs = []
    for model, micro in MICRO_BATCHES.items():
        for accum in (1, 4):
            for nprocs in (1, 2):
                configs.append((model, f"{nprocs} proc, K={accum}",
                                ["--model", model, "--nprocs", str(nprocs), "--accum-steps", str(accum),
                                 "--max-steps", str(micro // accum)]))
    for hook in ("fp16", "bf16"):
        configs.append(("mlp", f"2 proc, K=1, {hook} hook",
                        ["--model", "mlp", "--nprocs", "2", "--comm-hook", hook,
                         "--max-steps", str(MICRO_BATCHES["mlp"])]))
    return configs


def plot(rows, machine, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ips = {(r["model"], r["name"]): r["images_per_second"] for r in rows}
    bars = []  # (label, ratio of 2 processes to 1 at the same K)
    for model in MICRO_BATCHES:
        for accum in (1, 4):
            ratio = ips[(model, f"2 proc, K={accum}")] / ips[(model, f"1 proc, K={accum}")]
            bars.append((f"{model}, K={accum}", ratio))
    for hook in ("fp16", "bf16"):
        bars.append((f"mlp, K=1, {hook} hook", ips[("mlp", f"2 proc, K=1, {hook} hook")]
                     / ips[("mlp", "1 proc, K=1")]))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels, ratios = [b[0] for b in bars][::-1], [b[1] for b in bars][::-1]
    colours = ["#9bbb59" if "K=4" in label else "#c0504d" if "hook" in label else "#4f81bd"
               for label in labels]
    drawn = ax.barh(labels, ratios, color=colours)
    for bar, ratio in zip(drawn, ratios):
        ax.text(bar.get_width() + 0.02, bar.get_y() + bar.get_height() / 2, f"{ratio:.2f}x",
                va="center", fontsize=9)
    ax.axvline(1, color="#888", lw=0.8, ls="--")
    ax.axvline(2, color="#888", lw=0.8, ls=":")
    ax.set_xlim(0, max(2.2, max(ratios) * 1.15))
    ax.set_xlabel("images/s of 2 processes relative to 1 process at the same K (2.0 = perfect)")
    ax.set_title(f"DDP, 2 processes vs 1: K = micro-batches per all-reduce (median of "
                 f"{len(rows[0]['runs'])} runs each)\nmeasured on {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive(int), default=3)
    parser.add_argument("--gpu", action="store_true", help="NCCL on 1 and 2 GPUs instead of Gloo on CPU")
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    parser.add_argument("--figure", type=Path, default=REPO / "figures" / "ddp_comm_cost.png")
    parser.add_argument("--json", type=Path, default=REPO / "build" / "bench" / "comm.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --json")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads(args.json.read_text())
        plot(saved["rows"], saved["machine"], args.figure)
        return
    if args.gpu and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        sys.exit("bench_comm: --gpu needs 2 visible CUDA devices")

    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", args.data_dir)
    device = [] if args.gpu else ["--backend", "gloo", "--device", "cpu", "--threads-per-proc", "1"]
    common = [*device, "--batch-size", "64", "--dataset", dataset, "--data-dir", args.data_dir, "--quiet"]
    machine = machine_name(args.gpu)
    configs = configurations()
    print(f"machine: {machine}\ndataset: {dataset}, batch 64 per process, median of {args.repeats} "
          f"interleaved runs\n", flush=True)
    samples = {(model, name): [] for model, name, _ in configs}
    allreduce = {(model, name): [] for model, name, _ in configs}
    for repeat in range(args.repeats):
        for model, name, flags in configs:
            m = run_metrics("mnist_ddp_comm.py", flags, common)
            ips, ms = m["epochs"][-1]["images_per_second"], m["allreduce_ms"]
            samples[(model, name)].append(ips)
            allreduce[(model, name)].append(ms)
            print(f"  run {repeat + 1}/{args.repeats}  {model:<8} {name:<22} {ips:>10,.0f} images/s",
                  flush=True)
    rows = [{"model": model, "name": name, "images_per_second": statistics.median(samples[(model, name)]),
             "runs": samples[(model, name)], "allreduce_ms": statistics.median(allreduce[(model, name)])}
            for model, name, _ in configs]

    by_key = {(r["model"], r["name"]): r for r in rows}
    print(f"\n{'model':<8} {'configuration':<22} {'images/s':>10} {'vs 1 proc, K=1':>15} "
          f"{'vs 1 proc, same K':>18}  all-reduce alone   spread of runs")
    for r in rows:
        same_k = r["name"].replace("2 proc", "1 proc").split(", ")[:2]
        reference = by_key[(r["model"], ", ".join(same_k))]["images_per_second"]
        base = by_key[(r["model"], "1 proc, K=1")]["images_per_second"]
        alone = f"{r['allreduce_ms']:.2f} ms" if r["name"].startswith("2 proc") else ""
        print(f"{r['model']:<8} {r['name']:<22} {r['images_per_second']:>10,.0f} "
              f"{r['images_per_second'] / base:>14.2f}x {r['images_per_second'] / reference:>17.2f}x  "
              f"{alone:>16}   {min(r['runs']):,.0f} to {max(r['runs']):,.0f}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "dataset": dataset, "rows": rows}, indent=2))
    plot(rows, machine, args.figure)
    print(f"\nwrote {args.json} and {args.figure}")


if __name__ == "__main__":
    main()
