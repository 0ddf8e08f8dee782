"""Lesson 4: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader) under DistributedDataParallel.

    python gcn_ddp.py --nprocs 2 --device cpu                 # Gloo on CPU cores
    python gcn_ddp.py --amp bf16                              # NCCL, one process per visible GPU
    torchrun --nproc-per-node 2 gcn_ddp.py --device cpu       # or let torchrun launch them
    python gcn_ddp.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

It needs gcn_parts.py (the graphs, the model, its scoring) and ddp_hardening.py beside it; torch
and torch_geometric, with pyg-lib or torch-sparse for the neighbour sampler (tqdm optional; ogb for
ogbn-products, scipy for AmazonProducts). Compare it with gcn_single.py: the diff is what DDP
changes for a GNN.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # the course's modules, written once: copy them beside this file
    import ddp_hardening as hardening  # each call into it says what plain code it stands for
    from gcn_parts import (GCN, amazon_products, check_sampler, eval_subset, fan_outs, have_amazon_products,
                           have_ogbn_products, loss_fn, metric_sums, metric_value, ogbn_products,
                           probability, sort_edges, synthetic_graph, worker_count)
    from gcn_parts import PROCESSED, check_shared_memory, sampling_workers  # lesson 4's own
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, UsageError, check_writable, cpu_cores, positive, write_metrics


# --------------------------------------------------------------------------- data
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
            hardening.save_whole(graph, path)  # plain: torch.save(graph, path)
        except OSError as err:  # e.g. a read-only dataset folder: this rank keeps its own copy
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                print(f"note: cannot save {path} ({err.strerror}): each rank holds its own copy of "
                      f"the graph", flush=True)
            return data, split, metric
    saved = torch.load(path, mmap=True, weights_only=True)  # pages shared with the other ranks
    data = Data(x=saved["x"], edge_index=saved["edge_index"], y=saved["y"], num_nodes=saved["num_nodes"])
    return data, saved["split"], saved["metric"]


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


# --------------------------------------------------------------------------- training
def neighbor_loader(data, nodes, sampler, args):
    """Batches of --batch-size seed nodes from `nodes`, each with its sampled neighbourhood; in
    pinned memory when they go to a GPU, so that the host need not wait for the copy (lesson 3)."""
    from torch_geometric.loader import NeighborLoader

    return NeighborLoader(data, num_neighbors=args.num_neighbors, input_nodes=nodes,
                          batch_size=args.batch_size, neighbor_sampler=sampler,
                          pin_memory=args.device == "cuda",
                          # plain: num_workers=args.num_workers)
                          **sampling_workers(args.num_workers))


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
        bar = hardening.progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
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
                            store=hardening.attempt_store(args.timeout),  # plain: nothing
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
            args.dataset = hardening.prepare_in_turns(load, args.dataset, rank, args.prepare_timeout)
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
            raise UsageError("--amp fp16 is for GPUs here: use --amp bf16 (or off) with --device cpu")
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UsageError("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); "
                         "to run on CPU instead: --device cpu")
    if args.backend == "nccl" and not dist.is_nccl_available():
        raise UsageError("this PyTorch build has no NCCL: install a CUDA build of torch, "
                         "or use --backend gloo")
    gpus, procs = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))
    if procs > gpus:
        raise UsageError(f"{procs} processes but {gpus} visible GPU(s): each rank needs a GPU of its own, "
                         f"so use --nprocs {gpus} (or --nproc-per-node {gpus})")
    if gpu >= gpus:  # before asking about it: asking about a GPU that is not there fails
        raise UsageError(f"LOCAL_RANK={gpu}, but this process sees {gpus} GPU(s): every rank must see all of "
                         f"its machine's GPUs (Slurm: --gpus-per-node, not --gpus-per-task)")
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
        hardening.roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args)
        return
    check_setup(args, rank=0)
    # Started by hand: the graph loaded ONCE, here, in shared memory; the ranks get handles to it.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = hardening.master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    data, split, metric = load_dataset(args)
    check_enough_seeds(split, args.nprocs)
    check_shared_memory(data, split)  # plain: nothing
    prepare_graph(data, split)
    # plain: mp.spawn(worker, args=(args.nprocs, args, (data, split, metric)), nprocs=args.nprocs)
    hardening.spawn_workers(worker, args.nprocs, args, (data, split, metric))


# --------------------------------------------------------------------------- command line
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
    hardening.add_hardening_flags(p)  # plain: nothing
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


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
