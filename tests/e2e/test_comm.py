"""Lesson 6: gradient accumulation with no_sync() and compressed all-reduces change how often and in
what precision the ranks communicate, not what they compute (or only by rounding)."""
import pytest
from helpers import GPUS, max_abs_diff, needs_gpu, read_metrics, run_script

CPU = ["--backend", "gloo", "--device", "cpu"]


def test_accumulated_ddp_matches_one_process_on_the_same_global_batch(trained):
    # 2 ranks x 2 micro-batches of 16 per optimizer step = one process with batches of 64.
    single = trained("mnist_single.py", "--batch-size", 64)
    accumulated = trained("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--batch-size", 16, "--accum-steps", 2)
    assert max_abs_diff(single, accumulated) < 1e-5
    # The control differs: without accumulation, 2 x 16 is another global batch.
    plain = trained("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--batch-size", 16)
    assert max_abs_diff(single, plain) > 1e-3


def test_a_compression_hook_rounds_the_gradients_and_nothing_else(trained):
    exact = trained("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--batch-size", 16)
    # 25 steps apart by rounding only (measured: fp16 about 2e-5, bf16 2e-4: bf16 keeps 8 bits of
    # mantissa, fp16 11); 0 would mean that the hook never ran.
    for hook, bound in [("fp16", 1e-4), ("bf16", 1e-3)]:
        compressed = trained("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--batch-size", 16,
                             "--comm-hook", hook)
        assert 0 < max_abs_diff(exact, compressed) < bound, hook


def test_the_wide_model_learns_with_accumulation_and_bf16_gradients(tmp_path, data_args):
    metrics = tmp_path / "metrics.json"
    r = run_script("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--model", "mlp", "--accum-steps", 2,
                   "--comm-hook", "bf16", "--epochs", 2, "--max-steps", 40, "--metrics-json", metrics,
                   *data_args)
    assert r.returncode == 0, r.stderr
    m = read_metrics(metrics)
    epoch = m["epochs"][-1]
    assert epoch["steps"] == 40 and epoch["test_accuracy"] > 0.6  # chance: 0.1
    parameters = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert m["gradient_mb"] == pytest.approx(parameters * 2 / 1e6)  # bf16: 2 bytes each
    assert m["allreduce_ms"] > 0 and (m["accum_steps"], m["comm_hook"]) == (2, "bf16")
    assert "one all-reduce of that size alone" in r.stdout


@needs_gpu
@pytest.mark.parametrize("hook", ["none", "bf16"])
def test_on_gpus_with_nccl(tmp_path, data_args, hook):
    world = min(2, GPUS)
    metrics = tmp_path / "metrics.json"
    r = run_script("mnist_ddp_comm.py", "--nprocs", world, "--model", "mlp", "--accum-steps", 2,
                   "--comm-hook", hook, "--max-steps", 60, "--metrics-json", metrics, *data_args)
    assert r.returncode == 0, r.stderr
    m = read_metrics(metrics)
    assert (m["world_size"], m["backend"]) == (world, "nccl")
    assert m["allreduce_ms"] > 0 and m["epochs"][-1]["test_accuracy"] > 0.6
