"""Lesson 2, by hand: data parallelism without DDP, to see what DDP does for you.

    python mnist_by_hand.py --nprocs 2 --model linear --max-steps 50 --save by_hand.pt

Every process holds a whole replica of the model and trains on its share of each global batch.
After backward, the processes add up each gradient with an all-reduce and divide by their number,
so every replica takes the same step (the two lines marked "# BY HAND"). That is what
DistributedDataParallel does; it also sends the gradients in buckets while backward is still
running, and broadcasts rank 0's weights when it is built. A teaching script: it reads the data that
mnist_single.py (or any lesson script) has prepared, and it has none of the hardening of
mnist_ddp_cpu.py, which is the one to copy.
"""
import argparse
import math
import os
import socket
import struct
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# --------------------------------------------------------------------------- data (as in lesson 1)
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
MEAN_STD = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}


class UsageError(Exception):
    """Something the user can fix: reported in one line, without a traceback."""


def raw_dir(name, data_dir):
    return os.path.join(data_dir, FOLDERS[name], "raw")  # torchvision's layout


def read_idx(path):
    """One file in MNIST's IDX format: 0, 0, 8 (unsigned bytes), the number of dimensions, each
    size as a big-endian 32-bit integer, then the values."""
    with open(path, "rb") as f:
        data = bytearray(f.read())  # writable, as torch.frombuffer wants
    try:
        shape = struct.unpack_from(f">{data[3]}I", data, 4)
    except (IndexError, struct.error):  # not even a whole header
        shape = ()
    offset = 4 + 4 * len(shape)
    if data[:3] != b"\x00\x00\x08" or not shape or len(data) != offset + math.prod(shape):
        raise UsageError(f"{path} is not a whole MNIST-format file (cut short by an interrupted "
                         f"download or copy?): delete it and run again to fetch it anew")
    return torch.frombuffer(data, dtype=torch.uint8, offset=offset).reshape(shape)


def load_split(name, data_dir, train):
    """Decode the whole split into tensors once: no per-sample PIL work while training."""
    prefix = os.path.join(raw_dir(name, data_dir), "train" if train else "t10k")
    images, labels = read_idx(f"{prefix}-images-idx3-ubyte"), read_idx(f"{prefix}-labels-idx1-ubyte")
    mean, std = MEAN_STD[name]
    images = images.float().div_(255).sub_(mean).div_(std).unsqueeze(1)  # N x 1 x 28 x 28, in place
    return images, labels.long()


class ConvNet(nn.Module):
    """Two conv and two linear layers with dropout (Mastering PyTorch, chapter 11)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.dropout1 = nn.Dropout(0.10)
        self.dropout2 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits


def build_model(name):
    if name == "linear":  # Flatten + Linear (Graph Neural Networks in Action, 7.8)
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    return ConvNet()


# --------------------------------------------------------------------------- one rank, by hand
def worker(rank, world_size, args):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(max(1, os.cpu_count() // world_size))
    images, labels = load_split(args.dataset, args.data_dir, train=True)

    torch.manual_seed(args.seed)
    model = build_model(args.model)  # a plain model: no DDP wrapper
    for tensor in model.state_dict().values():  # BY HAND: every replica starts from rank 0's weights
        dist.broadcast(tensor, src=0)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank, as under DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_set = TensorDataset(images, labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    steps = 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # this rank's gradients, from its B samples
            for p in model.parameters():  # BY HAND: sum every gradient over the ranks, then average
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world_size
            optimizer.step()  # the same averaged gradients everywhere: the same step
            steps += 1
            if steps == args.max_steps:
                break
        if steps == args.max_steps:
            break

    if rank == 0:
        test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
        with torch.no_grad():
            model.eval()
            correct = sum((model(x).argmax(1) == y).sum().item()
                          for x, y in zip(test_images.split(128), test_labels.split(128)))
        accuracy = correct / len(test_labels)
        print(f"done: {args.model} on {args.dataset} by hand, {world_size} processes, {steps} steps, "
              f"test accuracy {accuracy:.2%}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line
def free_port():
    """A port that nothing listens on now (the OS picks it): where rank 0 waits for the others."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["linear", "convnet"], default="linear")
    p.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default=None,
                   help="default: MNIST if its files are in --data-dir, else Fashion-MNIST")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64, help="per process")
    p.add_argument("--lr", type=positive(float), default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--nprocs", type=positive(int), default=2)
    p.add_argument("--save", type=str, default=None, help="write rank 0's final state_dict here")
    p.add_argument("--quiet", action="store_true", help="(accepted, as by the other scripts)")
    p.add_argument("--timeout", type=positive(int), default=120, help="seconds a collective may wait")
    args = p.parse_args(argv)
    def present(name):
        return os.path.exists(os.path.join(raw_dir(name, args.data_dir), "t10k-labels-idx1-ubyte"))

    if args.dataset is None:
        args.dataset = "mnist" if present("mnist") else "fashion-mnist"
    if not present(args.dataset):
        raise UsageError(f"no {args.dataset} files in {raw_dir(args.dataset, args.data_dir)}: run "
                         f"mnist_single.py once with the same --data-dir to prepare them")
    return args


def main(args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
