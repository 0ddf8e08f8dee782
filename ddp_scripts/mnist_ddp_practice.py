"""Lesson 12: lesson 2's training where DDP meets the rest of PyTorch, each meeting a flag.

    python mnist_ddp_practice.py --batchnorm sync            # BatchNorm over the global batch, by hand
    python mnist_ddp_practice.py --batchnorm sync --float64  # ... compared with one process, exactly
    python mnist_ddp_practice.py --uneven 3 --join on        # ranks with fewer batches join early
    python mnist_ddp_practice.py --unused-head --find-unused # a parameter forward never uses
    python mnist_ddp_practice.py --checkpoint non-reentrant  # activation checkpointing under DDP
    python mnist_ddp_practice.py --compile aot_eager         # torch.compile of the DDP model
    python mnist_ddp_practice.py --amp fp16 --clip 1.0       # a scaled loss, clipped after unscaling

Compare it with mnist_ddp_cpu.py, whose launching it runs: the diff is what this lesson adds.
"""
import os
import sys
import time
from contextlib import nullcontext

try:  # lesson 2's script, which imports the course's modules: copy them beside this file
    import mnist_ddp_cpu as lesson2  # lesson 2's launching and command line, kept as they are
except ModuleNotFoundError as missing:  # copied alone: one line names the file (no torch: Python's error)
    raise missing if missing.name != "mnist_ddp_cpu" else SystemExit(
        f"{os.path.basename(sys.argv[0])}: error: mnist_ddp_cpu.py is missing: copy it from ddp_scripts/")
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_hardening as hardening  # each call into it says what plain code it stands for
from ddp_hardening import UsageError, positive
from mnist_parts import Report, build_model, evaluate, load_split


# --------------------------------------------------------------------------- BatchNorm across ranks
class SyncBatchNormFunction(torch.autograd.Function):
    """BatchNorm's arithmetic over the global batch. Forward all-reduces each channel's sum, sum of
    squares and count; backward all-reduces the two sums its gradient needs. (torch's SyncBatchNorm
    does the same on GPUs.) The sums are taken in float64: E[x^2] - E[x]^2 cancels digits."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        dims, shape = [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)  # all but the channels
        c, x64 = x.shape[1], x.double()
        sums = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), x64.new_tensor([x.numel() / c])])
        dist.all_reduce(sums)  # now the global batch's: the same on every rank
        count = sums[-1]
        mean = sums[:c] / count
        var = sums[c:2 * c] / count - mean * mean  # biased: the one that normalises
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.dims, ctx.shape, ctx.count = dims, shape, count
        unbiased = (var * count / (count - 1)).to(x.dtype)  # the running variance's, as nn.BatchNorm
        mean = mean.to(x.dtype)
        ctx.mark_non_differentiable(mean, unbiased)
        return xhat * weight.view(shape) + bias.view(shape), mean, unbiased

    @staticmethod
    def backward(ctx, dy, _mean, _var):
        xhat, weight, invstd = ctx.saved_tensors
        shape = ctx.shape
        local = torch.cat([dy.sum(ctx.dims), (dy * xhat).sum(ctx.dims)])
        grad_bias, grad_weight = local.chunk(2)  # this rank's: DDP averages them like any gradient
        total = local.to(torch.float64, copy=True)  # a copy in float64 too: all_reduce writes into it
        dist.all_reduce(total)  # every x moved the global mean and variance: the sums of all ranks
        mean_dy, mean_dy_xhat = (total / ctx.count).to(dy.dtype).chunk(2)
        dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * (invstd * weight).view(shape)
        return dx, grad_weight, grad_bias, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """nn.BatchNorm1d/2d normalising with the global batch's statistics while training."""

    def _check_input_dim(self, x):
        pass  # any of (N, C), (N, C, L), (N, C, H, W)

    def forward(self, x):
        if not self.training:
            return super().forward(x)  # the running statistics: nothing to share
        y, mean, var = SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():  # nn.BatchNorm's update, with the global batch's statistics
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var, self.momentum)
            self.num_batches_tracked += 1
        return y


class BNNet(nn.Module):
    """Lesson 2's ConvNet with BatchNorm in place of dropout. `block` is what activation
    checkpointing recomputes (no BatchNorm in it: recomputing one would update its running
    statistics twice); `aux`, with --unused-head, is a head that forward never uses."""

    def __init__(self, sync=False, unused_head=False, recompute="off"):
        super().__init__()
        bn2d, bn1d = (SyncBatchNorm, SyncBatchNorm) if sync else (nn.BatchNorm2d, nn.BatchNorm1d)
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3), bn2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                   nn.Linear(32 * 12 * 12, 64))
        self.head = nn.Sequential(bn1d(64), nn.ReLU(), nn.Linear(64, 10))
        self.aux = nn.Linear(64, 10) if unused_head else None
        self.recompute = recompute

    def forward(self, x):
        x = self.stem(x)
        if self.recompute == "off" or not torch.is_grad_enabled():  # evaluating: no backward to save for
            x = self.block(x)
        else:  # keep only the block's input; run it again during backward
            x = checkpoint(self.block, x, use_reentrant=self.recompute == "reentrant")
        return self.head(x)


def replica_spread(model):
    """How far apart the ranks' copies are: the largest difference between two ranks' values of
    any parameter, and of any buffer (BatchNorm's running statistics). 0.0: equal."""
    spread = {}
    for kind, tensors in (("parameters", model.parameters()), ("buffers", model.buffers())):
        high = torch.cat([t.detach().double().flatten() for t in tensors] or [torch.zeros(1)])
        low = -high
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MAX)  # minus the smallest
        spread[kind] = (high + low).max().item()
    return spread


# --------------------------------------------------------------------------- training
def train(rank, world_size, args):
    train_images, train_labels = load_split(args.dataset, args.data_dir, train=True)
    test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
    if args.float64:  # for comparisons with one process that show the arithmetic, not float32's rounding
        train_images, test_images = train_images.double(), test_images.double()

    # 2. Instantiate the model, then wrap it. The same seed gives every rank the same start
    #    (DDP also broadcasts rank 0's weights); a per-rank seed afterwards decorrelates dropout.
    torch.manual_seed(args.seed)
    plain = (BNNet(args.batchnorm == "sync", args.unused_head, args.checkpoint) if args.model == "bnnet"
             else build_model(args.model)).to(torch.float64 if args.float64 else torch.float32)
    # forward_sync_buffers (default on; before torch 2.13, broadcast_buffers): before each training
    # forward, rank 0's buffers (BatchNorm's running statistics) overwrite the others'.
    # find_unused_parameters: after each forward, look in the autograd graph for the parameters
    # backward will not reach. static_graph: learn once which those are.
    model = DDP(plain, forward_sync_buffers=not args.no_buffer_sync, bucket_cap_mb=args.bucket_cap_mb,
                find_unused_parameters=args.find_unused, static_graph=args.static_graph)
    # torch.compile of the DDP model: dynamo splits the graph where DDP's buckets end (optimize_ddp)
    compiled = torch.compile(model, backend=args.compile) if args.compile != "off" else model
    torch.manual_seed(args.seed + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # fp16 needs its loss scaled (its small gradients would flush to zero); bf16 has fp32's range
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)

    # 3. Per-process data: the sampler gives rank r the samples r, r+N, r+2N, ... of a
    #    permutation shared by all ranks; it pads so that every rank runs the same number of steps.
    train_set = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    report = Report(args, rank, world_size, batchnorm=args.batchnorm, compile=args.compile, amp=args.amp,
                    float64=args.float64, clip_norms=[])  # rank 0 speaks, and writes the metrics JSON
    report.say(f"training {args.model} on {args.dataset}: {world_size} processes, {args.threads_per_proc} "
               f"torch thread(s) each, batch {args.batch_size} per process "
               f"({args.batch_size * world_size} in all)")
    steps, norms = 0, report.fields["clip_norms"]
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        # plain: bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=rank != 0 or args.quiet)
        bar = hardening.progress(loader, f"epoch {epoch}", rank == 0 and not args.quiet)
        # Join: a rank out of batches answers the others' all-reduces (with zeros) until all are
        # out; "throw" instead raises on every rank as soon as one is out
        joined = (Join([model], throw_on_early_termination=args.join == "throw") if args.join != "off"
                  else nullcontext())
        try:
            with joined:
                for i, (x, y) in enumerate(bar):
                    if i == len(loader) - args.uneven * rank:  # --uneven K: rank r has K * r batches fewer,
                        break  # as when each rank reads its own files
                    optimizer.zero_grad()
                    with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                        loss = F.cross_entropy(compiled(x), y)
                    scaler.scale(loss).backward()  # 4. DDP all-reduces (averages) the gradients here
                    if args.clip:  # on the averaged gradients: the same norm, the same clip, on every rank
                        if not args.clip_before_unscale:
                            scaler.unscale_(optimizer)  # the true gradients, not the scaled ones
                        norms.append(nn.utils.clip_grad_norm_(model.parameters(), args.clip).item())
                    scaler.step(optimizer)  # ... so every rank takes the same step
                    scaler.update()
                    steps += 1
                    loss_sum += loss.item() * len(y)
                    seen += len(y)
                    if steps == args.max_steps:
                        break
        except RuntimeError as err:
            if "exhausted" not in str(err):  # raised by Join on every rank: the epoch ends here
                raise
            report.say(f"epoch {epoch}: a rank ran out of batches after {steps} steps: {err}")
        seconds = time.perf_counter() - epoch_start  # training only, evaluation excluded

        # 5. Evaluate across ranks: each scores a shard, all_reduce adds the sums up. The plain
        #    model.module is used because evaluation needs no gradient synchronisation.
        test_loss, test_accuracy = evaluate(plain, test_images, test_labels, rank, world_size)
        spread = replica_spread(plain)  # were the ranks' copies equal when they were scored?
        report.epoch(epoch, loss_sum, seen, seconds, steps, test_loss, test_accuracy, spread=spread,
                     note=f"  ranks apart by {spread['parameters']:.2g} (parameters), "
                          f"{spread['buffers']:.2g} (buffers)")
        # 6. Optional: a barrier keeps the ranks' epochs in step. DDP does not need it: every
        #    backward and the all_reduce above already wait for all ranks.
        dist.barrier()
        if steps == args.max_steps:
            break

    # 7. Print and save on rank 0 only; `plain` holds plain (non-DDP) parameter names.
    report.done(steps)
    if rank == 0 and args.save:
        torch.save(plain.state_dict(), args.save)


# --------------------------------------------------------------------------- launching: lesson 2's
def main(args):
    """Lesson 2's launching, running this file's train(): BatchNorm, Join, compile, ..."""
    lesson2.main(args, train, lesson2.check_setup)


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = lesson2.parser(__doc__)  # lesson 2's flags; this lesson's own below
    p.add_argument("--model", choices=["linear", "convnet", "bnnet"], default="bnnet")
    p.add_argument("--batchnorm", choices=["local", "sync"], default="local",
                   help="bnnet's statistics: each rank's own batch, or the global batch (by hand)")
    p.add_argument("--no-buffer-sync", action="store_true",
                   help="forward_sync_buffers=False: each rank keeps its own buffers (running statistics)")
    p.add_argument("--uneven", type=int, default=0, metavar="K", help="rank r has K * r batches fewer")
    p.add_argument("--join", choices=["off", "on", "throw"], default="off")
    p.add_argument("--unused-head", action="store_true", help="bnnet gets a head forward never uses")
    p.add_argument("--find-unused", action="store_true", help="DDP's find_unused_parameters")
    p.add_argument("--static-graph", action="store_true", help="DDP's static_graph")
    p.add_argument("--checkpoint", choices=["off", "reentrant", "non-reentrant"], default="off",
                   help="recompute bnnet's middle block in backward (activation checkpointing)")
    p.add_argument("--bucket-cap-mb", type=positive(float), default=None, help="DDP's bucket size (lesson 6)")
    p.add_argument("--compile", choices=["off", "inductor", "aot_eager", "eager"], default="off",
                   help="torch.compile the DDP model with this backend")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off")
    p.add_argument("--float64", action="store_true",
                   help="compute in float64 (slower): comparisons with one process then show the "
                        "arithmetic, not float32's rounding (lesson 12, section 2)")
    p.add_argument("--clip", type=positive(float), default=None, help="clip the gradients' norm to this")
    p.add_argument("--clip-before-unscale", action="store_true", help="the mistake: clip scaled gradients")
    args = lesson2.parse_args(argv, p)
    if args.model != "bnnet" and (args.batchnorm != "local" or args.unused_head or args.checkpoint != "off"):
        raise UsageError("--batchnorm, --unused-head and --checkpoint change bnnet: use --model bnnet")
    if args.float64 and args.amp != "off":
        raise UsageError("--amp computes in 16 bits, --float64 in 64: use one of them")
    if args.uneven < 0:
        raise UsageError(f"--uneven must be 0 or more, got {args.uneven}")
    return args


if __name__ == "__main__":
    hardening.run_main(main, parse_args)  # plain: main(parse_args())
