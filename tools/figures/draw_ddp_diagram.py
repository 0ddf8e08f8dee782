"""Draw figures/ddp_process_diagram.png: the life of a DDP run, launcher to teardown.

In the spirit of Figure 7.3 of Graph Neural Networks in Action: one lane per process, each step a
box, and the collective operations as bands across all lanes (every rank must reach them).

    python tools/figures/draw_ddp_diagram.py [--out figures/ddp_process_diagram.png]
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

LANES = ["rank 0", "rank 1", "rank N-1"]
LANE_X = [2.2, 5.5, 9.6]  # a gap between rank 1 and rank N-1 holds the dots
BOX_W, BOX_H = 2.9, 0.62
LOCAL, COLLECTIVE, LAUNCH = "#e8f1fb", "#fde9c9", "#e5f4e3"

# (y, text in each lane, collective band text or None)
STEPS = [
    (8.1, "init_process_group(\"gloo\" | \"nccl\",\nrank, world_size, timeout)",
     "process group: all ranks meet at MASTER_ADDR:MASTER_PORT"),
    (7.0, "model = DDP(build_model())", "broadcast: rank 0's weights to every rank"),
    (5.9, "DistributedSampler: samples\nr, r+N, r+2N, ...   set_epoch(e)", None),
    (4.8, "forward on own batch,\nloss, backward()", "all-reduce: gradients averaged during backward"),
    (3.7, "optimizer.step()\n(identical update on every rank)", None),
    (2.6, "evaluate own test shard", "all_reduce(SUM): loss, correct, count"),
    (1.5, "dist.barrier()   (optional)", "barrier, optional: nobody starts the next epoch early"),
    (0.4, "destroy_process_group()", None),
]


def box(ax, x, y, text, color, w=BOX_W, h=BOX_H, size=8.5, weight="normal"):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.03,rounding_size=0.08",
                                facecolor=color, edgecolor="#555555", linewidth=0.9, zorder=3))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, weight=weight, zorder=4)


def arrow(ax, start, end, color="#555555", style="-|>", rad=0.0, lw=1.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", zorder=5))


def draw(out):
    fig, ax = plt.subplots(figsize=(11.5, 9.2))
    ax.set_xlim(0, 12.6)
    ax.set_ylim(-0.3, 11.0)
    ax.axis("off")

    # The launcher: one process that prepares shared things once, then starts N workers.
    box(ax, 5.9, 10.3, "launcher:  python mnist_ddp_cpu.py --nprocs N   (or  torchrun --nproc-per-node N)\n"
        "prepare the data once,  pick a free MASTER_PORT,  mp.spawn(worker, nprocs=N)",
        LAUNCH, w=9.4, h=0.9, size=9.5)
    for x in LANE_X:
        arrow(ax, (5.9, 9.82), (x, 9.35))
    for x, name in zip(LANE_X, LANES):
        ax.text(x, 9.1, f"process {name}", ha="center", va="center", fontsize=10, weight="bold")
    ax.text((LANE_X[1] + LANE_X[2]) / 2, 9.1, ". . .", ha="center", va="center", fontsize=14)

    for y, text, band in STEPS:
        if band:  # a collective: a band across all lanes, every rank must arrive
            ax.add_patch(FancyBboxPatch((0.6, y - 0.46), 10.6, 0.92, boxstyle="round,pad=0.02",
                                        facecolor=COLLECTIVE, edgecolor="#c98a2b", lw=0.8, zorder=1))
            ax.text(11.3, y, band.replace(": ", ":\n", 1), ha="left", va="center", fontsize=7.5,
                    color="#8a5a12", zorder=4)
        for x in LANE_X:
            box(ax, x, y, text, LOCAL, size=8)
        ax.text((LANE_X[1] + LANE_X[2]) / 2, y, ". . .", ha="center", va="center", fontsize=12)
    for x in LANE_X:
        for (y0, *_), (y1, *_) in zip(STEPS, STEPS[1:]):
            arrow(ax, (x, y0 - BOX_H / 2), (x, y1 + BOX_H / 2))
        # each epoch loops from the barrier back to the sampler
        left, outer = x - BOX_W / 2, x - BOX_W / 2 - 0.16
        ax.plot([left, outer, outer], [1.5, 1.5, 5.9], color="#2b6cb0", lw=1.3, zorder=5)
        arrow(ax, (outer, 5.9), (left, 5.9), color="#2b6cb0", lw=1.3)
    ax.text(LANE_X[0] - BOX_W / 2 - 0.5, 3.7, "next\nepoch", ha="center", va="center",
            fontsize=8, color="#2b6cb0")

    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, fc=LAUNCH, ec="#555"),
                       plt.Rectangle((0, 0), 1, 1, fc=LOCAL, ec="#555"),
                       plt.Rectangle((0, 0), 1, 1, fc=COLLECTIVE, ec="#c98a2b")],
              labels=["runs once, before the workers", "runs in each process on its own",
                      "collective: every rank must take part"],
              loc="lower center", bbox_to_anchor=(0.5, -0.06), ncol=3, fontsize=8.5, frameon=False)
    ax.set_title("A DistributedDataParallel run: N processes, one process group", fontsize=12)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "figures" / "ddp_process_diagram.png"
    parser.add_argument("--out", type=Path, default=default)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
