"""The GCN pieces of lesson 4, written once: gcn_single.py and gcn_ddp.py import them (copy this file
beside either, with ddp_hardening.py).

    load_dataset(args)                  --dataset: a real graph on disk, or a synthetic one (offline)
    amazon_products / ogbn_products     the real graphs (downloads), PROCESSED: where their files land
    GCN, loss_fn, metric_sums, metric_value      the model and how it is scored
    neighbor_loader, evaluate           batches of sampled neighbourhoods; the metric over every rank
    add_gcn_flags(parser), check_gcn(args)       the lesson's command line; what it cannot run
    Report(args, metric, rank, world_size)       rank 0's lines, the metrics JSON, the `done:` line
    check_shared_memory, sampling_workers    lesson 4's own hardening
"""
import argparse
import os
import shutil
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from ddp_hardening import UsageError, die_with_parent, positive, write_metrics


SAMPLER_HELP = ("NeighborLoader needs pyg-lib or torch-sparse: pip install torch_geometric pyg_lib "
                "-f https://data.pyg.org/whl/torch-<version>+<cpu|cu1xx>.html (or, from source: "
                "pip install --no-build-isolation torch-scatter torch-sparse)")


# Quiet two library warnings that would be printed at every start: PyG's, that torch-sparse's sampler is
# deprecated in favour of pyg-lib (both work), and torch's, about torch.jit.script in torch-sparse.
warnings.filterwarnings("ignore", message=".*without a 'pyg-lib' installation")
warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # ogb's loader


def check_sampler():
    """Refuse, in one line, a PyG without a neighbour sampler (or no PyG)."""
    try:
        import torch_geometric.typing as pyg_typing
    except ImportError:
        raise UsageError("torch_geometric is not installed: pip install torch_geometric") from None
    if not (pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE):
        raise UsageError(SAMPLER_HELP)


def check_gcn(args):
    """What the GCN scripts cannot run: no sampler, or fan-outs other than the GCN's two hops."""
    check_sampler()
    if len(args.num_neighbors) != 2:
        raise UsageError(f"the GCN has 2 layers, so --num-neighbors takes 2 fan-outs (one per hop), "
                         f"got {len(args.num_neighbors)}")


# --------------------------------------------------------------------------- data
def load_dataset(args, real=None):
    """The graph, its node splits and its metric name. --dataset auto: a real graph only if it is on
    disk already (it is gigabytes), else a synthetic one. real(load): how to load a real one
    (default: load(args.data_dir))."""
    if args.dataset == "auto":
        args.dataset = ("ogbn-products" if have_ogbn_products(args.data_dir) else
                        "amazon-products" if have_amazon_products(args.data_dir) else "synthetic")
        if args.dataset == "synthetic" and not args.quiet and int(os.environ.get("RANK", 0)) == 0:
            print(f"neither ogbn-products nor AmazonProducts is in {args.data_dir}: using a synthetic "
                  f"graph of {args.num_nodes:,} nodes (--dataset ogbn-products downloads a real one)",
                  flush=True)
    if args.dataset == "synthetic":  # generated in seconds (each torchrun rank makes its own)
        return synthetic_graph(args.num_nodes, seed=args.seed)
    load = ogbn_products if args.dataset == "ogbn-products" else amazon_products
    return real(load) if real else load(args.data_dir)


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


# --------------------------------------------------------------------------- batches and scores
def neighbor_loader(data, nodes, sampler, args):
    """Batches of --batch-size seed nodes from `nodes`, each with its sampled neighbourhood; in
    pinned memory when they go to a GPU, so that the host need not wait for the copy (lesson 3)."""
    from torch_geometric.loader import NeighborLoader

    return NeighborLoader(data, num_neighbors=args.num_neighbors, input_nodes=nodes,
                          batch_size=args.batch_size, neighbor_sampler=sampler,
                          pin_memory=args.device == "cuda",
                          **sampling_workers(args.num_workers))  # num_workers=args.num_workers, safely


@torch.no_grad()
def evaluate(model, data, sampler, idx, args, device, rank=0, world_size=1):
    """The metric over idx. With several ranks, each scores every world_size-th node and the counts
    are all-reduced (summed: the metric is computed once, from the sums)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # Batches as big as in training: bigger ones would raise the peak memory.
    for batch in neighbor_loader(data, idx[rank::world_size], sampler, args):
        batch = batch.to(device, non_blocking=True)
        out = model(batch.x, batch.edge_index)[:batch.batch_size]  # seed nodes only
        totals += metric_sums(out, batch.y[:batch.batch_size])
    if world_size > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return metric_value(totals, data.y.dim() == 2)


class Report:
    """What both GCN scripts report, rank 0 speaking: its lines (`say`), a line per epoch, the
    metrics JSON after each epoch (a crash keeps the epochs done) and the `done:` summary."""

    def __init__(self, args, metric, rank=0, world_size=1, **fields):
        self.args, self.metric, self.rank, self.world_size = args, metric, rank, world_size
        self.fields = {"world_size": world_size, "model": "gcn", "dataset": args.dataset, "metric": metric,
                       "batch_size": args.batch_size, "threads_per_proc": args.threads_per_proc,
                       "device": args.device, "amp": args.amp, "num_workers": args.num_workers, **fields}
        self.history, self.start = [], time.perf_counter()

    def say(self, text):
        if self.rank == 0 and not self.args.quiet:
            print(text, flush=True)

    def epoch(self, epoch, loss_sum, seeds, sampled, seconds, steps, val, test):
        """The training loss and the nodes over every rank (summed by an all_reduce: every rank
        calls it), the val and test metrics (evaluate's), the epoch's time and steps."""
        totals = torch.stack([loss_sum.double(), loss_sum.new_tensor(float(seeds), dtype=torch.float64),
                              loss_sum.new_tensor(float(sampled), dtype=torch.float64)])
        if self.world_size > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        train_loss, per_second = (totals[0] / totals[1]).item(), totals[2].item() / seconds
        self.history.append({"epoch": epoch, "train_loss": train_loss, "val_metric": val,
                             "test_metric": test, "seconds": seconds, "sampled_nodes_per_second": per_second,
                             "seed_nodes": int(totals[1]), "steps": steps})
        self.say(f"epoch {epoch}: train loss {train_loss:.4f}  val {self.metric} {val:.2%}  test "
                 f"{self.metric} {test:.2%}  {seconds:.1f} s  {per_second:,.0f} sampled nodes/s")
        if self.rank == 0 and self.args.metrics_json:
            write_metrics(self.args.metrics_json, {**self.fields, "epochs": self.history})

    def done(self, steps):
        if self.rank == 0:
            last, n = self.history[-1], self.world_size
            print(f"done: GCN on {self.args.dataset}, {n} process{'es' * (n != 1)}, {steps} steps, test "
                  f"{self.metric} {last['test_metric']:.2%}, {last['sampled_nodes_per_second']:,.0f} "
                  f"sampled nodes/s, {time.perf_counter() - self.start:.1f} s in all", flush=True)


# --------------------------------------------------------------------------- command line
def add_gcn_flags(p):
    """The flags both GCN scripts take; gcn_ddp.py adds DDP's after them."""
    p.add_argument("--model", choices=["gcn"], default="gcn")
    p.add_argument("--dataset", choices=["auto", "synthetic", "ogbn-products", "amazon-products"],
                   default="auto", help="auto: a real graph already in --data-dir, else synthetic")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--num-nodes", type=positive(int), default=100_000, help="synthetic graph size")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=512, help="seed nodes per process")
    p.add_argument("--lr", type=positive(float), default=0.005)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None,
                   help="stop after this many optimizer steps in total")
    p.add_argument("--no-shuffle", action="store_true", help="fixed seed-node order")
    p.add_argument("--num-neighbors", type=fan_outs, default=[15, 10],
                   help="neighbours sampled per node at each hop, e.g. 15,10")
    p.add_argument("--hidden", type=positive(int), default=128)
    p.add_argument("--dropout", type=probability, default=0.5, help="dropout between the two GCN layers")
    p.add_argument("--eval-nodes", type=positive(int), default=None,
                   help="score at most this many val and test nodes (a fixed random subset; default all)")
    p.add_argument("--num-workers", type=worker_count, default=None,
                   help="sampling worker processes per process (default: 0 on CPU; on a GPU, the "
                        "process's share of the cores less one, at most 4)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                   help="mixed precision (fp16 with a gradient scaler)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")


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
