"""Demonstrations the lessons run in their cells: code a learner may read and reuse, kept out of
the cells so that a lesson shows its idea and its result. (The training itself lives in
../ddp_scripts/; the launching helpers in course_helpers.py.) tools/ uses them too: `make figures`
draws figures/gcn_sampled_batch.png with draw(), `make bench` measures input_pipeline_rates().
"""
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "ddp_scripts"


# --------------------------------------------------------------------------- lesson 4: one sampled batch
HOP_COLOURS = ["#c0392b", "#e67e22", "#5d7fa3"]  # seeds, first hop, second hop
HOP_NAMES = ["seed nodes (the loss is computed on these)", "first hop", "second hop"]


def hops(batch):
    """Hop of every node of a sampled batch (0 for seeds), found by walking its edges from the
    seeds: edge_index[0] is the sampled neighbour, edge_index[1] the node it was sampled for."""
    src, dst = batch.edge_index
    hop = torch.full((batch.num_nodes,), -1, dtype=torch.long)
    hop[:batch.batch_size] = 0  # NeighborLoader puts the seed nodes first
    parent = torch.full((batch.num_nodes,), -1, dtype=torch.long)
    for h in (1, 2):
        frontier = hop[dst] == h - 1
        for s, d in zip(src[frontier].tolist(), dst[frontier].tolist()):
            if hop[s] == -1:
                hop[s], parent[s] = h, d
    return hop, parent


def layout(hop, parent, batch_size):
    """Radial trees, one per seed: each node sits in the angular wedge of the node that
    first sampled it."""
    pos = torch.zeros(len(hop), 2)
    wedge = {}
    for seed in range(batch_size):
        centre = torch.tensor([seed * 11.0, 0.0])
        pos[seed] = centre
        wedge[seed] = (0.0, 2 * math.pi, centre)
    for h, radius in ((1, 2.2), (2, 4.8)):
        for p in sorted(wedge):
            kids = [i for i in (parent == p).nonzero().view(-1).tolist() if hop[i] == h]
            start, width, centre = wedge[p]
            for k, i in enumerate(kids):
                angle = start + width * (k + 0.5) / len(kids)
                pos[i] = centre + radius * torch.tensor([math.cos(angle), math.sin(angle)])
                wedge_width = width / len(kids)
                wedge.setdefault(i, (angle - wedge_width / 2, wedge_width, centre))
    return pos


def draw(batch, out, title=None):
    """Draw a NeighborLoader batch (with batch.batch_size seed nodes) to the PNG file out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hop, parent = hops(batch)
    pos = layout(hop, parent, batch.batch_size)
    fig, ax = plt.subplots(figsize=(10, 5.4))
    src, dst = batch.edge_index
    for s, d in zip(src.tolist(), dst.tolist()):
        tree = parent[s] == d
        ax.plot(*zip(pos[s].tolist(), pos[d].tolist()), color="#999" if tree else "#ddd",
                lw=0.6 if tree else 0.4, zorder=1)
    for h in (2, 1, 0):
        idx = (hop == h).nonzero().view(-1)
        ax.scatter(pos[idx, 0], pos[idx, 1], s=[160, 40, 14][h], color=HOP_COLOURS[h], zorder=2 + h,
                   edgecolors="white", linewidths=0.5, label=f"{HOP_NAMES[h]}: {len(idx)}")
    ax.set_aspect("equal")
    ax.axis("off")
    handles, labels = ax.get_legend_handles_labels()  # seeds first
    ax.legend(handles[::-1], labels[::-1], loc="lower center", bbox_to_anchor=(0.5, -0.12), ncol=3,
              frameon=False, fontsize=9)
    ax.set_title(title or f"one sampled batch: {batch.batch_size} seed nodes, {batch.num_nodes} nodes, "
                 f"{batch.num_edges} edges", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return {h: int((hop == h).sum()) for h in (0, 1, 2)}


def sample_batch(num_nodes=20_000, seeds=2, num_neighbors=(15, 10), seed=0):
    """A real batch from the lesson's synthetic graph, with the lesson's fan-out."""
    sys.path.insert(0, str(REPO / "ddp_scripts"))
    import gcn_parts
    from torch_geometric.loader import NeighborLoader

    data, split, _ = gcn_parts.synthetic_graph(num_nodes, seed=seed)
    torch.manual_seed(seed)
    loader = NeighborLoader(data, num_neighbors=list(num_neighbors), batch_size=seeds,
                            input_nodes=split["train"][:seeds])
    return next(iter(loader))


# --------------------------------------------------------------------------- the input pipeline
def input_pipeline_rates(data_dir, dataset, n_batches=200, batch=64):
    """images/s of the input pipeline alone, one thread: per-image PIL transforms vs decoded tensors."""
    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts
    from torch.utils.data import DataLoader, TensorDataset
    from torchvision import datasets, transforms

    torch.set_num_threads(1)
    mean, std = mnist_parts.MEAN_STD[dataset]
    per_image = getattr(datasets, mnist_parts.FOLDERS[dataset])(
        data_dir, train=True, download=False,
        transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))]))
    images, labels = mnist_parts.load_split(dataset, data_dir, train=True)
    rates = {}
    for name, ds in (("PIL transform per image", per_image),
                     ("tensors decoded once", TensorDataset(images, labels))):
        loader = iter(DataLoader(ds, batch_size=batch, shuffle=True))
        start = time.perf_counter()
        for _ in range(n_batches):
            next(loader)
        rates[name] = n_batches * batch / (time.perf_counter() - start)
    return rates


# --------------------------------------------------------------------------- lesson 9: a step in a trace
def overlap_in_trace(path, step=-1):
    """One profiled step of one rank's torch.profiler trace (a chrome-trace JSON, as --profile DIR
    writes): when backward ran on the main thread (its autograd operators, `*Backward0`) and when
    the all-reduces ran (events named `...all_reduce...`, on Gloo's threads or the main one).
    Returns {"step_ms", "backward_ms", "allreduce_ms", "overlapped_ms"}: the span of backward, the
    time covered by at least one all-reduce, and the part of it before backward's last operator
    ended. `step` picks one of the profiled steps (ProfilerStep#k events), the last by default."""
    import json

    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no ProfilerStep events (profile at least 5 steps)")
    chosen = steps[step]
    begin, end = chosen["ts"], chosen["ts"] + chosen["dur"]

    def inside(e):
        return begin <= e["ts"] < end

    backward = [e for e in events if inside(e) and e["name"].endswith("Backward0")
                and not e["name"].startswith("autograd::")]
    reduces = sorted(((e["ts"], e["ts"] + e["dur"]) for e in events
                      if inside(e) and "all_reduce" in e["name"]), key=lambda span: span[0])
    if not backward:
        raise ValueError(f"{path}: no backward operators in the chosen step")
    backward_end = max(e["ts"] + e["dur"] for e in backward)
    backward_start = min(e["ts"] for e in backward)
    covered, before_end, last = 0.0, 0.0, -math.inf  # the union of the all-reduces' spans
    for start, stop in reduces:
        start = max(start, last)
        if stop > start:
            covered += stop - start
            before_end += max(0.0, min(stop, backward_end) - start)
            last = stop
    return {"step_ms": chosen["dur"] / 1e3, "backward_ms": (backward_end - backward_start) / 1e3,
            "allreduce_ms": covered / 1e3, "overlapped_ms": before_end / 1e3}
