"""Lesson 6, in-process (one rank, Gloo): DDP's all-reduces counted with a communication hook put
in the fp16 hook's place. no_sync() skips all but the last micro-batch of each group, and DDP's
buckets are what torch 2.14.1 makes of them."""
import pytest
from helpers import load_script

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
    comm.worker(0, 1, args)
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
    comm.worker(0, 1, args)
    everything = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert sizes == [everything] + later_steps * 2
