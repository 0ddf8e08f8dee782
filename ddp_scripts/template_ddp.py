"""A DDP training script for your own project: replace the functions marked YOUR PROJECT.

    python template_ddp.py --nprocs 2 --epochs 1                   # launches itself (mp.spawn)
    torchrun --nproc-per-node 2 template_ddp.py --epochs 1         # or let torchrun launch it
    python template_ddp.py --device cuda --epochs 5                # one process per visible GPU

Copy it with ddp_hardening.py beside it: the two files train in an empty folder as they come (a
small regression network on a synthetic data set that the script writes itself), before you change
anything; they need only torch (tqdm optional). To port a project, replace the functions of the YOUR
PROJECT part (flags, data, model, optimizer, loss, metrics, which model to keep, checks) and leave
the rest: the DDP steps below them and the hardening module's calls (timeouts, one-line errors, a
whole job that stops when one rank fails, torchrun's restarts and several machines) work for any
project that fits these functions.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # the course's hardening module: copy it beside this file
    import ddp_hardening as hardening  # each call into it says what plain code it stands for
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, UsageError, check_writable, cpu_cores, positive, write_metrics


# =============================================================================== YOUR PROJECT
# Replace these with your project's. A batch is whatever your DataLoader yields (here a tuple of
# tensors); the script moves its tensors to the device and hands it to loss_on() and eval_sums()
# as it is. A port changes nothing below this part.

DESCRIPTION = "Train a small regression network on a synthetic data set under DDP (the template)."


def add_project_flags(parser):
    """Your project's own flags. The training flags (--epochs --batch-size --lr ...) are defined
    already: parser.set_defaults(lr=1e-3, epochs=20) gives them your project's defaults (a flag
    defined here again replaces the template's)."""
    parser.add_argument("--data", type=str, default="data/synthetic_regression.pt",
                        help="the data file (the default one is written on first use)")
    parser.add_argument("--hidden", type=positive(int), default=64, help="hidden units")


def prepare_data(args):
    """Put the data in place, once per file system (before training; under torchrun rank 0 goes
    first, then one rank per other machine). Set `prepare_data = None` when there is nothing to
    do. Here: write the synthetic data set when the default file is missing."""
    if os.path.exists(args.data):
        return
    if args.data != "data/synthetic_regression.pt":
        raise UsageError(f"no data file at {args.data}: give the path of an existing file with --data")
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(6000, 8, generator=generator)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(6000, 1, generator=generator)
    os.makedirs(os.path.dirname(args.data), exist_ok=True)
    torch.save({"x": x, "y": y}, f"{args.data}.{os.getpid()}.part")
    os.replace(f"{args.data}.{os.getpid()}.part", args.data)  # whole or not at all


def load_datasets(args):
    """(train set, test set, info), loaded by every rank: two torch Datasets, and a dict of what the
    model and the checkpoint need to know about the data (sizes, categories, the statistics of a
    normalisation computed on the training set, ...)."""
    try:
        data = torch.load(args.data, weights_only=True)
    except (OSError, RuntimeError, KeyError) as err:
        raise UsageError(f"cannot read {args.data}: {err}") from None
    train_count = len(data["x"]) * 5 // 6
    return (TensorDataset(data["x"][:train_count], data["y"][:train_count]),
            TensorDataset(data["x"][train_count:], data["y"][train_count:]),
            {"features": data["x"].shape[1]})


def build_model(args, info):
    return nn.Sequential(nn.Linear(info["features"], args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def loss_on(model, batch):
    """The loss of one training batch: a mean over its samples, as a 0-d tensor."""
    x, y = batch
    return F.mse_loss(model(x), y)


def eval_sums(model, batch):
    """Sums over one evaluation batch, as a dict with a "count" entry, added up over the batches and
    the ranks before metrics() sees them: exact whatever size each rank's share has."""
    x, y = batch
    return {"loss": F.mse_loss(model(x), y, reduction="sum"), "count": torch.tensor(len(y))}


def metrics(sums):
    """The test metrics, from the sums over the whole test set: here each a mean (an RMSE would be
    the square root of one, an F1 score a ratio of counts)."""
    return {name: value / sums["count"] for name, value in sums.items() if name != "count"}


def better(metrics, best):
    """Whether this epoch's model is the one that --save keeps (best: the metrics of the one kept so
    far, None at first). Here the last one; the best: `best is None or metrics["loss"] < best["loss"]`."""
    return True


def checkpoint(model, info):
    """What --save writes: the plain model's weights; return a dict to add what using the model
    needs (info's categories or normalisation statistics, ...)."""
    return model.state_dict()


def check_setup(args, rank):
    """Refuse, before any work, what cannot work: raise UsageError("...what to do...") for a
    one-line error. Runs in the launcher (mp.spawn) or in every rank (torchrun)."""
    # plain: nothing (refuses NCCL on a CPU, more ranks than GPUs: the device's one-line errors)
    hardening.check_device(args.device, args.backend, nprocs=args.nprocs,
                           gpu=int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU, by index
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


# =============================================================================== DDP steps
def to_device(batch, device):
    """The batch with its tensors on the device (tensors in tuples, lists and dicts; the rest as is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@torch.no_grad()
def evaluate(model, test_set, args, device, rank, world_size):
    """eval_sums() over this rank's share of the test set (every world_size-th sample: disjoint
    shares, each sample once), added up over the ranks: {name: sum}."""
    model.eval()
    share = Subset(test_set, range(rank, len(test_set), world_size))
    weight = 1.0 if len(share) else 0.0  # a rank with no sample adds zeros, but still takes part
    loader = DataLoader(share if len(share) else Subset(test_set, [0]), batch_size=args.batch_size,
                        pin_memory=device.type == "cuda")
    names, sums = None, 0
    for batch in loader:
        batch_sums = eval_sums(model, to_device(batch, device))
        names = names or list(batch_sums)
        sums = sums + weight * torch.stack([batch_sums[n].to(device, torch.float64) for n in names])
    dist.all_reduce(sums)  # SUM over the ranks, then metrics() divides once
    model.train()
    return {name: value.item() for name, value in zip(names, sums)}


def train(rank, local_rank, world_size, args):
    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    train_set, test_set, info = load_datasets(args)

    # 2. Build the model, then wrap it: the same seed gives every rank the same start (DDP also
    #    broadcasts rank 0's weights); a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    model = DDP(build_model(args, info).to(device),
                device_ids=[local_rank] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + rank)
    optimizer = make_optimizer(model, args)

    # 3. Each rank its share of the data: the same shuffle on every rank, padded so that every
    #    rank runs the same number of steps.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=device.type == "cuda")

    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)  # rank 0 speaks
    log(f"training: {world_size} processes on {device.type} ({args.backend}), batch {args.batch_size} "
        f"per process ({args.batch_size * world_size} in all)", flush=True)
    history, steps, start, best = [], 0, time.perf_counter(), None
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        epoch_start, loss_sum, seen = time.perf_counter(), torch.zeros((), device=device), 0
        # plain: bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
        for batch in bar:
            batch = to_device(batch, device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_on(model, batch)
            loss.backward()  # 4. DDP averages the gradients over the ranks here, during backward
            optimizer.step()  # ... so every rank takes the same step and the replicas stay equal
            loss_sum += loss.detach()
            seen += 1
            steps += 1
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # GPU work is asynchronous: wait before reading the clock
        seconds = time.perf_counter() - epoch_start

        # 5. Evaluate across ranks: sums over each rank's share, added up, divided once.
        scores = metrics(evaluate(model.module, test_set, args, device, rank, world_size))
        train_loss = torch.stack([loss_sum.double(), torch.tensor(seen, dtype=torch.float64, device=device)])
        dist.all_reduce(train_loss)
        samples = int(train_loss[1]) * args.batch_size  # batches of all ranks (the last may be short)
        history.append({"epoch": epoch, "train_loss": (train_loss[0] / train_loss[1]).item(),
                        **{f"test_{k}": v for k, v in scores.items()}, "seconds": seconds,
                        "samples_per_second": samples / seconds, "steps": steps})
        log(f"epoch {epoch}: train loss {history[-1]['train_loss']:.4f}  "
            + "  ".join(f"test {k} {v:.4f}" for k, v in scores.items())
            + f"  {seconds:.1f} s  {samples / seconds:,.0f} samples/s", flush=True)
        if rank == 0 and args.save and better(scores, best):  # 6. rank 0 saves: the plain model.module
            best = scores
            # plain: torch.save(to_device(checkpoint(model.module, info), "cpu"), args.save)
            hardening.save_whole(to_device(checkpoint(model.module, info), "cpu"), args.save)
        if rank == 0 and args.metrics_json:  # after every epoch: a crash keeps the epochs done
            write_metrics(args.metrics_json, {"world_size": world_size, "device": args.device,
                                              "batch_size": args.batch_size, "epochs": history})
        if steps == args.max_steps:
            break

    if rank == 0:  # print on rank 0 only; what --save keeps was saved after its epoch
        print(f"done: {world_size} processes, {steps} steps, "
              + ", ".join(f"test {k} {v:.4f}" for k, v in scores.items())
              + f", {time.perf_counter() - start:.1f} s in all", flush=True)


def worker(rank, world_size, args):
    """What each process runs, whether spawned by main() or started by torchrun."""
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ else rank  # torchrun sets it
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # before anything touches CUDA
    # 1. Join the process group; the timeout bounds every collective.
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=hardening.attempt_store(args.timeout),  # plain: nothing
                            timeout=timedelta(seconds=args.timeout))
    try:
        if "RANK" in os.environ and prepare_data:  # torchrun: the ranks prepare the data, in turns
            # plain: prepare_data(args)
            hardening.prepare_in_turns(lambda _: prepare_data(args), None, rank, args.prepare_timeout)
        train(rank, local_rank, world_size, args)
    finally:
        dist.destroy_process_group()  # 7. tear down, even after an error


def main(args):
    if "RANK" in os.environ:  # torchrun: this process is one rank; each checks itself first
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        hardening.roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args)
        return
    # Started by hand: check and prepare once, here; then --nprocs copies of this file.
    check_setup(args, rank=0)
    if prepare_data:
        prepare_data(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = hardening.master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    # plain: mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)
    hardening.spawn_workers(worker, args.nprocs, args)


# =============================================================================== command line


def parse_args(argv=None):
    p = Parser(DESCRIPTION)
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64, help="per process")
    p.add_argument("--lr", type=positive(float), default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None,
                   help="stop after this many optimizer steps in total")
    p.add_argument("--no-shuffle", action="store_true", help="fixed sample order")
    p.add_argument("--nprocs", type=positive(int), default=None,
                   help="processes to spawn (default: one per visible GPU with --device cuda, else 2; "
                        "ignored under torchrun)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--save", type=str, default=None,
                   help="write checkpoint() here after each epoch that better() accepts")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    # plain: p.add_argument("--timeout", type=int, default=300)
    hardening.add_hardening_flags(p, prepare=prepare_data is not None)
    add_project_flags(p)  # last: its set_defaults() reach the flags above
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.nprocs is None:
        args.nprocs = (torch.cuda.device_count() if args.device == "cuda" else 0) or 2
    args.threads_per_proc = args.threads_per_proc or cpu_cores(shared_by=args.nprocs)
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
