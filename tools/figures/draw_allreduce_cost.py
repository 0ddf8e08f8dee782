"""Figure for "DDP from the inside": the time of one all-reduce against its size, by hand and Gloo's.

    python ddp_scripts/allreduce_by_hand.py --mode measure --json build/allreduce.json
    python tools/figures/draw_allreduce_cost.py build/allreduce.json [--out figures/allreduce_cost.png]
    python tools/figures/draw_allreduce_cost.py   # measure first (make bench): build/bench/allreduce.json
                                 # and latency_n2/3/4.json (tools/figures/draw_inside_results.py)

Reads the JSON that allreduce_by_hand.py writes: the measured medians of ring_all_reduce and
dist.all_reduce on log-log axes, with lesson 6's model of a ring fitted to each as a line,
t = 2 (N - 1) alpha + 2 (N - 1) / N x size / B (alpha: one step's latency, B: the bandwidth),
alpha and B in the legend, and the machine and date of the measurement in the title.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COLOURS = {"ring": "#c0504d", "torch": "#4f81bd"}
LABELS = {"ring": "ring_all_reduce (by hand)", "torch": "dist.all_reduce (Gloo)"}


def fit_label(fit):
    bandwidth = fit["bandwidth_bytes_per_s"]
    return (f"α = {1e6 * fit['alpha_s']:.0f} µs a step, B = "
            + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "not fitted"))


def draw(json_path, out_path=REPO / "figures" / "allreduce_cost.png"):
    """Draw the measurements in json_path to out_path (a PNG); returns out_path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    data = json.loads(Path(json_path).read_text())
    rows = data["rows"]
    sizes = [r["bytes"] for r in rows]
    share = 2 * (data["nprocs"] - 1) / data["nprocs"]  # bytes each rank sends per byte all-reduced
    grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 200) for i in range(201)]  # even on a log axis
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("ring", "torch"):
        ax.plot(sizes, [1e3 * r[f"{name}_s"] for r in rows], "o", color=COLOURS[name],
                label=f"{LABELS[name]}, measured")
        fit = data["fit"][name]
        bandwidth = fit["bandwidth_bytes_per_s"]
        model = [1e3 * (fit["steps"] * fit["alpha_s"] + (share * size / bandwidth if bandwidth else 0))
                 for size in grid]
        ax.plot(grid, model, "-", color=COLOURS[name], lw=1, label=f"fit: {fit_label(fit)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes of float32 all-reduced)")
    ax.set_ylabel("time of one all-reduce (ms)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.1, 1, 10 ms
    ax.yaxis.set_minor_formatter(FuncFormatter(  # and 2 and 5 times those
        lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.grid(True, which="major", color="#ddd", lw=0.6)
    ax.legend(fontsize=8, loc="upper left")
    machine = data["machine"]
    ax.set_title(f"All-reduce over N = {data['nprocs']} processes, fitted t = 2 (N - 1) α + 2 (N - 1) / N × "
                 f"size / B (median of {data['repeats']})\n{machine['cpu']}, {machine['cores']} cores, torch "
                 f"{machine['torch']}, {data['date'][:10]}", fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="?",
                        help="written by allreduce_by_hand.py --mode measure --json (default: measure now)")
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "allreduce_cost.png")
    args = parser.parse_args()
    if args.json is None:
        args.json = REPO / "build" / "bench" / "allreduce.json"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        script = REPO / "ddp_scripts" / "allreduce_by_hand.py"
        command = [sys.executable, script, "--mode", "measure", "--nprocs", "2", "--json", args.json]
        subprocess.run(command, check=True)
        for n in (2, 3, 4):  # the fixed cost against N: 4 B to 4 KiB, 50 repeats (lesson 9's figure)
            subprocess.run([sys.executable, script, "--mode", "measure", "--nprocs", str(n), "--max-mb",
                            str(4096 / 2**20), "--repeats", "50", "--quiet", "--json",
                            args.json.with_name(f"latency_n{n}.json")], check=True)
    print(f"wrote {draw(args.json, args.out)}")


if __name__ == "__main__":
    main()
