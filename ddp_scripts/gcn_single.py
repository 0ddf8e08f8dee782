"""Lesson 4, in one process: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader).

    python gcn_single.py --device cpu                             # a synthetic graph (offline)
    python gcn_single.py --amp bf16                               # on a GPU
    python gcn_single.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

It needs gcn_parts.py (the graphs, the model, its scoring) and ddp_hardening.py beside it; torch
and torch_geometric, with pyg-lib or torch-sparse for the neighbour sampler (tqdm optional; ogb for
ogbn-products, scipy for AmazonProducts). The baseline of gcn_ddp.py: the diff of the two is what
DDP changes for a GNN.
"""
import os
import sys
import time

import torch

try:  # the course's modules, written once: copy them beside this file
    from gcn_parts import (GCN, amazon_products, check_sampler, eval_subset, fan_outs, have_amazon_products,
                           have_ogbn_products, loss_fn, metric_sums, metric_value, ogbn_products,
                           probability, sort_edges, synthetic_graph, worker_count)
    from ddp_hardening import (Parser, UsageError, check_writable, cpu_cores, positive, progress,
                               write_metrics)
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


# --------------------------------------------------------------------------- data
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


# --------------------------------------------------------------------------- model


# --------------------------------------------------------------------------- training


def neighbor_loader(data, nodes, sampler, args):
    """Batches of --batch-size seed nodes from `nodes`, each with its sampled neighbourhood; in
    pinned memory when they go to a GPU, so that the host need not wait for the copy (lesson 3)."""
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
            raise UsageError("--amp fp16 is for GPUs here: use --amp bf16 (or off) with --device cpu")
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


# --------------------------------------------------------------------------- progress


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
