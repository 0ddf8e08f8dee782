"""Lesson 6: gradient accumulation with no_sync() and compressed all-reduces change how often and in
what precision the ranks communicate, not what they compute (or only by rounding)."""
import pytest
from conftest import DATA_DIR, GPUS, load_script, needs_gpu, read_metrics, run_script
from test_bad_input import refused
from test_equivalence import max_abs_diff, train_and_load  # linear, --no-shuffle, 25 steps

CPU = ["--backend", "gloo", "--device", "cpu"]


def test_accumulated_ddp_matches_one_process_on_the_same_global_batch(tmp_path, data_args):
    # 2 ranks x 2 micro-batches of 16 per optimizer step = one process with batches of 64.
    single = train_and_load(tmp_path, "single", "mnist_single.py", "--batch-size", 64,
                            data_args=data_args)
    accumulated = train_and_load(tmp_path, "accumulated", "mnist_ddp_comm.py", *CPU, "--nprocs", 2,
                                 "--batch-size", 16, "--accum-steps", 2, data_args=data_args)
    assert max_abs_diff(single, accumulated) < 1e-5
    # The control differs: without accumulation, 2 x 16 is another global batch.
    plain = train_and_load(tmp_path, "plain", "mnist_ddp_comm.py", *CPU, "--nprocs", 2,
                           "--batch-size", 16, data_args=data_args)
    assert max_abs_diff(single, plain) > 1e-3


def test_a_compression_hook_rounds_the_gradients_and_nothing_else(tmp_path, data_args):
    exact = train_and_load(tmp_path, "exact", "mnist_ddp_comm.py", *CPU, "--nprocs", 2,
                           data_args=data_args)
    # 25 steps apart by rounding only (measured here: fp16 2e-5, bf16 2e-4: bf16 keeps 8 bits of
    # mantissa, fp16 11); 0 would mean that the hook never ran.
    for hook, bound in [("fp16", 1e-4), ("bf16", 1e-3)]:
        compressed = train_and_load(tmp_path, hook, "mnist_ddp_comm.py", *CPU, "--nprocs", 2,
                                    "--comm-hook", hook, data_args=data_args)
        assert 0 < max_abs_diff(exact, compressed) < bound, hook


@pytest.mark.parametrize("accum_steps, micro_batches", [(1, 12), (4, 12), (5, 12)])
def test_gradients_are_all_reduced_once_per_optimizer_step(monkeypatch, dataset, accum_steps, micro_batches):
    """Counts DDP's all-reduces with a hook (the linear model's gradients fill one bucket), in one
    process: no_sync() must skip all but the last micro-batch of each group."""
    comm = load_script("mnist_ddp_comm")
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return comm.default_hooks.allreduce_hook(state, bucket)

    monkeypatch.setattr(comm.default_hooks, "fp16_compress_hook", counting_hook)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(comm.free_port()))
    monkeypatch.delenv("RANK", raising=False)
    args = comm.parse_args(["--model", "linear", "--dataset", dataset, "--data-dir", str(DATA_DIR),
                            "--batch-size", "5000", "--nprocs", "1", "--quiet", "--comm-hook", "fp16",
                            "--accum-steps", str(accum_steps), *CPU])
    comm.worker(0, 1, args)
    # 60,000 images in micro-batches of 5,000: 12 a pass; groups of 5 are 5, 5 and a last of 2.
    assert micro_batches == 60_000 // 5000
    assert len(calls) == -(-micro_batches // accum_steps)
    assert set(calls) == {28 * 28 * 10 + 10}  # one bucket: every gradient, each time


@pytest.mark.parametrize("flags, later_steps", [([], [4216842, 1607680]),
                                               (["--bucket-cap-mb", "25"], [5824522])],
                         ids=["default", "25 MB"])
def test_without_the_flag_ddp_keeps_its_own_buckets(monkeypatch, dataset, flags, later_steps):
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
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(comm.free_port()))
    monkeypatch.delenv("RANK", raising=False)
    args = comm.parse_args(["--model", "mlp", "--dataset", dataset, "--data-dir", str(DATA_DIR),
                            "--batch-size", "16", "--max-steps", "3", "--nprocs", "1", "--quiet",
                            "--comm-hook", "fp16", *flags, *CPU])
    comm.worker(0, 1, args)
    everything = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert sizes == [everything] + later_steps * 2


def test_the_wide_model_learns_with_accumulation_and_bf16_gradients(tmp_path, data_args):
    metrics = tmp_path / "metrics.json"
    r = run_script("mnist_ddp_comm.py", *CPU, "--nprocs", 2, "--model", "mlp", "--accum-steps", 2,
                   "--comm-hook", "bf16", "--max-steps", 40, "--metrics-json", metrics, *data_args)
    assert r.returncode == 0, r.stderr
    m = read_metrics(metrics)
    epoch = m["epochs"][-1]
    assert epoch["steps"] == 40 and epoch["test_accuracy"] > 0.6  # chance: 0.1
    parameters = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert m["gradient_mb"] == pytest.approx(parameters * 2 / 1e6)  # bf16: 2 bytes each
    assert m["allreduce_ms"] > 0 and (m["accum_steps"], m["comm_hook"]) == (2, "bf16")
    assert "one all-reduce of that size alone" in r.stdout


@pytest.mark.parametrize("args, expected", [
    (["--accum-steps", "0"], "--accum-steps"),
    (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
    (["--comm-hook", "int8"], "invalid choice"),
])
def test_bad_values_of_the_new_flags(args, expected):
    assert expected in refused("mnist_ddp_comm.py", *CPU, *args)


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
