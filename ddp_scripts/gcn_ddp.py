"""Lesson 4: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader) under DistributedDataParallel.

    python gcn_ddp.py --nprocs 2 --device cpu                 # Gloo on CPU cores
    python gcn_ddp.py --amp bf16                              # NCCL, one process per visible GPU
    torchrun --nproc-per-node 2 gcn_ddp.py --device cpu       # or let torchrun launch them
    python gcn_ddp.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

Self-contained: copy it anywhere, it needs torch and torch_geometric, with pyg-lib or
torch-sparse for the neighbour sampler (tqdm optional; ogb for ogbn-products, scipy for
AmazonProducts). Compare it with gcn_single.py: the diff is what DDP changes for a GNN (above the
"hardening" fence).
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
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

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


# Quiet two library warnings that every process would print: PyG's, that torch-sparse's sampler is
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


def load_dataset(args, mapped=False):
    """The graph, its node splits and its metric name. mapped (torchrun): edges sorted, and a real
    graph mapped from a file that the ranks of a machine share (mapped_copy)."""
    if args.dataset == "auto":  # a real graph only if it is already on disk: it is gigabytes
        args.dataset = ("ogbn-products" if have_ogbn_products(args.data_dir) else
                        "amazon-products" if have_amazon_products(args.data_dir) else "synthetic")
        if args.dataset == "synthetic" and not args.quiet and int(os.environ.get("RANK", 0)) == 0:
            print(f"neither ogbn-products nor AmazonProducts is in {args.data_dir}: using a synthetic "
                  f"graph of {args.num_nodes:,} nodes (--dataset ogbn-products downloads a real one)",
                  flush=True)
    if args.dataset == "synthetic":  # generated in seconds: each torchrun rank makes its own
        data, split, metric = synthetic_graph(args.num_nodes, seed=args.seed)
        return (sort_edges(data) if mapped else data), split, metric
    load = ogbn_products if args.dataset == "ogbn-products" else amazon_products
    if mapped:
        return mapped_copy(load, args.data_dir, os.path.join(args.data_dir, PROCESSED[args.dataset]))
    return load(args.data_dir)


def mapped_copy(load, data_dir, processed):
    """torchrun: every rank is a program of its own and would hold a graph of its own (3 GB each
    for ogbn-products). Instead, the first rank of a machine loads the graph, sorts its edges and
    saves it beside the dataset's processed file; then every rank maps that file into memory
    (torch.load(mmap=True)), and the ranks of the machine share its pages, as spawned ranks
    share the launcher's copy."""
    from torch_geometric.data import Data

    path = os.path.join(os.path.dirname(processed), "sorted_for_ddp.pt")
    if not (os.path.exists(path) and os.path.exists(processed)
            and os.path.getmtime(path) >= os.path.getmtime(processed)):  # none saved since processing
        data, split, metric = load(data_dir)
        sort_edges(data)
        graph = {"x": data.x, "edge_index": data.edge_index, "y": data.y, "num_nodes": data.num_nodes,
                 "split": split, "metric": metric}
        try:
            save_whole(graph, path)  # plain: torch.save(graph, path)
        except OSError as err:  # e.g. a read-only dataset folder: this rank keeps its own copy
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                print(f"note: cannot save {path} ({err.strerror}): each rank holds its own copy of "
                      f"the graph", flush=True)
            return data, split, metric
    saved = torch.load(path, mmap=True, weights_only=True)  # pages shared with the other ranks
    data = Data(x=saved["x"], edge_index=saved["edge_index"], y=saved["y"], num_nodes=saved["num_nodes"])
    return data, saved["split"], saved["metric"]


def sort_edges(data):
    """Sort the edges by target once, so that the sampler reads them in place (CSC) instead of
    building its own sorted copy."""
    from torch_geometric.utils import sort_edge_index

    data.edge_index = sort_edge_index(data.edge_index, num_nodes=data.num_nodes, sort_by_row=False)
    return data


def prepare_graph(data, split):
    """mp.spawn: sort the edges once, and put every tensor in shared memory: the spawned ranks then
    map the launcher's single copy instead of holding one each."""
    sort_edges(data)
    for value in [*data.to_dict().values(), *split.values()]:
        if torch.is_tensor(value):
            value.share_memory_()


def rank_chunk(train_idx, epoch, rank, world_size, seed, shuffle=True):
    """This rank's training seeds for this epoch: one shared shuffle (same seed on every rank),
    cut into equal chunks. The floor drops at most world_size - 1 nodes, and equal chunks mean
    equal batch counts: a rank with one batch more would wait forever in its all-reduce."""
    order = train_idx
    if shuffle:
        shared = torch.Generator().manual_seed(seed + epoch)
        order = train_idx[torch.randperm(len(train_idx), generator=shared)]
    per_rank = len(order) // world_size
    return order[rank * per_rank:(rank + 1) * per_rank]


def check_enough_seeds(split, world_size):
    """Each rank trains on len(train) // world_size seed nodes: refuse a split that leaves none."""
    if len(split["train"]) < world_size:
        raise UsageError(f"{len(split['train'])} training node(s) cannot be split across {world_size} "
                         f"processes (each needs at least one): use a bigger graph or fewer processes")


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
                          **sampling_workers(args.num_workers))  # plain: num_workers=args.num_workers)


@torch.no_grad()
def evaluate(model, data, sampler, idx, args, device, rank, world_size):
    """Metric over idx: each rank scores every world_size-th node, the sums are all-reduced."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # Batches as big as in training: bigger ones would raise the peak memory.
    loader = neighbor_loader(data, idx[rank::world_size], sampler, args)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        out = model(batch.x, batch.edge_index)[:batch.batch_size]  # seed nodes only
        totals += metric_sums(out, batch.y[:batch.batch_size])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # SUM, then compute the metric once
    model.train()
    return metric_value(totals, data.y.dim() == 2)


def write_metrics(path, metrics):
    """The metrics JSON, written whole (a new file renamed over the old): never half a file."""
    with open(f"{path}.part", "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(f"{path}.part", path)


def train(rank, local_rank, world_size, data, split, metric, args):
    from torch_geometric.sampler import NeighborSampler

    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    num_classes = data.y.size(1) if data.y.dim() == 2 else int(data.y.max()) + 1

    # 2. The model on this rank's device, wrapped; the same seed gives every rank the same start.
    torch.manual_seed(args.seed)
    model = GCN(data.num_features, args.hidden, num_classes, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Mixed precision, as in lesson 3: autocast for the forward pass, a scaler for fp16's range.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # 3. One sampler per rank over the shared graph (edges sorted: no copy), on the CPU.
    sampler = NeighborSampler(data, num_neighbors=args.num_neighbors, is_sorted=True)
    # Scoring millions of test nodes every epoch costs more than training on a big graph:
    # --eval-nodes scores a fixed random subset (the same on every rank) instead.
    eval_idx = {name: eval_subset(split[name], args.eval_nodes, args.seed) for name in ("val", "test")}

    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    log(f"training GCN on {args.dataset} ({data.num_nodes:,} nodes, {data.num_edges:,} edges): "
        f"{world_size} process(es) on {device.type} ({args.backend}, amp {args.amp}), batch "
        f"{args.batch_size} seed nodes per process, fan-out {args.num_neighbors}, "
        f"{args.num_workers} sampling worker(s) per process", flush=True)
    if len(eval_idx["test"]) < len(split["test"]) or len(eval_idx["val"]) < len(split["val"]):
        log(f"val and test scored on random subsets of {args.eval_nodes:,} nodes (--eval-nodes)")
    history, steps, start = [], 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        chunk = rank_chunk(split["train"], epoch, rank, world_size, args.seed, not args.no_shuffle)
        loader = neighbor_loader(data, chunk, sampler, args)
        epoch_start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        seeds, sampled = 0, 0
        # plain: bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
        for batch in bar:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                out = model(batch.x, batch.edge_index)
            # The loss covers the seed nodes only: the first batch_size rows. The sampled
            # neighbours are there to feed the convolutions, not to be trained on (they would
            # also leak validation and test nodes into training).
            loss = loss_fn(out[:batch.batch_size].float(), batch.y[:batch.batch_size])
            scaler.scale(loss).backward()  # 4. DDP averages the gradients across ranks here
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

        # 5. Evaluate across ranks, then gather the training totals of all ranks.
        val = evaluate(model.module, data, sampler, eval_idx["val"], args, device, rank, world_size)
        test = evaluate(model.module, data, sampler, eval_idx["test"], args, device, rank, world_size)
        totals = torch.stack([loss_sum, torch.tensor(float(seeds), dtype=torch.float64, device=device),
                              torch.tensor(float(sampled), dtype=torch.float64, device=device)])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        train_loss = (totals[0] / totals[1]).item()
        history.append({"epoch": epoch, "train_loss": train_loss, "val_metric": val, "test_metric": test,
                        "seconds": seconds, "sampled_nodes_per_second": totals[2].item() / seconds,
                        "seed_nodes": int(totals[1]), "steps": steps})
        log(f"epoch {epoch}: train loss {train_loss:.4f}  val {metric} {val:.2%}  test {metric} "
            f"{test:.2%}  {seconds:.1f} s  {totals[2].item() / seconds:,.0f} sampled nodes/s", flush=True)
        if rank == 0 and args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": world_size,
                "model": "gcn", "dataset": args.dataset, "metric": metric, "batch_size": args.batch_size,
                "threads_per_proc": args.threads_per_proc, "device": args.device, "amp": args.amp,
                "num_workers": args.num_workers, "backend": args.backend, "epochs": history})
        # 6. Optional: a barrier keeps the ranks' epochs in step (NCCL's: on this rank's GPU).
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    if rank != 0:  # 7. Print and save on rank 0 only.
        return
    last = history[-1]
    print(f"done: GCN on {args.dataset}, {world_size} process(es), {steps} steps, test {metric} "
          f"{last['test_metric']:.2%}, {last['sampled_nodes_per_second']:,.0f} sampled nodes/s, "
          f"{time.perf_counter() - start:.1f} s in all", flush=True)
    if args.save:
        torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)


# --------------------------------------------------------------------------- launching
def worker(rank, world_size, args, graph=None):
    """What each process runs: with the graph from main(), in shared memory, or under torchrun."""
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ else rank  # torchrun sets it
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    # 1. Join the process group (NCCL for GPUs, Gloo for CPUs), with a timeout on every collective.
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=attempt_store(args.timeout),  # plain: nothing
                            timeout=timedelta(seconds=args.timeout))
    try:
        if graph is None:  # torchrun: no launcher has loaded the graph; the ranks do
            def load(dataset):  # downloads and processes what is not on disk yet
                nonlocal graph
                args.dataset = dataset
                graph = load_dataset(args, mapped=True)  # sorted, as prepare_graph sorts it
                check_enough_seeds(graph[1], world_size)
                return args.dataset

            # plain: load(args.dataset)
            args.dataset = prepare_in_turns(load, args.dataset, rank, args.prepare_timeout)
        train(rank, local_rank, world_size, *graph, args)
    finally:
        dist.destroy_process_group()  # 8. tear down, even after an error


def check_device(args, gpu=0):
    """Refuse, before any process starts, what cannot work; say what to do instead. gpu: the index
    of the GPU to ask about (asking with no index would start CUDA on GPU 0 in every process)."""
    check_sampler()
    if len(args.num_neighbors) != 2:
        raise UsageError(f"the GCN has 2 layers, so --num-neighbors takes 2 fan-outs (one per hop), "
                         f"got {len(args.num_neighbors)}")
    if args.device == "cpu":
        if args.backend == "nccl":
            raise UsageError("NCCL needs CUDA tensors: use --backend gloo with --device cpu")
        if args.amp == "fp16":
            raise UsageError("--amp fp16 needs a GPU: use --amp bf16 (or off) with --device cpu")
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UsageError("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); "
                         "to run on CPU instead: --device cpu")
    if args.backend == "nccl" and not dist.is_nccl_available():
        raise UsageError("this PyTorch build has no NCCL: install a CUDA build of torch, "
                         "or use --backend gloo")
    gpus, procs = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))
    if procs > gpus or gpu >= gpus:  # first: asking about a GPU that is not there fails
        raise UsageError(f"{procs} processes but {gpus} visible GPU(s): NCCL needs a GPU of its own "
                         f"for each rank, so use --nprocs {gpus} (or --nproc-per-node {gpus})")
    if args.amp == "bf16" and torch.cuda.get_device_capability(gpu) < (8, 0):
        raise UsageError(f"{torch.cuda.get_device_name(gpu)} has no native bf16 (before compute "
                         f"capability 8.0 it is emulated, slowly): use --amp fp16")


def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    check_device(args, gpu=int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU, by index
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


def main(args):
    if "RANK" in os.environ:
        # Started by torchrun: this process already is one rank; it checks its set-up first.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args)
        return
    check_setup(args, rank=0)
    # Started by hand: the graph loaded ONCE, here, in shared memory; the ranks get handles to it.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    data, split, metric = load_dataset(args)
    check_enough_seeds(split, args.nprocs)
    check_shared_memory(data, split)  # plain: nothing
    prepare_graph(data, split)
    # plain: mp.spawn(worker, args=(args.nprocs, args, (data, split, metric)), nprocs=args.nprocs)
    spawn_workers(worker, args.nprocs, args, (data, split, metric))


def free_port():
    """A port that nothing listens on now (the OS picks it): where rank 0 waits for the others."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    p.add_argument("--nprocs", type=positive(int), default=None,
                   help="processes to spawn (default: one per visible GPU, 2 on CPU)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                   help="mixed precision (fp16 with a gradient scaler)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--timeout", type=positive(int), default=300,
                   help="seconds any collective may wait for the other ranks before failing")
    add_hardening_flags(p)  # plain: nothing
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.nprocs is None:  # one process per visible GPU
        args.nprocs = (torch.cuda.device_count() if args.device == "cuda" else 0) or 2
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))  # processes on this machine
    if args.threads_per_proc is None:
        args.threads_per_proc = max(1, cpu_cores() // procs)
    if args.num_workers is None:  # on CPU every core already runs a rank; a GPU rank samples beside it
        args.num_workers = 0 if args.device == "cpu" else min(4, max(0, cpu_cores() // procs - 1))
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


# ================================================================================== hardening
# Below this fence: what makes the lesson above safe on real clusters, the same block in every
# DDP script of the course (a test keeps the copies identical). The part above reaches it through
# the lines marked "# plain: ...", which say what each stands for; ddp_scripts/minimal/ holds each
# script with those plain forms and without this part.
# What it needs from the part above: the imports argparse, os, socket, sys, time, torch,
# torch.distributed as dist, torch.multiprocessing as mp and datetime's timedelta; the names
# UsageError (raised anywhere, it ends the job with its one line: a check that refuses raises it),
# free_port(), positive(), parse_args() and main(args); the flags --timeout and --quiet.
# What a copier may delete: any piece whose "# plain:" line is put back to its plain form, with the
# functions only it calls; prepare_in_turns() with its flag (add_hardening_flags(p, prepare=False))
# when the script has no data to put in place.

def add_hardening_flags(parser, prepare=True):
    if prepare:  # prepare_in_turns()'s timeout
        parser.add_argument("--prepare-timeout", type=positive(int), default=3600,
                            help="under torchrun: seconds a rank may wait while others download "
                                 "and prepare the data")
    # torch.distributed.launch and DeepSpeed's launcher pass it; the LOCAL_RANK environment
    # variable, which they set too, is what counts (as PyTorch recommends).
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)


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


def master_port():
    """A port for rank 0 to listen on: the user's MASTER_PORT if it is free, else one the OS picks.
    A busy one is refused now, in one line, rather than by every worker with a traceback."""
    if "MASTER_PORT" not in os.environ:
        return str(free_port())
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise UsageError(f"MASTER_PORT={port} is already in use: choose another port "
                             f"or unset MASTER_PORT to let the script pick a free one") from None
    return str(port)


def attempt_store(timeout):
    """torchrun restarts the ranks (--max-restarts) in the store where the previous round's ranks
    wrote their addresses, and a rank that reads one of those connects to a process that is gone
    (pytorch/pytorch#135712). Each rendezvous round gets keys of its own; None (not torchrun, or
    no store shared by the agents): init_process_group's own store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, token = this_round(timeout)
    return dist.PrefixStore(f"round-{token}/", store)


_ROUND = []  # (agent's store, this round's token), once per process


def this_round(timeout):
    """torchrun: a client of the agents' store, and a token that every rank of this rendezvous round
    gets, and no rank of another round. Not TORCHELASTIC_RESTART_COUNT: each torchrun agent counts
    its own restarts, and one whose ranks were restarted because another machine failed does not
    count it (pytorch/pytorch#108158), so the ranks of one round can hold different counts, and
    the ranks of two rounds the same. Rank 0 draws the token; every other rank keeps writing fresh
    numbers under its own key until rank 0 has seen one change (a rank of an earlier round wrote
    its last number long ago, and is gone) and answered it with the token."""
    if _ROUND:
        return _ROUND[0]
    import uuid

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    prefix, deadline = f"round/{os.environ.get('TORCHELASTIC_RUN_ID')}/", time.monotonic() + timeout

    def read(key):
        return store.get(key) if store.check([key]) else None

    if rank == 0:
        token = uuid.uuid4().hex
        earlier = {r: read(f"{prefix}hello/{r}") for r in range(1, world_size)}
        while earlier:
            for r, before in list(earlier.items()):
                now = read(f"{prefix}hello/{r}")
                if now is not None and now != before:  # written by a live rank of this round
                    store.set(f"{prefix}answer/{r}", now + b" " + token.encode())
                    del earlier[r]
            if earlier and time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(earlier)} did not report within {timeout} s")
            time.sleep(0.05)
    else:
        mine = set()
        while True:
            number = uuid.uuid4().hex.encode()
            mine.add(number)
            store.set(f"{prefix}hello/{rank}", number)
            time.sleep(0.05)
            answer = read(f"{prefix}answer/{rank}")
            if answer and answer.split(b" ")[0] in mine:
                token = answer.split(b" ")[1].decode()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not answer within {timeout} s")
    _ROUND.append((store, token))
    return _ROUND[0]


def roll_call(check, args, rank, world_size, timeout=None):
    """torchrun: every rank runs check(args, rank) (GPUs, libraries, output paths) and tells all
    the others how it went, through torchrun's store, before any rank joins the process group. A
    refusal on one machine then stops every rank within seconds, said once, by rank 0; without the
    roll call the other machines would wait --timeout for a rank that has gone. On a refusal every
    rank exits with code 1."""
    timeout = timeout or args.timeout
    problem = ""
    try:
        check_network()
        check(args, rank)
    except UsageError as err:
        problem = str(err) if rank == 0 else f"{err} (rank {rank}, on {socket.gethostname()})"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # RANK set by hand: no store yet
        if problem:
            say(problem)
            sys.exit(1)
        return
    try:
        store, token = this_round(timeout)  # keys of this rendezvous round only
        prefix = f"roll-call/{token}/"
        keys = [f"{prefix}{r}" for r in range(world_size)]
        store.set(keys[rank], problem)
        store.wait(keys)  # every rank has reported
        problems = [p for p in (store.get(key).decode() for key in keys) if p]
        store.add(prefix + "read", 1)
        # Stay until all have read them: the store lives in rank 0's torchrun, which stops when
        # one of its ranks ends.
        deadline = time.monotonic() + timeout
        while problems and store.add(prefix + "read", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # torch's DistError: a rank did not report in time, or the store is gone
        if problem or int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per machine
            say(problem or f"not every rank reported for the roll call (waited up to --timeout "
                           f"{timeout} s): look for the error in each machine's output")
            sys.exit(1)
        exit_after_the_speaker()
    if problems:
        # Rank 0 says the first; torchrun --max-restarts starts a refused job again, to be refused
        # again: only the first attempt says it.
        said = f"roll-call/{os.environ.get('TORCHELASTIC_RUN_ID')}/said/{problems[0]}"
        if rank == 0:
            if store.add(said, 1) == 1:
                say(problems[0])
            sys.exit(1)
        exit_after_the_speaker()


def prepare_in_turns(prepare, first, rank, timeout):
    """torchrun: run prepare(choice) in every rank, in three turns, so that no two processes ever
    download into the same folder at once. Rank 0 goes first, with choice=first, and decides (e.g.
    what --dataset auto means): what it returns is the choice of every later turn. Then the first
    process of each other machine: it downloads a copy only where rank 0's files are not visible
    (no shared filesystem). Then all the others, which find the files in place. A turn ends when
    every rank knows that it went well; a UsageError in any rank stops all of them with its one
    line. A first download can outlast --timeout, so the turns get a process group with a timeout
    of their own (`timeout`, --prepare-timeout), a Gloo one whatever the training backend: the
    waiting ranks wait on the CPU, not in a GPU collective (Gloo connects the group here, while no
    rank is busy). Returns rank 0's choice."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    outcomes, choice = [None] * dist.get_world_size(), first
    try:
        for turn, mine in enumerate([rank == 0, rank != 0 and local_rank == 0, local_rank != 0]):
            error = None
            if mine:
                try:
                    choice = prepare(choice)
                except UsageError as err:
                    error = f"{err} (on {socket.gethostname()})" if turn == 1 else str(err)
            dist.all_gather_object(outcomes, (error, choice), group=group)
            errors = [e for e, _ in outcomes if e]
            if errors:
                raise UsageError(errors[0])
            choice = outcomes[0][1]  # rank 0's decision, for every rank
    finally:
        dist.destroy_process_group(group)
    return choice


def quiet_interrupt_in_finalizer(unraisable):
    """A Ctrl-C that lands while Python runs a finalizer (a __del__) cannot stop the worker there:
    Python prints it as "Exception ignored in ..." with a traceback, and goes on. Say nothing: the
    launcher, interrupted too, sends every worker a SIGINT of its own. Anything else: as usual."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def spawned_worker(rank, worker, stop, *worker_args):
    """What mp.spawn runs in each new process. spawn_workers started it deaf to Ctrl-C: listen again
    now, and stop at once if the job was interrupted meanwhile; then work, an error said once."""
    import signal

    sys.unraisablehook = quiet_interrupt_in_finalizer
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the launcher's handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not stop.is_set():
            try:
                worker(rank, *worker_args)
            except UsageError as err:
                said_once(err, rank)
        code = 0
    except SystemExit as exit_:  # said_once's exit code
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        # Deaf again: an interrupted worker gets a second SIGINT (the terminal's, then the
        # launcher's), and one that lands after mp.spawn's wrapper has caught the first, on the
        # way out, would print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_sooner()
    leave(code)  # an exception other than SystemExit went on to mp.spawn's wrapper, its traceback


def native_threads():
    """This process's threads as the kernel counts them (Python's own count misses torch's), or
    None where there is no /proc."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


THREADS_AFTER_IMPORTS = native_threads()  # this line runs once the lesson's imports are done


def start_method():
    """How spawn_workers starts the workers: "fork" where it is safe, "spawn" (what mp.spawn does)
    elsewhere. A forked worker starts with torch already imported, which saves it seconds; but fork
    copies only the calling thread. It is safe when no thread has started here since the imports
    (an OpenMP pool that a computation here started leaves a forked worker hung at its first
    parallel operation) and there is no GPU (CUDA cannot be used in a child forked after the parent
    has used it). DDP_START_METHOD=spawn, fork or forkserver decides instead."""
    chosen = os.environ.get("DDP_START_METHOD")
    if chosen:
        if chosen not in mp.get_all_start_methods():
            raise UsageError(f"DDP_START_METHOD={chosen} is not one of "
                             f"{', '.join(mp.get_all_start_methods())} (or unset it)")
        return chosen
    if THREADS_AFTER_IMPORTS is not None and native_threads() == THREADS_AFTER_IMPORTS \
            and "fork" in mp.get_all_start_methods() and not torch.cuda.is_available():
        return "fork"
    return "spawn"


def exit_sooner():
    """Python's last garbage collection at exit walks every object that torch's imports created
    (about a second here); frozen, they are left to the operating system. Finalizers, atexit
    functions and the flushing of open files still run."""
    import gc

    gc.freeze()


def leave(code):
    """End this process now with exit code `code`, the way multiprocessing ends a forked worker
    (os._exit), after the atexit functions and with the output flushed: Python's own shutdown is
    skipped. During that shutdown, on Python before 3.14, a thread of torch's that calls into
    Python (for instance a Gloo thread dropping the last reference to a tensor that Python made)
    is ended in the middle of C++ code, and the process aborts: "terminate called without an
    active exception" (CPython gh-87135), a finished run reported as killed by SIGABRT. A file
    still open is not flushed here: write through `with` blocks, as the lesson part does."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_network():
    """GLOO_SOCKET_IFNAME names the network interfaces Gloo binds to, a comma-separated list: one
    that this machine lacks stops each rank in init_process_group with a C++ traceback."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if not names or not hasattr(socket, "if_nameindex"):
        return
    present = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in names if name not in present]
    if missing:
        raise UsageError(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}: this machine has no "
                         f"network interface {', '.join(missing)} (it has {', '.join(present)}): name "
                         f"the interface of the network that the machines share, or unset it")


def spawn_workers(worker, nprocs, *worker_args):
    """mp.spawn(worker, args=(nprocs, *worker_args), nprocs=nprocs), the workers started as
    start_method() says, and however the run ends, it ends whole: a worker that fails makes
    mp.spawn stop the others, and Ctrl-C or SIGTERM here stops them too (mp.spawn's own join would
    keep waiting while they train on)."""
    import logging
    import signal

    check_network()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` behaves like Ctrl-C
    # mp.spawn logs "Terminating process ... via signal SIGTERM" for each worker it stops after a
    # failure; the one line this launcher prints says so already.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    method = start_method()
    if method == "fork":  # DDP's constructor imports torch._dynamo (~1 s): once here, not per worker
        import torch._dynamo  # noqa: F401
    stop = mp.get_context(method).Event()  # set when interrupted, for workers still starting
    try:
        # The workers start deaf to Ctrl-C (an ignored signal stays ignored in a new process), so
        # that a Ctrl-C while they import torch prints no traceback from each; they listen again
        # in spawned_worker. This process stops them, below.
        listening = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            workers = mp.start_processes(spawned_worker, args=(worker, stop, nprocs, *worker_args),
                                         nprocs=nprocs, join=False, start_method=method)
        finally:
            signal.signal(signal.SIGINT, listening)
        while not workers.join():  # True once all have finished; raises when one has failed
            pass
    except KeyboardInterrupt:  # pass it on to the workers started; kill any left after 10 s
        stop.set()  # first: a worker still starting sees it once it listens, the others get SIGINT
        started, deadline = mp.active_children(), time.monotonic() + 10
        for process in started:
            os.kill(process.pid, signal.SIGINT)
        for process in started:
            process.join(max(0, deadline - time.monotonic()))  # 10 s for all, not 10 s each
            if process.is_alive():
                process.kill()
        raise
    except mp.ProcessExitedException as err:  # a worker died or failed; spawn stopped the others
        if err.error_index == 0 and err.exit_code == 1:  # rank 0 has printed why, in one line
            sys.exit(1)
        how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
        raise UsageError(f"worker {err.error_index} ended with {how}; the other workers were "
                         f"stopped") from None
    except mp.ProcessRaisedException as err:  # an unexpected exception: show its traceback
        print(err, file=sys.stderr)
        raise UsageError("a worker raised the exception above; the other workers were stopped") \
            from None


def die_with_parent(parent_pid, worker_id=None):
    """On Linux, ask the kernel to kill this process when its parent dies: a rank when its torchrun
    agent dies (else the rank, in a session of its own, trains on, and the other machines' agents
    wait for it), a sampling worker when its rank dies (else it stays, holding the job's output and
    the shared graph). worker_id: DataLoader's argument to its worker_init_fn."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before that took effect
            os._exit(1)


def say(problem):
    print(f"{os.path.basename(sys.argv[0])}: error: {problem}", file=sys.stderr, flush=True)


def said_once(err, rank):
    """An error in the workers, which every rank may have met: rank 0 says it, in one line."""
    if rank == 0:
        say(err)
        sys.exit(1)
    exit_after_the_speaker()


def exit_after_the_speaker():
    """Exit code 1, quietly, a little later than the rank that says why: the launcher (or torchrun)
    stops the other processes of a job as soon as one has ended, and would stop that rank before
    it had spoken."""
    time.sleep(2)
    sys.exit(1)


def run_main(argv=None):
    """main(parse_args(argv)), with every way it can end said in one line: a mistake in the
    command line (exit code 2; under torchrun it answers the roll call, so that a typo on one
    machine stops every machine), an error found by a check or by the workers (1), Ctrl-C or
    SIGTERM (130). However it ends, the process ends through leave(): after an error too, torch's
    threads are still there to abort Python's shutdown (decision 8)."""
    try:
        end_in_one_line(argv)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
    except BaseException:  # a bug: its traceback, then the same safe exit
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)


def end_in_one_line(argv):
    """run_main's work: returns when main has finished; every other ending raises SystemExit with
    its exit code, after its one line."""
    rank = int(os.environ.get("RANK", 0))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank that torchrun's agent started: end with it
        die_with_parent(os.getppid())
    try:
        args = parse_args(argv)
    except UsageError as err:
        problem = str(err)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            def refuse(args, rank):
                raise UsageError(problem)
            # 300: the parser's default --timeout, since this command line's own cannot be read.
            roll_call(refuse, None, rank, int(os.environ["WORLD_SIZE"]), timeout=300)
        say(problem)
        sys.exit(2)
    try:
        main(args)
    except UsageError as err:
        if "RANK" in os.environ:  # torchrun: every rank may have met it; rank 0 says it
            said_once(err, rank)
        say(err)
        sys.exit(1)
    except RuntimeError as err:  # torch's DistError too
        import re

        lost = re.search(r"Connection (?:closed|reset) by peer(?: \[[^]]*\](?::\d+)?)?|Broken pipe", str(err))
        unreachable = re.search(r"connectFullMesh failed with (?:\[[^]]*\] )?([^$\n]*)", str(err))
        # Silence, not a closed connection: a machine whose network or power went, or a stuck rank.
        silent = re.search(r"Timed out waiting \d+ms for \w+ operation to complete", str(err))
        if not (lost or unreachable or silent) or "RANK" not in os.environ:  # a bug: its traceback,
            raise                                                   # reported by mp.spawn's launcher
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:  # one line per machine
            exit_after_the_speaker()
        if lost:
            say(f"rank {rank} lost its connection to another rank ({lost[0]}): a process or a "
                f"machine of this job has gone; the first error in each machine's output says which")
        elif silent:
            say(f"rank {rank} on {socket.gethostname()} heard nothing from another rank within the timeout "
                f"({silent[0]}): a machine of this job is off the network or down, or a rank is stuck "
                f"(lesson 8's watchdog shows where); raise --timeout if one step can take longer")
        else:  # Gloo's ranks did not reach each other
            loopback = "remote=[127." in str(err)
            say(f"rank {rank} on {socket.gethostname()} could not connect to the other ranks "
                f"({unreachable[1].strip()}): "
                + ("a rank gave a loopback address (its machine's GLOO_SOCKET_IFNAME is lo, or its "
                   "hostname resolves to 127.0.1.1 in /etc/hosts); " if loopback else "")
                + "set GLOO_SOCKET_IFNAME on every machine to the interface of the network they share")
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; any workers have been stopped
        if rank == 0:  # under torchrun, one line from rank 0
            print(f"{os.path.basename(sys.argv[0])}: interrupted; all workers stopped", file=sys.stderr)
        sys.exit(130)


# --------------------------------------------------------------------- hardening of lesson 4 only
def save_whole(obj, path):
    """torch.save(obj, path), but no reader ever sees half a file: written beside it under a name
    of this host and process, then renamed; a failed write leaves nothing behind."""
    part = f"{path}.{socket.gethostname()}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:  # (a Python file: failures are OSErrors with a reason)
            torch.save(obj, f)
        os.replace(part, path)  # atomic
    except BaseException:
        if os.path.isfile(part):
            os.remove(part)
        raise


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


if __name__ == "__main__":
    run_main()  # plain: main(parse_args())
