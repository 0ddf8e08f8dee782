"""Lesson 3: the same MNIST training under DistributedDataParallel on GPUs, with the NCCL backend.

    python mnist_ddp_gpu.py --model convnet --epochs 1              # one process per visible GPU
    torchrun --nproc-per-node 2 mnist_ddp_gpu.py --amp fp16          # or let torchrun launch them
    python mnist_ddp_gpu.py --backend gloo --device cpu --nprocs 2   # no GPU: the same code on CPU

It needs mnist_parts.py (lesson 1's data, models, evaluation, flags, report) and ddp_hardening.py beside it.
Compare it with mnist_ddp_cpu.py: the diff is what moving to GPUs changes.
"""
import os
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
    from mnist_parts import Report, add_training_flags, build_model, evaluate, load_split, prepare_data
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")
from ddp_hardening import Parser, check_writable, cpu_cores, positive


# --------------------------------------------------------------------------- training
def train(rank, local_rank, world_size, args):
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
    amp_dtype, scaler = mixed_precision(args.amp, device)  # --amp: autocast's dtype, fp16's scaler

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    report = Report(args, rank, world_size, device=args.device, amp=args.amp, backend=args.backend)
    report.say(f"training {args.model} on {args.dataset}: {world_size} processes on "
               f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
               f"({args.backend}, amp {args.amp}), batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    steps = 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # This rank's samples, copied to the device once an epoch: a batch is a slice of them.
        batches = torch.tensor(list(sampler), device=device).split(args.batch_size)
        # plain: batches = tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        batches = hardening.progress(batches, f"epoch {epoch}", rank == 0 and not args.quiet)
        # 4. The epoch's steps, on the GPU: DDP all-reduces (averages) the gradients in each backward.
        loss_sum, seen, steps, seconds = train_epoch(model, optimizer, scaler, amp_dtype, train_images,
                                                     train_labels, batches, steps, args.max_steps)

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. The plain
        #    model.module is used because evaluation needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(model.module, test_images, test_labels, rank, world_size)
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    report.done(steps)
    if rank == 0 and args.save:
        torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)


def mixed_precision(amp, device):
    """--amp's autocast dtype (bf16, fp16; None: off) and gradient scaler. Autocast runs matmuls and
    convolutions in 16 bits. fp16 has a small range, so the scaler scales its loss up before backward
    (and the gradients back down), reading back from the GPU whether a gradient overflowed: one
    synchronisation per step. bf16 has float32's range: its scaler is off, a no-op."""
    return ({"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp),
            torch.amp.GradScaler(device.type, enabled=amp == "fp16"))


def train_epoch(model, optimizer, scaler, amp_dtype, images, labels, batches, steps, max_steps):
    """One epoch: a step for each batch of indices into images and labels, until max_steps steps in
    all. Returns the loss summed over its samples, their number, the steps so far and the epoch's
    seconds (training only: evaluation excluded)."""
    start, device = time.perf_counter(), images.device
    loss_sum, seen = torch.zeros((), dtype=torch.float64, device=device), 0
    for index in batches:
        x, y = images[index], labels[index]  # a gather on the GPU: no copy from the host
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients here
        scaler.step(optimizer)  # ... so every rank takes the same step and the replicas stay equal
        scaler.update()
        loss_sum += loss.detach() * len(y)  # stays on the GPU: no .item(), no wait per step
        seen += len(y)
        steps += 1
        if steps == max_steps:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: wait before reading the clock
    return loss_sum, seen, steps, time.perf_counter() - start


def worker(rank, world_size, args, train=train):
    """What each process runs, whether spawned by main() or started by torchrun: `train` (this
    file's, or the one a later lesson's script passes) inside a process group."""
    # One GPU per process: local_rank numbers the processes on this machine (rank counts all
    # machines). Select the GPU before anything touches CUDA, or every rank piles onto GPU 0.
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ else rank  # torchrun sets it
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(args.threads_per_proc)  # cores // processes: do not oversubscribe
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
def check_setup(args, rank):
    """Refuse, before this rank joins the group, what cannot work; say what to do instead."""
    # plain: nothing (refuses NCCL on a CPU, fp16 on a CPU, more ranks than GPUs, bf16 without it)
    hardening.check_device(args.device, args.backend, args.amp, args.nprocs,
                           gpu=int(os.environ.get("LOCAL_RANK", 0)))  # this process's GPU, by index
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


def main(args, train=train, check_setup=check_setup):
    """Run train(rank, local_rank, world_size, args) in every process of the job; a later lesson's
    script passes its own train and check_setup, and the launching stays this lesson's."""
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
    """Lesson 1's flags, what DDP adds to them, and the device's; a later lesson's script adds its own."""
    p = Parser(doc)
    add_training_flags(p)  # lesson 1's: --model --dataset --epochs --batch-size --lr ... (mnist_parts.py)
    p.add_argument("--nprocs", type=positive(int), default=None,
                   help="processes to spawn (default: one per visible GPU, 2 on CPU; "
                        "ignored under torchrun, which sets WORLD_SIZE)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                   help="mixed precision (fp16 with a gradient scaler)")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    hardening.add_hardening_flags(p)  # plain: p.add_argument("--timeout", type=int, default=300)
    return p


def parse_args(argv=None, p=None):
    """The command line read with parser(), or with `p`, a later lesson's parser built on it."""
    args = (p or parser()).parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.nprocs is None:  # one process per visible GPU
        args.nprocs = (torch.cuda.device_count() if args.device == "cuda" else 0) or 2
    args.threads_per_proc = args.threads_per_proc or cpu_cores(shared_by=args.nprocs)
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
