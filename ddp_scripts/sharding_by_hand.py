"""Lesson 10, by hand: ZeRO stage 1, the optimizer's state sharded across the ranks.

    python sharding_by_hand.py --nprocs 2 --shard zero1 --max-steps 20 --save zero1.pt
    python sharding_by_hand.py --nprocs 2 --shard torch --max-steps 20 --save torch.pt   # torch's ZeRO
    python sharding_by_hand.py --nprocs 2 --shard none --max-steps 20 --save ddp.pt      # DDP, unsharded

Under DDP every rank keeps the optimizer's state for every parameter: AdamW's two running averages
are twice the model, on every rank. ShardedOptimizer (below) deals the parameters out to the ranks,
each to one owner; a rank keeps optimizer state for the parameters it owns only. A step is then:
DDP averages every gradient on every rank, as before; each rank updates the parameters it owns with
the optimizer it was given; each owner broadcasts its updated parameters to the others. Every rank
ends the step with the same parameters as under DDP, and 1/N of the optimizer state (up to how the
tensors divide). --shard torch runs torch's ZeroRedundancyOptimizer instead, which deals the
parameters out the same way. The optimizer (--optimizer adamw, or sgd with momentum) gets two
parameter groups: the weight matrices with weight decay, the biases without.
A teaching script: it reads the data that mnist_single.py (or any lesson script) has prepared, and
it has none of the hardening of mnist_fsdp.py, which is the one to copy.
"""
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

try:  # the course's modules, written once: copy them beside this file
    from mnist_parts import build_model, load_split, prepared
    from ddp_hardening import Parser, UsageError, free_port, positive
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


def parameter_groups(model, weight_decay):
    """Two groups, as most training scripts have them: weight matrices decay, biases do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_optimizer(model, args):
    """--shard none: the whole optimizer on every rank; zero1: by hand; torch: ZeroRedundancyOptimizer."""
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    groups = parameter_groups(model, args.weight_decay)
    if args.shard == "zero1":
        return ShardedOptimizer(groups, optimizer_class, lr=args.lr, **options)
    if args.shard == "torch":
        return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, lr=args.lr, **options)
    return optimizer_class(groups, lr=args.lr, **options)


def optimizer_state_bytes(optimizer):
    """What this rank's optimizer holds in state, whichever --shard made it."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer = optimizer.optimizer  # the optimizer of this rank's share
    elif isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # likewise, in torch's
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}


# --------------------------------------------------------------------------- one rank
def worker(rank, world_size, args):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(args.threads_per_proc)
    images, labels = load_split(args.dataset, args.data_dir, train=True)

    torch.manual_seed(args.seed)
    model = DDP(build_model(args.model))  # the gradients averaged as in lesson 3, in every mode
    optimizer = make_optimizer(model, args)
    # Rank r takes samples r, r + N, ... of each global batch: step k trains on the same G samples
    # for any N, so that 1, 2 or 3 ranks take the same steps.
    sampler = DistributedSampler(images, num_replicas=world_size, rank=rank,
                                 shuffle=not args.no_shuffle, seed=args.seed)
    batches = torch.tensor(list(sampler)).split(args.global_batch_size // world_size)

    seconds, steps = [], 0
    for index in batches[:args.max_steps]:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images[index]), labels[index]).backward()  # DDP: averaged gradients
        optimizer.step()  # none: all of it here; zero1, torch: this rank's share, then broadcast
        seconds.append(time.perf_counter() - start)
        steps += 1
    state = [0] * world_size  # each rank's optimizer state, measured from its tensors
    dist.all_gather_object(state, optimizer_state_bytes(optimizer))

    if rank == 0:
        test_images, test_labels = load_split(args.dataset, args.data_dir, train=False)
        with torch.no_grad():
            model.eval()
            correct = sum((model.module(x).argmax(1) == y).sum().item()
                          for x, y in zip(test_images.split(512), test_labels.split(512)))
        accuracy, per_step = correct / len(test_labels), statistics.median(seconds[3:] or seconds)
        parameter_bytes = sum(p.nbytes for p in model.parameters())
        if not args.quiet:
            print("optimizer state per rank: " + ", ".join(f"{s / 2**20:.2f} MiB" for s in state)
                  + f" (the parameters: {parameter_bytes / 2**20:.2f} MiB)", flush=True)
        print(f"done: {args.model} on {args.dataset}, --shard {args.shard}, {args.optimizer}, {world_size} "
              f"processes, {steps} steps, test accuracy {accuracy:.2%}, {per_step * 1e3:.1f} ms per step",
              flush=True)
        if args.save:
            torch.save(model.module.state_dict(), args.save)
        if args.metrics_json:
            with open(args.metrics_json, "w") as f:
                json.dump({"shard": args.shard, "optimizer": args.optimizer, "model": args.model,
                           "world_size": world_size, "steps": steps, "test_accuracy": accuracy,
                           "parameter_bytes": parameter_bytes, "optimizer_state_bytes": state,
                           "ms_per_step": per_step * 1e3}, f, indent=2)
    dist.barrier()  # the ranks leave together, once rank 0 has scored and saved
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--shard", choices=["none", "zero1", "torch"], default="zero1",
                   help="none: DDP with the whole optimizer on every rank; zero1: ShardedOptimizer; "
                        "torch: ZeroRedundancyOptimizer")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="adamw, or sgd with momentum 0.9")
    p.add_argument("--model", choices=["linear", "convnet", "mlp"], default="mlp")
    p.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default=None,
                   help="default: MNIST if its files are in --data-dir, else Fashion-MNIST")
    p.add_argument("--data-dir", type=str, default="data")
    p.add_argument("--global-batch-size", type=positive(int), default=60,
                   help="the batch of all ranks together: keep it, and 1, 2 or 3 ranks take the same steps")
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01, help="of the weight matrices' group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive(int), default=None, help="default: one epoch")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--nprocs", type=positive(int), default=2)
    p.add_argument("--threads-per-proc", type=positive(int), default=None,
                   help="torch threads per process (default: cores // processes, at least 1)")
    p.add_argument("--save", type=str, default=None, help="write rank 0's final state_dict here")
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--quiet", action="store_true", help="only the final line")
    p.add_argument("--timeout", type=positive(int), default=120, help="seconds a collective may wait")
    args = p.parse_args(argv)
    if args.global_batch_size % args.nprocs:
        raise UsageError(f"--global-batch-size {args.global_batch_size} does not split evenly over "
                         f"{args.nprocs} ranks: choose a multiple of {args.nprocs}")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay {args.weight_decay}: give 0 or more")
    if args.threads_per_proc is None:
        args.threads_per_proc = max(1, (os.cpu_count() or 1) // args.nprocs)
    args.dataset = prepared(args.dataset, args.data_dir)  # the files mnist_single.py prepared
    return args


def main(args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as err:  # something the user can fix: one line, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
