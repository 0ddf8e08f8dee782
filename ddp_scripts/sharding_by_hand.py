"""Lesson 10, by hand: ZeRO stages 1 (the optimizer's state sharded), 2 (and the gradients), 3 (all).

    python sharding_by_hand.py --nprocs 2 --shard zero1 --max-steps 20 --save zero1.pt
    python sharding_by_hand.py --nprocs 2 --shard torch --max-steps 20 --save torch.pt   # torch's ZeRO
    python sharding_by_hand.py --nprocs 2 --shard none --max-steps 20 --save ddp.pt      # DDP, unsharded
    python sharding_by_hand.py --nprocs 2 --shard zero2 --max-steps 20 --save zero2.pt   # and the gradients
    python sharding_by_hand.py --nprocs 2 --shard zero3 --max-steps 20 --save zero3.pt   # FSDP by hand
    python sharding_by_hand.py --nprocs 2 --shard zero3 --compute-dtype bfloat16 --max-steps 20
    python sharding_by_hand.py --nprocs 2 --shard fsdp --max-steps 20   # torch's fully_shard, to compare

Under DDP every rank keeps the optimizer's state for every parameter: AdamW's two running averages
are twice the model, on every rank. ShardedOptimizer (below) deals the parameters out to the ranks,
each to one owner; a rank keeps optimizer state for the parameters it owns only. A step is then:
DDP averages every gradient on every rank, as before; each rank updates the parameters it owns with
the optimizer it was given; each owner broadcasts its updated parameters to the others. Every rank
ends the step with the same parameters as under DDP, and 1/N of the optimizer state (up to how the
tensors divide). --shard torch runs torch's ZeroRedundancyOptimizer instead, which deals the
parameters out the same way. The optimizer (--optimizer adamw, or sgd with momentum) gets two
parameter groups: the weight matrices with weight decay, the biases without.

--shard zero3 keeps no whole parameter anywhere: ShardedLayer keeps 1/N of each parameter's rows
per rank, gathers a layer whole just before its forward, frees it after, gathers it again when
backward needs it, and reduce-scatters the gradients: each rank steps its own rows. It counts the
bytes of its collectives (comm_bytes.py) and of the whole tensors alive at once. --shard zero2
(ShardedGradients) keeps the parameters whole and reduce-scatters the gradients: each rank keeps
its rows' gradients and optimizer state, steps them, and all-gathers the updated rows.
--shard fsdp runs torch's fully_shard on each layer instead (ZeRO-3); --shard fsdp-no-reshard with
reshard_after_forward=False, which keeps each layer whole from its forward to its backward (no
second gather): ZeRO-2's bytes, ZeRO-3's memory between steps.
A teaching script: it reads the data that mnist_single.py (or any lesson script) has prepared, and
it has none of the hardening of mnist_fsdp.py, which is the one to copy.
"""
import statistics
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

try:  # the course's modules, written once: copy them beside this file
    from comm_bytes import BACKENDS, bytes_sent
    from mnist_parts import add_prepared_flags, build_model, evaluate, load_split, prepared_args, save_outputs
    from ddp_hardening import Parser, UsageError, positive, run_plainly
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


# --------------------------------------------------------------------------- ZeRO-1 by hand
class ShardedOptimizer:
    """ZeRO stage 1: each rank keeps the optimizer state of its own share of the parameters.

    params: parameters, or parameter groups (dicts with "params" and the group's options), as any
    torch optimizer takes them; optimizer_class and its keyword arguments: the optimizer each rank
    runs on its share. Call step() after the gradients are averaged (by DDP, or lesson 9's classes)."""

    def __init__(self, params, optimizer_class, **defaults):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        seen, self.groups = set(), []
        for group in groups:  # a weight shared by two layers is one tensor: listed once, one owner, one state
            params = [p for p in dict.fromkeys(group["params"]) if id(p) not in seen]
            seen.update(map(id, params))
            self.groups.append({**group, "params": params})
        self.params = [p for group in self.groups for p in group["params"]]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameters")
        # BY HAND: deal the parameters out as ZeroRedundancyOptimizer does: group by group, the largest
        # first, each whole to the rank with the fewest elements so far (the lowest rank on a tie), the
        # counts carried from one group to the next. Whole tensors: the shares are uneven.
        self.owner, elements = {}, [0] * self.world_size
        for group in self.groups:
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):  # stable on ties
                rank = elements.index(min(elements))
                self.owner[p] = rank  # a tensor is a dict key by identity, as in torch's optimizers
                elements[rank] += p.numel()
        # BY HAND: this rank's optimizer sees its share only (each group keeps its options, the
        # share of it may be empty): the state it makes exists for that share alone.
        share = [{**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}
                 for group in self.groups]
        self.optimizer = optimizer_class(share, **defaults)
        self.param_groups = self.optimizer.param_groups  # this rank's share, e.g. to change the lr

    def zero_grad(self, set_to_none=True):
        """Every gradient, not only this rank's share's: backward and DDP fill them all."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        self.optimizer.step()  # BY HAND: the parameters this rank owns, from the averaged gradients
        for p in self.params:  # BY HAND: every parameter sent by its owner; the others receive it
            dist.broadcast(p, src=self.owner[p])


# --------------------------------------------------------------------------- ZeRO-3 (FSDP) by hand
def gather_rows(shard, rows):
    """A parameter whole from every rank's shard (rank r's rows r * R to (r + 1) * R), its first
    `rows` rows: the padding cut off. (The pieces received, as large, live only during the call.)"""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard)  # BY HAND: rank r's shard into pieces[r], on every rank
    return torch.cat(pieces)[:rows]


class Memory:
    """What ZeRO-3 keeps whole, counted from the tensors: the bytes of gathered parameters alive at
    once (each from its gathering until it is freed), and the largest whole gradient reduce-
    scattered. Left out: the copies that live only while a collective runs."""

    def __init__(self):
        self.now = self.peak_gathered = self.peak_gradient = 0

    def holds(self, tensor, nbytes):
        self.now += nbytes
        self.peak_gathered = max(self.peak_gathered, self.now)
        weakref.finalize(tensor, self.freed, nbytes)  # called when the tensor is freed

    def freed(self, nbytes):
        self.now -= nbytes

    def passes(self, gradient):
        self.peak_gradient = max(self.peak_gradient, gradient.nbytes)


MEMORY = Memory()


class GatherShards(torch.autograd.Function):
    """Forward: all-gather each of a layer's parameters whole from the ranks' shards. Backward:
    reduce-scatter each whole gradient, so that every rank keeps the average of its own shard's."""

    @staticmethod
    def forward(ctx, layer, *shards):
        ctx.layer = layer
        return tuple(layer.gather(i) for i in range(len(shards)))

    @staticmethod
    def backward(ctx, *grads):
        return None, *(ctx.layer.reduce_scatter(i, grad) for i, grad in enumerate(grads))


class ShardedLayer(nn.Module):
    """ZeRO stage 3 for one layer: each parameter is kept as rows [r * R, (r + 1) * R) on rank r
    (R = its rows / N rounded up; zeros pad the last rank's), whole only while the layer computes:
    gathered just before forward, freed after it, gathered again when backward needs it. Every rank
    must build the layer alike (the same seed): there is no DDP to broadcast rank 0's start.
    compute_dtype: gather and compute in it (bfloat16) while the shards, the optimizer's master
    copy, keep the parameters' dtype; the gradients are averaged in the shards' dtype."""

    def __init__(self, layer, compute_dtype=None):
        super().__init__()
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        self.layer, self.names = layer, [name for name, _ in layer.named_parameters(recurse=False)]
        self.shapes = [getattr(layer, name).shape for name in self.names]
        for name in self.names:
            whole = getattr(layer, name)
            if whole.dim() == 0:
                raise ValueError(f"{name} is a scalar: there are no rows to shard")
            rows = -(-len(whole) // self.world_size)  # rounded up
            padding = [0, 0] * (whole.dim() - 1) + [0, rows * self.world_size - len(whole)]
            padded = F.pad(whole.detach(), padding)
            # this rank's rows, under the parameter's own name: an optimizer sees shards like parameters
            mine = nn.Parameter(padded[rank * rows:(rank + 1) * rows].clone(), whole.requires_grad)
            delattr(layer, name)  # the layer keeps no whole copy
            self.register_parameter(name, mine)
        self.dtype = compute_dtype or self.shard(0).dtype
        self.whole = None  # the gathered parameters, while forward runs
        self.sent = []  # (collective, bytes of the whole), each call: what the ranks exchanged

    def shard(self, i):
        return getattr(self, self.names[i])

    def gather(self, i):
        """Parameter i whole, in the compute dtype: every rank's rows, the padding cut off."""
        shard = self.shard(i).detach().to(self.dtype)
        whole = gather_rows(shard, self.shapes[i][0])
        self.sent.append(("all_gather", shard.nbytes * self.world_size))
        MEMORY.holds(whole._base, whole._base.nbytes)  # the buffer, padding included, that views keep
        return whole

    def reduce_scatter(self, i, grad):
        """The gradient of parameter i's shard: this rank's rows of the sum over the ranks, / N,
        summed in the shard's dtype (bfloat16's 8 bits would lose digits adding N gradients)."""
        shard = self.shard(i)
        padding = [0, 0] * (grad.dim() - 1) + [0, len(shard) * self.world_size - len(grad)]
        grad = F.pad(grad.to(shard.dtype), padding)  # also a contiguous copy (a weight's arrives transposed)
        mine = torch.empty_like(shard)
        dist.reduce_scatter(mine, list(grad.chunk(self.world_size)))  # BY HAND: chunk r to rank r
        self.sent.append(("reduce_scatter", grad.nbytes))
        MEMORY.passes(grad)
        return mine / self.world_size  # the average, as DDP's

    def forward(self, x):
        self.whole = GatherShards.apply(self, *(self.shard(i) for i in range(len(self.names))))
        try:
            for name, whole in zip(self.names, self.whole):
                setattr(self.layer, name, whole)  # the layer computes with the whole parameters ...
            # ... which autograd must not keep for backward: it keeps a note, and gathers them again
            with torch.autograd.graph.saved_tensors_hooks(self.note, self.gather_again):
                return self.layer(x.to(self.dtype))
        finally:
            for name in self.names:
                setattr(self.layer, name, None)  # ... nor the layer: freed once forward is done
            self.whole = None

    def note(self, tensor):
        """Autograd saves `tensor` for backward: if it is (a view of) gathered parameter i, keep
        only which one and how it was viewed."""
        for i, whole in enumerate(self.whole):
            if tensor.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
                return i, tensor.size(), tensor.stride(), tensor.storage_offset()
        return tensor.detach()  # (not the tensor itself: a tensor saving itself would be a cycle)

    def gather_again(self, saved):
        if isinstance(saved, tuple):  # BY HAND: backward needs parameter i: gather it again
            i, size, stride, offset = saved
            return self.gather(i).as_strided(size, stride, offset)
        return saved


def shard_model(model, compute_dtype=None):
    """Every layer that has parameters of its own becomes a ShardedLayer (in place; the model is
    returned). Refused: a parameter shared by two layers (each would shard its own copy), and
    parameters of the model itself (no parent to hold its ShardedLayer)."""
    owners = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if owners.setdefault(p, name) != name:
                raise ValueError(f"a parameter is shared by {owners[p]} and {name}: shard_model "
                                 f"shards each layer's own parameters")
    if "" in owners.values():
        raise ValueError("the model has parameters of its own: give shard_model a model of layers")
    for name, module in list(model.named_modules()):
        for child_name, child in module.named_children():
            if any(True for _ in child.parameters(recurse=False)):
                setattr(module, child_name, ShardedLayer(child, compute_dtype))
    return model


def full_state_dict(model):
    """The whole parameters, in the shards' dtype, under the plain model's names, on every rank."""
    state = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedLayer):
            for i, name in enumerate(module.names):
                state[f"{prefix}.{name}"] = gather_rows(module.shard(i).detach(), module.shapes[i][0]).clone()
    return state


# --------------------------------------------------------------------------- ZeRO-2 by hand
class ShardedGradients:
    """ZeRO stage 2, between the two: every rank keeps the parameters whole, but of each gradient
    and of the optimizer's state only its rows (dealt as ShardedLayer deals them). As backward
    completes a gradient, it is reduce-scattered and the whole one freed; the optimizer steps this
    rank's rows; an all-gather brings every rank's updated rows to all. No DDP: the reduce-scatter
    averages. Takes parameters or parameter groups, and any optimizer class, as ShardedOptimizer."""

    def __init__(self, params, optimizer_class, **defaults):
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.rows, share, self.sent = {}, [], []  # parameter -> this rank's rows of it, as a parameter
        for group in groups:
            for p in [p for p in dict.fromkeys(group["params"]) if p not in self.rows]:
                if p.dim() == 0:
                    raise ValueError("a scalar parameter has no rows to shard")
                rows = -(-len(p) // self.world_size)
                padded = F.pad(p.detach(), [0, 0] * (p.dim() - 1) + [0, rows * self.world_size - len(p)])
                self.rows[p] = nn.Parameter(padded[rank * rows:(rank + 1) * rows].clone())
                p.register_post_accumulate_grad_hook(self.reduce_scatter)  # BY HAND: p's gradient is whole
            share.append({**group, "params": [self.rows[p] for p in dict.fromkeys(group["params"])]})
        self.optimizer = optimizer_class(share, **defaults)  # its state: this rank's rows only
        self.param_groups = self.optimizer.param_groups

    def reduce_scatter(self, p):
        mine = self.rows[p]
        grad = F.pad(p.grad, [0, 0] * (p.dim() - 1) + [0, len(mine) * self.world_size - len(p)])
        mine.grad = torch.empty_like(mine)
        dist.reduce_scatter(mine.grad, list(grad.chunk(self.world_size)))  # BY HAND: rows r to rank r
        mine.grad /= self.world_size  # the average, as DDP's
        p.grad = None  # BY HAND: the whole gradient is freed; this rank keeps its rows'
        self.sent.append(("reduce_scatter", grad.nbytes))
        MEMORY.passes(grad)

    def zero_grad(self, set_to_none=True):
        for mine in self.rows.values():
            mine.grad = None

    @torch.no_grad()
    def step(self):
        self.optimizer.step()  # this rank's rows, from their averaged gradient
        for p, mine in self.rows.items():  # BY HAND: every rank's updated rows, to every rank
            p.copy_(gather_rows(mine, len(p)))
            self.sent.append(("all_gather", mine.nbytes * self.world_size))


def parameter_groups(model, weight_decay):
    """Two groups, as most training scripts have them: weight matrices decay, biases do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_optimizer(model, args):
    """--shard none, zero3, fsdp: the whole optimizer on what this rank holds; zero1, zero2: by hand; torch:
    ZeroRedundancyOptimizer."""
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    groups = parameter_groups(model, args.weight_decay)
    if args.shard == "zero2":
        return ShardedGradients(groups, optimizer_class, lr=args.lr, **options)
    if args.shard == "zero1":
        return ShardedOptimizer(groups, optimizer_class, lr=args.lr, **options)
    if args.shard == "torch":
        return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, lr=args.lr, **options)
    return optimizer_class(groups, lr=args.lr, **options)


def optimizer_state_bytes(optimizer):
    """What this rank's optimizer holds in state, whichever --shard made it."""
    if isinstance(optimizer, (ShardedOptimizer, ShardedGradients)):
        optimizer = optimizer.optimizer  # the optimizer of this rank's share
    elif isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # likewise, in torch's
    return sum(local(t).nbytes for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))


def local(t):
    """What this rank stores of a tensor: its shard, for fully_shard's DTensors."""
    return t.to_local() if isinstance(t, DTensor) else t


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # float16 needs a loss scale


def bytes_written():
    """What this process has written so far, its sockets included (Linux's /proc/self/io), or None."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        return None


# --------------------------------------------------------------------------- one rank
def worker(rank, world_size, args):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(args.threads_per_proc)
    images, labels = load_split(args.dataset, args.data_dir, train=True)

    torch.manual_seed(args.seed)
    if args.shard == "zero3":  # no DDP: each sharded layer reduce-scatters its own gradients
        model = shard_model(build_model(args.model), COMPUTE_DTYPES[args.compute_dtype])
    elif args.shard == "zero2":  # no DDP: ShardedGradients reduce-scatters the gradients
        model = build_model(args.model)
    elif args.shard.startswith("fsdp"):  # torch's fully_shard, a unit per layer as in mnist_fsdp.py
        model, mesh = build_model(args.model), init_device_mesh("cpu", (world_size,))
        for module in [*(m for m in model.modules() if isinstance(m, nn.Linear)), model]:
            fully_shard(module, mesh=mesh, reshard_after_forward=args.shard == "fsdp")
    else:
        model = DDP(build_model(args.model))  # the gradients averaged as in lesson 3
    optimizer = make_optimizer(model, args)
    # Rank r takes samples r, r + N, ... of each global batch: step k trains on the same G samples
    # for any N, so that 1, 2 or 3 ranks take the same steps.
    sampler = DistributedSampler(images, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    batches = torch.tensor(list(sampler)).split(args.global_batch_size // world_size)
    layers = [m for m in model.modules() if isinstance(m, ShardedLayer)]

    seconds, steps = [], 0
    for index in batches[:args.max_steps]:
        start, written = time.perf_counter(), bytes_written()
        for counted in [*layers, optimizer]:
            getattr(counted, "sent", []).clear()  # what the last step exchanged is kept
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images[index]).float(), labels[index]).backward()  # averaged gradients
        optimizer.step()  # none, zero3, fsdp: all this rank holds; zero1, torch: its share, broadcast
        seconds.append(time.perf_counter() - start)
        written = bytes_written() - written if written is not None else None  # the last step's is kept
        steps += 1
    rows = getattr(optimizer, "rows", {})  # zero2: a copy of this rank's rows, stepped, and their gradients
    grads = [local(t.grad) for t in [*model.parameters(), *rows.values()] if t.grad is not None]
    held = {"optimizer_state_bytes": optimizer_state_bytes(optimizer),  # each rank's, from its tensors
            "parameter_bytes": sum(local(p).nbytes for p in [*model.parameters(), *rows.values()]),
            "written_bytes_per_step": written,
            "gradient_bytes": sum(g.nbytes for g in grads),
            "gathered_peak_bytes": MEMORY.peak_gathered, "gradient_peak_bytes": MEMORY.peak_gradient}
    every = [None] * world_size
    dist.all_gather_object(every, held)
    plain = build_model(args.model)  # the model whole, in float32, for scoring and saving
    plain.load_state_dict(full_state_dict(model) if layers else  # fsdp: each DTensor gathered whole
                          {k: t.full_tensor() if isinstance(t, DTensor) else t
                           for k, t in getattr(model, "module", model).state_dict().items()})

    if rank == 0:
        test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
        _, accuracy = evaluate(plain, test_images, test_labels)  # lesson 1's, on rank 0 alone
        per_step = statistics.median(seconds[3:] or seconds)
        metrics = {key: [h[key] for h in every] for key in held}
        # zero2, zero3: the last step's collectives, as they counted them
        sent = [call for layer in layers for call in layer.sent] + getattr(optimizer, "sent", [])
        metrics["sent_bytes_per_step"] = {b: sum(bytes_sent(c, size, world_size, b) for c, size in sent)
                                          for b in BACKENDS} if sent else None
        if not args.quiet:
            print("optimizer state per rank: " + ", ".join(f"{s / 2**20:.2f} MiB"
                                                           for s in metrics["optimizer_state_bytes"])
                  + ", parameters per rank: " + ", ".join(f"{s / 2**20:.2f} MiB"
                                                         for s in metrics["parameter_bytes"]), flush=True)
        print(f"done: {args.model} on {args.dataset}, --shard {args.shard}, {args.optimizer}, {world_size} "
              f"processes, {steps} steps, test accuracy {accuracy:.2%}, {per_step * 1e3:.1f} ms per step",
              flush=True)
        metrics.update(shard=args.shard, optimizer=args.optimizer, model=args.model, steps=steps,
                       compute_dtype=args.compute_dtype, world_size=world_size, test_accuracy=accuracy,
                       ms_per_step=per_step * 1e3)
        save_outputs(args, plain.state_dict(), metrics)
    dist.barrier()  # the ranks leave together, once rank 0 has scored and saved
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = Parser(__doc__)
    add_prepared_flags(p)  # --dataset --data-dir --lr --seed --max-steps --nprocs --save ... (mnist_parts.py)
    p.add_argument("--shard", choices=["none", "zero1", "torch", "zero2", "zero3", "fsdp", "fsdp-no-reshard"],
                   default="zero1",
                   help="none: DDP with the whole optimizer on every rank; zero1: ShardedOptimizer; "
                        "torch: ZeroRedundancyOptimizer; zero2: ShardedGradients; zero3: ShardedLayer "
                        "(FSDP by hand); fsdp: torch's fully_shard; fsdp-no-reshard: with "
                        "reshard_after_forward=False")
    p.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default="float32",
                   help="zero3: gather the parameters and compute in this dtype (the shards stay float32)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="adamw, or sgd with momentum 0.9")
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="mlp")
    p.add_argument("--global-batch-size", type=positive(int), default=60,
                   help="the batch of all ranks together: keep it, and 1, 2 or 3 ranks take the same steps")
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01, help="of the weight matrices' group")
    p.add_argument("--max-steps", type=positive(int), default=None, help="default: one epoch")
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    args = p.parse_args(argv)
    if args.global_batch_size % args.nprocs:
        raise UsageError(f"--global-batch-size {args.global_batch_size} does not split evenly over "
                         f"{args.nprocs} ranks: choose a multiple of {args.nprocs}")
    if args.compute_dtype != "float32" and args.shard != "zero3":
        raise UsageError(f"--compute-dtype {args.compute_dtype} is zero3's: add --shard zero3")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay {args.weight_decay}: give 0 or more")
    return prepared_args(args)  # the data lesson 1's script prepared; the threads


if __name__ == "__main__":
    # plain: args = parse_args(); MASTER_ADDR/PORT here; mp.spawn(worker, args=(args.nprocs, args))
    run_plainly(worker, parse_args)
