"""Figure for lesson 10: what each rank holds under DDP, ZeRO (stage 1) and FSDP, for lesson 6's MLP
with AdamW in float32, drawn from the model's own parameter count.

    python tools/figures/draw_sharding.py [--ranks 2] [--out figures/sharding_what_each_rank_holds.png]

Per rank, three stacked parts: the parameters (P bytes), their gradients (P) and AdamW's two
running averages (2P). DDP keeps all of it on every rank. ZeRO keeps AdamW's state of its share of
the parameters, dealt out as torch 2.14.1's ZeroRedundancyOptimizer deals them: whole tensors,
largest first, each to the rank with the fewest elements so far. FSDP splits all three, each
tensor's rows dealt out as torch.chunk deals them (blocks of ceil(rows / N), rank 0 first).
mnist_fsdp.py's state_mib_per_rank measures the same (tests/unit/test_fsdp_parts.py checks that
these counts equal it), and lesson 10 shows both.
"""
import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS = [("parameters", "#4f81bd"), ("gradients", "#9bbb59"), ("AdamW state (2 averages)", "#c0504d")]


def zero_shares(shapes, n):
    """The elements of the parameters each rank optimizes under ZeroRedundancyOptimizer: sorted by
    size, largest first, each to the rank with the fewest so far (the lowest rank on a tie)."""
    sizes = [0] * n
    for numel in sorted((math.prod(s) for s in shapes), reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return sizes


def fsdp_shares(shapes, n):
    """The elements each rank holds of every parameter under fully_shard: its rows in blocks of
    ceil(rows / N), as torch.chunk cuts them (the last ranks may get fewer, or none)."""
    shares = [0] * n
    for shape in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        block = -(-rows // n)
        for rank in range(n):
            shares[rank] += max(0, min(block, rows - rank * block)) * rest
    return shares


def held(mode, n, shapes):
    """Per rank, MiB of (parameters, gradients, optimizer state), float32 and AdamW."""
    mib = 4 / 2**20
    p = sum(math.prod(s) for s in shapes) * mib
    if mode == "DDP":
        return [(p, p, 2 * p)] * n
    if mode == "ZeRO-1":
        return [(p, p, 2 * share * mib) for share in zero_shares(shapes, n)]
    return [(share * mib, share * mib, 2 * share * mib) for share in fsdp_shares(shapes, n)]


def draw(n=2, out=REPO / "figures" / "sharding_what_each_rank_holds.png"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(REPO / "ddp_scripts"))
    from mnist_fsdp import build_model

    shapes = [tuple(t.shape) for t in build_model("mlp").parameters()]
    params = sum(math.prod(s) for s in shapes)
    p = params * 4 / 2**20  # float32, MiB
    modes = ["DDP", "ZeRO-1", "FSDP"]
    fig, ax = plt.subplots(figsize=(8, 3.9))
    rows = [(mode, rank) for mode in modes for rank in range(n)]
    for y, (mode, rank) in enumerate(reversed(rows)):
        left = 0.0
        for (name, colour), size in zip(PARTS, held(mode, n, shapes)[rank]):
            ax.barh(y, size, left=left, color=colour, edgecolor="white", label=name if y == 0 else None)
            left += size
        ax.text(left + 1, y, f"{left:.0f} MiB", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{mode}, rank {rank}" for mode, rank in reversed(rows)], fontsize=9)
    ax.set_xlabel("MiB held by one rank (float32)")
    ax.set_xlim(0, 4 * p * 1.18)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"What each of {n} ranks holds: lesson 6's MLP ({params / 1e6:.1f}M parameters) with AdamW\n"
                 f"DDP: 4P on every rank. ZeRO-1: P + P + AdamW's state of its share of whole tensors, "
                 f"dealt largest first.\nFSDP: every tensor's rows dealt out, about 4P/N. P = {p:.1f} MiB",
                 fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "sharding_what_each_rank_holds.png")
    args = parser.parse_args()
    print(f"wrote {draw(args.ranks, args.out)}")


if __name__ == "__main__":
    main()
