"""Lesson 11: model parallelism, for a layer too big for one device or a model too deep for one.

    python mnist_model_parallel.py --mode tp --nprocs 2 --max-steps 50     # tensor parallelism
    python mnist_model_parallel.py --mode pp --nprocs 2 --microbatches 8   # pipeline parallelism
    python mnist_model_parallel.py --mode pp --microbatches 8 --schedule 1f1b  # fewer activations kept
    python mnist_model_parallel.py --mode pp --microbatches 8 --schedule 1f1b-by-hand  # 1F1B written out

Lesson 6's MLP (784 -> 2048 -> 2048 -> 10), trained by N processes that each hold a part of it,
where DDP gives each a whole copy and a part of the batch. Every process here sees the whole global
batch, and the weights end where one process's would on the same batches.
  --mode tp  splits the two large layers across the processes (a slice of each weight matrix on each).
  --mode pp  gives each process a few whole layers (a stage) and passes activations along, one
             micro-batch after another, so that the stages work at the same time. Try --microbatches
             1, 2, 4, 8: the bubble (N-1)/(M+N-1) shrinks, but each micro-batch has costs of its own.
             --metrics-json keeps when each stage ran each micro-batch's forward and backward.
A teaching script, Gloo on CPU: it reads the data that mnist_single.py (or any lesson script) has
prepared, and it has none of the hardening of mnist_ddp_cpu.py.
"""
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:  # the course's modules, written once: copy them beside this file
    from mnist_parts import add_prepared_flags, evaluate, load_split, prepared_args, save_outputs
    from ddp_hardening import Parser, UsageError, positive, run_plainly
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


def global_batches(images, labels, args):
    """The same global batches on every rank (the same seed, the same order), --max-steps at most:
    whole batches only, so that every step (and every micro-batch) has the same size."""
    steps = 0
    for epoch in range(1, args.epochs + 1):
        order = (torch.arange(len(labels)) if args.no_shuffle else
                 torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed + epoch)))
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            index = order[start:start + args.batch_size]
            yield images[index], labels[index]
            steps += 1
            if steps == args.max_steps:
                return


def build_model(width=2048):
    """Lesson 6's MLP (mnist_ddp_comm.py, --model mlp), its hidden width a flag here."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


# --------------------------------------------------------------------------- tensor parallelism
def tensor_parallel(model, mesh):
    """Split the hidden block over the ranks; returns the same model, its weights now DTensors.

    Layer "1", Linear(784, W), column-wise: rank r holds W/N of its W output features (rows of the
        weight, W/N x 784, and their biases). From the whole input, it makes its W/N features.
    Layer "2", ReLU: works on each rank's W/N features alone.
    Layer "3", Linear(W, W), row-wise: rank r holds the W x W/N columns of the weight that read its
        W/N features, and makes a partial sum of all W outputs. One all-reduce adds the N partial
        sums: every rank then has the whole activation. Its bias is held whole on every rank; each
        rank adds bias/N to its partial sum, and the all-reduce sums them back to one bias.
    Layers "4" and "5", ReLU and Linear(W, 10): small, whole on every rank (plain tensors). They see
        the same activation and labels everywhere, so they get the same gradients without a collective.
    """
    return parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})


def full_state_dict(model):
    """Each sharded weight gathered whole (an all-gather: every rank must call this)."""
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()}


def shape(t):
    return "x".join(map(str, t.shape))


def counts(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()} or "none"


def train_tp(rank, world_size, args, model, images, labels):
    model = tensor_parallel(model, init_device_mesh("cpu", (world_size,)))  # 1. a mesh of N ranks
    if rank == 0 and not args.quiet:
        held = [f"{name} {shape(t.to_local() if isinstance(t, DTensor) else t)} of {shape(t)}"
                for name, t in model.state_dict().items()]
        print(f"rank 0 holds {', '.join(held)}", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # on each rank's shard
    losses, seconds = [], []
    for x, y in global_batches(images, labels, args):  # 2. every rank: the same whole global batch
        start = time.perf_counter()
        count = rank == 0 and not losses and not args.quiet  # count the collectives of the first step
        forward, backward = (CommDebugMode(), CommDebugMode()) if count else (nullcontext(), nullcontext())
        optimizer.zero_grad()
        with forward:
            loss = F.cross_entropy(model(x), y)  # 3. one all-reduce (layer "3"'s output, B x W floats)
        with backward:
            loss.backward()  # 4. none: layer 1's input needs no gradient, the rest is local
            optimizer.step()  # 5. none: each rank steps its own shard
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        if count:
            print(f"collectives in one step: forward {counts(forward)}, backward and step "
                  f"{counts(backward)}", flush=True)
    return full_state_dict(model), losses, seconds  # 6. all-gather the shards


# --------------------------------------------------------------------------- pipeline parallelism
CUTS = [3, 5]  # where the MLP can be cut: before layer "3" (Linear(W, W)) and before "5" (Linear(W, 10))


def train_pp(rank, world_size, args, model, images, labels):
    # 1. Stage r holds whole layers: with 2 ranks, stage 0 holds layers 0-2 (Flatten, Linear(784, W),
    #    ReLU) and stage 1 layers 3-5 (Linear(W, W), ReLU, Linear(W, 10)); with 3, one Linear each.
    #    A slice of an nn.Sequential keeps the layers' names ("3.weight"), so the parts reassemble.
    #    The stages need not take equally long (stage 0: 784 x W weights, and no gradient for the
    #    images; stage 1: W x W and W x 10): the slower one sets the pace.
    bounds = [0, *CUTS[:world_size - 1], len(model)]
    part = model[bounds[rank]:bounds[rank + 1]]
    timeline = Timeline()  # when this stage ran each micro-batch's forward and backward
    if args.schedule == "1f1b-by-hand":
        def run_step(x, y, micro_losses):
            one_f_one_b_by_hand(part, rank, world_size, args, x, y, micro_losses, timeline)
    else:
        stage = PipelineStage(part, stage_index=rank, num_stages=world_size, device=torch.device("cpu"))
        # 2. GPipe: all micro-batches forward, then all backward. 1F1B: once the pipeline is full,
        #    each stage alternates one forward and one backward, so that it holds the activations of
        #    at most N - r micro-batches, not M. The loss function runs on the last stage, on each
        #    micro-batch; the gradients are summed over the micro-batches and divided by their number
        #    (scale_grads): the mean loss of the whole batch, as one process would have.
        schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = schedule_class(stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)
        stage.forward_one_chunk = timeline.timed("F", stage.forward_one_chunk)  # the schedule calls these
        stage.backward_one_chunk = timeline.timed("B", stage.backward_one_chunk)  # for each micro-batch

        def run_step(x, y, micro_losses):
            # 3. Stage 0 feeds the images, the last stage the labels. Forward, stage r sends each
            #    micro-batch's activation (B/M x W) to stage r+1; backward, its gradient back to stage
            #    r: 2 x M x (N-1) point-to-point messages a step, no collective. Each micro-batch's
            #    backward also adds a whole weight gradient to .grad: tiny micro-batches cost more
            #    than they save.
            schedule.step(*([x] if rank == 0 else []), target=y if rank == world_size - 1 else None,
                          losses=micro_losses)
    saved = SavedActivations(part.parameters())
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0 and not args.quiet:
        print(f"{world_size} stages, layers {bounds}; {args.microbatches} micro-batches of "
              f"{args.batch_size // args.microbatches}, schedule {args.schedule}", flush=True)
    losses, seconds = [], []
    for x, y in global_batches(images, labels, args):
        start = time.perf_counter()
        timeline.steps.append([])
        optimizer.zero_grad()
        micro_losses = []
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):  # counts them
            run_step(x, y, micro_losses)
        optimizer.step()  # 4. each stage steps its own layers: no collective
        if rank == world_size - 1:
            losses.append(torch.stack(micro_losses).mean().item())  # equal micro-batches: the batch's mean
        seconds.append(time.perf_counter() - start)
    # 5. Rank 0 collects the stages' weights (and the last stage's losses, every stage's peak and timeline).
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object((part.state_dict(), losses, saved.peak, timeline.steps), parts, dst=0)
    if rank != 0:
        return None, None, seconds
    args.saved_peak_bytes = [peak for _, _, peak, _ in parts]
    args.timeline = [steps for _, _, _, steps in parts]
    return {name: t for weights, _, _, _ in parts for name, t in weights.items()}, parts[-1][1], seconds


def one_f_one_b_by_hand(part, rank, world_size, args, x, y, micro_losses, timeline):
    """One step of 1F1B with plain sends and receives, in Schedule1F1B's order: stage r runs
    min(M, N - r) forwards (the warm-up), then one backward and one forward in turn, then the
    backwards left. Receives wait; sends are posted (isend) and waited for later, so that two
    neighbours that both send never wait on each other: an activation's send once its gradient has
    come back, a gradient's before the next gradient goes."""
    m, first, last = args.microbatches, rank == 0, rank == world_size - 1
    inputs, targets = x.chunk(m), y.chunk(m)
    kept, sent = {}, {}  # per micro-batch: its input and output, for its backward; its activation's send
    gradient_sent = []  # the last gradient sent back

    def forward(i):
        if first:
            inp = inputs[i]
        else:  # every cut carries B/M x W activations
            inp = torch.empty(len(inputs[i]), args.width)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_()  # so that backward gives the gradient to send back
        with timeline.timing("F", i):
            out = part(inp)
        if last:
            out = F.cross_entropy(out, targets[i])  # this micro-batch's mean loss
            micro_losses.append(out.detach())
        else:
            sent[i] = dist.isend(out.detach(), dst=rank + 1)
        kept[i] = inp, out

    def backward(i):
        inp, out = kept.pop(i)  # dropping them frees the activations autograd kept
        grad = None
        if not last:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            sent.pop(i).wait()  # its gradient is back: the activation has arrived
        with timeline.timing("B", i):
            out.backward(grad)  # adds this micro-batch's share to each weight's .grad
        if not first:
            if gradient_sent:
                gradient_sent.pop().wait()
            gradient_sent.append(dist.isend(inp.grad, dst=rank - 1))

    warm_up = min(m, world_size - rank)
    for i in range(warm_up):
        forward(i)
    for i in range(m - warm_up):
        backward(i)
        forward(warm_up + i)
    for i in range(m - warm_up, m):
        backward(i)
    for work in gradient_sent:
        work.wait()
    for p in part.parameters():  # the sum over micro-batches of their mean losses' gradients / M
        p.grad.div_(m)


def idle_shares(timeline):
    """Stage by stage, the share of a step spent in neither a forward nor a backward (the bubble, and
    the sends and receives): a step from the first forward on any stage to the last backward on any
    stage; the median over the steps, the first left out."""
    shares = [[] for _ in timeline]
    steps = range(1 if len(timeline[0]) > 1 else 0, len(timeline[0]))
    for step in steps:
        events = [timeline[r][step] for r in range(len(timeline))]
        times = [t for stage in events for _, _, start, end in stage for t in (start, end)]
        span = max(times) - min(times)
        for r, stage in enumerate(events):
            shares[r].append(1 - sum(e - b for _, _, b, e in stage) / span)
    return [torch.tensor(s).median().item() for s in shares]


def slot_seconds(timeline):
    """The slowest stage's median forward + median backward of one micro-batch, the first step left
    out: one slot of a pipeline's step, which theory counts M + N - 1 of."""
    def median(stage, kind):
        return statistics.median(e - b for step in stage[1:] or stage for k, _, b, e in step if k == kind)
    return max(median(stage, "F") + median(stage, "B") for stage in timeline)


class Timeline:
    """When this stage ran each micro-batch's forward ("F") and backward ("B"), step by step:
    (kind, micro-batch, start, end) in seconds of time.perf_counter(), a clock that all processes
    on one machine share (across machines the clocks would need aligning)."""

    def __init__(self):
        self.steps = []

    @contextmanager
    def timing(self, kind, microbatch):
        start = time.perf_counter()
        yield
        self.steps[-1].append((kind, microbatch, start, time.perf_counter()))

    def timed(self, kind, method):  # a method whose first argument is the micro-batch
        def run(microbatch, *args, **kwargs):
            with self.timing(kind, microbatch):
                return method(microbatch, *args, **kwargs)
        return run


class SavedActivations:
    """The activations that autograd keeps for backward, bytes alive at once, counted through
    saved_tensors_hooks: each tensor saved counted once (a weight saved is not an activation)
    until the last reference to it is dropped, after the backward that needed it."""

    def __init__(self, parameters):
        self.weights = {p.untyped_storage().data_ptr() for p in parameters}
        self.alive, self.now, self.peak = {}, 0, 0  # (address, bytes) -> [bytes, references]

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self.weights:
            return tensor.detach()
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in self.alive:
            self.alive[key] = [tensor.nbytes, 0]
            self.now += self.alive[key][0]
            self.peak = max(self.peak, self.now)
        self.alive[key][1] += 1
        return Saved(tensor.detach(), key, self)

    def unpack(self, saved):
        return saved.tensor if isinstance(saved, Saved) else saved

    def dropped(self, key):
        self.alive[key][1] -= 1
        if not self.alive[key][1]:
            self.now -= self.alive.pop(key)[0]


class Saved:
    def __init__(self, tensor, key, counter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        self.counter.dropped(self.key)


# --------------------------------------------------------------------------- one rank
def worker(rank, world_size, args):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(max(1, os.cpu_count() // world_size))
    images, labels = load_split(args.dataset, args.data_dir, train=True)
    torch.manual_seed(args.seed)
    model = build_model(args.width)  # the same initial weights on every rank (the same seed)
    train = train_tp if args.mode == "tp" else train_pp
    weights, losses, seconds = train(rank, world_size, args, model, images, labels)

    if rank == 0:  # the gathered weights, in a plain one-process model
        plain = build_model(args.width)
        plain.load_state_dict(weights)
        test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
        _, accuracy = evaluate(plain, test_images, test_labels)  # lesson 1's, on rank 0 alone
        # the median step, the first left out (it also sets things up: the stages' shapes, the buffers)
        per_step = torch.tensor(seconds[1:] or seconds or [0.0]).median().item()
        how = "tensor parallel" if args.mode == "tp" else "pipeline parallel"
        extra, idle = "", idle_shares(args.timeline) if args.mode == "pp" else None
        if args.mode == "pp":  # GPipe idles each stage for N-1 of the M+N-1 slots of a step
            bubble = (world_size - 1) / (args.microbatches + world_size - 1)
            extra = (f", {args.microbatches} micro-batches, bubble (N-1)/(M+N-1) = {bubble:.0%}, "
                     f"measured idle {', '.join(f'{share:.0%}' for share in idle)}")
        print(f"done: mlp (width {args.width}) on {args.dataset}, {how} over {world_size} processes"
              f"{extra}, {len(losses)} steps, {per_step * 1000:.1f} ms a step (median), final loss "
              f"{losses[-1] if losses else float('nan'):.4f}, test accuracy {accuracy:.2%}",
              flush=True)
        save_outputs(args, plain.state_dict(), {
            "mode": args.mode, "world_size": world_size, "width": args.width, "batch_size": args.batch_size,
            "microbatches": args.microbatches, "schedule": args.schedule, "loss": losses,
            "seconds_per_step": seconds, "saved_peak_bytes": getattr(args, "saved_peak_bytes", None),
            "timeline": getattr(args, "timeline", None), "idle_shares": idle,
            "slot_seconds": slot_seconds(args.timeline) if args.mode == "pp" else None})
    dist.barrier()  # the ranks leave together, once rank 0 has scored and saved
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = Parser(__doc__)
    add_prepared_flags(p)  # --dataset --data-dir --lr --seed --max-steps --nprocs --save ... (mnist_parts.py)
    p.add_argument("--mode", choices=["tp", "pp"], required=True,
                   help="tp: tensor parallelism, pp: pipeline parallelism")
    p.add_argument("--width", type=positive(int), default=2048, help="the MLP's hidden width")
    p.add_argument("--microbatches", type=positive(int), default=4, help="(pp) per global batch")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "1f1b-by-hand"], default="gpipe",
                   help="(pp) all forwards then all backwards, or one forward one backward "
                        "(torch's Schedule1F1B, or written out in this script)")
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=64, help="global: every rank sees all of it")
    p.add_argument("--save", type=str, default=None, help="write the whole model's state_dict here")
    p.add_argument("--metrics-json", type=str, default=None, help="loss and seconds per step")
    args = p.parse_args(argv)
    if args.mode == "tp" and args.width % args.nprocs:
        raise UsageError(f"--width {args.width} does not split evenly over --nprocs {args.nprocs} "
                         f"(tensor parallelism gives each process width/nprocs features)")
    if args.mode == "pp" and args.nprocs > len(CUTS) + 1:
        raise UsageError(f"--nprocs {args.nprocs}: the MLP has {len(CUTS) + 1} linear layers, so at "
                         f"most {len(CUTS) + 1} pipeline stages")
    if args.mode == "pp" and args.schedule == "1f1b" and args.microbatches < args.nprocs:
        raise UsageError(f"--schedule 1f1b (torch's Schedule1F1B) needs at least as many micro-batches as "
                         f"stages: --microbatches {args.microbatches} < --nprocs {args.nprocs} (1f1b-by-hand "
                         f"takes any number)")
    if args.mode == "pp" and args.batch_size % args.microbatches:
        raise UsageError(f"--microbatches {args.microbatches} does not divide --batch-size "
                         f"{args.batch_size}: every micro-batch must have the same size")
    return prepared_args(args)  # the data lesson 1's script prepared; the threads


if __name__ == "__main__":
    # plain: args = parse_args(); MASTER_ADDR/PORT here; mp.spawn(worker, args=(args.nprocs, args))
    run_plainly(worker, parse_args)
