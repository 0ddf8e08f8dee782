"""Lesson 4, in one process: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader).

    python gcn_single.py --device cpu                             # a synthetic graph (offline)
    python gcn_single.py --amp bf16                               # on a GPU
    python gcn_single.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

Self-contained: copy it anywhere, it needs torch and torch_geometric, with pyg-lib or
torch-sparse for the neighbour sampler (tqdm optional; ogb for ogbn-products, scipy for
AmazonProducts). The baseline of gcn_ddp.py: the diff of the two is what DDP changes for a GNN.
"""
import argparse
import json
import os
import shutil
import socket
import sys
import threading
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # its default lock, a semaphore, leaks if a process is killed
except ImportError:  # the progress bar is optional
    def tqdm(iterable, **kwargs):
        return iterable


class UsageError(Exception):
    """Something the user can fix: reported in one line, without a traceback."""


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


def load_dataset(args):
    """The graph, its node splits and its metric name."""
    if args.dataset == "auto":  # a real graph only if it is already on disk: it is gigabytes
        args.dataset = ("ogbn-products" if have_ogbn_products(args.data_dir) else
                        "amazon-products" if have_amazon_products(args.data_dir) else "synthetic")
        if args.dataset == "synthetic" and not args.quiet:
            print(f"neither ogbn-products nor AmazonProducts is in {args.data_dir}: using a synthetic "
                  f"graph of {args.num_nodes:,} nodes (--dataset ogbn-products downloads a real one)",
                  flush=True)
    if args.dataset == "synthetic":  # generated in seconds
        return synthetic_graph(args.num_nodes, seed=args.seed)
    load = ogbn_products if args.dataset == "ogbn-products" else amazon_products
    return load(args.data_dir)


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


# --------------------------------------------------------------------------- training
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


def neighbor_loader(data, nodes, sampler, args):
    """Batches of --batch-size seed nodes from `nodes`, each with its sampled neighbourhood; in
    pinned memory when they go to a GPU, so that the copy can overlap with its work (lesson 3)."""
    from torch_geometric.loader import NeighborLoader

    return NeighborLoader(data, num_neighbors=args.num_neighbors, input_nodes=nodes,
                          batch_size=args.batch_size, neighbor_sampler=sampler,
                          pin_memory=args.device == "cuda",
                          num_workers=args.num_workers)


@torch.no_grad()
def evaluate(model, data, sampler, idx, args, device):
    """Metric over idx, from counts summed over the batches."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # Batches as big as in training: bigger ones would raise the peak memory.
    loader = neighbor_loader(data, idx, sampler, args)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        out = model(batch.x, batch.edge_index)[:batch.batch_size]  # seed nodes only
        totals += metric_sums(out, batch.y[:batch.batch_size])
    model.train()
    return metric_value(totals, data.y.dim() == 2)


def write_metrics(path, metrics):
    """The metrics JSON, written whole (a new file renamed over the old): never half a file."""
    with open(f"{path}.part", "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(f"{path}.part", path)


def train(data, split, metric, args):
    from torch_geometric.sampler import NeighborSampler

    torch.set_num_threads(args.threads_per_proc)
    device = torch.device(args.device)
    num_classes = data.y.size(1) if data.y.dim() == 2 else int(data.y.max()) + 1

    torch.manual_seed(args.seed)
    model = GCN(data.num_features, args.hidden, num_classes, args.dropout).to(device)
    torch.manual_seed(args.seed)  # the random stream for dropout (and sampling) starts here
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Mixed precision, as in lesson 3: autocast for the forward pass, a scaler for fp16's range.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # One sampler over the graph (edges already sorted: no copy); sampling runs on the CPU, the
    # sampled batch then moves to the GPU.
    sampler = NeighborSampler(data, num_neighbors=args.num_neighbors, is_sorted=True)
    # Scoring millions of test nodes every epoch costs more than training on a big graph:
    # --eval-nodes scores a fixed random subset instead.
    eval_idx = {name: eval_subset(split[name], args.eval_nodes, args.seed) for name in ("val", "test")}

    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"training GCN on {args.dataset} ({data.num_nodes:,} nodes, {data.num_edges:,} edges): "
        f"1 process on {device.type} (amp {args.amp}), batch {args.batch_size} seed nodes, "
        f"fan-out {args.num_neighbors}, {args.num_workers} sampling worker(s)", flush=True)
    if len(eval_idx["test"]) < len(split["test"]) or len(eval_idx["val"]) < len(split["val"]):
        log(f"val and test scored on random subsets of {args.eval_nodes:,} nodes (--eval-nodes)")
    history, steps, start = [], 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = split["train"]  # a new shuffle of the training nodes each epoch
        if not args.no_shuffle:
            shuffle = torch.Generator().manual_seed(args.seed + epoch)
            order = order[torch.randperm(len(order), generator=shuffle)]
        loader = neighbor_loader(data, order, sampler, args)
        epoch_start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        seeds, sampled = 0, 0
        bar = progress(loader, f"epoch {epoch}", not args.quiet)
        for batch in bar:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                out = model(batch.x, batch.edge_index)
            # The loss covers the seed nodes only: the first batch_size rows. The sampled
            # neighbours are there to feed the convolutions, not to be trained on (they would
            # also leak validation and test nodes into training).
            loss = loss_fn(out[:batch.batch_size].float(), batch.y[:batch.batch_size])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach() * batch.batch_size
            seeds += batch.batch_size
            sampled += batch.num_nodes
            steps += 1
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - epoch_start

        val = evaluate(model, data, sampler, eval_idx["val"], args, device)
        test = evaluate(model, data, sampler, eval_idx["test"], args, device)
        train_loss = loss_sum.item() / seeds
        history.append({"epoch": epoch, "train_loss": train_loss, "val_metric": val, "test_metric": test,
                        "seconds": seconds, "sampled_nodes_per_second": sampled / seconds,
                        "seed_nodes": seeds, "steps": steps})
        log(f"epoch {epoch}: train loss {train_loss:.4f}  val {metric} {val:.2%}  test {metric} "
            f"{test:.2%}  {seconds:.1f} s  {sampled / seconds:,.0f} sampled nodes/s", flush=True)
        if args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": 1,
                "model": "gcn", "dataset": args.dataset, "metric": metric, "batch_size": args.batch_size,
                "threads_per_proc": args.threads_per_proc, "device": args.device, "amp": args.amp,
                "num_workers": args.num_workers, "epochs": history})
        if steps == args.max_steps:
            break

    last = history[-1]
    print(f"done: GCN on {args.dataset}, 1 process, {steps} steps, test {metric} "
          f"{last['test_metric']:.2%}, {last['sampled_nodes_per_second']:,.0f} sampled nodes/s, "
          f"{time.perf_counter() - start:.1f} s in all", flush=True)
    if args.save:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)


# --------------------------------------------------------------------------- launching
def check_device(args, gpu=0):
    """Refuse, before any process starts, what cannot work; say what to do instead. gpu: the index
    of the GPU to ask about (asking with no index would start CUDA on GPU 0 in every process)."""
    check_sampler()
    if len(args.num_neighbors) != 2:
        raise UsageError(f"the GCN has 2 layers, so --num-neighbors takes 2 fan-outs (one per hop), "
                         f"got {len(args.num_neighbors)}")
    if args.device == "cpu":
        if args.amp == "fp16":
            raise UsageError("--amp fp16 needs a GPU: use --amp bf16 (or off) with --device cpu")
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UsageError("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); "
                         "to run on CPU instead: --device cpu")
    if args.amp == "bf16" and torch.cuda.get_device_capability(gpu) < (8, 0):
        raise UsageError(f"{torch.cuda.get_device_name(gpu)} has no native bf16 (before compute "
                         f"capability 8.0 it is emulated, slowly): use --amp fp16")


def main(args):
    check_device(args)
    check_writable(args.save, args.metrics_json)
    data, split, metric = load_dataset(args)
    sort_edges(data)
    train(data, split, metric, args)


# --------------------------------------------------------------------------- command line
def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{message} (see --help)")


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


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


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
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
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads (default: all cores)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    args = p.parse_args(argv)
    if args.threads_per_proc is None:
        args.threads_per_proc = cpu_cores()
    if args.num_workers is None:  # on CPU every core already trains; beside a GPU, cores sample
        args.num_workers = 0 if args.device == "cpu" else min(4, max(0, cpu_cores() - 1))
    return args


def check_writable(*paths):
    """Refuse now, not after training, an output that cannot be written; create missing folders."""
    for path in filter(None, paths):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot write {path}: cannot create {folder} ({err.strerror})") from None
        if not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write {path}: no write permission in {folder}")


# --------------------------------------------------------------------------- progress
def progress(steps, desc, show):
    """The steps of an epoch, their progress shown when `show`: tqdm's live bar in a terminal;
    elsewhere (a notebook's cell, a log file) a line now and then, at most one every 5 s and 20 an
    epoch, so that a long epoch is seen to move: "  [epoch 1] 40/94 steps, 1,234 samples/s, 12 s
    left" (never "epoch 1: ...", which starts the epoch's own summary)."""
    if not show:
        return steps
    if sys.stdout.isatty():
        return tqdm(steps, desc=desc, leave=False)
    return progress_lines(steps, desc)


def progress_lines(steps, desc):
    total, start, last, said, samples = len(steps), time.monotonic(), time.monotonic(), 0, 0
    for done, step in enumerate(steps, 1):
        yield step
        size = getattr(step, "batch_size", None)  # a graph batch's seed nodes
        first = next(iter(step.values())) if isinstance(step, dict) else (
            step[0] if isinstance(step, (tuple, list)) else step)
        samples += size if isinstance(size, int) else len(first)
        now = time.monotonic()
        if now - last >= 5 and said < 20 and done < total:
            print(f"  [{desc}] {done}/{total} steps, {samples / (now - start):,.0f} samples/s, "
                  f"{(total - done) * (now - start) / done:.0f} s left", flush=True)
            last, said = now, said + 1


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
