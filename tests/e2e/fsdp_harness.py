"""Run in forked processes by tests/e2e/test_sharding_by_hand.py: sharding_by_hand.py's ZeRO-3 by hand
(shard_model, ShardedLayer) and ZeRO-2 (ShardedGradients) against one process on the whole global
batch, in float32 and with bfloat16 as the compute dtype, with two controls: one that reduce-
scatters nothing (each rank steps its shard with its own gradient), one that keeps the gathered
parameters for backward. Layers of 47, 33 and 5 rows, which 2 and 3 ranks do not divide. Rank 0
saves {case: results}."""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharding_harness import STEPS, set_up, start  # noqa: E402  (the same set-up and batches)


def net():
    return nn.Sequential(nn.Linear(20, 47), nn.ReLU(), nn.Linear(47, 33), nn.ReLU(), nn.Linear(33, 5))


def one_process(by_hand, x, y, dtype, parts=1):
    """The unsharded model, float32 master weights, AdamW. Each step: for each of `parts` equal parts
    of the global batch, a copy in `dtype` computes that part's gradients, which are brought back to
    float32 and averaged (as gradient accumulation does; one part: the whole batch at once)."""
    torch.manual_seed(0)
    master = net()
    optimizer = torch.optim.AdamW(by_hand.parameter_groups(master, 0.1), lr=0.01)
    for step in range(STEPS):
        optimizer.zero_grad()
        for xs, ys in zip(x[step].chunk(parts), y[step].chunk(parts)):
            compute = copy.deepcopy(master).to(dtype)
            F.cross_entropy(compute(xs.to(dtype)).float(), ys).backward()
            for p, q in zip(master.parameters(), compute.parameters()):
                p.grad = q.grad.float() / parts + (p.grad if p.grad is not None else 0)
        optimizer.step()
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


def worker(rank, world_size, script, out):
    by_hand, x, y, mine = set_up(rank, world_size, script)

    class NoReduceScatter(by_hand.ShardedLayer):  # control: each rank's own gradient, its rows
        def reduce_scatter(self, i, grad):
            rows = len(self.shard(i))
            grad = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, rows * self.world_size - len(grad)])
            return grad[rank * rows:(rank + 1) * rows].to(self.shard(i).dtype)

    class KeepsWhole(by_hand.ShardedLayer):  # control: autograd keeps the gathered parameters
        def note(self, tensor):
            return tensor

    results = {}
    for case, dtype, layer_class in [("float32", None, by_hand.ShardedLayer),
                                     ("bfloat16", torch.bfloat16, by_hand.ShardedLayer),
                                     ("no_reduce_scatter", None, NoReduceScatter),
                                     ("keeps_whole", None, KeepsWhole)]:
        by_hand.MEMORY = by_hand.Memory()  # each case counts its own
        by_hand.ShardedLayer, saved_class = layer_class, by_hand.ShardedLayer
        torch.manual_seed(0)
        model = by_hand.shard_model(net(), dtype)
        by_hand.ShardedLayer = saved_class
        optimizer = torch.optim.AdamW(by_hand.parameter_groups(model, 0.1), lr=0.01)
        layers = [m for m in model.modules() if isinstance(m, by_hand.ShardedLayer)]
        for step in range(STEPS):
            for layer in layers:
                layer.sent.clear()
            optimizer.zero_grad()
            F.cross_entropy(model(x[step, mine]).float(), y[step, mine]).backward()
            optimizer.step()
        held = {"parameters": sum(p.nbytes for p in model.parameters()),
                "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
                "optimizer_state": by_hand.optimizer_state_bytes(optimizer),
                "gathered_peak": by_hand.MEMORY.peak_gathered, "gradient_peak": by_hand.MEMORY.peak_gradient}
        every = [None] * world_size
        dist.all_gather_object(every, held)
        results[case] = {"weights": by_hand.full_state_dict(model), "held": every,
                         "sent": [call for layer in layers for call in layer.sent]}
    # ZeRO-2: the parameters whole, the gradients and AdamW's state in rows
    by_hand.MEMORY = by_hand.Memory()
    torch.manual_seed(0)
    model = net()
    optimizer = by_hand.ShardedGradients(by_hand.parameter_groups(model, 0.1), torch.optim.AdamW, lr=0.01)
    for step in range(STEPS):
        optimizer.sent.clear()
        optimizer.zero_grad()
        F.cross_entropy(model(x[step, mine]), y[step, mine]).backward()
        assert all(p.grad is None for p in model.parameters())  # each whole gradient freed in backward
        optimizer.step()
    held = {"gradients": sum(t.grad.nbytes for t in optimizer.rows.values()),
            "rows": sum(t.nbytes for t in optimizer.rows.values()),
            "optimizer_state": by_hand.optimizer_state_bytes(optimizer)}
    every = [None] * world_size
    dist.all_gather_object(every, held)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    alike = [None] * world_size
    dist.all_gather_object(alike, weights)
    results["zero2"] = {"weights": weights, "held": every, "sent": list(optimizer.sent),
                        "ranks_equal": all(torch.equal(w[k], weights[k]) for w in alike for k in w)}
    results["one_float32"] = one_process(by_hand, x, y, torch.float32)
    results["one_bfloat16"] = one_process(by_hand, x, y, torch.bfloat16)
    results["one_bfloat16_in_parts"] = one_process(by_hand, x, y, torch.bfloat16, parts=world_size)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    start(worker, "29513")
