"""Benchmark for sharding (mnist_fsdp.py): what each rank holds, and what a step costs, on THIS machine.

For 1, 2 and 3 ranks, each --shard mode (ddp, zero, fsdp) trains lesson 6's MLP (5.8M parameters)
with AdamW for --steps steps, global batch 60, on the first 6,000 images (the data is not what is
measured), Gloo on CPU with one thread per rank, or NCCL with --gpu. Each configuration runs
--repeats times, interleaved; reported (medians): the state one rank holds (parameters, gradients,
AdamW's state, counted from its local shards: state_mib_per_rank, the largest rank), its peak
memory (CPU: the process's peak resident set, torch and the data included; GPU: what torch
allocated), the time per step (the training epoch's seconds / steps, the first step's set-up
included), each as a ratio to DDP on as many ranks. Then, on CPU, the state each rank of
sharding_by_hand.py holds (--shard zero1, zero2, zero3 on 2 and 3 ranks, 2 steps; counted from its
tensors: one run each). Writes docs/measured/fsdp.json (committed: lesson 13's planner is checked
against it) and figures/fsdp_memory.png.

    python tools/bench/bench_fsdp.py [--steps 30] [--repeats 3] [--gpu]
"""
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
from bench import cores, cpu_name, positive, run_metrics

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "notebooks"))
from course_helpers import small_copy  # noqa: E402

MODES = ["ddp", "zero", "fsdp"]
BY_HAND = ["zero1", "zero2", "zero3"]  # sharding_by_hand.py's stages
GLOBAL_BATCH = 60  # splits over 1, 2 and 3 ranks


def machine_name(gpu):
    if gpu:
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{cpu_name()}, {cores()} cores, torch {torch.__version__}"


def plot(rows, machine, date, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["ranks"] for r in rows})
    by_key = {(r["mode"], r["ranks"]): r for r in rows}
    panels = [("state_mib", "state per rank (MiB):\nparameters + gradients + AdamW"),
              ("peak_mib", "peak memory per rank (MiB)"), ("ms_per_step", "time per step (ms)")]
    colours = {"ddp": "#4f81bd", "zero": "#9bbb59", "fsdp": "#c0504d"}
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    width = 0.8 / len(MODES)
    for ax, (key, title) in zip(axes, panels):
        for i, mode in enumerate(MODES):
            xs = [n + (i - 1) * width for n in ranks]
            values = [by_key[(mode, n)][key] for n in ranks]
            bars = ax.bar(xs, values, width, label=f"--shard {mode}", color=colours[mode])
            for bar, n in zip(bars, ranks):
                ratio = by_key[(mode, n)][key] / by_key[("ddp", n)][key]
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{ratio:.2f}",
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(ranks)
        ax.set_xlabel("ranks")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.12)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"mnist_fsdp.py, MLP + AdamW, medians of {len(rows[0]['runs'])} runs (numbers on the "
                 f"bars: ratio to DDP on as many ranks)\nmeasured on {machine}, {date}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def state_by_hand(dataset, data_dir):
    """What each rank of sharding_by_hand.py holds after 2 steps: parameters (zero2: with the rows
    its optimizer steps), gradients and optimizer state, in bytes, counted from its tensors."""
    rows = []
    for n in (2, 3):
        for shard in BY_HAND:
            m = run_metrics("sharding_by_hand.py", ["--shard", shard, "--nprocs", str(n)],
                            ["--global-batch-size", str(GLOBAL_BATCH), "--max-steps", "2", "--quiet",
                             "--dataset", dataset, "--data-dir", str(data_dir)])
            state = [sum(kinds) for kinds in zip(m["parameter_bytes"], m["gradient_bytes"],
                                                 m["optimizer_state_bytes"])]
            rows.append({"shard": shard, "ranks": n, "state_bytes_per_rank": state,
                         "parameter_bytes": m["parameter_bytes"], "gradient_bytes": m["gradient_bytes"],
                         "optimizer_state_bytes": m["optimizer_state_bytes"]})
            print(f"  by hand  {shard:<5} {n} ranks  state {[round(b / 2**20, 2) for b in state]} MiB",
                  flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive(int), default=30)
    parser.add_argument("--repeats", type=positive(int), default=3)
    parser.add_argument("--gpu", action="store_true", help="NCCL on 1 to 3 GPUs instead of Gloo on CPU")
    parser.add_argument("--figure", type=Path, default=REPO / "figures" / "fsdp_memory.png")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "measured" / "fsdp.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --json")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads(args.json.read_text())
        plot(saved["rows"], saved["machine"], saved["date"], args.figure)
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpu and gpus == 0:
        sys.exit("bench_fsdp: --gpu needs a visible CUDA device")
    ranks = list(range(1, min(3, gpus) + 1)) if args.gpu else [1, 2, 3]

    sys.path.insert(0, str(REPO / "ddp_scripts"))
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", str(REPO / "data"))
    data_dir = small_copy(dataset, REPO / "data" / "smoke")
    device = [] if args.gpu else ["--backend", "gloo", "--device", "cpu", "--threads-per-proc", "1"]
    common = [*device, "--model", "mlp", "--global-batch-size", str(GLOBAL_BATCH), "--max-steps",
              str(args.steps), "--dataset", dataset, "--data-dir", str(data_dir), "--quiet"]
    machine, date = machine_name(args.gpu), datetime.date.today().isoformat()
    print(f"machine: {machine}\ndate: {date}\n{dataset} (first 6,000 images), MLP + AdamW, global batch "
          f"{GLOBAL_BATCH}, {args.steps} steps, median of {args.repeats} interleaved runs\n", flush=True)
    configs = [(mode, n) for n in ranks for mode in MODES]
    samples = {config: [] for config in configs}
    for repeat in range(args.repeats):
        for mode, n in configs:
            m = run_metrics("mnist_fsdp.py", ["--shard", mode, "--nprocs", str(n)], common)
            epoch = m["epochs"][-1]
            sample = {"state_mib": max(m["state_mib_per_rank"]), "peak_mib": max(m["peak_mib_per_rank"]),
                      "ms_per_step": 1e3 * epoch["seconds"] / epoch["steps"],
                      "state_mib_per_rank": m["state_mib_per_rank"],
                      "peak_mib_per_rank": m["peak_mib_per_rank"]}
            samples[(mode, n)].append(sample)
            print(f"  run {repeat + 1}/{args.repeats}  {mode:<5} {n} rank(s)  state "
                  f"{sample['state_mib']:6.1f} MiB  peak {sample['peak_mib']:7.1f} MiB  "
                  f"{sample['ms_per_step']:7.1f} ms/step", flush=True)
    rows = []
    for mode, n in configs:
        runs = samples[(mode, n)]
        rows.append({"mode": mode, "ranks": n, "runs": runs,
                     **{key: statistics.median(r[key] for r in runs)
                        for key in ("state_mib", "peak_mib", "ms_per_step")}})

    by_key = {(r["mode"], r["ranks"]): r for r in rows}
    print(f"\nper rank, the largest rank; ratios to DDP on as many ranks ({machine}, {date})")
    print(f"{'ranks':>5} {'mode':<5} {'state MiB':>10} {'ratio':>6} {'peak MiB':>9} {'ratio':>6} "
          f"{'ms/step':>8} {'ratio':>6}   spread of ms/step")
    for r in rows:
        ddp = by_key[("ddp", r["ranks"])]
        times = [run["ms_per_step"] for run in r["runs"]]
        ratio = {key: r[key] / ddp[key] for key in ("state_mib", "peak_mib", "ms_per_step")}
        print(f"{r['ranks']:>5} {r['mode']:<5} {r['state_mib']:>10.1f} {ratio['state_mib']:>5.2f}x "
              f"{r['peak_mib']:>9.1f} {ratio['peak_mib']:>5.2f}x {r['ms_per_step']:>8.1f} "
              f"{ratio['ms_per_step']:>5.2f}x   {min(times):.1f} to {max(times):.1f}")

    by_hand = [] if args.gpu else state_by_hand(dataset, data_dir)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "date": date, "dataset": dataset,
                                     "steps": args.steps, "global_batch": GLOBAL_BATCH, "rows": rows,
                                     "by_hand": by_hand}, indent=2))
    plot(rows, machine, date, args.figure)
    print(f"\nwrote {args.json} and {args.figure}")


if __name__ == "__main__":
    main()
