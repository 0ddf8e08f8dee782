"""Lesson 4, in one process: a GCN trained on sampled neighbourhoods (PyG's NeighborLoader).

    python gcn_single.py --device cpu                             # a synthetic graph (offline)
    python gcn_single.py --amp bf16                               # on a GPU
    python gcn_single.py --dataset ogbn-products --eval-nodes 50000   # a real graph (1.4 GB download)

It needs gcn_parts.py (graphs, model, loader, scoring, flags, report) and ddp_hardening.py beside it; torch
and torch_geometric, with pyg-lib or torch-sparse for the neighbour sampler (tqdm optional; ogb for
ogbn-products, scipy for AmazonProducts). The baseline of gcn_ddp.py: the diff of the two is what
DDP changes for a GNN.
"""
import sys
import time

import torch

try:  # the course's modules, written once: copy them beside this file
    from gcn_parts import (GCN, Report, add_gcn_flags, check_gcn, eval_subset, evaluate, load_dataset,
                           loss_fn, neighbor_loader, sort_edges)
    from ddp_hardening import Parser, check_device, check_writable, cpu_cores, positive, progress, run_main
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


# --------------------------------------------------------------------------- training
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

    report = Report(args, metric)  # its lines, the metrics JSON after each epoch, the `done:` summary
    report.say(f"training GCN on {args.dataset} ({data.num_nodes:,} nodes, {data.num_edges:,} edges): "
               f"1 process on {device.type} (amp {args.amp}), batch {args.batch_size} seed nodes, "
               f"fan-out {args.num_neighbors}, {args.num_workers} sampling worker(s)")
    if len(eval_idx["test"]) < len(split["test"]) or len(eval_idx["val"]) < len(split["val"]):
        report.say(f"val and test scored on random subsets of {args.eval_nodes:,} nodes (--eval-nodes)")
    steps = 0
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
        report.epoch(epoch, loss_sum, seeds, sampled, seconds, steps, val, test)
        if steps == args.max_steps:
            break

    report.done(steps)
    if args.save:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)


# --------------------------------------------------------------------------- launching
def main(args):
    check_gcn(args)
    check_device(args.device, amp=args.amp)  # one line for what the device cannot do (lesson 3)
    check_writable(args.save, args.metrics_json)
    data, split, metric = load_dataset(args)
    sort_edges(data)
    train(data, split, metric, args)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = Parser(__doc__)
    add_gcn_flags(p)  # --dataset --epochs --batch-size --num-neighbors --amp --device ... (gcn_parts.py)
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.threads_per_proc is None:
        args.threads_per_proc = cpu_cores()
    if args.num_workers is None:  # on CPU every core already trains; beside a GPU, cores sample
        args.num_workers = 0 if args.device == "cpu" else min(4, max(0, cpu_cores() - 1))
    return args


if __name__ == "__main__":
    run_main(main, parse_args)  # main(parse_args()), a mistake said in one line, no traceback
