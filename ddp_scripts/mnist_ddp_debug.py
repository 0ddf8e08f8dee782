"""Lesson 8: lesson 2's training with two debugging aids: a watchdog that prints where each rank is
when it stops making progress, and a check that the replicas are still equal.

    python mnist_ddp_debug.py --nprocs 2 --watchdog 60 --check-sync-every 100
    python mnist_ddp_debug.py --bug stall --watchdog 5 --timeout 20  # see a stuck rank found
    python mnist_ddp_debug.py --bug diverge --check-sync-every 10    # see silent divergence caught

Self-contained: copy it anywhere, it needs only torch and torchvision (tqdm optional).
Compare it with mnist_ddp_cpu.py: the diff is the lesson (above the "hardening" fence).
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
import traceback
from datetime import timedelta
from urllib.error import URLError
from urllib.request import getproxies

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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


# --------------------------------------------------------------------------- debugging aids
class Watchdog:
    """A thread that prints where this rank is when it has made no progress for `seconds`: the
    stack of the main thread, tagged with the rank. In a hang, every rank reports, so one sees at
    once which rank is stuck outside the collectives and where the others wait for it (DDP's
    all-reduce inside backward, a barrier). It only reports: the group's timeout ends the job."""

    def __init__(self, rank, seconds):
        self.rank, self.seconds = rank, seconds
        self.last, self.reported = time.monotonic(), False
        self.main = threading.main_thread().ident
        self.stopped = threading.Event()
        if seconds > 0:
            threading.Thread(target=self.watch, daemon=True).start()

    def progress(self):  # call after each step, evaluation, barrier
        self.last, self.reported = time.monotonic(), False

    def watch(self):
        # The main thread waits for collectives in C++ with the GIL released, so this one runs.
        while not self.stopped.wait(min(1.0, self.seconds / 4)):
            idle = time.monotonic() - self.last
            if idle >= self.seconds and not self.reported:
                self.reported = True  # once per stall
                frames = traceback.extract_stack(sys._current_frames()[self.main])[-6:]
                report = "".join(traceback.format_list(frames))
                # One write, so that two ranks' reports cannot interleave on a shared terminal or pipe.
                sys.stderr.write(f"watchdog: rank {self.rank} has made no progress for {idle:.0f} s; "
                                 f"it is at:\n{report}\n")
                sys.stderr.flush()

    def stop(self):
        self.stopped.set()


def check_replicas(model, steps):
    """DDP keeps the replicas equal only if nothing changes one rank's copy alone. Compare a
    checksum of every parameter and buffer across ranks (replicas are equal to the bit, so the
    sums are too); stop every rank with the first tensor that differs, or that is not finite."""
    names, tensors = zip(*model.module.state_dict().items())
    sums = torch.stack([torch.stack([t.double().sum(), t.double().pow(2).sum()]) for t in tensors])
    mine = sums.view(torch.int64)  # compared as bits: a NaN is unequal to itself, its bits are not
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # a collective: every rank checks at the same steps
    for other, theirs in enumerate(every):
        differs = (theirs != every[0]).any(dim=1).nonzero()
        if len(differs):
            name = names[differs[0].item()]
            raise UsageError(f"the replicas differ after step {steps}: {name} is not the same on "
                             f"ranks 0 and {other} (something changed one rank's copy outside DDP: "
                             f"a load, an update or a random draw on some ranks only)")
    diverged = (~sums.isfinite()).any(dim=1).nonzero()  # equal on every rank, as checked above
    if len(diverged):
        raise UsageError(f"training diverged by step {steps}: {names[diverged[0].item()]} holds NaN or "
                         f"inf on every rank, alike (not a desync): lower --lr or look for a bad input")


def inject_bug(bug, rank, model, args):
    """For the lesson: the two mistakes this script's aids find, on the last rank or the first."""
    if bug == "stall" and rank == dist.get_world_size() - 1:
        # A rank stuck outside the collectives: a slow disk, an input() prompt, a hung loader.
        time.sleep(10 * args.timeout)
    if bug == "diverge" and rank == 0:
        # Rank 0 alone loads weights after DDP was built (DDP broadcasts them only when it starts):
        # from now on the replicas differ, and nothing fails.
        model.module.load_state_dict(build_model(args.model).state_dict())


# --------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model, images, labels, rank, world_size):
    """Loss and accuracy over the whole test set: each rank scores every world_size-th image."""
    model.eval()
    images, labels = images[rank::world_size], labels[rank::world_size]  # disjoint shards
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y in zip(images.split(128), labels.split(128)):
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").item()
        totals[1] += (logits.argmax(1) == y).sum().item()
        totals[2] += len(y)
    # SUM over ranks, then divide once: shards may differ in size (an average of averages would not)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def write_metrics(path, metrics):
    """The metrics JSON, written whole (a new file renamed over the old): never half a file."""
    with open(f"{path}.part", "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(f"{path}.part", path)


def train(rank, world_size, args):
    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)

    # 2. Instantiate the model, then wrap it. The same seed gives every rank the same start
    #    (DDP also broadcasts rank 0's weights); a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    model = DDP(build_model(args.model))
    torch.manual_seed(args.seed + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)  # rank 0 speaks
    log(f"training {args.model} on {args.dataset}: {world_size} processes, {args.threads_per_proc} "
        f"torch thread(s) each, batch {args.batch_size} per process "
        f"({args.batch_size * world_size} in all)", flush=True)
    watchdog = Watchdog(rank, args.watchdog)  # from here on, a rank that stalls says where it is
    history, steps, checks, start = [], 0, 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        # plain: bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
        for x, y in bar:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # 4. DDP all-reduces (averages) the gradients here, during backward
            optimizer.step()  # ... so every rank takes the same step and the replicas stay equal
            loss_sum += loss.item() * len(y)
            seen += len(y)
            steps += 1
            watchdog.progress()
            if steps == args.bug_step:
                inject_bug(args.bug, rank, model, args)
            if args.check_sync_every and steps % args.check_sync_every == 0:
                check_replicas(model, steps)  # stops every rank with the tensor that differs
                checks += 1
            if steps == args.max_steps:
                break
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. The plain
        #    model.module is used because evaluation needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(model.module, test_images, test_labels, rank, world_size)
        train_totals = torch.tensor([loss_sum, seen], dtype=torch.float64)
        dist.all_reduce(train_totals, op=dist.ReduceOp.SUM)
        loss_mean, seen_all = (train_totals[0] / train_totals[1]).item(), int(train_totals[1])
        history.append({"epoch": epoch, "train_loss": loss_mean, "test_loss": test_loss,
                        "test_accuracy": test_accuracy, "seconds": seconds,
                        "images_per_second": seen_all / seconds, "steps": steps})
        log(f"epoch {epoch}: train loss {loss_mean:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_accuracy:.2%}  {seconds:.1f} s  {seen_all / seconds:,.0f} images/s",
            flush=True)
        if rank == 0 and args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": world_size,
                "model": args.model, "dataset": args.dataset, "batch_size": args.batch_size,
                "threads_per_proc": args.threads_per_proc, "replica_checks": checks, "epochs": history})
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks.
        dist.barrier()
        watchdog.progress()
        if steps == args.max_steps:
            break
    watchdog.stop()

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    if rank == 0:
        last = history[-1]
        print(f"done: {args.model} on {args.dataset}, {world_size} processes, {steps} steps, "
              f"test accuracy {last['test_accuracy']:.2%}, {last['images_per_second']:,.0f} "
              f"images/s, {time.perf_counter() - start:.1f} s in all", flush=True)
        if args.check_sync_every:
            print(f"replicas compared {checks} times (every {args.check_sync_every} steps): equal",
                  flush=True)
        if args.save:
            torch.save(model.module.state_dict(), args.save)


def worker(rank, world_size, args):
    """What each process runs, whether spawned by main() or started by torchrun."""
    # 1. Join the process group. Every rank meets at MASTER_ADDR:MASTER_PORT (set by main() below
    #    or by torchrun); Gloo is the backend for CPUs. The timeout bounds every collective, so a
    #    rank that dies or stalls turns into an error instead of a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            store=attempt_store(args.timeout),  # plain: nothing
                            timeout=timedelta(seconds=args.timeout))
    try:
        if "RANK" in os.environ:  # torchrun: no launcher has prepared the data; the ranks do
            # plain: args.dataset = prepare_data(args.dataset, args.data_dir)
            args.dataset = prepare_in_turns(lambda d: prepare_data(d, args.data_dir, not args.quiet),
                                            args.dataset, rank, args.prepare_timeout)
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()  # 8. tear down, even after an error


# --------------------------------------------------------------------------- launching
def free_port():
    """A port that nothing listens on now (the OS picks it): where rank 0 waits for the others."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


def main(args):
    if "RANK" in os.environ:
        # Started by torchrun: this process already is one rank, and torchrun has set MASTER_ADDR
        # and MASTER_PORT. Each rank checks its own set-up before joining the group.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args)
        return
    # Started by hand: check and prepare the data once, here; then start --nprocs copies of this
    # file, each of which imports it (hence the __main__ guard) and runs worker(rank, nprocs, args).
    check_setup(args, rank=0)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    if args.nprocs > cpu_cores() and not args.quiet:
        print(f"note: {args.nprocs} processes on {cpu_cores()} cores: they will take turns, "
              f"expect it slower than fewer processes", flush=True)
    # plain: mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)
    spawn_workers(worker, args.nprocs, args)


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


def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    return value


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
    p.add_argument("--nprocs", type=positive(int), default=2,
                   help="processes to spawn (ignored under torchrun, which sets WORLD_SIZE)")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--timeout", type=positive(int), default=300,
                   help="seconds any collective may wait for the other ranks before failing")
    p.add_argument("--watchdog", type=non_negative, default=60,
                   help="seconds without progress after which each rank prints where it is (0: off)")
    p.add_argument("--check-sync-every", type=non_negative, default=100,
                   help="compare the replicas every this many steps (0: never)")
    p.add_argument("--bug", choices=["none", "stall", "diverge"], default="none",
                   help="for the lesson: stall (the last rank stops responding) or diverge "
                        "(rank 0 alone reloads its weights)")
    p.add_argument("--bug-step", type=positive(int), default=10, help="the step after which --bug strikes")
    add_hardening_flags(p)  # plain: nothing
    args = p.parse_args(argv)
    if args.threads_per_proc is None:
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))  # torchrun sets it
        args.threads_per_proc = max(1, cpu_cores() // procs)
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


# ================================================================================== hardening
# Below this fence: what makes the lesson above safe on real clusters, the same block in every
# DDP script of the course (a test keeps the copies identical). The part above reaches it through
# the lines marked "# plain: ...", which say what each stands for; ddp_scripts/minimal/ holds each
# script with those plain forms and without this part.
# What it needs from the part above: the imports argparse, os, socket, sys, time, torch,
# torch.distributed as dist, torch.multiprocessing as mp and datetime's timedelta; the names
# UsageError (raised anywhere, it ends the job with its one line: a check that refuses raises it),
# free_port(), positive(), parse_args() and main(args); the flags --timeout and --quiet.
# What a copier may delete: any piece whose "# plain:" line is put back to its plain form, with the
# functions only it calls; prepare_in_turns() with its flag (add_hardening_flags(p, prepare=False))
# when the script has no data to put in place.

def add_hardening_flags(parser, prepare=True):
    if prepare:  # prepare_in_turns()'s timeout
        parser.add_argument("--prepare-timeout", type=positive(int), default=3600,
                            help="under torchrun: seconds a rank may wait while others download "
                                 "and prepare the data")
    # torch.distributed.launch and DeepSpeed's launcher pass it; the LOCAL_RANK environment
    # variable, which they set too, is what counts (as PyTorch recommends).
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)


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


def master_port():
    """A port for rank 0 to listen on: the user's MASTER_PORT if it is free, else one the OS picks.
    A busy one is refused now, in one line, rather than by every worker with a traceback."""
    if "MASTER_PORT" not in os.environ:
        return str(free_port())
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise UsageError(f"MASTER_PORT={port} is already in use: choose another port "
                             f"or unset MASTER_PORT to let the script pick a free one") from None
    return str(port)


def attempt_store(timeout):
    """torchrun restarts the ranks (--max-restarts) in the store where the previous round's ranks
    wrote their addresses, and a rank that reads one of those connects to a process that is gone
    (pytorch/pytorch#135712). Each rendezvous round gets keys of its own; None (not torchrun, or
    no store shared by the agents): init_process_group's own store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, token = this_round(timeout)
    return dist.PrefixStore(f"round-{token}/", store)


_ROUND = []  # (agent's store, this round's token), once per process


def this_round(timeout):
    """torchrun: a client of the agents' store, and a token that every rank of this rendezvous round
    gets, and no rank of another round. Not TORCHELASTIC_RESTART_COUNT: each torchrun agent counts
    its own restarts, and one whose ranks were restarted because another machine failed does not
    count it (pytorch/pytorch#108158), so the ranks of one round can hold different counts, and
    the ranks of two rounds the same. Rank 0 draws the token; every other rank keeps writing fresh
    numbers under its own key until rank 0 has seen one change (a rank of an earlier round wrote
    its last number long ago, and is gone) and answered it with the token."""
    if _ROUND:
        return _ROUND[0]
    import uuid

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    prefix, deadline = f"round/{os.environ.get('TORCHELASTIC_RUN_ID')}/", time.monotonic() + timeout

    def read(key):
        return store.get(key) if store.check([key]) else None

    if rank == 0:
        token = uuid.uuid4().hex
        earlier = {r: read(f"{prefix}hello/{r}") for r in range(1, world_size)}
        while earlier:
            for r, before in list(earlier.items()):
                now = read(f"{prefix}hello/{r}")
                if now is not None and now != before:  # written by a live rank of this round
                    store.set(f"{prefix}answer/{r}", now + b" " + token.encode())
                    del earlier[r]
            if earlier and time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(earlier)} did not report within {timeout} s")
            time.sleep(0.05)
    else:
        mine = set()
        while True:
            number = uuid.uuid4().hex.encode()
            mine.add(number)
            store.set(f"{prefix}hello/{rank}", number)
            time.sleep(0.05)
            answer = read(f"{prefix}answer/{rank}")
            if answer and answer.split(b" ")[0] in mine:
                token = answer.split(b" ")[1].decode()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not answer within {timeout} s")
    _ROUND.append((store, token))
    return _ROUND[0]


def roll_call(check, args, rank, world_size, timeout=None):
    """torchrun: every rank runs check(args, rank) (GPUs, libraries, output paths) and tells all
    the others how it went, through torchrun's store, before any rank joins the process group. A
    refusal on one machine then stops every rank within seconds, said once, by rank 0; without the
    roll call the other machines would wait --timeout for a rank that has gone. On a refusal every
    rank exits with code 1."""
    timeout = timeout or args.timeout
    problem = ""
    try:
        check_network()
        check(args, rank)
    except UsageError as err:
        problem = str(err) if rank == 0 else f"{err} (rank {rank}, on {socket.gethostname()})"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # RANK set by hand: no store yet
        if problem:
            say(problem)
            sys.exit(1)
        return
    try:
        store, token = this_round(timeout)  # keys of this rendezvous round only
        prefix = f"roll-call/{token}/"
        keys = [f"{prefix}{r}" for r in range(world_size)]
        store.set(keys[rank], problem)
        store.wait(keys)  # every rank has reported
        problems = [p for p in (store.get(key).decode() for key in keys) if p]
        store.add(prefix + "read", 1)
        # Stay until all have read them: the store lives in rank 0's torchrun, which stops when
        # one of its ranks ends.
        deadline = time.monotonic() + timeout
        while problems and store.add(prefix + "read", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # torch's DistError: a rank did not report in time, or the store is gone
        if problem or int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per machine
            say(problem or f"not every rank reported for the roll call (waited up to --timeout "
                           f"{timeout} s): look for the error in each machine's output")
            sys.exit(1)
        exit_after_the_speaker()
    if problems:
        # Rank 0 says the first; torchrun --max-restarts starts a refused job again, to be refused
        # again: only the first attempt says it.
        said = f"roll-call/{os.environ.get('TORCHELASTIC_RUN_ID')}/said/{problems[0]}"
        if rank == 0:
            if store.add(said, 1) == 1:
                say(problems[0])
            sys.exit(1)
        exit_after_the_speaker()


def prepare_in_turns(prepare, first, rank, timeout):
    """torchrun: run prepare(choice) in every rank, in three turns, so that no two processes ever
    download into the same folder at once. Rank 0 goes first, with choice=first, and decides (e.g.
    what --dataset auto means): what it returns is the choice of every later turn. Then the first
    process of each other machine: it downloads a copy only where rank 0's files are not visible
    (no shared filesystem). Then all the others, which find the files in place. A turn ends when
    every rank knows that it went well; a UsageError in any rank stops all of them with its one
    line. A first download can outlast --timeout, so the turns get a process group with a timeout
    of their own (`timeout`, --prepare-timeout), a Gloo one whatever the training backend: the
    waiting ranks wait on the CPU, not in a GPU collective (Gloo connects the group here, while no
    rank is busy). Returns rank 0's choice."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    outcomes, choice = [None] * dist.get_world_size(), first
    try:
        for turn, mine in enumerate([rank == 0, rank != 0 and local_rank == 0, local_rank != 0]):
            error = None
            if mine:
                try:
                    choice = prepare(choice)
                except UsageError as err:
                    error = f"{err} (on {socket.gethostname()})" if turn == 1 else str(err)
            dist.all_gather_object(outcomes, (error, choice), group=group)
            errors = [e for e, _ in outcomes if e]
            if errors:
                raise UsageError(errors[0])
            choice = outcomes[0][1]  # rank 0's decision, for every rank
    finally:
        dist.destroy_process_group(group)
    return choice


def quiet_interrupt_in_finalizer(unraisable):
    """A Ctrl-C that lands while Python runs a finalizer (a __del__) cannot stop the worker there:
    Python prints it as "Exception ignored in ..." with a traceback, and goes on. Say nothing: the
    launcher, interrupted too, sends every worker a SIGINT of its own. Anything else: as usual."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def spawned_worker(rank, worker, stop, *worker_args):
    """What mp.spawn runs in each new process. spawn_workers started it deaf to Ctrl-C: listen again
    now, and stop at once if the job was interrupted meanwhile; then work, an error said once."""
    import signal

    sys.unraisablehook = quiet_interrupt_in_finalizer
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the launcher's handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not stop.is_set():
            try:
                worker(rank, *worker_args)
            except UsageError as err:
                said_once(err, rank)
        code = 0
    except SystemExit as exit_:  # said_once's exit code
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        # Deaf again: an interrupted worker gets a second SIGINT (the terminal's, then the
        # launcher's), and one that lands after mp.spawn's wrapper has caught the first, on the
        # way out, would print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_sooner()
    leave(code)  # an exception other than SystemExit went on to mp.spawn's wrapper, its traceback


def native_threads():
    """This process's threads as the kernel counts them (Python's own count misses torch's), or
    None where there is no /proc."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


THREADS_AFTER_IMPORTS = native_threads()  # this line runs once the lesson's imports are done


def start_method():
    """How spawn_workers starts the workers: "fork" where it is safe, "spawn" (what mp.spawn does)
    elsewhere. A forked worker starts with torch already imported, which saves it seconds; but fork
    copies only the calling thread. It is safe when no thread has started here since the imports
    (an OpenMP pool that a computation here started leaves a forked worker hung at its first
    parallel operation) and there is no GPU (CUDA cannot be used in a child forked after the parent
    has used it). DDP_START_METHOD=spawn, fork or forkserver decides instead."""
    chosen = os.environ.get("DDP_START_METHOD")
    if chosen:
        if chosen not in mp.get_all_start_methods():
            raise UsageError(f"DDP_START_METHOD={chosen} is not one of "
                             f"{', '.join(mp.get_all_start_methods())} (or unset it)")
        return chosen
    if THREADS_AFTER_IMPORTS is not None and native_threads() == THREADS_AFTER_IMPORTS \
            and "fork" in mp.get_all_start_methods() and not torch.cuda.is_available():
        return "fork"
    return "spawn"


def exit_sooner():
    """Python's last garbage collection at exit walks every object that torch's imports created
    (about a second here); frozen, they are left to the operating system. Finalizers, atexit
    functions and the flushing of open files still run."""
    import gc

    gc.freeze()


def leave(code):
    """End this process now with exit code `code`, the way multiprocessing ends a forked worker
    (os._exit), after the atexit functions and with the output flushed: Python's own shutdown is
    skipped. During that shutdown, on Python before 3.14, a thread of torch's that calls into
    Python (for instance a Gloo thread dropping the last reference to a tensor that Python made)
    is ended in the middle of C++ code, and the process aborts: "terminate called without an
    active exception" (CPython gh-87135), a finished run reported as killed by SIGABRT. A file
    still open is not flushed here: write through `with` blocks, as the lesson part does."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_network():
    """GLOO_SOCKET_IFNAME names the network interfaces Gloo binds to, a comma-separated list: one
    that this machine lacks stops each rank in init_process_group with a C++ traceback."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if not names or not hasattr(socket, "if_nameindex"):
        return
    present = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in names if name not in present]
    if missing:
        raise UsageError(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}: this machine has no "
                         f"network interface {', '.join(missing)} (it has {', '.join(present)}): name "
                         f"the interface of the network that the machines share, or unset it")


def spawn_workers(worker, nprocs, *worker_args):
    """mp.spawn(worker, args=(nprocs, *worker_args), nprocs=nprocs), the workers started as
    start_method() says, and however the run ends, it ends whole: a worker that fails makes
    mp.spawn stop the others, and Ctrl-C or SIGTERM here stops them too (mp.spawn's own join would
    keep waiting while they train on)."""
    import logging
    import signal

    check_network()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` behaves like Ctrl-C
    # mp.spawn logs "Terminating process ... via signal SIGTERM" for each worker it stops after a
    # failure; the one line this launcher prints says so already.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    method = start_method()
    if method == "fork":  # DDP's constructor imports torch._dynamo (~1 s): once here, not per worker
        import torch._dynamo  # noqa: F401
    stop = mp.get_context(method).Event()  # set when interrupted, for workers still starting
    try:
        # The workers start deaf to Ctrl-C (an ignored signal stays ignored in a new process), so
        # that a Ctrl-C while they import torch prints no traceback from each; they listen again
        # in spawned_worker. This process stops them, below.
        listening = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            workers = mp.start_processes(spawned_worker, args=(worker, stop, nprocs, *worker_args),
                                         nprocs=nprocs, join=False, start_method=method)
        finally:
            signal.signal(signal.SIGINT, listening)
        while not workers.join():  # True once all have finished; raises when one has failed
            pass
    except KeyboardInterrupt:  # pass it on to the workers started; kill any left after 10 s
        stop.set()  # first: a worker still starting sees it once it listens, the others get SIGINT
        started, deadline = mp.active_children(), time.monotonic() + 10
        for process in started:
            os.kill(process.pid, signal.SIGINT)
        for process in started:
            process.join(max(0, deadline - time.monotonic()))  # 10 s for all, not 10 s each
            if process.is_alive():
                process.kill()
        raise
    except mp.ProcessExitedException as err:  # a worker died or failed; spawn stopped the others
        if err.error_index == 0 and err.exit_code == 1:  # rank 0 has printed why, in one line
            sys.exit(1)
        how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
        raise UsageError(f"worker {err.error_index} ended with {how}; the other workers were "
                         f"stopped") from None
    except mp.ProcessRaisedException as err:  # an unexpected exception: show its traceback
        print(err, file=sys.stderr)
        raise UsageError("a worker raised the exception above; the other workers were stopped") \
            from None


def die_with_parent(parent_pid, worker_id=None):
    """On Linux, ask the kernel to kill this process when its parent dies: a rank when its torchrun
    agent dies (else the rank, in a session of its own, trains on, and the other machines' agents
    wait for it), a sampling worker when its rank dies (else it stays, holding the job's output and
    the shared graph). worker_id: DataLoader's argument to its worker_init_fn."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before that took effect
            os._exit(1)


def say(problem):
    print(f"{os.path.basename(sys.argv[0])}: error: {problem}", file=sys.stderr, flush=True)


def said_once(err, rank):
    """An error in the workers, which every rank may have met: rank 0 says it, in one line."""
    if rank == 0:
        say(err)
        sys.exit(1)
    exit_after_the_speaker()


def exit_after_the_speaker():
    """Exit code 1, quietly, a little later than the rank that says why: the launcher (or torchrun)
    stops the other processes of a job as soon as one has ended, and would stop that rank before
    it had spoken."""
    time.sleep(2)
    sys.exit(1)


def run_main(argv=None):
    """main(parse_args(argv)), with every way it can end said in one line: a mistake in the
    command line (exit code 2; under torchrun it answers the roll call, so that a typo on one
    machine stops every machine), an error found by a check or by the workers (1), Ctrl-C or
    SIGTERM (130). However it ends, the process ends through leave(): after an error too, torch's
    threads are still there to abort Python's shutdown (decision 8)."""
    try:
        end_in_one_line(argv)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
    except BaseException:  # a bug: its traceback, then the same safe exit
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)


def end_in_one_line(argv):
    """run_main's work: returns when main has finished; every other ending raises SystemExit with
    its exit code, after its one line."""
    rank = int(os.environ.get("RANK", 0))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank that torchrun's agent started: end with it
        die_with_parent(os.getppid())
    try:
        args = parse_args(argv)
    except UsageError as err:
        problem = str(err)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            def refuse(args, rank):
                raise UsageError(problem)
            # 300: the parser's default --timeout, since this command line's own cannot be read.
            roll_call(refuse, None, rank, int(os.environ["WORLD_SIZE"]), timeout=300)
        say(problem)
        sys.exit(2)
    try:
        main(args)
    except UsageError as err:
        if "RANK" in os.environ:  # torchrun: every rank may have met it; rank 0 says it
            said_once(err, rank)
        say(err)
        sys.exit(1)
    except RuntimeError as err:  # torch's DistError too
        import re

        lost = re.search(r"Connection (?:closed|reset) by peer(?: \[[^]]*\](?::\d+)?)?|Broken pipe", str(err))
        unreachable = re.search(r"connectFullMesh failed with (?:\[[^]]*\] )?([^$\n]*)", str(err))
        # Silence, not a closed connection: a machine whose network or power went, or a stuck rank.
        silent = re.search(r"Timed out waiting \d+ms for \w+ operation to complete", str(err))
        if not (lost or unreachable or silent) or "RANK" not in os.environ:  # a bug: its traceback,
            raise                                                   # reported by mp.spawn's launcher
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:  # one line per machine
            exit_after_the_speaker()
        if lost:
            say(f"rank {rank} lost its connection to another rank ({lost[0]}): a process or a "
                f"machine of this job has gone; the first error in each machine's output says which")
        elif silent:
            say(f"rank {rank} on {socket.gethostname()} heard nothing from another rank within the timeout "
                f"({silent[0]}): a machine of this job is off the network or down, or a rank is stuck "
                f"(lesson 8's watchdog shows where); raise --timeout if one step can take longer")
        else:  # Gloo's ranks did not reach each other
            loopback = "remote=[127." in str(err)
            say(f"rank {rank} on {socket.gethostname()} could not connect to the other ranks "
                f"({unreachable[1].strip()}): "
                + ("a rank gave a loopback address (its machine's GLOO_SOCKET_IFNAME is lo, or its "
                   "hostname resolves to 127.0.1.1 in /etc/hosts); " if loopback else "")
                + "set GLOO_SOCKET_IFNAME on every machine to the interface of the network they share")
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; any workers have been stopped
        if rank == 0:  # under torchrun, one line from rank 0
            print(f"{os.path.basename(sys.argv[0])}: interrupted; all workers stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run_main()  # plain: main(parse_args())
