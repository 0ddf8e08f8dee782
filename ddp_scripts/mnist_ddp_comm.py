"""Lesson 6: lesson 3's training, with what it costs to communicate measured and paid less often.

    python mnist_ddp_comm.py --model mlp --accum-steps 4     # all-reduce once per 4 micro-batches
    python mnist_ddp_comm.py --model mlp --comm-hook bf16    # send the gradients in bf16
    python mnist_ddp_comm.py --backend gloo --device cpu --nprocs 2 --model mlp --bucket-cap-mb 1
    python mnist_ddp_comm.py --model mlp --profile traces    # traces/rank<r>.json: what overlaps

Compare it with mnist_ddp_gpu.py, whose launching it runs: the diff is the lesson.
"""
import os
import sys
import time
from contextlib import nullcontext

try:  # lesson 3's script, which imports the course's modules: copy them beside this file
    import mnist_ddp_gpu as lesson3  # lesson 3's launching and command line, kept as they are
except ModuleNotFoundError as missing:  # copied alone: one line names the file (no torch: Python's error)
    raise missing if missing.name != "mnist_ddp_gpu" else SystemExit(
        f"{os.path.basename(sys.argv[0])}: error: mnist_ddp_gpu.py is missing: copy it from ddp_scripts/")
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hardening as hardening  # each call into it says what plain code it stands for
from ddp_hardening import check_writable, positive
from mnist_parts import Report, build_model, evaluate, load_split


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
    amp_dtype, scaler = lesson3.mixed_precision(args.amp, device)  # --amp: autocast's dtype, fp16's scaler

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)

    # What one gradient all-reduce costs here, measured alone: compare it with the time of a step.
    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.comm_hook, torch.float32)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gradient_mb = numel * torch.finfo(wire_dtype).bits / 8 / 1e6
    allreduce_seconds = time_allreduce(numel, wire_dtype, device)
    report = Report(args, rank, world_size, device=args.device, amp=args.amp, backend=args.backend,
                    accum_steps=args.accum_steps, comm_hook=args.comm_hook, bucket_cap_mb=args.bucket_cap_mb,
                    gradient_mb=gradient_mb, allreduce_ms=allreduce_seconds * 1e3)
    report.say(f"training {args.model} on {args.dataset}: {world_size} processes on "
               f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
               f"({args.backend}, amp {args.amp}), batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    report.say(f"gradients: {gradient_mb:.2f} MB per step ({str(wire_dtype)[6:]}); one all-reduce of that "
               f"size alone: {allreduce_seconds * 1e3:.2f} ms; optimizer step every {args.accum_steps} "
               f"micro-batch(es) of {args.batch_size} ({args.batch_size * args.accum_steps * world_size} "
               f"images per step in all)")
    steps = 0
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
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy)
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks. NCCL's barrier is a
        #    tiny all-reduce on a GPU: name this rank's, or torch guesses the device.
        dist.barrier(device_ids=[local_rank] if args.backend == "nccl" else None)
        if steps == args.max_steps:
            break

    if trace:
        trace.stop()

    # 7. Print and save on rank 0 only; model.module holds plain (non-DDP) parameter names.
    report.done(steps)
    if rank == 0 and args.save:
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


# --------------------------------------------------------------------------- launching: lesson 3's
def main(args):
    """Lesson 3's launching, running this file's train(): its buckets, hooks and accumulation."""
    lesson3.main(args, train, lesson3.check_setup)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = lesson3.parser(__doc__)  # lesson 3's flags; this lesson's own below
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="convnet")
    p.add_argument("--accum-steps", type=positive(int), default=1,
                   help="micro-batches of --batch-size per optimizer step; the gradients are "
                        "all-reduced once per step")
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16"], default="none",
                   help="all-reduce the gradients in this precision (half the bytes)")
    p.add_argument("--bucket-cap-mb", type=positive(float), default=None,
                   help="DDP's bucket size: gradients are all-reduced in buckets of about this size "
                        "(default: DDP's own, 25 MB after a first bucket of 1 MiB)")
    p.add_argument("--profile", type=str, default=None, metavar="DIR",
                   help="write a torch.profiler trace of optimizer steps 3 to 5 of each rank into DIR")
    args = lesson3.parse_args(argv, p)
    if args.profile:  # every rank writes its trace there: refused now, not after training
        check_writable(os.path.join(args.profile, "rank0.json"))
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
