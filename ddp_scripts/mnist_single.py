"""Lesson 1: train an MNIST classifier in ONE process (the baseline for every DDP lesson).

    python mnist_single.py --model convnet --epochs 1
    python mnist_single.py --model linear --batch-size 128 --max-steps 50 --no-shuffle

Self-contained: copy it anywhere, it needs only torch and torchvision (tqdm optional).
Compare it with mnist_ddp_cpu.py: the diff is the DDP lesson (the part above the "hardening" fence).
"""
import argparse
import gzip
import json
import math
import os
import shutil
import socket
import struct
import sys
import threading
import time
from urllib.error import URLError
from urllib.request import getproxies

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # its default lock, a semaphore, leaks if a process is killed
except ImportError:  # the progress bar is optional
    def tqdm(iterable, **kwargs):
        return iterable


# --------------------------------------------------------------------------- data
# torchvision's folder names. The script reads the files itself: importing torchvision takes ~1.5 s.
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
MEAN_STD = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}
RAW_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FASHION_MNIST_PACKAGE_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


class UsageError(Exception):
    """Something the user can fix: reported in one line, without a traceback."""


def raw_dir(name, data_dir):
    return os.path.join(data_dir, FOLDERS[name], "raw")  # torchvision's layout


def have_files(name, data_dir):
    return all(os.path.exists(os.path.join(raw_dir(name, data_dir), f)) for f in RAW_FILES)


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


def load_split(name, data_dir, train):
    """Decode the whole split into tensors once: no per-sample PIL work while training."""
    prefix = os.path.join(raw_dir(name, data_dir), "train" if train else "t10k")
    images, labels = read_idx(f"{prefix}-images-idx3-ubyte"), read_idx(f"{prefix}-labels-idx1-ubyte")
    mean, std = MEAN_STD[name]
    images = images.float().div_(255).sub_(mean).div_(std).unsqueeze(1)  # N x 1 x 28 x 28, in place
    return images, labels.long()


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
    if name == "linear":  # Flatten + Linear (Graph Neural Networks in Action, 7.8)
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    return ConvNet()


# --------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model, images, labels):
    """Loss and accuracy over the whole test set."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for x, y in zip(images.split(128), labels.split(128)):
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
    model.train()
    return loss_sum / len(labels), correct / len(labels)


def write_metrics(path, metrics):
    """The metrics JSON, written whole (a new file renamed over the old): never half a file."""
    with open(f"{path}.part", "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(f"{path}.part", path)


def train(args):
    torch.set_num_threads(args.threads_per_proc)
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    train_set = TensorDataset(train_images, train_labels)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=not args.no_shuffle,
                        generator=torch.Generator().manual_seed(args.seed))

    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"training {args.model} on {args.dataset}: 1 process, {args.threads_per_proc} torch "
        f"thread(s), batch {args.batch_size}", flush=True)
    history, steps, start = [], 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        bar = progress(loader, f"epoch {epoch}", not args.quiet)
        for x, y in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(y)
            seen += len(y)
            steps += 1
            if steps == args.max_steps:
                break
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        test_loss, test_accuracy = evaluate(model, test_images, test_labels)
        history.append({"epoch": epoch, "train_loss": loss_sum / seen, "test_loss": test_loss,
                        "test_accuracy": test_accuracy, "seconds": seconds,
                        "images_per_second": seen / seconds, "steps": steps})
        log(f"epoch {epoch}: train loss {loss_sum / seen:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_accuracy:.2%}  {seconds:.1f} s  {seen / seconds:,.0f} images/s",
            flush=True)
        if args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": 1,
                "model": args.model, "dataset": args.dataset, "batch_size": args.batch_size,
                "threads_per_proc": args.threads_per_proc, "epochs": history})
        if steps == args.max_steps:
            break

    last = history[-1]
    print(f"done: {args.model} on {args.dataset}, 1 process, {steps} steps, "
          f"test accuracy {last['test_accuracy']:.2%}, {last['images_per_second']:,.0f} images/s, "
          f"{time.perf_counter() - start:.1f} s in all", flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


def main(args):
    check_writable(args.save, args.metrics_json)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    train(args)


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


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
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
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads (default: all cores)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    args = p.parse_args(argv)
    if args.threads_per_proc is None:
        args.threads_per_proc = cpu_cores()
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
