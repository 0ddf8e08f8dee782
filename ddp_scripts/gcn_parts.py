"""The GCN pieces of lesson 4, written once: gcn_single.py and gcn_ddp.py import them (copy this file
beside either, with ddp_hardening.py).

    synthetic_graph(num_nodes)          a graph a GCN can learn from, made here (offline)
    amazon_products / ogbn_products     the real graphs (downloads), PROCESSED: where their files land
    GCN, loss_fn, metric_sums, metric_value      the model and how it is scored
    check_sampler()                     refuses, in one line, a PyG without a neighbour sampler
    fan_outs, worker_count, probability      argparse types of the lesson's flags
    check_shared_memory, sampling_workers    lesson 4's own hardening (gcn_ddp.py calls them)
"""
import argparse
import os
import shutil
import socket
import sys
import warnings

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from ddp_hardening import UsageError, die_with_parent


SAMPLER_HELP = ("NeighborLoader needs pyg-lib or torch-sparse: pip install torch_geometric pyg_lib "
                "-f https://data.pyg.org/whl/torch-<version>+<cpu|cu1xx>.html (or, from source: "
                "pip install --no-build-isolation torch-scatter torch-sparse)")


# Quiet two library warnings that would be printed at every start: PyG's, that torch-sparse's sampler is
# deprecated in favour of pyg-lib (both work), and torch's, about torch.jit.script in torch-sparse.
warnings.filterwarnings("ignore", message=".*without a 'pyg-lib' installation")
warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # ogb's loader


def check_sampler():
    try:
        import torch_geometric.typing as pyg_typing
    except ImportError:
        raise UsageError("torch_geometric is not installed: pip install torch_geometric") from None
    if not (pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE):
        raise UsageError(SAMPLER_HELP)


# --------------------------------------------------------------------------- data
def synthetic_graph(num_nodes, num_classes=16, num_features=100, seed=0):
    """A graph a GCN can learn from: communities (mostly same-class edges), skewed degrees
    (a few hubs, many leaves), and features that are a weak class signal plus noise."""
    from torch_geometric.data import Data
    from torch_geometric.utils import coalesce, to_undirected

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=g)
    # out-degrees from a log-normal: median 6, a long tail of hubs (capped at 300)
    degree = torch.empty(num_nodes).log_normal_(mean=1.8, std=1.0, generator=g).clamp(1, 300).long()
    src = torch.repeat_interleave(torch.arange(num_nodes), degree)
    # 60% of edges stay inside the source's class, the rest go anywhere
    by_class = torch.argsort(y)
    class_start = torch.searchsorted(y[by_class], torch.arange(num_classes))
    class_size = torch.bincount(y, minlength=num_classes)
    pick = (torch.rand(len(src), generator=g) * class_size[y[src]]).long()
    dst = by_class[class_start[y[src]] + pick]
    anywhere = torch.rand(len(src), generator=g) < 0.4
    dst[anywhere] = torch.randint(0, num_nodes, (int(anywhere.sum()),), generator=g)
    keep = src != dst
    edge_index = coalesce(to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=num_nodes))
    centroids = torch.randn(num_classes, num_features, generator=g)
    x = torch.randn(num_nodes, num_features, generator=g).add_(centroids.mul(0.12)[y])  # in place
    perm = torch.randperm(num_nodes, generator=g)
    n_train, n_val = int(0.6 * num_nodes), int(0.2 * num_nodes)
    data = Data(x=x, edge_index=edge_index, y=y, num_nodes=num_nodes)
    split = {"train": perm[:n_train], "val": perm[n_train:n_train + n_val],
             "test": perm[n_train + n_val:]}
    return data, split, "accuracy"


# Where PyG and ogb keep each real graph once processed.
PROCESSED = {"ogbn-products": os.path.join("ogbn_products", "processed", "geometric_data_processed.pt"),
             "amazon-products": os.path.join("AmazonProducts", "processed", "data.pt")}


def amazon_products(data_dir):
    """PyG's AmazonProducts (1,569,960 nodes, 200 features, 107 classes, multi-label): downloaded
    into data_dir/AmazonProducts/raw on first use, then processed once into processed/data.pt."""
    from torch_geometric.datasets import AmazonProducts

    root = os.path.join(data_dir, "AmazonProducts")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # offline: fail in seconds, not minutes
    try:
        data = AmazonProducts(root)[0]
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        raise UsageError(f"AmazonProducts is not in {root}/raw and could not be downloaded "
                         f"({type(err).__name__}; offline?): run once online, or use --dataset "
                         f"synthetic") from None
    finally:
        socket.setdefaulttimeout(previous)
    split = {name: data[f"{name}_mask"].nonzero().view(-1) for name in ("train", "val", "test")}
    data = data.__class__(x=data.x, edge_index=data.edge_index, y=data.y.float(), num_nodes=data.num_nodes)
    return data, split, "micro_f1"


def have_amazon_products(data_dir):
    root = os.path.join(data_dir, "AmazonProducts")
    return os.path.exists(os.path.join(data_dir, PROCESSED["amazon-products"])) or all(
        os.path.exists(os.path.join(root, "raw", f))
        for f in ("adj_full.npz", "feats.npy", "class_map.json", "role.json"))


def ogbn_products(data_dir):
    """OGB's ogbn-products (2,449,029 nodes, 100 features, 47 classes, one label per node) through
    the ogb package: downloaded (1.4 GB) into data_dir/ogbn_products on first use, then processed
    once into processed/geometric_data_processed.pt. Three quirks of ogb are handled here."""
    sys.modules.setdefault("outdated", None)  # 1. skip ogb's import-time check of PyPI for a newer
    try:                                      #    ogb: a thread without a timeout that can delay exit
        import ogb.nodeproppred.dataset_pyg as ogb_pyg
    except ImportError:
        raise UsageError("--dataset ogbn-products needs the ogb package: pip install ogb") from None
    from torch_geometric.data import Data

    # 2. ogb asks on stdin before a download over 1 GB, and when an old copy lacks its RELEASE
    #    file; ranks have no terminal. Asking for this dataset is the yes; an old copy is kept.
    ogb_pyg.decide_download = lambda url: True
    ogb_pyg.input = lambda prompt="": "n"
    # 3. Its processed file holds PyG classes, which torch.load (weights_only, torch >= 2.6)
    #    refuses unless they are allowed.
    if hasattr(torch.serialization, "add_safe_globals"):
        from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
        from torch_geometric.data.storage import GlobalStorage

        torch.serialization.add_safe_globals([DataEdgeAttr, DataTensorAttr, GlobalStorage])
    root = os.path.join(data_dir, "ogbn_products")
    existed = os.path.isdir(root)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # offline: fail in seconds, not minutes
    try:
        dataset = ogb_pyg.PygNodePropPredDataset("ogbn-products", root=data_dir)
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        if not existed:  # leave no half-made folder (ogb would later take it for an old release)
            shutil.rmtree(root, ignore_errors=True)
        raise UsageError(f"ogbn-products is not in {root} and could not be downloaded "
                         f"({type(err).__name__}; offline?): run once online, or use --dataset "
                         f"synthetic") from None
    finally:
        socket.setdefaulttimeout(previous)
    data, idx = dataset[0], dataset.get_idx_split()
    split = {"train": idx["train"], "val": idx["valid"], "test": idx["test"]}
    data = Data(x=data.x, edge_index=data.edge_index, y=data.y.view(-1), num_nodes=data.num_nodes)
    return data, split, "accuracy"


def have_ogbn_products(data_dir):
    root = os.path.join(data_dir, "ogbn_products")
    return os.path.exists(os.path.join(data_dir, PROCESSED["ogbn-products"])) or all(
        os.path.exists(os.path.join(root, f))
        for f in ("RELEASE_v1.txt", "raw/edge.csv.gz", "raw/node-feat.csv.gz", "raw/node-label.csv.gz",
                  "split/sales_ranking/train.csv.gz"))


def sort_edges(data):
    """Sort the edges by target once, so that the sampler reads them in place (CSC) instead of
    building its own sorted copy."""
    from torch_geometric.utils import sort_edge_index

    data.edge_index = sort_edge_index(data.edge_index, num_nodes=data.num_nodes, sort_by_row=False)
    return data


def eval_subset(idx, limit, seed):
    if limit is None or len(idx) <= limit:
        return idx
    return idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed))[:limit]]


# --------------------------------------------------------------------------- model
class GCN(nn.Module):
    """Two GCNConv layers with ReLU and dropout between them: two hops of neighbourhood."""

    def __init__(self, in_dim, hidden, out_dim, dropout=0.5):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1 = GCNConv(in_dim, hidden)
        self.conv2 = GCNConv(hidden, out_dim)
        self.dropout = dropout

    def forward(self, x, edge_index):
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


def loss_fn(out, y):
    """Cross-entropy for one label per node; binary cross-entropy per class for multi-label y."""
    if y.dim() == 2:
        return F.binary_cross_entropy_with_logits(out, y)
    return F.cross_entropy(out, y)


def metric_sums(out, y):
    """Counts that add up across batches and ranks: [correct, total, 0] for accuracy,
    [true positives, false positives, false negatives] for micro-F1 (multi-label)."""
    if y.dim() == 2:
        pred, y = out > 0, y > 0.5
        return torch.stack([(pred & y).sum(), (pred & ~y).sum(), (~pred & y).sum()]).double()
    correct = (out.argmax(1) == y).sum().double()
    return torch.stack([correct, correct.new_tensor(len(y)), correct.new_tensor(0)])


def metric_value(totals, multi_label):
    if multi_label:
        tp, fp, fn = totals
        return (2 * tp / (2 * tp + fp + fn).clamp(min=1)).item()
    return (totals[0] / totals[1].clamp(min=1)).item()


# --------------------------------------------------------------------------- command line
def fan_outs(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if any(v == 0 or v < -1 for v in values):
        raise argparse.ArgumentTypeError("each fan-out is a positive count, or -1 for all neighbours")
    return values


def worker_count(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"0 (sample in the training process) or more expected, got {text}")
    return value


def probability(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a probability in [0, 1) expected, got {text}")
    return value


# --------------------------------------------------------------------------- lesson 4's hardening
def check_shared_memory(data, split, folder="/dev/shm"):
    """mp.spawn's ranks share the graph through shared memory, which is /dev/shm on Linux, and a
    container may have made it small (Docker's default: 64 MB). Refuse a graph that does not fit,
    in one line, rather than let the ranks die of a bus error when they touch its pages."""
    if not os.path.isdir(folder):
        return
    need = sum(t.numel() * t.element_size() for t in [*data.to_dict().values(), *split.values()]
               if torch.is_tensor(t))
    free = shutil.disk_usage(folder).free
    if need > free:
        raise UsageError(f"the graph needs {need / 2**20:,.0f} MiB of shared memory and {folder} has "
                         f"{free / 2**20:,.0f} MiB free: give it more (docker run --shm-size=4g, or "
                         f"a larger tmpfs), or launch with torchrun, whose ranks map the graph from a "
                         f"file on disk instead")


def sampling_workers(num_workers):
    """NeighborLoader (DataLoader) arguments for this rank's sampling worker processes: forked
    where the OS can (in a rank started by mp.spawn they would otherwise be spawned: a fresh
    Python that imports torch and PyG again, for every worker of every loader), and killed by
    the kernel if the rank dies."""
    import functools

    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers,
            "multiprocessing_context": "fork" if "fork" in mp.get_all_start_methods() else None,
            "worker_init_fn": functools.partial(die_with_parent, os.getpid())}
