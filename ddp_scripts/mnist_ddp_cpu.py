"""Lesson 2: the same MNIST training under DistributedDataParallel on CPU, with the Gloo backend.

    python mnist_ddp_cpu.py --nprocs 2 --model convnet --epochs 1          # launches itself (mp.spawn)
    torchrun --nproc-per-node 2 mnist_ddp_cpu.py --model convnet --epochs 1  # or let torchrun launch it

Lesson 1's data, models, evaluation, flags and report come from mnist_parts.py; what keeps the job
safe on a real cluster from ddp_hardening.py, in the few calls marked `hardening.`: copy both beside it.
Compare it with mnist_single.py: the diff is the DDP lesson.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # the course's modules, written once: copy them beside this file
    import ddp_hardening as hardening  # each call into it says what plain code it stands for
    from mnist_parts import Report, add_training_flags, build_model, evaluate, load_split, prepare_data
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, check_writable, cpu_cores, positive


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

    report = Report(args, rank, world_size)  # rank 0 speaks, and writes the metrics JSON
    report.say(f"training {args.model} on {args.dataset}: {world_size} processes, {args.threads_per_proc} "
               f"torch thread(s) each, batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    steps = 0
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
            if steps == args.max_steps:
                break
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up (as the report
        #    adds up the ranks' training losses). The plain model.module is used because evaluation
        #    needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(model.module, test_images, test_labels, rank, world_size)
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks.
        dist.barrier()
        if steps == args.max_steps:
            break

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    report.done(steps)
    if rank == 0 and args.save:
        torch.save(model.module.state_dict(), args.save)


def worker(rank, world_size, args, train=train):
    """What each process runs, whether spawned by main() or started by torchrun: `train` (this
    file's, or the one a later lesson's script passes) inside a process group."""
    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
    # 1. Join the process group. Every rank meets at MASTER_ADDR:MASTER_PORT (set by main() below
    #    or by torchrun); Gloo is the backend for CPUs. The timeout bounds every collective, so a
    #    rank that dies or stalls turns into an error instead of a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            store=hardening.attempt_store(args.timeout),  # plain: nothing
                            timeout=timedelta(seconds=args.timeout))
    try:
        if "RANK" in os.environ:  # torchrun: no launcher has prepared the data; the ranks do
            # plain: args.dataset = prepare_data(args.dataset, args.data_dir)
            args.dataset = hardening.prepare_in_turns(
                lambda d: prepare_data(d, args.data_dir, not args.quiet), args.dataset, rank,
                args.prepare_timeout)
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()  # 8. tear down, even after an error


# --------------------------------------------------------------------------- launching
def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


def main(args, train=train, check_setup=check_setup):
    """Run train(rank, world_size, args) in every process of the job; a later lesson's script passes
    its own train and check_setup, and the launching stays this lesson's."""
    if "RANK" in os.environ:
        # Started by torchrun: this process already is one rank, and torchrun has set MASTER_ADDR
        # and MASTER_PORT. Each rank checks its own set-up before joining the group.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        hardening.roll_call(check_setup, args, rank, world_size)  # plain: check_setup(args, rank)
        worker(rank, world_size, args, train)
        return
    # Started by hand: check and prepare the data once, here; then start --nprocs processes, each of
    # which imports the script that was run (hence its __main__ guard) and runs worker(rank, N, args, train).
    check_setup(args, rank=0)
    args.dataset = prepare_data(args.dataset, args.data_dir, verbose=not args.quiet)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = hardening.master_port()  # plain: os.environ["MASTER_PORT"] = str(free_port())
    if args.nprocs > cpu_cores() and not args.quiet:
        print(f"note: {args.nprocs} processes on {cpu_cores()} cores: they will take turns, "
              f"expect it slower than fewer processes", flush=True)
    # plain: mp.spawn(worker, args=(args.nprocs, args, train), nprocs=args.nprocs)
    hardening.spawn_workers(worker, args.nprocs, args, train)


# --------------------------------------------------------------------------- command line
def parser(doc=__doc__):
    """Lesson 1's flags and what DDP adds to them; a later lesson's script adds its own."""
    p = Parser(doc)
    add_training_flags(p)  # lesson 1's: --model --dataset --epochs --batch-size --lr ... (mnist_parts.py)
    p.add_argument("--nprocs", type=positive(int), default=2,
                   help="processes to spawn (ignored under torchrun, which sets WORLD_SIZE)")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    hardening.add_hardening_flags(p)  # plain: p.add_argument("--timeout", type=int, default=300)
    return p


def parse_args(argv=None, p=None):
    """The command line read with parser(), or with `p`, a later lesson's parser built on it."""
    args = (p or parser()).parse_args(argv)
    args.threads_per_proc = args.threads_per_proc or cpu_cores(shared_by=args.nprocs)
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
