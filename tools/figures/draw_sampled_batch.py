"""Figure for lesson 4: one real mini-batch from PyG's NeighborLoader, drawn hop by hop (the
drawing itself is notebooks/course_demos.py's, which notebook 04 uses on a batch of its own).

    python tools/figures/draw_sampled_batch.py [--out figures/gcn_sampled_batch.png]   (make figures)

Needs PyG (make graph); without it, says so and redraws nothing.
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "notebooks"))
import course_demos  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "gcn_sampled_batch.png")
    args = parser.parse_args()
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        print(f"draw_sampled_batch: PyG is not installed (make graph): {args.out} not redrawn")
        return
    batch = course_demos.sample_batch()
    counts = course_demos.draw(batch, args.out, title="one batch from NeighborLoader(num_neighbors=[15, 10], "
                               f"batch_size=2): {batch.num_nodes} nodes, {batch.num_edges} edges")
    print(f"wrote {args.out}: nodes per hop {counts}")


if __name__ == "__main__":
    main()
