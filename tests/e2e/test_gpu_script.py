"""Lesson 3's script: its CPU fallback runs end to end here; on a machine with GPUs it trains with
NCCL (skipped, with the reason, elsewhere). Its refusals and checks: tests/unit/test_gpu_checks.py."""
import pytest
from helpers import GPUS, needs_gpu, read_metrics, run_script, torchrun

CPU = ["--backend", "gloo", "--device", "cpu"]


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_cpu_fallback_trains_with_two_processes(tmp_path, data_args, dataset, amp):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_gpu.py", *CPU, "--nprocs", 2, "--amp", amp, "--max-steps", 40,
                   "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("2 processes on CPU (gloo") == 1  # the header line says where, once
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["device"], metrics["backend"], metrics["amp"]) == \
        (2, "cpu", "gloo", amp)
    (epoch,) = metrics["epochs"]
    assert epoch["steps"] == 40 and epoch["test_accuracy"] > 0.4


def test_cpu_fallback_under_torchrun(tmp_path, data_args):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_gpu.py", *CPU, "--model", "linear", "--max-steps", 10,
                   "--metrics-json", out, *data_args,
                   launcher=torchrun(2))
    assert r.returncode == 0, r.stderr
    assert read_metrics(out)["world_size"] == 2


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


