"""DDP is data parallelism: N processes with batch B take exactly the steps that one process takes
with batch N*B, when both see the same samples (--no-shuffle) and nothing is random (linear model)."""
import pytest
import torch
from conftest import run_script, script_env

STEPS = 25


def train_and_load(tmp_path, name, script, *args, data_args, env=None):
    path = tmp_path / f"{name}.pt"
    r = run_script(script, "--model", "linear", "--no-shuffle", "--max-steps", STEPS,
                   "--save", path, "--quiet", *args, *data_args, env=env)
    assert r.returncode == 0, r.stderr
    return torch.load(path)


def max_abs_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("script, world_size, start_method", [
    ("mnist_ddp_cpu.py", 2, None), ("mnist_ddp_cpu.py", 3, None),
    ("mnist_ddp_cpu.py", 2, "spawn"),  # what the scripts use where fork is not safe
    ("mnist_ddp_gpu.py", 2, None),  # its CPU fallback; tests/test_gpu_script.py covers GPUs
])
def test_ddp_matches_one_process_on_the_same_global_batch(tmp_path, data_args, script, world_size,
                                                          start_method):
    batch = 40
    single = train_and_load(tmp_path, "single", "mnist_single.py", "--batch-size", world_size * batch,
                            data_args=data_args)
    cpu = ["--backend", "gloo", "--device", "cpu"] if script == "mnist_ddp_gpu.py" else []
    env = script_env(DDP_START_METHOD=start_method) if start_method else None
    ddp = train_and_load(tmp_path, "ddp", script, *cpu, "--nprocs", world_size,
                         "--batch-size", batch, data_args=data_args, env=env)
    assert max_abs_diff(single, ddp) < 1e-5

    # The comparison can fail: one process with the per-rank batch takes different steps ...
    small = train_and_load(tmp_path, "small", "mnist_single.py", "--batch-size", batch,
                           data_args=data_args)
    assert max_abs_diff(single, small) > 1e-3
    # ... and training moved the weights far from where they started.
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10)).state_dict()
    assert max_abs_diff(single, initial) > 1e-2


def test_gradients_averaged_by_hand_end_with_ddps_weights(tmp_path, data_args):
    """mnist_by_hand.py: a plain model, rank 0's weights broadcast, each gradient all-reduced and
    divided by the number of ranks. It takes DDP's steps, and one process's on the global batch."""
    world_size, batch = 2, 40
    common = ["--nprocs", world_size, "--batch-size", batch]
    ddp = train_and_load(tmp_path, "ddp", "mnist_ddp_cpu.py", *common, data_args=data_args)
    by_hand = train_and_load(tmp_path, "by-hand", "mnist_by_hand.py", *common, data_args=data_args)
    single = train_and_load(tmp_path, "single", "mnist_single.py", "--batch-size", world_size * batch,
                            data_args=data_args)
    assert max_abs_diff(ddp, by_hand) < 1e-6
    assert max_abs_diff(single, by_hand) < 1e-5
    # The control: one process with one rank's batch takes other steps, so the comparison can fail.
    alone = train_and_load(tmp_path, "alone", "mnist_single.py", "--batch-size", batch, data_args=data_args)
    assert max_abs_diff(alone, by_hand) > 1e-3
