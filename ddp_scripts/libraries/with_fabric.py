"""Lesson 2's training (and lesson 6's accumulation) written with Lightning Fabric: the same global
batch, the same updates as one process, which tests/e2e/test_libraries.py checks. Read it beside
docs/LIBRARIES.md, which maps each of the course's mechanisms to Fabric's.

    python ddp_scripts/libraries/with_fabric.py --nprocs 2 --max-steps 50
    python ddp_scripts/libraries/with_fabric.py --nprocs 2 --accum 4 --save model.pt

Runs on the CPU (Gloo; on GPUs, accelerator="cuda" and NCCL). Needs `lightning-fabric`
(requirements-libraries.txt) and the course's mnist_parts.py, ddp_hardening.py in
ddp_scripts/ for the data, and example_flags.py beside it.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's data and models
from mnist_parts import build_model, load_split, prepare_data  # noqa: E402
from example_flags import parse_args  # noqa: E402  (the flags, beside this file)


def train(fabric, args):
    # Lesson 2: fabric.launch started the ranks and the process group; setup() wraps the model in
    # DDP (strategy="ddp_fork"), setup_dataloaders() gives each rank a DistributedSampler: every
    # world_size-th image, so each rank's batch is the global batch / world size, as in lesson 2.
    torch.manual_seed(0)
    model = build_model(args.model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))
    images, labels = load_split(args.dataset, args.data_dir, train=True)
    per_rank = args.batch_size // args.accum // fabric.world_size  # one rank's micro-batch
    loader = fabric.setup_dataloaders(DataLoader(
        TensorDataset(images[:args.max_steps * args.batch_size], labels[:args.max_steps * args.batch_size]),
        batch_size=per_rank))

    for i, (x, y) in enumerate(loader):
        last = (i + 1) % args.accum == 0
        # Lesson 6: DDP's no_sync() on every micro-batch but the last; the loss divided by hand.
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(F.cross_entropy(model(x), y) / args.accum)
        if last:
            optimizer.step()
            optimizer.zero_grad()

    # Lesson 2's evaluation: each rank scores every world_size-th image, the sums all-reduced.
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
    x = test_images[:args.eval_images][fabric.global_rank::fabric.world_size]
    y = test_labels[:args.eval_images][fabric.global_rank::fabric.world_size]
    model.eval()
    with torch.no_grad():
        counts = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    correct, total = fabric.all_reduce(counts, reduce_op="sum").tolist()
    if fabric.is_global_zero:
        print(f"done: {fabric.world_size} processes, test accuracy {correct / total:.2%} of {total} images",
              flush=True)
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps({"world_size": fabric.world_size,
                                                           "correct": correct, "total": total}))
        if args.save:
            torch.save(model.module.state_dict(), args.save)  # .module: the model inside the wrappers


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    args.dataset = prepare_data("auto", args.data_dir)  # once, before the processes start
    torch.set_num_threads(1)
    # "ddp_fork": the ranks are forked, and a forked process ends with os._exit. Spawned ("ddp_spawn"),
    # each ends through Python's shutdown, where a Gloo thread can still abort it (SIGABRT after
    # "terminate called without an active exception": docs/decisions/0008). Fork before CUDA is used.
    fabric = Fabric(accelerator="cpu", devices=args.nprocs, strategy="ddp_fork")
    fabric.launch(train, args)  # starts --nprocs ranks, each calls train(fabric, args)
