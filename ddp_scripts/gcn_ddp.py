"""Lesson 4: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader) under DistributedDataParallel.

    python gcn_ddp.py --nprocs 2 --device cpu                 # Gloo on CPU cores
    python gcn_ddp.py --amp bf16                              # NCCL, one process per visible GPU
    torchrun --nproc-per-node 2 gcn_ddp.py --device cpu       # or let torchrun launch them
    python gcn_ddp.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

It needs gcn_parts.py (graphs, model, loader, scoring, flags, report) and ddp_hardening.py beside it; torch
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
    from gcn_parts import (GCN, PROCESSED, Report, add_gcn_flags, check_gcn, eval_subset, evaluate,
                           load_dataset, loss_fn, neighbor_loader, sort_edges)
    from gcn_parts import check_shared_memory  # lesson 4's own hardening
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, UsageError, check_writable, cpu_cores, positive


# --------------------------------------------------------------------------- data
def load_mapped(args):
    """torchrun: the graph with its edges sorted, a real one mapped from a file that the ranks of a
    machine share (mapped_copy)."""
    def mapped(load):
        return mapped_copy(load, args.data_dir, os.path.join(args.data_dir, PROCESSED[args.dataset]))

    data, split, metric = load_dataset(args, real=mapped)
    return (sort_edges(data) if args.dataset == "synthetic" else data), split, metric


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

    report = Report(args, metric, rank, world_size, backend=args.backend)  # rank 0 speaks, and writes
    report.say(f"training GCN on {args.dataset} ({data.num_nodes:,} nodes, {data.num_edges:,} edges): "
               f"{world_size} process(es) on {device.type} ({args.backend}, amp {args.amp}), batch "
               f"{args.batch_size} seed nodes per process, fan-out {args.num_neighbors}, "
               f"{args.num_workers} sampling worker(s) per process")
    if len(eval_idx["test"]) < len(split["test"]) or len(eval_idx["val"]) < len(split["val"]):
        report.say(f"val and test scored on random subsets of {args.eval_nodes:,} nodes (--eval-nodes)")
    steps = 0
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

        # 5. Evaluate across ranks (each scores a shard, the counts are all-reduced); the report adds
        #    up the ranks' training totals the same way.
        val = evaluate(model.module, data, sampler, eval_idx["val"], args, device, rank, world_size)
        test = evaluate(model.module, data, sampler, eval_idx["test"], args, device, rank, world_size)
        report.epoch(epoch, loss_sum, seeds, sampled, seconds, steps, val, test)
        # 6. Optional: a barrier keeps the ranks' epochs in step (NCCL's: on this rank's GPU).
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    report.done(steps)  # 7. Print and save on rank 0 only.
    if rank == 0 and args.save:
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
                graph = load_mapped(args)  # sorted, as prepare_graph sorts it
                check_enough_seeds(graph[1], world_size)
                return args.dataset

            # plain: load(args.dataset)
            args.dataset = hardening.prepare_in_turns(load, args.dataset, rank, args.prepare_timeout)
        train(rank, local_rank, world_size, *graph, args)
    finally:
        dist.destroy_process_group()  # 8. tear down, even after an error


def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    check_gcn(args)  # a sampler, two fan-outs
    # plain: nothing (refuses NCCL on a CPU, fp16 on a CPU, more ranks than GPUs, bf16 without it)
    hardening.check_device(args.device, args.backend, args.amp, args.nprocs,
                           gpu=int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU, by index
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
    p = Parser(__doc__)
    add_gcn_flags(p)  # gcn_single.py's: --dataset --epochs --batch-size --num-neighbors ... (gcn_parts.py)
    p.add_argument("--nprocs", type=positive(int), default=None,
                   help="processes to spawn (default: one per visible GPU, 2 on CPU)")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    hardening.add_hardening_flags(p)  # plain: p.add_argument("--timeout", type=int, default=300)
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.nprocs is None:  # one process per visible GPU
        args.nprocs = (torch.cuda.device_count() if args.device == "cuda" else 0) or 2
    args.threads_per_proc = args.threads_per_proc or cpu_cores(shared_by=args.nprocs)
    if args.num_workers is None:  # on CPU every core already runs a rank; a GPU rank samples beside it
        args.num_workers = 0 if args.device == "cpu" else min(4, cpu_cores(shared_by=args.nprocs) - 1)
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
