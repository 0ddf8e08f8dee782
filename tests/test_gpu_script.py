"""Lesson 3's script: its CPU fallback runs end to end here; its refusals come before any process
starts; on a machine with GPUs it trains with NCCL (skipped, with the reason, elsewhere)."""
import time

import pytest
from conftest import (
    GPUS,
    load_script,
    needs_gpu,
    read_metrics,
    refused_before_spawn,
    run_script,
    script_env,
    torchrun,
)

CPU = ["--backend", "gloo", "--device", "cpu"]


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_cpu_fallback_trains_with_two_processes(tmp_path, data_args, dataset, amp):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_gpu.py", *CPU, "--nprocs", 2, "--amp", amp, "--max-steps", 60,
                   "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("2 processes on CPU (gloo") == 1  # the header line says where, once
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["device"], metrics["backend"], metrics["amp"]) == \
        (2, "cpu", "gloo", amp)
    (epoch,) = metrics["epochs"]
    assert epoch["steps"] == 60 and epoch["test_accuracy"] > 0.4


def test_cpu_fallback_under_torchrun(tmp_path, data_args):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_gpu.py", *CPU, "--model", "linear", "--max-steps", 10,
                   "--metrics-json", out, *data_args,
                   launcher=torchrun(2))
    assert r.returncode == 0, r.stderr
    assert read_metrics(out)["world_size"] == 2


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
    (["--device", "cpu", "--amp", "fp16"], "--amp fp16 needs a GPU"),
])
def test_refusals_from_the_command_line(args, expected):
    start = time.monotonic()
    r = run_script("mnist_ddp_gpu.py", *args, env=script_env(CUDA_VISIBLE_DEVICES=""), timeout=60)
    assert time.monotonic() - start < 30
    assert r.returncode != 0 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert expected in line


@needs_gpu
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_nccl_on_gpus(tmp_path, data_args, amp):
    world = min(2, GPUS)
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_gpu.py", "--nprocs", world, "--amp", amp, "--max-steps", 200,
                   "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["backend"]) == (world, "nccl")
    assert metrics["epochs"][-1]["test_accuracy"] > 0.6


@pytest.mark.parametrize("script", ["mnist_ddp_gpu", "mnist_ddp_resume", "mnist_ddp_comm", "gcn_ddp"])
@pytest.mark.parametrize("local_rank", [None, "1"], ids=["launcher", "torchrun-local-rank-1"])
def test_the_gpu_checks_ask_about_this_processs_gpu_by_index(monkeypatch, script, local_rank):
    """With CUDA faked: the checks that run before set_device() name the GPU they ask about (the
    launcher: GPU 0; under torchrun: the rank's LOCAL_RANK). Asked with no index, CUDA would start on
    the current device, GPU 0, in every rank of the machine."""
    if script == "gcn_ddp":
        pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
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
    module.check_setup(args, rank=int(local_rank or 0))
    assert asked == [("capability", int(local_rank or 0))]
