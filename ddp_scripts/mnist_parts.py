"""The MNIST pieces of the course, written once: the data (files, download, an offline fallback),
the models and the evaluation. Lesson 1's script and every MNIST lesson after it import them; copy
this file beside a lesson script (with ddp_hardening.py for a DDP script).

    prepare_data(dataset, data_dir)     put the files in place once; returns "mnist" or "fashion-mnist"
    load_split(dataset, data_dir, train)      the split as two tensors: images N x 1 x 28 x 28, labels
    build_model(name)                   "linear", "convnet" or "mlp"
    evaluate(model, images, labels, rank, world_size)   test loss and accuracy, over every rank
"""
import gzip
import math
import os
import shutil
import socket
import struct
from urllib.error import URLError
from urllib.request import getproxies

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ddp_hardening import UsageError

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
