"""Lesson 8: lesson 2's training with debugging aids: a watchdog that prints where each rank is
when it stops making progress (and can write its flight recorder), and a check that the replicas
are still equal.

    python mnist_ddp_debug.py --nprocs 2 --watchdog 60 --check-sync-every 100
    python mnist_ddp_debug.py --bug stall --watchdog 5 --timeout 20  # see a stuck rank found
    python mnist_ddp_debug.py --bug skip --watchdog 5 --timeout 20 --flight-recorder fr
    torchfrtrace fr                                                   # see which collective differs
    python mnist_ddp_debug.py --bug diverge --check-sync-every 10    # see silent divergence caught

Compare it with mnist_ddp_cpu.py, whose launching it runs: the diff is the lesson.
"""
import argparse
import os
import pickle
import sys
import threading
import time
import traceback

try:  # lesson 2's script, which imports the course's modules: copy them beside this file
    import mnist_ddp_cpu as lesson2  # lesson 2's launching and command line, kept as they are
except ModuleNotFoundError as missing:  # copied alone: one line names the file (no torch: Python's error)
    raise missing if missing.name != "mnist_ddp_cpu" else SystemExit(
        f"{os.path.basename(sys.argv[0])}: error: mnist_ddp_cpu.py is missing: copy it from ddp_scripts/")
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hardening as hardening  # each call into it says what plain code it stands for
from ddp_hardening import UsageError, check_writable, positive
from mnist_parts import Report, build_model, evaluate, load_split


# --------------------------------------------------------------------------- debugging aids
class Watchdog:
    """A thread that prints where this rank is when it has made no progress for `seconds`: the
    stack of the main thread, tagged with the rank. In a hang, every rank reports, so one sees at
    once which rank is stuck outside the collectives and where the others wait for it (DDP's
    all-reduce inside backward, a barrier). With `flight_recorder` (a folder) each rank also writes
    its flight recorder there. It only reports: the group's timeout ends the job."""

    def __init__(self, rank, seconds, flight_recorder=None):
        self.rank, self.seconds, self.flight_recorder = rank, seconds, flight_recorder
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
                if self.flight_recorder:
                    path = dump_flight_recorder(self.flight_recorder, self.rank)
                    print(f"watchdog: rank {self.rank} wrote its flight recorder to {path}", flush=True)

    def stop(self):
        self.stopped.set()


def dump_flight_recorder(folder, rank):
    """Write this rank's flight recorder to folder/rank_<rank>: the process's last collectives (up to
    TORCH_FR_BUFFER_SIZE of them, 2,000 by default), each with its group, sequence number, kind,
    sizes and the Python stack that called it. `torchfrtrace folder` then lines the ranks' records
    up and names the collectives where they differ. NCCL can write these files itself when a
    collective times out; Gloo records as well but writes only when asked, and torch 2.14.1 asks
    through a private function (it may change in any release)."""
    records = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    # torch 2.14.1's Gloo dump lists the default group as '' in its table of groups, while its
    # records name it by its real name ('0'); torchfrtrace looks the name up and fails. Write the
    # group's entry under its real name.
    world = dist.group.WORLD
    records["pg_config"].pop("", None)
    records["pg_config"][world.group_name] = {"name": world.group_name, "desc": world.group_desc,
                                              "ranks": str(dist.get_process_group_ranks(world))}
    path = os.path.join(folder, f"rank_{rank}")
    with open(path, "wb") as f:
        pickle.dump(records, f)
    return path


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
    """For the lesson: the mistakes this script's aids find, on the last rank or the first."""
    if bug == "stall" and rank == dist.get_world_size() - 1:
        # A rank stuck outside the collectives: a slow disk, an input() prompt, a hung loader.
        time.sleep(10 * args.timeout)
    if bug == "diverge" and rank == 0:
        # Rank 0 alone loads weights after DDP was built (DDP broadcasts them only when it starts):
        # from now on the replicas differ, and nothing fails.
        model.module.load_state_dict(build_model(args.model).state_dict())
    if bug == "skip" and rank == 0:
        # A collective under `if rank == 0:` (here a barrier, as before saving): the other ranks
        # skip it and go on to the next step's gradient all-reduce, which meets this barrier.
        dist.barrier()


# --------------------------------------------------------------------------- training
def train(rank, world_size, args):
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

    report = Report(args, rank, world_size, replica_checks=0)  # rank 0 speaks, and writes the metrics
    report.say(f"training {args.model} on {args.dataset}: {world_size} processes, {args.threads_per_proc} "
               f"torch thread(s) each, batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    # From here on, a rank that stalls says where it is (and writes its flight recorder).
    watchdog = Watchdog(rank, args.watchdog, args.flight_recorder)
    steps, checks = 0, 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        # plain: bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
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
        report.fields["replica_checks"] = checks
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks.
        dist.barrier()
        watchdog.progress()
        if steps == args.max_steps:
            break
    watchdog.stop()

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    report.done(steps)
    if rank == 0:
        if args.check_sync_every:
            print(f"replicas compared {checks} times (every {args.check_sync_every} steps): equal",
                  flush=True)
        if args.save:
            torch.save(model.module.state_dict(), args.save)


# --------------------------------------------------------------------------- launching: lesson 2's
def check_setup(args, rank):
    """Lesson 2's checks, then this lesson's: the flight recorder's folder, and a watchdog to write it."""
    lesson2.check_setup(args, rank)
    if args.flight_recorder:  # every rank writes its own file, on its own machine
        if not args.watchdog or args.watchdog >= args.timeout:
            raise UsageError(f"--flight-recorder is written when the watchdog fires, before --timeout "
                             f"ends the job: give --watchdog fewer seconds than --timeout "
                             f"({args.timeout}), and not 0")
        if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
            raise UsageError(f"--flight-recorder: this torch ({torch.__version__}) has no way to write "
                             f"Gloo's flight recorder; leave the flag out")
        check_writable(os.path.join(args.flight_recorder, f"rank_{rank}"))


def main(args):
    """Lesson 2's launching, running this file's train() (with its aids) and checks."""
    lesson2.main(args, train, check_setup)


# --------------------------------------------------------------------------- command line
def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    return value


def parse_args(argv=None):
    p = lesson2.parser(__doc__)  # lesson 2's flags; this lesson's own below
    p.add_argument("--watchdog", type=non_negative, default=60,
                   help="seconds without progress after which each rank prints where it is (0: off)")
    p.add_argument("--flight-recorder", type=str, default=None, metavar="FOLDER",
                   help="when the watchdog fires, each rank writes its flight recorder to "
                        "FOLDER/rank_<rank>, for torchfrtrace FOLDER (a new folder for each run)")
    p.add_argument("--check-sync-every", type=non_negative, default=100,
                   help="compare the replicas every this many steps (0: never)")
    p.add_argument("--bug", choices=["none", "stall", "diverge", "skip"], default="none",
                   help="for the lesson: stall (the last rank stops responding), diverge (rank 0 "
                        "alone reloads its weights) or skip (rank 0 alone runs a barrier)")
    p.add_argument("--bug-step", type=positive(int), default=10, help="the step after which --bug strikes")
    return lesson2.parse_args(argv, p)


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
