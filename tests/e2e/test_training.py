"""Lessons 1-3 end to end: the scripts train, write their metrics, and the loss falls; and DDP is
data parallelism: N processes with batch B take exactly the steps that one process takes with
batch N*B, when both see the same samples (--no-shuffle) and nothing is random (linear model)."""
import math

import pytest
import torch
from helpers import max_abs_diff, read_metrics, run_script, torchrun

CHANCE_LOSS = math.log(10)  # cross-entropy of a uniform guess over 10 classes
EPOCH_KEYS = {"epoch", "train_loss", "test_accuracy", "seconds", "images_per_second"}
TRAIN_IMAGES = 6000  # the data_args fixture's training set


def check_metrics(metrics, world_size, model, dataset, steps):
    assert metrics["world_size"] == world_size
    assert metrics["model"] == model
    assert metrics["dataset"] == dataset
    epochs = metrics["epochs"]
    assert epochs and all(EPOCH_KEYS <= set(e) for e in epochs)
    assert epochs[-1]["steps"] == steps
    assert all(e["seconds"] > 0 and e["images_per_second"] > 0 for e in epochs)
    return epochs


def test_single_process_convnet_learns(tmp_path, data_args, dataset):
    out = tmp_path / "new" / "deeper" / "m.json"  # missing folders are created
    r = run_script("mnist_single.py", "--model", "convnet", "--max-steps", 90,
                   "--threads-per-proc", 1, "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout and "images/s" in r.stdout
    (epoch,) = check_metrics(read_metrics(out), 1, "convnet", dataset, 90)
    assert epoch["train_loss"] < 0.8 * CHANCE_LOSS
    assert epoch["test_accuracy"] > 0.5  # chance is 0.1


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_cpu_trains_and_reports_from_rank0(tmp_path, data_args, dataset, world_size):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_cpu.py", "--nprocs", world_size, "--model", "convnet",
                   "--max-steps", 60, "--batch-size", 32, "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    # rank 0 alone prints: one header, one epoch line, one summary
    assert r.stdout.count("done:") == 1 and r.stdout.count("epoch 1:") == 1
    assert f"{world_size} processes" in r.stdout
    (epoch,) = check_metrics(read_metrics(out), world_size, "convnet", dataset, 60)
    assert epoch["train_loss"] < 0.9 * CHANCE_LOSS
    assert epoch["test_accuracy"] > 0.4


def test_loss_falls_from_epoch_to_epoch(tmp_path, data_args, dataset):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_cpu.py", "--nprocs", 2, "--model", "linear", "--epochs", 3,
                   "--batch-size", 50, "--lr", 0.005, "--metrics-json", out, *data_args)
    assert r.returncode == 0, r.stderr
    epochs = check_metrics(read_metrics(out), 2, "linear", dataset, 3 * TRAIN_IMAGES // 100)
    losses = [e["train_loss"] for e in epochs]
    assert losses[0] > losses[1] > losses[2], losses


def test_three_ranks_with_a_batch_size_that_does_not_divide_the_data(tmp_path, data_args):
    # 6000 images / 3 ranks / batch 997 leaves a short last batch: every rank must still run
    # the same number of steps, or the last all-reduce waits forever.
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_cpu.py", "--nprocs", 3, "--model", "linear", "--batch-size", 997,
                   "--timeout", 60, "--metrics-json", out, *data_args, timeout=180)
    assert r.returncode == 0, r.stderr
    (epoch,) = read_metrics(out)["epochs"]
    assert epoch["steps"] == math.ceil(TRAIN_IMAGES / 3 / 997)


def test_torchrun_launch(tmp_path, data_args, dataset):
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_cpu.py", "--model", "linear", "--max-steps", 20,
                   "--metrics-json", out, *data_args, launcher=torchrun(2))
    assert r.returncode == 0, r.stderr
    (epoch,) = check_metrics(read_metrics(out), 2, "linear", dataset, 20)
    assert epoch["test_accuracy"] > 0.4


def test_save_writes_plain_state_dict_keys_and_quiet_prints_only_the_summary(tmp_path, data_args):
    path = tmp_path / "new" / "deeper" / "model.pt"  # missing folders are created
    r = run_script("mnist_ddp_cpu.py", "--nprocs", 2, "--model", "convnet", "--max-steps", 3,
                   "--save", path, "--quiet", *data_args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("done:") and r.stdout.count("\n") == 1
    state = torch.load(path)
    assert state and not any(k.startswith("module.") for k in state)
    assert set(state) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_older_launchers_that_pass_local_rank_work(tmp_path, data_args):
    """torch.distributed.launch (and DeepSpeed's launcher) pass --local-rank to the script; the
    scripts accept it and read LOCAL_RANK from the environment, as torchrun sets it."""
    out = tmp_path / "m.json"
    r = run_script("mnist_ddp_cpu.py", "--model", "linear", "--max-steps", 3, "--metrics-json", out,
                   *data_args, launcher=["-m", "torch.distributed.launch", "--nproc-per-node", "2"])
    assert r.returncode == 0, r.stderr
    assert read_metrics(out)["world_size"] == 2


@pytest.mark.parametrize("script, world_size, start_method", [
    ("mnist_ddp_cpu.py", 2, None), ("mnist_ddp_cpu.py", 3, None),
    ("mnist_ddp_cpu.py", 2, "spawn"),  # what the scripts use where fork is not safe
    ("mnist_ddp_gpu.py", 2, None),  # its CPU fallback; tests/e2e/test_gpu_script.py covers GPUs
])
def test_ddp_matches_one_process_on_the_same_global_batch(trained, script, world_size, start_method):
    batch = 32
    single = trained("mnist_single.py", "--batch-size", world_size * batch)
    cpu = ["--backend", "gloo", "--device", "cpu"] if script == "mnist_ddp_gpu.py" else []
    env = {"DDP_START_METHOD": start_method} if start_method else None
    ddp = trained(script, *cpu, "--nprocs", world_size, "--batch-size", batch, env=env)
    assert max_abs_diff(single, ddp) < 1e-5

    # The comparison can fail: one process with the per-rank batch takes different steps ...
    small = trained("mnist_single.py", "--batch-size", batch)
    assert max_abs_diff(single, small) > 1e-3
    # ... and training moved the weights far from where they started.
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10)).state_dict()
    assert max_abs_diff(single, initial) > 1e-2
