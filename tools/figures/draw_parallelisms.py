"""Figure for lesson 11: what each of two ranks holds and sends in one step of lesson 6's MLP under
data parallelism (DDP), FSDP, tensor parallelism and pipeline parallelism.

    python tools/figures/draw_parallelisms.py [--out figures/parallelisms.png]

Each panel shows the MLP's three linear layers as nn.Linear stores their weights, output x input
(W x 784, W x W, 10 x W; dim 0 drawn as rows), on rank 0 and rank 1: the
part of each weight the rank holds (filled) against the whole (outlined), the share of the global
batch it computes, and what crosses between the ranks in a step, with its size in terms of P (the
parameters' bytes), B (the global batch), W (the hidden width) and M (micro-batches). Schematic: the
sizes come from the strategies' definitions, as lessons 9 to 11 derive and measure them.
"""
import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = [("W x 784", 0.9), ("W x W", 1.0), ("10 x W", 0.25)]  # nn.Linear's weight (out x in), height
HELD = {  # per strategy, per rank: the fraction (start, end) of each layer's rows held, ("cols", start,
    # end) of its columns; None: nothing of it
    "DDP": [[(0, 1)] * 3, [(0, 1)] * 3],
    "FSDP": [[(0, .5)] * 3, [(.5, 1)] * 3],
    "tensor parallel": [[(0, .5), ("cols", 0, .5), (0, 1)], [(.5, 1), ("cols", .5, 1), (0, 1)]],
    "pipeline parallel": [[(0, 1), None, None], [None, (0, 1), (0, 1)]],
}
BATCH = {"DDP": "B/2 samples each", "FSDP": "B/2 samples each", "tensor parallel": "all B samples, both",
         "pipeline parallel": "all B, in M micro-batches"}
SENT = {
    "DDP": "all-reduce of the gradients,\n2(N-1)/N x P per rank, once a step",
    "FSDP": "all-gather each layer (forward, backward),\nreduce-scatter its gradients: 1.5x DDP's\n"
            "bytes on NCCL, 2x on Gloo (an all-reduce)",
    "tensor parallel": "all-reduce of the second linear layer's output\n"
                       "(module \"3\"), B x W floats, in forward\n(none in backward here)",
    "pipeline parallel": "each micro-batch's activation 0 -> 1 (B/M x W),\n"
                         "its gradient 1 -> 0; idle (N-1)/(M+N-1)",
}


def draw(out=REPO / "figures" / "parallelisms.png"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(12, 3.6))
    for ax, (name, ranks) in zip(axes, HELD.items()):
        ax.set_xlim(0, 4.2)
        ax.set_ylim(-0.5, 4.0)
        ax.axis("off")
        ax.set_title(name, fontsize=11)
        for r, held in enumerate(ranks):
            x0 = 0.2 + r * 2.1
            ax.text(x0 + 0.8, 3.75, f"rank {r}", ha="center", fontsize=9, weight="bold")
            y = 3.4
            for (label, height), part in zip(LAYERS, held):
                y -= height + 0.12
                ax.add_patch(patches.Rectangle((x0, y), 1.6, height, fill=False, ec="#888", lw=0.8))
                if part is not None and part[0] == "cols":  # row-wise parallel: a block of columns
                    _, start, end = part
                    ax.add_patch(patches.Rectangle((x0 + 1.6 * start, y), 1.6 * (end - start), height,
                                                   color="#4f81bd", alpha=0.85))
                elif part is not None:
                    start, end = part
                    ax.add_patch(patches.Rectangle((x0, y + height * (1 - end)), 1.6, height * (end - start),
                                                   color="#4f81bd", alpha=0.85))
                ax.text(x0 + 0.8, y + height / 2, label, ha="center", va="center", fontsize=7,
                        color="white" if part == (0, 1) else "black")
        ax.text(2.1, 0.85 - 0.2, BATCH[name], ha="center", fontsize=8, style="italic")
        ax.annotate("", xy=(2.35, 1.9), xytext=(1.85, 1.9),
                    arrowprops=dict(arrowstyle="<|-|>", color="#c0504d", lw=2, mutation_scale=14))
        ax.text(2.1, 0.05, SENT[name], ha="center", va="center", fontsize=7.5, color="#c0504d")
    fig.suptitle("What each of 2 ranks holds (filled: the part of each weight it keeps; a weight as "
                 "nn.Linear stores it, output x input, dim 0 down) and sends in one step of lesson 6's MLP",
                 fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "parallelisms.png")
    print(f"wrote {draw(parser.parse_args().out)}")


if __name__ == "__main__":
    main()
