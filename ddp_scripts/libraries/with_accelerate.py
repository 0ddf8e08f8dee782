"""Lesson 2's training (and lesson 6's accumulation) written with Hugging Face Accelerate: the same
global batch, the same updates as one process, which tests/e2e/test_libraries.py checks. Read it
beside docs/LIBRARIES.md, which maps each of the course's mechanisms to Accelerate's.

    python ddp_scripts/libraries/with_accelerate.py --nprocs 2 --max-steps 50
    python ddp_scripts/libraries/with_accelerate.py --nprocs 2 --accum 4 --save model.pt

Runs on the CPU (Gloo); for GPUs, drop `cpu=True` below and the same launches use NCCL. Needs
`accelerate` (requirements-libraries.txt) and the course's mnist_parts.py, ddp_hardening.py in
ddp_scripts/ for the data, and example_flags.py beside it.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, notebook_launcher
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's data and models
from ddp_hardening import master_port  # noqa: E402
from mnist_parts import build_model, load_split, prepare_data  # noqa: E402
from example_flags import parse_args  # noqa: E402  (the flags, beside this file)


def train(args):
    # Lesson 2: one process per rank, the process group, the global batch. Accelerate reads the rank
    # and world size its launcher set; split_batches=True makes --batch-size the global batch (the
    # default, False, makes it each process's). Lesson 6: accumulation, with no_sync() inside.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    torch.manual_seed(0)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    images, labels = load_split(args.dataset, args.data_dir, train=True)
    micro_batch = args.batch_size // args.accum  # all ranks' images in one micro-batch
    loader = DataLoader(TensorDataset(images[:args.max_steps * args.batch_size],
                                      labels[:args.max_steps * args.batch_size]), batch_size=micro_batch)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
    test_loader = DataLoader(TensorDataset(test_images[:args.eval_images], test_labels[:args.eval_images]),
                             batch_size=100)
    # DDP around the model (lesson 2), a sampler per rank (a slice of each global batch here).
    model, optimizer, loader, test_loader = accelerator.prepare(model, optimizer, loader, test_loader)

    for x, y in loader:
        with accelerator.accumulate(model):  # skips the all-reduce but on the last micro-batch
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)  # divides the loss by --accum: the mean over the whole batch
            optimizer.step()  # a step only when the micro-batches are all in (it counts them)
            optimizer.zero_grad()

    # Lesson 2's evaluation: each rank scores its share; gather_for_metrics collects every rank's
    # predictions and drops the copies a rank added to even out the shares (here --eval-images).
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in test_loader:
            predictions, targets = accelerator.gather_for_metrics((model(x).argmax(1), y))
            correct += (predictions == targets).sum().item()
            total += len(targets)
    if accelerator.is_main_process:
        print(f"done: {accelerator.num_processes} processes, test accuracy {correct / total:.2%} "
              f"of {total} images", flush=True)
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps({"world_size": accelerator.num_processes,
                                                           "correct": correct, "total": total}))
        if args.save:
            torch.save(accelerator.unwrap_model(model).state_dict(), args.save)


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    # Started by hand, this runs once, before the processes start; under a launcher every rank runs
    # it (then download first, or wrap it in accelerator.main_process_first() inside train).
    args.dataset = prepare_data("auto", args.data_dir)
    if "RANK" in os.environ:  # started by `accelerate launch` or torchrun: this process is one rank
        train(args)
    else:  # started by hand: notebook_launcher starts --nprocs ranks (from a notebook too)
        # use_port: its default is always 29500, where a second job on the machine would collide
        notebook_launcher(train, (args,), num_processes=args.nprocs, use_port=master_port())
