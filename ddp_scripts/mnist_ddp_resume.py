"""Lesson 5: lesson 3's training made to survive a crash: a snapshot after every epoch, resumed.

    torchrun --nproc-per-node 2 --max-restarts 3 mnist_ddp_resume.py --epochs 5   # restarts on a crash
    python mnist_ddp_resume.py --epochs 5          # crashed or stopped? run it again: it resumes
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 mnist_ddp_resume.py --backend gloo \\
        --device cpu --epochs 3 --crash-in-epoch 2   # no GPU; a rank crashes once, the job resumes

It needs mnist_parts.py (the data, models and evaluation) and ddp_hardening.py beside it.
Compare it with mnist_ddp_gpu.py: the diff is what fault tolerance adds.
"""
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # the course's modules, written once: copy them beside this file
    import ddp_hardening as hardening  # each call into it says what plain code it stands for
    from mnist_parts import build_model, evaluate, load_split, prepare_data
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, UsageError, check_writable, cpu_cores, positive, write_metrics


# --------------------------------------------------------------------------- training
def train(rank, local_rank, world_size, args):
    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.deterministic:  # GPU kernels that give the same bits every run (CPU ones already do)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first use
        torch.use_deterministic_algorithms(True)  # cuDNN too; an op without such a kernel raises
    # MNIST (220 MB as floats) fits on any GPU: each rank keeps the whole set on its own device
    # and gathers a batch with one indexing kernel. No host-to-device copy per step, no per-sample
    # collate. For data that does not fit: DataLoader(..., pin_memory=True), then
    # x.to(device, non_blocking=True), so that the host goes on while the GPU copies.
    train_images, train_labels = (t.to(device) for t in load_split(args.dataset, args.data_dir, True))
    test_images, test_labels = (t.to(device) for t in load_split(args.dataset, args.data_dir, False))

    # 2. Instantiate the model on this rank's GPU, then wrap it; device_ids names that one GPU.
    #    The same seed gives every rank the same start (DDP also broadcasts rank 0's weights);
    #    a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Mixed precision: autocast runs matmuls and convolutions in bf16/fp16. fp16 has a small
    # range, so its loss is scaled up before backward (and the gradients back down) by a scaler,
    # which reads back from the GPU whether a gradient overflowed: one synchronisation per step.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)  # rank 0 speaks
    # Resume: rank 0 reads the last snapshot, if there is one, and sends it to every rank, so
    # that all continue from the same state (whatever each machine's disk holds). Everything that
    # the next epoch depends on is in it: weights, optimizer (momentum), scaler, each rank's random
    # state (dropout), the epochs done and their metrics.
    snapshot = load_snapshot(args, rank, device)
    history, steps, first_epoch = [], 0, 1
    if snapshot:
        model.module.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])  # with the snapshot's learning rate:
        if optimizer.param_groups[0]["lr"] != args.lr:  # this run's --lr wins, and says so
            log(f"learning rate {args.lr:g} (--lr), not the snapshot's {optimizer.param_groups[0]['lr']:g}",
                flush=True)
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        scaler.load_state_dict(snapshot["scaler"])
        history, steps, first_epoch = snapshot["history"], snapshot["steps"], snapshot["epoch"] + 1
        if snapshot["world_size"] == world_size:  # the same ranks: each resumes its own random stream
            torch.set_rng_state(snapshot["rng"][rank]["cpu"])
            if device.type == "cuda" and snapshot["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(snapshot["rng"][rank]["cuda"], device)
        log(f"resuming from {args.snapshot}: epoch {snapshot['epoch']} done, {steps} steps"
            + ("" if snapshot["world_size"] == world_size else
               f" (taken with {snapshot['world_size']} processes; now {world_size}: the global batch "
               f"is {args.batch_size * world_size}, the snapshot's was "
               f"{snapshot['args']['batch_size'] * snapshot['world_size']}, and dropout draws anew)"),
            flush=True)

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    log(f"training {args.model} on {args.dataset}: {world_size} processes on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
        f"({args.backend}, amp {args.amp}), batch {args.batch_size} per process "
        f"({args.batch_size * world_size} in all)", flush=True)
    start = time.perf_counter()
    for epoch in range(first_epoch, args.epochs + 1):
        if args.max_steps is not None and steps >= args.max_steps:  # the snapshot may be past it
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # This rank's samples, copied to the device once an epoch: a batch is a slice of them.
        batches = torch.tensor(list(sampler), device=device).split(args.batch_size)
        epoch_start = time.perf_counter()
        loss_sum, seen = torch.zeros((), dtype=torch.float64, device=device), 0
        # plain: bar = tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(batches, f"epoch {epoch}", rank == 0 and not args.quiet)
        for step_in_epoch, index in enumerate(bar):
            if (epoch == args.crash_in_epoch and epoch > first_epoch and rank == world_size - 1
                    and step_in_epoch == len(batches) // 2):
                crash(rank, epoch)  # for the lesson; only in an attempt that began before this epoch
            x, y = train_images[index], train_labels[index]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()  # 4. DDP all-reduces (averages) the gradients here
            scaler.step(optimizer)  # ... so every rank takes the same step and the replicas stay equal
            scaler.update()
            loss_sum += loss.detach() * len(y)  # stays on the GPU: no .item(), no wait per step
            seen += len(y)
            steps += 1
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # GPU work is asynchronous: wait before reading the clock
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. The plain
        #    model.module is used because evaluation needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(model.module, test_images, test_labels, rank, world_size)
        train_totals = torch.stack([loss_sum, torch.tensor(seen, dtype=torch.float64, device=device)])
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
                "threads_per_proc": args.threads_per_proc, "device": args.device, "amp": args.amp,
                "resumed_after_epoch": first_epoch - 1, "backend": args.backend, "epochs": history})
        # Snapshot after each whole epoch (one cut short by --max-steps is not one): the first rank
        # of every machine writes it, so that a rank 0 restarted on another machine finds it there.
        if step_in_epoch == len(batches) - 1:
            save_snapshot(args, epoch, steps, model, optimizer, scaler, history, device)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    if rank == 0:
        if first_epoch > len(history):  # the snapshot had already reached --epochs or --max-steps
            log(f"nothing left to train: the snapshot has {len(history)} epochs, {steps} steps "
                f"(raise --epochs or --max-steps, or delete {args.snapshot} to start afresh)", flush=True)
        last = history[-1]
        print(f"done: {args.model} on {args.dataset}, {world_size} processes, {steps} steps, "
              f"test accuracy {last['test_accuracy']:.2%}, {last['images_per_second']:,.0f} "
              f"images/s, {time.perf_counter() - start:.1f} s in all", flush=True)
        if args.save:
            torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)


# What must not change between the run that took a snapshot and the one that resumes from it.
SNAPSHOT_MUST_MATCH = ("model", "dataset", "batch_size", "seed", "no_shuffle", "amp")


def read_snapshot(args):
    """The snapshot at args.snapshot, None if there is none; refuses one that this run cannot
    continue (another model, another batch per process and global batch, ...: the run would no
    longer be the one interrupted)."""
    if not os.path.exists(args.snapshot):
        return None
    try:
        snapshot = torch.load(args.snapshot, map_location="cpu", weights_only=True)
        taken_with = snapshot["args"]
    except Exception as err:  # a truncated file, or not a snapshot of this script
        raise UsageError(f"cannot resume from {args.snapshot}: not a snapshot that this script can read "
                         f"({type(err).__name__}); delete it to start afresh") from None
    # The batch per process may change with the number of processes if the global batch does not.
    same_global_batch = (taken_with["batch_size"] * snapshot["world_size"]
                         == args.batch_size * int(os.environ.get("WORLD_SIZE", args.nprocs)))
    changed = [flag(key, taken_with[key]) for key in SNAPSHOT_MUST_MATCH
               if taken_with[key] != getattr(args, key) and not (key == "dataset" and args.dataset == "auto")
               and not (key == "batch_size" and same_global_batch)]
    if changed:
        raise UsageError(f"{args.snapshot} was taken with {', '.join(changed)}: run with the same, "
                         f"or delete it to start afresh")
    return snapshot


def load_snapshot(args, rank, device):
    """Rank 0 reads the snapshot, if any, and broadcasts it; every rank returns it (or None). A
    snapshot that cannot be used stops every rank, with rank 0's one line."""
    message = [None, None]  # (snapshot, problem)
    if rank == 0:
        try:
            message[0] = read_snapshot(args)
        except UsageError as err:
            message[1] = str(err)
    # Objects go through the process group (NCCL: pickled into a byte tensor on this rank's GPU).
    dist.broadcast_object_list(message, src=0, device=device)
    if message[1]:
        raise UsageError(message[1])
    return message[0]


def flag(key, value):
    """How a setting reads on the command line: --batch-size 64, --no-shuffle, no --no-shuffle."""
    name = "--" + key.replace("_", "-")
    return (name if value else f"no {name}") if isinstance(value, bool) else f"{name} {value}"


def save_snapshot(args, epoch, steps, model, optimizer, scaler, history, device):
    """Every rank hands in its random state; the first rank of each machine writes the snapshot
    atomically and durably: a crash of the process, or of the machine, while writing leaves the
    previous one intact."""
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    every_rng = [None] * dist.get_world_size()
    dist.all_gather_object(every_rng, rng)  # a collective: every rank must call save_snapshot
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) != 0:
        return
    snapshot = {"epoch": epoch, "steps": steps, "world_size": dist.get_world_size(),
                "args": {key: getattr(args, key) for key in SNAPSHOT_MUST_MATCH},
                "model": {k: v.cpu() for k, v in model.module.state_dict().items()},
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "rng": every_rng, "history": history}
    partial = f"{args.snapshot}.{socket.gethostname()}.{os.getpid()}.part"  # machines may share a disk
    hardening.remove_stale_parts(args.snapshot)  # plain: nothing
    try:
        with open(partial, "wb") as f:
            torch.save(snapshot, f)
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename, so that a power cut cannot
        os.replace(partial, args.snapshot)  # leave a renamed file whose bytes never got there
        folder = os.open(os.path.dirname(os.path.abspath(args.snapshot)), os.O_RDONLY)
        try:
            os.fsync(folder)  # and the rename itself on the disk
        finally:
            os.close(folder)
    except BaseException:  # a full disk, Ctrl-C: leave no half-written file behind
        if os.path.exists(partial):
            os.remove(partial)
        raise


def crash(rank, epoch):
    """--crash-in-epoch: this rank dies as if the machine had lost it (no exception, no clean-up)."""
    print(f"rank {rank}: simulated crash in the middle of epoch {epoch} (--crash-in-epoch)",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def worker(rank, world_size, args):
    """What each process runs, whether spawned by main() or started by torchrun."""
    # One GPU per process: local_rank numbers the processes on this machine (rank counts all
    # machines). Select the GPU before anything touches CUDA, or every rank piles onto GPU 0.
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ else rank  # torchrun sets it
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    # 1. Join the process group. Every rank meets at MASTER_ADDR:MASTER_PORT (set by main() below
    #    or by torchrun); NCCL is the backend for GPUs (Gloo for CPUs). The timeout bounds every
    #    collective, so a rank that dies or stalls turns into an error instead of a hang.
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=hardening.attempt_store(args.timeout),  # plain: nothing
                            timeout=timedelta(seconds=args.timeout))
    try:
        if "RANK" in os.environ:  # torchrun: no launcher has prepared the data; the ranks do
            # plain: args.dataset = prepare_data(args.dataset, args.data_dir)
            args.dataset = hardening.prepare_in_turns(
                lambda d: prepare_data(d, args.data_dir, not args.quiet), args.dataset, rank,
                args.prepare_timeout)
        train(rank, local_rank, world_size, args)
    finally:
        dist.destroy_process_group()  # 8. tear down, even after an error


# --------------------------------------------------------------------------- launching
def check_device(args, gpu=0):
    """Refuse, before any process starts, what cannot work; say what to do instead. gpu: the index
    of the GPU to ask about (asking with no index would start CUDA on GPU 0 in every process)."""
    if args.device == "cpu":
        if args.backend == "nccl":
            raise UsageError("NCCL needs CUDA tensors: use --backend gloo with --device cpu")
        if args.amp == "fp16":
            raise UsageError("--amp fp16 is for GPUs here: use --amp bf16 (or off) with --device cpu")
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UsageError("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); "
                         "to run on CPU instead: --backend gloo --device cpu")
    if args.backend == "nccl" and not dist.is_nccl_available():
        raise UsageError("this PyTorch build has no NCCL: install a CUDA build of torch, "
                         "or use --backend gloo")
    gpus, procs = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))
    if procs > gpus:
        raise UsageError(f"{procs} processes but {gpus} visible GPU(s): each rank needs a GPU of its own, "
                         f"so use --nprocs {gpus} (or --nproc-per-node {gpus})")
    if gpu >= gpus:  # before asking about it: asking about a GPU that is not there fails
        raise UsageError(f"LOCAL_RANK={gpu}, but this process sees {gpus} GPU(s): every rank must see all of "
                         f"its machine's GPUs (Slurm: --gpus-per-node, not --gpus-per-task)")
    if args.amp == "bf16" and torch.cuda.get_device_capability(gpu) < (8, 0):
        raise UsageError(f"{torch.cuda.get_device_name(gpu)} has no native bf16 (before compute "
                         f"capability 8.0 it is emulated, slowly): use --amp fp16")


def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    check_device(args, gpu=int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU, by index
    if rank == 0:  # only rank 0 writes them (on its own machine), and reads the snapshot
        check_writable(args.save, args.metrics_json)
        read_snapshot(args)
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # the first rank of each machine snapshots
        check_writable(args.snapshot)


def main(args):
    if "RANK" in os.environ:
        # Started by torchrun: this process already is one rank, and torchrun has set MASTER_ADDR
        # and MASTER_PORT. Each rank checks its own set-up before joining the group.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        hardening.roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args)
        return
    # Started by hand: check and prepare the data once, here; then start --nprocs copies of this
    # file, each of which imports it (hence the __main__ guard) and runs worker(rank, nprocs, args).
    check_setup(args, rank=0)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = hardening.master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    if args.nprocs > cpu_cores() and not args.quiet:
        print(f"note: {args.nprocs} processes on {cpu_cores()} cores: they will take turns, "
              f"expect it slower than fewer processes", flush=True)
    # plain: mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)
    hardening.spawn_workers(worker, args.nprocs, args)


# --------------------------------------------------------------------------- command line
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
    p.add_argument("--nprocs", type=positive(int), default=None,
                   help="processes to spawn (default: one per visible GPU, 2 on CPU; "
                        "ignored under torchrun, which sets WORLD_SIZE)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                   help="mixed precision (fp16 with a gradient scaler)")
    p.add_argument("--snapshot", type=str, default="snapshot.pt",
                   help="written after every epoch; resumed from when it exists")
    p.add_argument("--crash-in-epoch", type=positive(int), default=None,
                   help="for the lesson: the last rank dies halfway through this epoch (2 or "
                        "more), once; a restart or a rerun resumes from the snapshot")
    p.add_argument("--deterministic", action="store_true",
                   help="reproducible GPU kernels (slower): without it, two identical GPU runs "
                        "differ, and so do a resumed run and an uninterrupted one")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--save", type=str, default=None, help="write the final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument("--timeout", type=positive(int), default=300,
                   help="seconds any collective may wait for the other ranks before failing")
    hardening.add_hardening_flags(p)  # plain: nothing
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.nprocs is None:  # one process per visible GPU
        args.nprocs = (torch.cuda.device_count() if args.device == "cuda" else 0) or 2
    if args.threads_per_proc is None:
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", args.nprocs))  # torchrun sets it
        args.threads_per_proc = max(1, cpu_cores() // procs)
    if args.crash_in_epoch is not None and not 2 <= args.crash_in_epoch <= args.epochs:
        p.error(f"--crash-in-epoch must be between 2 and --epochs ({args.epochs}): a crash in epoch 1 "
                f"leaves no snapshot to resume from")
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
