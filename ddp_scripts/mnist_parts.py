"""The MNIST pieces of the course, written once: the data (files, download, an offline fallback),
the models, the evaluation, lesson 1's command line and what each run reports. Lesson 1's script
and every MNIST lesson after it import them; copy this file beside a lesson script (with
ddp_hardening.py, which it imports).

    prepare_data(dataset, data_dir)     put the files in place once; returns "mnist" or "fashion-mnist"
    load_split(dataset, data_dir, train, device)   the split as two tensors: images N x 1 x 28 x 28, labels
    build_model(name)                   "linear", "convnet" or "mlp"
    evaluate(model, images, labels, rank, world_size)   test loss and accuracy, over every rank
    add_training_flags(parser)          lesson 1's flags: --model --dataset --epochs --batch-size ...
    Report(args, rank, world_size)      rank 0's lines, the metrics JSON and the `done:` summary
    add_prepared_flags, prepared_args, save_outputs    the by-hand scripts', which read lesson 1's files
"""
import gzip
import math
import os
import shutil
import socket
import struct
import time
from urllib.error import URLError
from urllib.request import getproxies

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ddp_hardening import UsageError, cpu_cores, positive, write_metrics

# --------------------------------------------------------------------------- data
# torchvision's folder names. The files are read here: importing torchvision takes ~1.5 s.
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
MEAN_STD = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}
RAW_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FASHION_MNIST_PACKAGE_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


def raw_dir(name, data_dir):
    return os.path.join(data_dir, FOLDERS[name], "raw")  # torchvision's layout


def have_files(name, data_dir):
    return all(os.path.exists(os.path.join(raw_dir(name, data_dir), f)) for f in RAW_FILES)


def prepared(name, data_dir):
    """The data set of the teaching scripts, which read what a lesson script has prepared: `name`, or
    when it is None MNIST if all its files are in data_dir, else Fashion-MNIST; refused in one line
    if its files are not there."""
    if name is None:
        name = "mnist" if have_files("mnist", data_dir) else "fashion-mnist"
    if not have_files(name, data_dir):
        raise UsageError(f"no {name} files in {raw_dir(name, data_dir)}: run mnist_single.py once "
                         f"with the same --data-dir to prepare them")
    return name


def try_download(name, data_dir):
    """torchvision's own download; False (within seconds, not minutes) when offline."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(10)
    try:
        if not getproxies():  # offline, this fails at once, before the import (a proxy looks it up)
            socket.getaddrinfo("ossci-datasets.s3.amazonaws.com", 443)  # torchvision's MNIST mirror
        from torchvision import datasets
        getattr(datasets, FOLDERS[name])(data_dir, train=True, download=True)  # train and test files
        return True
    except (RuntimeError, URLError, OSError):
        return False
    finally:
        socket.setdefaulttimeout(previous)


def copy_from_package(data_dir):
    os.makedirs(raw_dir("fashion-mnist", data_dir), exist_ok=True)
    for f in RAW_FILES:
        target = os.path.join(raw_dir("fashion-mnist", data_dir), f)
        with gzip.open(os.path.join(FASHION_MNIST_PACKAGE_DIR, f + ".gz")) as src, \
                open(target + ".part", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(target + ".part", target)  # atomic: a reader never sees half a file


def prepare_data(dataset, data_dir, verbose=True):
    """Put the files on disk (download at most once) and return the dataset actually used.

    Call it in ONE process: N processes downloading into the same folder corrupt each other.
    """
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot use --data-dir {data_dir}: {err.strerror}") from None
    if dataset in ("auto", "mnist"):
        if have_files("mnist", data_dir) or try_download("mnist", data_dir):
            return "mnist"
        if dataset == "mnist":
            raise UsageError(
                f"MNIST is not in {raw_dir('mnist', data_dir)} and could not be downloaded (offline?): "
                f"run once online, copy the four *-ubyte files there, or use --dataset fashion-mnist")
    if not have_files("fashion-mnist", data_dir):
        if os.path.isdir(FASHION_MNIST_PACKAGE_DIR):
            copy_from_package(data_dir)
        elif not try_download("fashion-mnist", data_dir):
            raise UsageError(
                f"Fashion-MNIST is not in {raw_dir('fashion-mnist', data_dir)} and could not be "
                f"downloaded (offline?): install Debian's dataset-fashion-mnist or copy the files there")
    if dataset == "auto" and verbose:
        print("MNIST is not available (no files, no download): using Fashion-MNIST instead "
              "(same shapes, 10 classes of clothing).", flush=True)
    return "fashion-mnist"


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


def load_split(name, data_dir, train, device="cpu"):
    """Decode the whole split into tensors once: no per-sample PIL work while training. On a GPU
    (`device`), the whole split fits: a batch is then gathered there, with no copy per step."""
    prefix = os.path.join(raw_dir(name, data_dir), "train" if train else "t10k")
    images, labels = read_idx(f"{prefix}-images-idx3-ubyte"), read_idx(f"{prefix}-labels-idx1-ubyte")
    mean, std = MEAN_STD[name]
    images = images.float().div_(255).sub_(mean).div_(std).unsqueeze(1)  # N x 1 x 28 x 28, in place
    return images.to(device), labels.long().to(device)


# --------------------------------------------------------------------------- models
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
    if name == "mlp":  # 5.8M parameters: 23 MB of gradients to all-reduce per step, 20x the ConvNet's
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 2048), nn.ReLU(),
                             nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    if name == "linear":  # Flatten + Linear (Graph Neural Networks in Action, 7.8)
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    return ConvNet()


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, images, labels, rank=0, world_size=1):
    """Loss and accuracy over the whole test set. With several ranks, each scores every
    world_size-th image, and an all_reduce adds up the sums: shards may differ in size, so the
    sums are added and divided once (an average of averages would be off)."""
    model.eval()
    # The same number of batches on every rank (up to 128 images each; fewer, or none, at times):
    # under FSDP each forward is a collective, which every rank must run as often.
    batches = math.ceil(len(labels) / world_size / 128)
    images, labels = images[rank::world_size], labels[rank::world_size]  # disjoint shards
    # On the GPU, and no .item() per batch: each would wait for the GPU. NCCL reduces GPU tensors.
    totals = torch.zeros(3, dtype=torch.float64, device=images.device)  # loss sum, correct, count
    for x, y in zip(images.tensor_split(batches), labels.tensor_split(batches)):
        logits = model(x).float()
        totals[0] += F.cross_entropy(logits, y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    if world_size > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# --------------------------------------------------------------------------- the command line
def add_training_flags(p):
    """Lesson 1's flags, which every MNIST script takes; a later script adds its own after them,
    and may define one of these again to change it (ddp_hardening.Parser lets the last one win)."""
    p.add_argument("--model", choices=["linear", "convnet"], default="convnet")
    p.add_argument("--dataset", choices=["auto", "mnist", "fashion-mnist"], default="auto",
                   help="auto: MNIST if present or downloadable, else Fashion-MNIST")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64)
    p.add_argument("--lr", type=positive(float), default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None,
                   help="stop after this many optimizer steps in total")
    p.add_argument("--no-shuffle", action="store_true", help="fixed sample order")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")


def add_prepared_flags(p):
    """The flags the by-hand scripts share: the data lesson 1's script prepared (they download
    nothing: prepared() checks it), the schedule, the ranks, the outputs, the collectives' timeout."""
    p.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default=None,
                   help="default: MNIST if its files are in --data-dir, else Fashion-MNIST")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--lr", type=positive(float), default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--nprocs", type=positive(int), default=2)
    p.add_argument("--save", type=str, default=None, help="write rank 0's final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final line")
    p.add_argument("--timeout", type=positive(int), default=120, help="seconds a collective may wait")


def prepared_args(args):
    """A by-hand script's command line, its own checks passed: the data lesson 1's script prepared
    (refused in one line if it is not there), and the threads, each process's share of the cores."""
    if getattr(args, "threads_per_proc", 0) is None:
        args.threads_per_proc = cpu_cores(shared_by=args.nprocs)
    args.dataset = prepared(args.dataset, args.data_dir)  # the files mnist_single.py prepared
    return args


def save_outputs(args, weights, metrics):
    """Rank 0's outputs of a by-hand run: --save's weights, --metrics-json's record (written whole)."""
    if args.save:
        torch.save(weights, args.save)
    if args.metrics_json:
        write_metrics(args.metrics_json, metrics)


# --------------------------------------------------------------------------- what a run reports
class Report:
    """What every MNIST script reports, rank 0 speaking: its lines (`say`), one line per epoch, the
    metrics JSON after each epoch (a crash keeps the epochs done) and the `done:` summary. `fields`:
    what the JSON holds beside the epochs (a field of the same name replaces the default one)."""

    def __init__(self, args, rank=0, world_size=1, **fields):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.fields = {"world_size": world_size, "model": args.model, "dataset": args.dataset,
                       "batch_size": args.batch_size, "threads_per_proc": args.threads_per_proc, **fields}
        self.history, self.start = [], time.perf_counter()

    def say(self, text):
        if self.rank == 0 and not self.args.quiet:
            print(text, flush=True)

    def epoch(self, epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy, note="", **more):
        """Record an epoch: its training loss over every rank (the ranks' sums and counts added up
        by an all_reduce, so every rank calls it; a loss_sum on a GPU stays there, as NCCL wants),
        its test loss and accuracy (evaluate's), its training time and steps; `more` goes into the
        epoch's record, `note` at the end of its line."""
        loss_sum = torch.as_tensor(loss_sum, dtype=torch.float64)
        totals = torch.stack([loss_sum, torch.tensor(seen, dtype=torch.float64, device=loss_sum.device)])
        if self.world_size > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        loss_mean, seen_all = (totals[0] / totals[1]).item(), int(totals[1])
        self.history.append({"epoch": epoch, "train_loss": loss_mean, "test_loss": test_loss,
                             "test_accuracy": test_accuracy, "seconds": seconds,
                             "images_per_second": seen_all / seconds, "steps": steps, **more})
        self.say(f"epoch {epoch}: train loss {loss_mean:.4f}  test loss {test_loss:.4f}  test accuracy "
                 f"{test_accuracy:.2%}  {seconds:.1f} s  {seen_all / seconds:,.0f} images/s{note}")
        if self.rank == 0 and self.args.metrics_json:
            write_metrics(self.args.metrics_json, {**self.fields, "epochs": self.history})

    def done(self, steps):
        """The summary line, printed by rank 0 even with --quiet: the tests and notebooks look for it."""
        if self.rank == 0:
            last, n = self.history[-1], self.world_size
            print(f"done: {self.args.model} on {self.args.dataset}, {n} process{'es' * (n != 1)}, "
                  f"{steps} steps, test accuracy {last['test_accuracy']:.2%}, "
                  f"{last['images_per_second']:,.0f} images/s, {time.perf_counter() - self.start:.1f} s "
                  f"in all", flush=True)
