"""Draw figures/ddp_data_flow.png: one training step of data parallelism, what moves where.

The global batch is split across the ranks (DistributedSampler: rank r takes samples r, r+N, ...);
each rank runs forward and backward on its share with its own replica of the model and gets its
own gradients; one all-reduce averages them; every rank applies the same averaged gradients to the
same weights, so the replicas stay equal. Drawn for 2 ranks, with made-up gradient values whose
average is computed here, not typed in.

    python tools/figures/draw_data_flow.py [--out figures/ddp_data_flow.png]
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

RANK_COLORS = ["#4f81bd", "#e07b39"]  # rank 0, rank 1
LOCAL, COLLECTIVE, SAME = "#e8f1fb", "#fde9c9", "#e5f4e3"
GRADIENTS = [[0.6, -0.3, 0.2, 0.5], [0.2, -0.5, 0.4, -0.1]]  # each rank's, for 4 parameters
LANE_X = [3.2, 8.8]


def box(ax, x, y, w, h, text, color, size=9.5):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.03,rounding_size=0.1",
                                facecolor=color, edgecolor="#555555", linewidth=0.9, zorder=2))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, zorder=4)


def arrow(ax, start, end, rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, color="#555555", lw=1.0,
                                 connectionstyle=f"arc3,rad={rad}", zorder=3))


def bars(ax, x, y, values, color, label):
    """A small bar chart of gradient values centred at (x, y), with its label underneath."""
    width, scale = 0.32, 0.55
    ax.plot([x - 0.8, x + 0.8], [y, y], color="#888888", lw=0.6, zorder=4)
    for i, value in enumerate(values):
        left = x - 0.7 + i * 0.38
        ax.add_patch(Rectangle((left, min(y, y + value * scale)), width, abs(value) * scale,
                               facecolor=color, edgecolor="none", zorder=5))
    ax.text(x, y - 0.55, label, ha="center", va="center", fontsize=8.5, zorder=5)


def draw(out):
    average = [sum(values) / len(values) for values in zip(*GRADIENTS)]
    fig, ax = plt.subplots(figsize=(12, 9.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 11.6)
    ax.axis("off")

    # The global batch: 2B samples, dealt out in turn (rank r takes r, r+N, r+2N, ...).
    ax.text(6, 11.25, "one global batch of N x B samples (here N = 2 ranks, B = 6 per rank)",
            ha="center", fontsize=10.5, weight="bold")
    for i in range(12):
        ax.add_patch(Rectangle((2.4 + i * 0.6, 10.35), 0.5, 0.5, facecolor=RANK_COLORS[i % 2],
                               edgecolor="white", zorder=3))
        ax.text(2.65 + i * 0.6, 10.6, str(i), ha="center", va="center", fontsize=8, color="white", zorder=4)
    ax.text(6, 9.95, "DistributedSampler: rank r takes positions r, r+N, r+2N, ... of one shuffle that "
            "every rank draws alike", ha="center",
            fontsize=9, style="italic")

    for rank, (x, color) in enumerate(zip(LANE_X, RANK_COLORS)):
        arrow(ax, (6, 9.75), (x, 9.25))
        ax.text(x, 9.0, f"rank {rank}", ha="center", fontsize=11, weight="bold", color=color)
        box(ax, x, 8.1, 4.6, 1.0, f"its B samples: {', '.join(str(i) for i in range(rank, 12, 2))}\n"
            "forward with its replica of the weights W", LOCAL)
        arrow(ax, (x, 7.58), (x, 7.12))
        box(ax, x, 6.55, 4.6, 1.0, "loss.backward(): gradients of the mean\nloss over its B samples", LOCAL)
        bars(ax, x, 5.35, GRADIENTS[rank], color, f"g{rank}: rank {rank}'s gradients (they differ)")

    # The all-reduce: one collective that every rank must reach.
    ax.add_patch(Rectangle((0.4, 3.55), 11.2, 0.95, facecolor=COLLECTIVE, edgecolor="#c9a15a", zorder=1))
    ax.text(6, 4.2, "all-reduce, average:  g = (g0 + g1) / N", ha="center", fontsize=10.5, weight="bold")
    ax.text(6, 3.8, "DDP runs it inside backward(), bucket by bucket, while the rest of backward goes on",
            ha="center", fontsize=8.5, style="italic")
    for x in LANE_X:
        arrow(ax, (x, 4.75), (x, 4.52))

    for x in LANE_X:
        bars(ax, x, 2.95, average, "#6a9f58", "g: the same averaged gradients on every rank")
        arrow(ax, (x, 2.28), (x, 1.88))
        box(ax, x, 1.4, 4.6, 0.9,
            "optimizer.step():  W <- W - lr * g\nthe same step: the replicas stay equal", SAME)
    ax.text(6, 0.35, "= one process taking one step on all N x B samples: the average of the ranks' mean "
            "gradients\nis the mean gradient of the whole batch (equal shares)", ha="center", fontsize=9.5)

    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        default=str(Path(__file__).resolve().parents[2] / "figures" / "ddp_data_flow.png"))
    args = parser.parse_args()
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
