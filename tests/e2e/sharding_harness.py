"""Run in forked processes by tests/e2e/test_sharding_by_hand.py: sharding_by_hand.py's
ShardedOptimizer (ZeRO-1 by hand) against one process running the unsharded optimizer on the
whole global batch, against torch's ZeroRedundancyOptimizer, and a control that forgets the
broadcast. A small net with a parameter shared by two layers; AdamW and SGD with momentum; the
parameters given as two groups (weight decay on the matrices only) or as a plain list. Rank 0
saves {case: results}."""
import importlib.util
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, GLOBAL_BATCH = 8, 24  # 24 splits over 2 and 3 ranks
CASES = [("adamw", "groups"), ("sgd", "groups"), ("adamw", "list")]


class Tied(nn.Module):
    """Tensors of several sizes, two biases of one size (a tie in the dealing), and one weight shared
    by two layers (one parameter: one owner, its gradient the sum of both uses)."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(20, 48), nn.Linear(48, 48), nn.Linear(48, 48)
        self.third.weight = self.second.weight
        self.out = nn.Linear(48, 5)

    def forward(self, x):
        h = F.relu(self.first(x))
        return self.out(F.relu(self.third(F.relu(self.second(h)))))


def load(script):
    sys.path.insert(0, os.path.dirname(script))  # where the script finds the modules it imports
    spec = importlib.util.spec_from_file_location("sharding_by_hand", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def set_up(rank, world_size, script):
    """This rank joins the group, on one thread: (the script as a module, STEPS global batches of
    20 features and 5 classes, the same on every rank, and this rank's slice of each)."""
    by_hand = load(script)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(STEPS, GLOBAL_BATCH, 20, generator=generator)
    y = torch.randint(0, 5, (STEPS, GLOBAL_BATCH), generator=generator)
    per_rank = GLOBAL_BATCH // world_size
    return by_hand, x, y, slice(rank * per_rank, (rank + 1) * per_rank)


def start(worker, default_port):
    """Run worker(rank, world_size, script, out) on the ranks the command line asks for."""
    world_size, script, out = int(sys.argv[1]), *sys.argv[2:]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ.get("HARNESS_PORT", default_port)
    mp.start_processes(worker, args=(world_size, script, out), nprocs=world_size,
                       start_method="fork")  # no thread has started here: fork is safe


def worker(rank, world_size, script, out):
    by_hand, x, y, mine = set_up(rank, world_size, script)

    class NoBroadcast(by_hand.ShardedOptimizer):  # the control: each rank updates its share only
        @torch.no_grad()
        def step(self):
            self.optimizer.step()

    results = {}
    for name, given in CASES:
        optimizer_class, options = by_hand.OPTIMIZERS[name]
        options = {"lr": 0.01, **options}

        def params(model):
            return (by_hand.parameter_groups(model, weight_decay=0.1) if given == "groups"
                    else list(model.parameters()))

        torch.manual_seed(0)
        one = Tied()  # one process, the unsharded optimizer, the whole global batch
        reference = optimizer_class(params(one), **options)
        for step in range(STEPS):
            reference.zero_grad()
            F.cross_entropy(one(x[step]), y[step]).backward()
            reference.step()
        case = {"one": weights(one), "unsharded_state": by_hand.optimizer_state_bytes(reference)}
        for kind in ("sharded", "control", "torch"):
            torch.manual_seed(0)
            model = Tied()
            ddp = DDP(model)
            if kind == "torch":
                optimizer = ZeroRedundancyOptimizer(params(model), optimizer_class=optimizer_class, **options)
            else:
                optimizer = (by_hand.ShardedOptimizer if kind == "sharded" else NoBroadcast)(
                    params(model), optimizer_class, **options)
            for step in range(STEPS):
                optimizer.zero_grad()
                F.cross_entropy(ddp(x[step, mine]), y[step, mine]).backward()
                optimizer.step()
            case[kind] = weights(model)
            names = {id(p): n for n, p in model.named_parameters()}
            if kind == "torch":  # torch's dealing: for each rank, its share of each group
                shares = optimizer._partition_parameters()
                case["torch_owners"] = {names[id(p)]: r for r, groups in enumerate(shares)
                                        for group in groups for p in group["params"]}
            elif kind == "sharded":
                case["owners"] = {names[id(p)]: r for p, r in optimizer.owner.items()}
            state = [0] * world_size
            dist.all_gather_object(state, by_hand.optimizer_state_bytes(optimizer))
            case[f"{kind}_state"] = state
            every = [None] * world_size  # every rank's weights: the same after each broadcast
            dist.all_gather_object(every, case[kind])
            case[f"{kind}_ranks_equal"] = all(torch.equal(w[k], every[0][k]) for w in every for k in w)
        results[(name, given)] = case
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    start(worker, "29512")
