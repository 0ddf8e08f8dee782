"""Lesson 3's checks, before any process starts or any GPU is touched, with CUDA faked where no GPU
is present: more processes than GPUs, no NCCL, bf16 on a GPU without it, a rank whose GPU index is
past the GPUs; the GPU each check asks about (by index); and what a GPU step asks of the host (no
index tensor copied per step; on a GPU, the synchronisations per step counted)."""
import pytest
from helpers import launching, load_script, needs_gpu, needs_sampler, refused_before_spawn

CPU = ["--backend", "gloo", "--device", "cpu"]


def refused_in_process(monkeypatch, argv, gpus, nccl=True):
    gpu = load_script("mnist_ddp_gpu")
    monkeypatch.setattr(gpu.dist, "is_nccl_available", lambda: nccl)
    return refused_before_spawn(gpu, monkeypatch, argv, gpus)


def test_more_processes_than_gpus_is_refused(monkeypatch, tmp_path):
    message = refused_in_process(monkeypatch, ["--nprocs", "3", "--data-dir", str(tmp_path)], gpus=2)
    assert "3 processes but 2 visible GPU(s)" in message and "--nprocs 2" in message


def test_missing_nccl_is_refused(monkeypatch, tmp_path):
    message = refused_in_process(monkeypatch, ["--data-dir", str(tmp_path)], gpus=1, nccl=False)
    assert "no NCCL" in message


def test_default_nprocs_is_one_per_gpu(monkeypatch):
    gpu = load_script("mnist_ddp_gpu")
    monkeypatch.setattr(gpu.torch.cuda, "device_count", lambda: 3)
    assert gpu.parse_args([]).nprocs == 3
    assert gpu.parse_args(["--device", "cpu"]).nprocs == 2


@pytest.mark.parametrize("args, expected", [
    ([], "no CUDA device is visible"),
    (["--backend", "nccl", "--device", "cpu"], "NCCL needs CUDA tensors"),
    (["--device", "cpu", "--amp", "fp16"], "--amp fp16 is for GPUs"),
])
def test_refusals_from_the_command_line(monkeypatch, args, expected):
    assert expected in refused_in_process(monkeypatch, args, gpus=0)


@pytest.mark.parametrize("script", ["mnist_ddp_gpu", "mnist_ddp_resume", "mnist_ddp_comm", "gcn_ddp"])
@pytest.mark.parametrize("local_rank", [None, "1"], ids=["launcher", "torchrun-local-rank-1"])
def test_the_gpu_checks_ask_about_this_processs_gpu_by_index(monkeypatch, script, local_rank):
    """With CUDA faked: the checks that run before set_device() name the GPU they ask about (the
    launcher: GPU 0; under torchrun: the rank's LOCAL_RANK). Asked with no index, CUDA would start on
    the current device, GPU 0, in every rank of the machine."""
    if script == "gcn_ddp":
        needs_sampler()
    module = load_script(script)
    asked = []

    def capability(device=None):
        asked.append(("capability", device))
        return (9, 0)

    def name(device=None):
        asked.append(("name", device))
        return "a faked GPU"

    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(module.torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(module.torch.cuda, "get_device_name", name)
    monkeypatch.setattr(module.dist, "is_nccl_available", lambda: True)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = module.parse_args(["--amp", "bf16", "--nprocs", "2"])
    launching(module)[1](args, rank=int(local_rank or 0))  # its check_setup
    assert asked == [("capability", int(local_rank or 0))]


@pytest.mark.parametrize("script", ["mnist_ddp_gpu", "mnist_ddp_resume", "mnist_ddp_comm", "gcn_ddp",
                                    "mnist_fsdp", "template_ddp"])
@pytest.mark.parametrize("local_world_size", ["2", "1"], ids=["more-ranks-than-gpus", "rank-index-past-gpus"])
def test_bf16_with_a_rank_that_has_no_gpu_is_refused_not_crashed(monkeypatch, script, local_world_size):
    """LOCAL_RANK 1 on a machine with one visible GPU: the count (and the index) is checked before the
    GPU is asked for its capability, which for a missing index fails with an AssertionError traceback
    (and the other ranks would wait --timeout). Two ranks for one GPU are told to use fewer; a rank
    that sees fewer GPUs than its machine has (one GPU per task, as Slurm's --gpus-per-task gives)
    is told that every rank must see them all, not to use fewer processes."""
    if script == "gcn_ddp":
        needs_sampler()
    module = load_script(script)

    def capability(device=None):
        assert device < 1, "Invalid device id"  # what torch raises for an index it does not have
        return (9, 0)

    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(module.torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(module.dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    flags = ["--device", "cuda"] if script == "template_ddp" else ["--amp", "bf16"]  # template: no --amp
    args = module.parse_args(flags)
    with pytest.raises(module.hardening.UsageError) as refusal:
        launching(module)[1](args, rank=1)  # its check_setup
    if local_world_size == "2":
        assert "2 processes but 1 visible GPU(s)" in str(refusal.value) and "--nprocs 1" in str(refusal.value)
    else:
        assert "LOCAL_RANK=1, but this process sees 1 GPU(s)" in str(refusal.value)
        assert "--gpus-per-node" in str(refusal.value) and "--nprocs" not in str(refusal.value)


@pytest.mark.parametrize("script", ["mnist_ddp_gpu", "mnist_ddp_resume", "mnist_ddp_comm"])
def test_a_step_builds_no_index_tensor_from_the_host(monkeypatch, data_args, script):
    """The epoch's sample order goes to the device once, and each step slices it. A tensor built
    per step from a list of indices is a copy from host memory, which on a GPU waits for all the
    work queued before it: every step would wait for the previous one. Run in-process, one rank."""
    import torch

    module = load_script(script)
    extra = ["--snapshot", str(data_args[-1] / "snap.pt")] if script == "mnist_ddp_resume" else []
    args = module.parse_args([*CPU, "--nprocs", "1", "--model", "linear", "--batch-size", "16",
                              "--max-steps", "8", "--quiet", *extra, *map(str, data_args)])
    from_lists, tensor = [], torch.tensor

    def spy(data, *a, **k):
        if isinstance(data, list):
            from_lists.append(len(data))
        return tensor(data, *a, **k)

    monkeypatch.setattr(module.torch, "tensor", spy)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(module.hardening.free_port()))
    threads = torch.get_num_threads()
    try:
        launching(module)[0](0, 1, args)  # its worker
    finally:
        torch.set_num_threads(threads)
    assert len(from_lists) == 1 and from_lists[0] > 8 * 16, from_lists  # the epoch's order, once


@needs_gpu
@pytest.mark.parametrize("amp, per_step", [("off", 0), ("fp16", 1)])
def test_synchronisations_per_step_on_a_gpu(monkeypatch, data_args, amp, per_step):
    """Counted with CUDA's sync debug mode, which warns at every operation that waits for the GPU:
    a run of 12 steps against one of 4, in-process, one rank on GPU 0. With --amp off no step
    waits; fp16's gradient scaler reads back whether a gradient overflowed, once a step."""
    import warnings

    import torch

    module = load_script("mnist_ddp_gpu")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    counts = {}
    for steps in (4, 12):
        monkeypatch.setenv("MASTER_PORT", str(module.hardening.free_port()))
        args = module.parse_args(["--nprocs", "1", "--amp", amp, "--model", "linear", "--max-steps",
                                  str(steps), "--quiet", *map(str, data_args)])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.worker(0, 1, args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts[steps] = sum("synchronizing" in str(w.message) for w in caught)
    assert counts[12] - counts[4] == 8 * per_step, counts
