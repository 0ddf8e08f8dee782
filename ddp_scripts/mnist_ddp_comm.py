"""Lesson 6: lesson 3's training, with what it costs to communicate measured and paid less often.

    python mnist_ddp_comm.py --model mlp --accum-steps 4     # all-reduce once per 4 micro-batches
    python mnist_ddp_comm.py --model mlp --comm-hook bf16    # send the gradients in bf16
    python mnist_ddp_comm.py --backend gloo --device cpu --nprocs 2 --model mlp --bucket-cap-mb 1
    python mnist_ddp_comm.py --model mlp --profile traces    # traces/rank<r>.json: what overlaps

It needs mnist_parts.py (the data, models and evaluation) and ddp_hardening.py beside it.
Compare it with mnist_ddp_gpu.py: the diff is what this lesson adds.
"""
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
    # DDP all-reduces the gradients in buckets of about bucket_cap_mb, each as soon as backward has
    # filled it, so that communication overlaps with the rest of backward. None: DDP's default,
    # 25 MB buckets after a first one of 1 MiB (passing 25 makes the first one 25 MB too).
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    # A communication hook replaces DDP's all-reduce of each bucket: these cast the bucket to
    # fp16/bf16, all-reduce half the bytes, and cast the average back.
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if args.comm_hook in hooks:
        model.register_comm_hook(None, hooks[args.comm_hook])  # None: the default process group
    torch.manual_seed(args.seed + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Mixed precision: autocast runs matmuls and convolutions in bf16/fp16. fp16 has a small
    # range, so its loss is scaled up before backward (and the gradients back down) by a scaler,
    # which reads back from the GPU whether a gradient overflowed: one synchronisation per step.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)  # rank 0 speaks
    log(f"training {args.model} on {args.dataset}: {world_size} processes on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
        f"({args.backend}, amp {args.amp}), batch {args.batch_size} per process "
        f"({args.batch_size * world_size} in all)", flush=True)
    # What one gradient all-reduce costs here, measured alone: compare it with the time of a step.
    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.comm_hook, torch.float32)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gradient_mb = numel * torch.finfo(wire_dtype).bits / 8 / 1e6
    allreduce_seconds = time_allreduce(numel, wire_dtype, device)
    log(f"gradients: {gradient_mb:.2f} MB per step ({str(wire_dtype)[6:]}); one all-reduce of that "
        f"size alone: {allreduce_seconds * 1e3:.2f} ms; optimizer step every {args.accum_steps} "
        f"micro-batch(es) of {args.batch_size} ({args.batch_size * args.accum_steps * world_size} "
        f"images per step in all)", flush=True)
    history, steps, start = [], 0, time.perf_counter()
    trace = profile_steps(args, rank, device)
    if trace:
        trace.start()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # This rank's samples, copied to the device once an epoch: a batch is a slice of them.
        batches = torch.tensor(list(sampler), device=device).split(args.batch_size)
        epoch_start = time.perf_counter()
        loss_sum, seen = torch.zeros((), dtype=torch.float64, device=device), 0
        # plain: bar = tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(batches, f"epoch {epoch}", rank == 0 and not args.quiet)
        for i, index in enumerate(bar):
            # Micro-batches go in groups of --accum-steps (the epoch's last group may be shorter;
            # every rank has as many micro-batches, so all agree on where the groups end).
            group_start = i - i % args.accum_steps
            group = min(args.accum_steps, len(batches) - group_start)
            last = i - group_start == group - 1
            if i == group_start:
                optimizer.zero_grad(set_to_none=True)
            x, y = train_images[index], train_labels[index]
            # 4. Under no_sync() backward only adds this micro-batch's gradients into .grad, with no
            #    communication; the group's last backward all-reduces (averages) the sums, once.
            #    Forward must be inside too: DDP prepares the reduction there.
            with nullcontext() if last else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss / group).backward()  # / group: the sum of the group's means is a mean
            loss_sum += loss.detach() * len(y)  # stays on the GPU: no .item(), no wait per step
            seen += len(y)
            if last:
                scaler.step(optimizer)  # the same averaged gradients on every rank: the same step
                scaler.update()
                steps += 1
                if trace:
                    trace.step()
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
                "accum_steps": args.accum_steps, "comm_hook": args.comm_hook,
                "bucket_cap_mb": args.bucket_cap_mb, "gradient_mb": gradient_mb,
                "allreduce_ms": allreduce_seconds * 1e3, "backend": args.backend, "epochs": history})
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    if trace:
        trace.stop()

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    if rank == 0:
        last = history[-1]
        print(f"done: {args.model} on {args.dataset}, {world_size} processes, {steps} steps, "
              f"test accuracy {last['test_accuracy']:.2%}, {last['images_per_second']:,.0f} "
              f"images/s, {time.perf_counter() - start:.1f} s in all", flush=True)
        if args.save:
            torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)


def time_allreduce(numel, dtype, device, repeats=5):
    """Seconds that one all_reduce of numel elements takes here: the median of a few, after a
    warm-up (the first also connects and allocates). Every rank must call it."""
    buffer = torch.zeros(numel, dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL returns before the GPU has done it
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def profile_steps(args, rank, device):
    """--profile DIR: a torch.profiler trace of optimizer steps 3 to 5 of this rank, DIR/rank<rank>.json
    (open it in https://ui.perfetto.dev: backward's operators, and the all-reduces beside them on
    Gloo's threads or NCCL's stream). None without --profile."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    path = os.path.join(args.profile, f"rank{rank}.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(path))


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
    if rank == 0:  # only rank 0 writes them (on its own machine)
        check_writable(args.save, args.metrics_json)


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
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="convnet")
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
    p.add_argument("--accum-steps", type=positive(int), default=1,
                   help="micro-batches of --batch-size per optimizer step; the gradients are "
                        "all-reduced once per step")
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16"], default="none",
                   help="all-reduce the gradients in this precision (half the bytes)")
    p.add_argument("--bucket-cap-mb", type=positive(float), default=None,
                   help="DDP's bucket size: gradients are all-reduced in buckets of about this size "
                        "(default: DDP's own, 25 MB after a first bucket of 1 MiB)")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--profile", type=str, default=None, metavar="DIR",
                   help="write a torch.profiler trace of optimizer steps 3 to 5 of each rank into DIR")
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
    if args.profile:  # every rank writes its trace there: refused now, not after training
        check_writable(os.path.join(args.profile, "rank0.json"))
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
