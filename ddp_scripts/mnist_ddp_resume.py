"""Lesson 5: lesson 3's training made to survive a crash: a snapshot after every epoch, resumed.

    torchrun --nproc-per-node 2 --max-restarts 3 mnist_ddp_resume.py --epochs 5   # restarts on a crash
    python mnist_ddp_resume.py --epochs 5          # crashed or stopped? run it again: it resumes
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 mnist_ddp_resume.py --backend gloo \\
        --device cpu --epochs 3 --crash-in-epoch 2   # no GPU; a rank crashes once, the job resumes

Compare it with mnist_ddp_gpu.py, whose launching it runs: the diff is what fault tolerance adds.
"""
import os
import signal
import socket
import sys

try:  # lesson 3's script, which imports the course's modules: copy them beside this file
    import mnist_ddp_gpu as lesson3  # lesson 3's launching, command line and epoch, kept as they are
except ModuleNotFoundError as missing:  # copied alone: one line names the file (no torch: Python's error)
    raise missing if missing.name != "mnist_ddp_gpu" else SystemExit(
        f"{os.path.basename(sys.argv[0])}: error: mnist_ddp_gpu.py is missing: copy it from ddp_scripts/")
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hardening as hardening  # each call into it says what plain code it stands for
from ddp_hardening import UsageError, check_writable, positive
from mnist_parts import Report, build_model, evaluate, load_split


# --------------------------------------------------------------------------- training
def train(rank, local_rank, world_size, args):
    if args.deterministic:  # GPU kernels that give the same bits every run (CPU ones already do)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first use
        torch.use_deterministic_algorithms(True)  # cuDNN too; an op without such a kernel raises
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    # MNIST (220 MB as floats) fits on any GPU: each rank keeps the whole set on its own device
    # and gathers a batch with one indexing kernel. No host-to-device copy per step, no per-sample
    # collate. For data that does not fit: DataLoader(..., pin_memory=True), then
    # x.to(device, non_blocking=True), so that the host goes on while the GPU copies.
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True, device=device)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False, device=device)

    # 2. Instantiate the model on this rank's GPU, then wrap it; device_ids names that one GPU.
    #    The same seed gives every rank the same start (DDP also broadcasts rank 0's weights);
    #    a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    torch.manual_seed(args.seed + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp_dtype, scaler = lesson3.mixed_precision(args.amp, device)  # --amp: autocast's dtype, fp16's scaler

    report = Report(args, rank, world_size, device=args.device, amp=args.amp,
                    resumed_after_epoch=0, backend=args.backend)
    # Resume: rank 0 reads the last snapshot, if there is one, and sends it to every rank, so
    # that all continue from the same state (whatever each machine's disk holds). Everything that
    # the next epoch depends on is in it: weights, optimizer (momentum), scaler, each rank's random
    # state (dropout), the epochs done and their metrics.
    snapshot = load_snapshot(args, rank, device)
    steps, first_epoch = 0, 1
    if snapshot:
        model.module.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])  # with the snapshot's learning rate:
        if optimizer.param_groups[0]["lr"] != args.lr:  # this run's --lr wins, and says so
            report.say(f"learning rate {args.lr:g} (--lr), not the snapshot's "
                       f"{optimizer.param_groups[0]['lr']:g}")
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        scaler.load_state_dict(snapshot["scaler"])
        report.history, steps, first_epoch = snapshot["history"], snapshot["steps"], snapshot["epoch"] + 1
        report.fields["resumed_after_epoch"] = snapshot["epoch"]
        if snapshot["world_size"] == world_size:  # the same ranks: each resumes its own random stream
            torch.set_rng_state(snapshot["rng"][rank]["cpu"])
            if device.type == "cuda" and snapshot["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(snapshot["rng"][rank]["cuda"], device)
        report.say(f"resuming from {args.snapshot}: epoch {snapshot['epoch']} done, {steps} steps"
                   + ("" if snapshot["world_size"] == world_size else
                      f" (taken with {snapshot['world_size']} processes; now {world_size}: the global "
                      f"batch is {args.batch_size * world_size}, the snapshot's was "
                      f"{snapshot['args']['batch_size'] * snapshot['world_size']}, and dropout draws anew)"))

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    report.say(f"training {args.model} on {args.dataset}: {world_size} processes on "
               f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
               f"({args.backend}, amp {args.amp}), batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    for epoch in range(first_epoch, args.epochs + 1):
        if args.max_steps is not None and steps >= args.max_steps:  # the snapshot may be past it
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # This rank's samples, copied to the device once an epoch: a batch is a slice of them.
        batches = torch.tensor(list(sampler), device=device).split(args.batch_size)
        steps_before = steps  # a whole epoch takes len(batches) steps; one cut by --max-steps, fewer
        # plain: bar = tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(batches, f"epoch {epoch}", rank == 0 and not args.quiet)
        if epoch == args.crash_in_epoch and epoch > first_epoch and rank == world_size - 1:
            bar = crash_midway(bar, len(batches), rank, epoch)  # in an attempt begun before this epoch
        # 4. Lesson 3's epoch: DDP all-reduces (averages) the gradients in each backward.
        loss_sum, seen, steps, seconds = lesson3.train_epoch(model, optimizer, scaler, amp_dtype,
                                                             train_images, train_labels, bar, steps,
                                                             args.max_steps)

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. The plain
        #    model.module is used because evaluation needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(model.module, test_images, test_labels, rank, world_size)
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        # Snapshot after each whole epoch (one cut short by --max-steps is not one): the first rank
        # of every machine writes it, so that a rank 0 restarted on another machine finds it there.
        if steps - steps_before == len(batches):
            save_snapshot(args, epoch, steps, model, optimizer, scaler, report.history, device)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    if first_epoch > len(report.history):  # the snapshot had already reached --epochs or --max-steps
        report.say(f"nothing left to train: the snapshot has {len(report.history)} epochs, {steps} steps "
                   f"(raise --epochs or --max-steps, or delete {args.snapshot} to start afresh)")
    report.done(steps)
    if rank == 0 and args.save:
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
    remove_stale_parts(args.snapshot)
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


def crash_midway(batches, count, rank, epoch):
    """--crash-in-epoch: the epoch's `count` batches, until halfway through them this rank dies as
    if its machine had been lost (no exception, no clean-up)."""
    for i, index in enumerate(batches):
        if i == count // 2:
            print(f"rank {rank}: simulated crash in the middle of epoch {epoch} (--crash-in-epoch)",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        yield index


def remove_stale_parts(snapshot):
    """Remove the .part files of this snapshot that a writer on this machine left when it was
    killed while writing (SIGKILL, the machine lost): their names give the host and the process
    id, and that process is gone. Writers on other machines clean up their own."""
    folder, prefix = os.path.split(os.path.abspath(snapshot))
    prefix += f".{socket.gethostname()}."
    for name in os.listdir(folder):
        pid = name[len(prefix):-len(".part")]
        if name.startswith(prefix) and name.endswith(".part") and pid.isdigit():
            try:
                os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
            except ProcessLookupError:
                try:
                    os.remove(os.path.join(folder, name))
                except FileNotFoundError:  # another writer got there first
                    pass
            except PermissionError:  # it exists, as another user's process
                pass


# --------------------------------------------------------------------------- launching: lesson 3's
def check_setup(args, rank):
    """Lesson 3's checks, then this lesson's: the snapshot, read by rank 0 and written by the first
    rank of each machine."""
    lesson3.check_setup(args, rank)
    if rank == 0:
        read_snapshot(args)
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # the first rank of each machine snapshots
        check_writable(args.snapshot)


def main(args):
    """Lesson 3's launching, running this file's train() (which snapshots) and checks."""
    lesson3.main(args, train, check_setup)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = lesson3.parser(__doc__)  # lesson 3's flags; this lesson's own below
    p.add_argument("--snapshot", type=str, default="snapshot.pt",
                   help="written after every epoch; resumed from when it exists")
    p.add_argument("--crash-in-epoch", type=positive(int), default=None,
                   help="for the lesson: the last rank dies halfway through this epoch (2 or "
                        "more), once; a restart or a rerun resumes from the snapshot")
    p.add_argument("--deterministic", action="store_true",
                   help="reproducible GPU kernels (slower): without it, two identical GPU runs "
                        "differ, and so do a resumed run and an uninterrupted one")
    args = lesson3.parse_args(argv, p)
    if args.crash_in_epoch is not None and not 2 <= args.crash_in_epoch <= args.epochs:
        p.error(f"--crash-in-epoch must be between 2 and --epochs ({args.epochs}): a crash in epoch 1 "
                f"leaves no snapshot to resume from")
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
