"""Lesson 6, in-process (one rank, Gloo): DDP's all-reduces counted with a communication hook put
in the fp16 hook's place. no_sync() skips all but the last micro-batch of each group, and DDP's
buckets are what torch 2.14.1 makes of them."""
import pytest
from helpers import launching, load_script

CPU = ["--backend", "gloo", "--device", "cpu"]


@pytest.mark.parametrize("accum_steps, micro_batches", [(1, 12), (4, 12), (5, 12)])
def test_gradients_are_all_reduced_once_per_optimizer_step(monkeypatch, in_process_rank, data_args,
                                                           accum_steps, micro_batches):
    """Counts DDP's all-reduces with a hook (the linear model's gradients fill one bucket), in one
    process: no_sync() must skip all but the last micro-batch of each group."""
    comm = load_script("mnist_ddp_comm")
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return comm.default_hooks.allreduce_hook(state, bucket)

    monkeypatch.setattr(comm.default_hooks, "fp16_compress_hook", counting_hook)
    args = comm.parse_args(["--model", "linear", *map(str, data_args), "--batch-size", "500",
                            "--nprocs", "1", "--quiet", "--comm-hook", "fp16",
                            "--accum-steps", str(accum_steps), *CPU])
    launching(comm)[0](0, 1, args)  # lesson 3's worker, running comm's train
    # 6,000 images in micro-batches of 500: 12 a pass; groups of 5 are 5, 5 and a last of 2.
    assert micro_batches == 6000 // 500
    assert len(calls) == -(-micro_batches // accum_steps)
    assert set(calls) == {28 * 28 * 10 + 10}  # one bucket: every gradient, each time


@pytest.mark.parametrize("flags, later_steps", [([], [4216842, 1607680]),
                                               (["--bucket-cap-mb", "25"], [5824522])],
                         ids=["default", "25 MB"])
def test_without_the_flag_ddp_keeps_its_own_buckets(monkeypatch, in_process_rank, data_args, flags,
                                                    later_steps):
    """What torch 2.14.1's DDP does with the MLP's 5.8 million gradients: the first step sends them in
    one bucket; then DDP rebuilds its buckets in the order backward produced the gradients. By
    default (bucket_cap_mb=None) the first bucket closes once it holds 1 MiB (layer 3, then layer 2:
    16.9 MB), the rest (layer 1) follows; with bucket_cap_mb=25 the first bucket may hold 25 MB, and
    all of them fit in one. So passing 25, "the default", is not DDP's default."""
    comm = load_script("mnist_ddp_comm")
    sizes = []

    def counting_hook(state, bucket):
        sizes.append(bucket.buffer().numel())
        return comm.default_hooks.allreduce_hook(state, bucket)

    monkeypatch.setattr(comm.default_hooks, "fp16_compress_hook", counting_hook)
    args = comm.parse_args(["--model", "mlp", *map(str, data_args), "--batch-size", "16", "--max-steps", "3",
                            "--nprocs", "1", "--quiet",
                            "--comm-hook", "fp16", *flags, *CPU])
    launching(comm)[0](0, 1, args)  # lesson 3's worker, running comm's train
    everything = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert sizes == [everything] + later_steps * 2


@pytest.mark.parametrize("model_name", ["mlp", "convnet", "1 MiB last"])
@pytest.mark.parametrize("bucket_mb", [None, 0.05, 1, 4, 8, 25])
def test_bucketed_by_hand_makes_ddps_buckets(one_rank_group, model_name, bucket_mb):
    """Lesson 9's `--sync bucketed` says it makes DDP's buckets: the same tensors in the same
    buckets as torch 2.14.1's DDP, with DDP's default sizes (bucket_cap_mb=None: the first bucket
    closes at 1 MiB) and with the sizes of lesson 9's sweep and exercise 2, and a few more. DDP's
    buckets are the ones it rebuilds after its first step, read by a hook; both are compared as
    lists of sizes, in order.
    "1 MiB last" ends in a weight of exactly 1 MiB: a bucket that reaches its cap is closed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    by_hand = load_script("mnist_by_hand")

    def build():
        torch.manual_seed(0)
        if model_name == "1 MiB last":
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                       torch.nn.Linear(512, 512, bias=False))  # 512 classes: 10 used
        return by_hand.build_model(model_name)

    model = build()
    made = by_hand.Bucketed(model, bucket_mb)
    by_hand_sizes = [sum(p.numel() for p in bucket) for bucket in made.buckets]

    ddp = DDP(build(), bucket_cap_mb=bucket_mb)
    seen = []

    def recording_hook(state, bucket):
        seen.append(bucket.buffer().numel())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, recording_hook)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    for _ in range(2):  # the first step sends one bucket; DDP rebuilds its buckets after it
        seen.clear()
        F.cross_entropy(ddp(x), y).backward()
    assert seen == by_hand_sizes
    assert sum(by_hand_sizes) == sum(p.numel() for p in model.parameters())
