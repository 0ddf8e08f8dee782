"""Run in spawned processes by tests/e2e/test_by_hand.py: every synchronisation of
mnist_by_hand.py, real DDP and an unsynchronised control, each from the same start on the same
batches, for two models (the ConvNet, with dropout; and a net with a parameter shared by two
layers and a frozen one). Rank 0 saves {(sync, model): state_dict}. HARNESS_DEVICE=cuda: the same
on CUDA tensors with NCCL, one GPU per rank (the classes' buffers must follow the gradients)."""
import importlib.util
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, BATCH = 8, 16


class SharedAndFrozen(nn.Module):
    """A parameter shared by two layers (its gradient the sum of both uses) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(28 * 28, 32), nn.Linear(32, 32)
        self.third = nn.Linear(32, 32)
        self.third.weight = self.second.weight  # shared: one parameter, two layers
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        h = F.relu(self.first(x.flatten(1)))
        h = F.relu(self.third(F.relu(self.second(h))))
        return self.out(self.frozen(h))


def worker(rank, world_size, script, dataset, data_dir, out, cuda):
    sys.path.insert(0, os.path.dirname(script))  # where the script finds the modules it imports
    spec = importlib.util.spec_from_file_location("mnist_by_hand", script)
    by_hand = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(by_hand)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    images, labels = by_hand.load_split(dataset, data_dir, train=True)
    images, labels = images.to(device), labels.to(device)
    results = {}
    for model_name in ("convnet", "shared"):
        for sync in ("ddp", *by_hand.SYNC, "none"):
            torch.manual_seed(0)
            model = by_hand.build_model("convnet") if model_name == "convnet" else SharedAndFrozen()
            model = model.to(device)
            if sync == "ddp":
                step_model, finish = DDP(model, device_ids=[rank] if cuda else None), (lambda: None)
            elif sync == "none":  # the control: each rank trains on its own batches
                step_model, finish = model, (lambda: None)
            else:
                made = (by_hand.Bucketed(model, bucket_mb=0.01) if sync == "bucketed"
                        else by_hand.SYNC[sync](model))
                step_model, finish = model, made.finish_gradient_synchronization
            torch.manual_seed(1 + rank)  # dropout differs per rank
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            for step in range(STEPS):
                start = (step * world_size + rank) * BATCH  # the global batch, cut by rank
                x, y = images[start:start + BATCH], labels[start:start + BATCH]
                optimizer.zero_grad()
                F.cross_entropy(step_model(x), y).backward()
                finish()
                optimizer.step()
            results[(sync, model_name)] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, script, dataset, data_dir, out = int(sys.argv[1]), *sys.argv[2:]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ.get("HARNESS_PORT", "29511")
    cuda = os.environ.get("HARNESS_DEVICE") == "cuda"
    mp.start_processes(worker, args=(world_size, script, dataset, data_dir, out, cuda), nprocs=world_size,
                       start_method="spawn" if cuda else "fork")  # no thread has started here: fork is safe
