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
