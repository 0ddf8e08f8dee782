"""Lessons 2 and 9, by hand: data parallelism without DDP, to see what DDP does for you.

    python mnist_by_hand.py --nprocs 2 --model linear --max-steps 50 --save by_hand.pt
    python mnist_by_hand.py --nprocs 2 --model mlp --sync bucketed --bucket-mb 4 --max-steps 40

Every process holds a whole replica of the model and trains on its share of each global batch.
The replicas start from rank 0's weights (a broadcast), and before each optimizer step every
gradient is summed over the processes and divided by their number, so that every replica takes the
same step. How the gradients travel is --sync, one small class each, the steps that lead to what
DistributedDataParallel does:

    per-tensor  one all-reduce per gradient, after backward (lesson 2)
    flat        one all-reduce of all the gradients copied into one buffer, after backward
    overlap     a hook per parameter starts its gradient's all-reduce as soon as backward has
                produced it, while backward goes on; the step waits for all of them
    bucketed    gradients gathered, in the reverse order of the parameters, into buckets (DDP's
                sizes, or --bucket-mb); each bucket's all-reduce starts once it is full (DDP starts
                them in order; see the class)

Each class wraps a model (`sync = Bucketed(model)`);
`sync.finish_gradient_synchronization()` waits for the averaged gradients before `optimizer.step()`.
--profile DIR writes a torch.profiler trace of a few steps per rank (open it in
https://ui.perfetto.dev or chrome://tracing). A teaching script: it reads the data that
mnist_single.py (or any lesson script) has prepared, and it has none of the hardening of
mnist_ddp_cpu.py, which is the one to copy.
"""
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # the course's modules, written once: copy them beside this file
    from mnist_parts import add_prepared_flags, build_model, evaluate, load_split, prepared_args, save_outputs
    from ddp_hardening import Parser, UsageError, positive, run_plainly
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


# --------------------------------------------------------------------------- the gradients, four ways
def gradient(p):
    """p's gradient; zeros for a parameter that this step did not use (every rank must still send
    something for it, in the same order)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class PerTensor:
    """One all-reduce per gradient, once backward is done: the naive way (lesson 2)."""

    def __init__(self, model):
        # model.parameters() yields a parameter shared by two layers once; frozen ones are skipped.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = dist.get_world_size()
        for tensor in model.state_dict().values():  # BY HAND: every replica starts from rank 0's weights
            dist.broadcast(tensor, src=0)

    def finish_gradient_synchronization(self):
        """Call between backward() and optimizer.step(): every gradient averaged over the ranks."""
        for p in self.params:  # BY HAND: sum every gradient over the ranks, then average
            dist.all_reduce(gradient(p), op=dist.ReduceOp.SUM)
            p.grad /= self.world_size


class Flat(PerTensor):
    """All the gradients copied into one buffer, one all-reduce, copied back: one message, its fixed
    cost paid once instead of once per tensor, for two copies of the gradients."""

    def finish_gradient_synchronization(self):
        grads = [gradient(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


class Overlap(PerTensor):
    """A hook on each parameter starts its gradient's all-reduce as soon as backward has accumulated
    it into p.grad (register_post_accumulate_grad_hook: once per backward, after every use of p has
    added its part), while backward computes the gradients of the layers before. async_op=True: the
    call returns a handle at once and Gloo's own threads send and add; handle.wait() blocks until the
    sum is in p.grad. Every rank starts them in the same order, that of backward. finish waits for all."""

    def __init__(self, model):
        super().__init__(model)
        self.pending = []  # (parameter, the all-reduce under way)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        self.pending.append((p, dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True)))

    def finish_gradient_synchronization(self):
        started = {id(p) for p, _ in self.pending}
        for p in self.params:  # unused this step (no hook ran): zeros, sent now, in parameter order
            if id(p) not in started:
                self.pending.append((p, dist.all_reduce(gradient(p), op=dist.ReduceOp.SUM, async_op=True)))
        for p, work in self.pending:
            work.wait()
            p.grad /= self.world_size
        self.pending = []


class Bucketed(PerTensor):
    """The gradients grouped into buckets, in the reverse order of the parameters (about the order
    in which backward produces them). When the last gradient of a bucket is ready, the bucket is
    copied into one buffer and its all-reduce starts, while backward goes on: fewer, bigger messages
    than Overlap's, still overlapped. DDP's sizes (torch 2.14.1; the buckets DDP rebuilds after its
    first step, which sends every gradient in one bucket): a bucket closes once it holds at least its
    cap, 1 MiB for the first bucket and 25 MiB for the others by default, or bucket_mb for every
    bucket (DDP's bucket_cap_mb); a tensor is never split between buckets.
    Simpler than DDP, by design: DDP starts its buckets' all-reduces in order (a full bucket waits for
    the ones before it), copies each gradient into its bucket as it arrives (multiplied by 1/N),
    gives each dtype and device buckets of their own, and after its first step rebuilds its buckets
    in the order the gradients came. This class starts any full bucket at once, copies a bucket when
    it starts, assumes one dtype and device, and keeps the reversed order of the parameters. On the
    course's models the buckets come out as DDP's (tests/unit/test_comm_buckets.py)."""

    def __init__(self, model, bucket_mb=None):
        super().__init__(model)
        caps = [1.0, 25.0] if bucket_mb is None else [bucket_mb]  # MiB: the first bucket's, then the others'
        self.buckets, size = [[]], 0
        for p in reversed(self.params):
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
            if size >= int(caps[min(len(self.buckets), len(caps)) - 1] * 2**20):  # full (whole bytes, as DDP)
                self.buckets.append([])
                size = 0
        if not self.buckets[-1]:
            self.buckets.pop()
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(bucket) for bucket in self.buckets]  # gradients not yet ready, per bucket
        self.pending = {}  # bucket index -> (its buffer, the all-reduce under way)
        self.buffers = {}  # bucket index -> its buffer, kept from step to step as DDP keeps its own
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        i = self.bucket_of[id(p)]
        self.missing[i] -= 1
        if self.missing[i] == 0:  # the bucket is full: send it
            self.start(i)

    def start(self, i):
        grads = [gradient(p).reshape(-1) for p in self.buckets[i]]
        if i not in self.buffers:  # a new buffer each step would cost its allocation (page faults) each step
            self.buffers[i] = grads[0].new_empty(sum(g.numel() for g in grads))  # its dtype and device
        flat = torch.cat(grads, out=self.buffers[i])
        self.pending[i] = (flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):  # a bucket with an unused parameter: sent now, in order
            if i not in self.pending:
                self.start(i)
        for i, (flat, work) in sorted(self.pending.items()):
            work.wait()
            flat /= self.world_size
            grads = [p.grad for p in self.buckets[i]]
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        self.pending, self.missing = {}, [len(bucket) for bucket in self.buckets]


SYNC = {"per-tensor": PerTensor, "flat": Flat, "overlap": Overlap, "bucketed": Bucketed}


# --------------------------------------------------------------------------- one rank
def profiler(args, rank):
    """--profile DIR: a torch.profiler trace of steps 3 to 5 of this rank, DIR/rank<rank>.json."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    path = os.path.join(args.profile, f"rank{rank}.json")
    return profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(path))


def worker(rank, world_size, args):
    torch.set_num_threads(args.threads_per_proc)  # as lesson 2's worker: cores // processes
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    images, labels = load_split(args.dataset, args.data_dir, train=True)

    torch.manual_seed(args.seed)
    model = build_model(args.model)  # a plain model: no DDP wrapper
    # BY HAND: rank 0's weights to every replica; then the gradients' averaging, --sync's way
    sync = Bucketed(model, args.bucket_mb) if args.sync == "bucketed" else SYNC[args.sync](model)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank, as under DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_set = TensorDataset(images, labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    trace, steps, seconds = profiler(args, rank), 0, []
    if trace:
        trace.start()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # this rank's gradients, from its B samples
            sync.finish_gradient_synchronization()  # BY HAND: the averaged gradients on every rank
            optimizer.step()  # the same averaged gradients everywhere: the same step
            seconds.append(time.perf_counter() - start)
            if trace:
                trace.step()
            steps += 1
            if steps == args.max_steps:
                break
        if steps == args.max_steps:
            break
    if trace:
        trace.stop()

    if rank == 0:
        test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
        _, accuracy = evaluate(model, test_images, test_labels)  # lesson 1's, on rank 0 alone
        per_step = statistics.median(seconds[3:] or seconds)  # the first steps warm up
        print(f"done: {args.model} on {args.dataset} by hand ({args.sync}), {world_size} processes, "
              f"{steps} steps, test accuracy {accuracy:.2%}, {per_step * 1e3:.1f} ms per step", flush=True)
        save_outputs(args, model.state_dict(), {"sync": args.sync, "bucket_mb": args.bucket_mb,
                     "model": args.model, "world_size": world_size, "steps": steps, "test_accuracy": accuracy,
                     "ms_per_step": per_step * 1e3, "seconds": seconds})
    dist.barrier()  # the ranks leave together, once rank 0 has scored and saved
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = Parser(__doc__)
    add_prepared_flags(p)  # --dataset --data-dir --lr --seed --max-steps --nprocs --save ... (mnist_parts.py)
    p.add_argument("--sync", choices=list(SYNC), default="per-tensor",
                   help="how the gradients are averaged (see the top of this file)")
    p.add_argument("--bucket-mb", type=positive(float), default=None,
                   help="--sync bucketed: every bucket closes at this size, in MiB (default: DDP's, "
                        "1 MiB for the first bucket, 25 MiB for the others)")
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="linear")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64, help="per process")
    p.add_argument("--profile", type=str, default=None, metavar="DIR",
                   help="write a torch.profiler trace of steps 3 to 5 of each rank into DIR")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--quiet", action="store_true", help="(accepted, as by the other scripts)")
    args = p.parse_args(argv)
    if args.bucket_mb is not None and args.sync != "bucketed":
        raise UsageError("--bucket-mb sets the buckets of --sync bucketed: add --sync bucketed, or drop it")
    if args.profile:
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot use --profile {args.profile}: {err.strerror}") from None
        if not os.access(args.profile, os.W_OK):
            raise UsageError(f"cannot use --profile {args.profile}: no write permission there")

    return prepared_args(args)  # the data lesson 1's script prepared; the threads


if __name__ == "__main__":
    # plain: args = parse_args(); MASTER_ADDR/PORT here; mp.spawn(worker, args=(args.nprocs, args))
    run_plainly(worker, parse_args)
