"""Lesson 12: where DDP meets the rest of PyTorch. Each cure ends with the weights of one process
on the same global batch (computed here, in this process, with plain PyTorch), each failure with
the error the pinned torch prints, and each comparison has a control that differs."""
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, load_script, max_abs_diff, needs_gpu, read_metrics, run_script, script_env
from torch.utils.data import DataLoader, TensorDataset

SCRIPT = "mnist_ddp_practice.py"
BATCH, STEPS = 16, 12
EXACT = 1e-5  # two float32 runs of one computation, in another order
# Runs compared with one process compute in float64 (--float64): in float32, a max-pool whose two
# largest inputs lie within rounding of each other takes either, which moves a gradient by about a
# percent, and from then on the runs part by more than rounding, by how much depending on the CPU.
# Here, one process in float32 against float64: at step 2 one of the max-pool's 147,456 windows
# took the other input, and after 12 steps they were 5.8e-3 apart (a 2-core Intel Xeon). In float64,
# DDP and one process ended 3.4e-14 apart.
EXACT64 = 1e-10


def train_ddp(tmp_path, data_args, *flags, nprocs=2, check=True):
    """The script on `nprocs` ranks, BATCH images each, STEPS steps in fixed order: (its weights,
    its metrics, the finished process)."""
    name = f"ddp{len(list(tmp_path.glob('*.pt')))}"
    weights, metrics = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    r = run_script(SCRIPT, "--nprocs", nprocs, "--batch-size", BATCH, "--max-steps", STEPS, "--no-shuffle",
                   "--quiet", "--save", weights, "--metrics-json", metrics, *flags, *data_args)
    if check:
        assert r.returncode == 0, r.stderr
        return torch.load(weights), read_metrics(metrics), r
    return None, None, r


def one_process(data_args, batch, unused_head=False, dtype=torch.float64):
    """bnnet trained by one process with plain BatchNorm on `batch` images a step: the reference."""
    practice, parts = load_script("mnist_ddp_practice"), load_script("mnist_parts")
    images, labels = parts.load_split(data_args[1], data_args[3], train=True)
    torch.manual_seed(0)
    model = practice.BNNet(unused_head=unused_head).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(TensorDataset(images.to(dtype), labels), batch_size=batch)
    for _, (x, y) in zip(range(STEPS), loader):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def running_stats(state):
    return {k: v for k, v in state.items() if "running" in k}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_batchnorm_by_hand_ends_with_one_process_weights_and_statistics(tmp_path, data_args, nprocs):
    reference = one_process(data_args, nprocs * BATCH)
    synced, metrics, _ = train_ddp(tmp_path, data_args, "--batchnorm", "sync", "--float64", nprocs=nprocs)
    assert max_abs_diff(reference, synced) < EXACT64  # weights and running statistics
    assert metrics["epochs"][-1]["spread"] == {"parameters": 0.0, "buffers": 0.0}
    # the control: per-rank statistics normalise each rank's batch with its own mean (0.15 apart here)
    local, metrics, _ = train_ddp(tmp_path, data_args, "--batchnorm", "local", "--float64", nprocs=nprocs)
    assert max_abs_diff(reference, local) > 1e-2
    assert max_abs_diff(running_stats(reference), running_stats(local)) > 1e-2
    # rank 0's buffers went to every rank before each forward; each then added its last batch
    assert metrics["epochs"][-1]["spread"]["parameters"] == 0.0 < metrics["epochs"][-1]["spread"]["buffers"]


def test_syncing_buffers_keeps_the_ranks_statistics_close(tmp_path, data_args):
    _, kept, _ = train_ddp(tmp_path, data_args)
    _, apart, _ = train_ddp(tmp_path, data_args, "--no-buffer-sync")
    assert 0 < kept["epochs"][-1]["spread"]["buffers"] < apart["epochs"][-1]["spread"]["buffers"]


# Two Gloo ranks on one GPU (NCCL would want a GPU per rank): torch's SyncBatchNorm and the
# lesson's, on the same slices of one batch, forward and backward.
AGAINST_TORCH = """
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])
from mnist_ddp_practice import SyncBatchNorm

def rank_main(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    x, g = torch.randn(16, 8, 5, 5, device="cuda") * 3 + 1, torch.randn(16, 8, 5, 5, device="cuda")
    x, g = x[8 * rank:8 * rank + 8], g[8 * rank:8 * rank + 8]  # this rank's half of the batch
    results = []
    for layer in (torch.nn.SyncBatchNorm(8), SyncBatchNorm(8)):
        layer = layer.cuda()
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 2, 8))
        xi = x.clone().requires_grad_()
        (layer(xi) * g).sum().backward()
        results.append([layer(xi.detach()).detach(), xi.grad, layer.weight.grad, layer.bias.grad,
                        layer.running_mean, layer.running_var])
    worst = max((a - b).abs().max().item() for a, b in zip(*results))
    print(f"rank {rank}: largest difference {worst:.3g}", flush=True)
    assert worst < 1e-4, worst
    dist.destroy_process_group()

if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    mp.spawn(rank_main, nprocs=2)
"""


@needs_gpu
def test_batchnorm_by_hand_equals_torchs_syncbatchnorm_on_a_gpu(tmp_path):
    from helpers import free_port

    script = tmp_path / "against_torch.py"
    script.write_text(AGAINST_TORCH)
    r = subprocess.run([sys.executable, script, SCRIPTS, str(free_port())], capture_output=True, text=True,
                       timeout=180, env=script_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("largest difference") == 2


def test_torch_syncbatchnorm_refuses_cpu_tensors(one_rank_group):
    """Why the lesson builds it by hand: in torch 2.14.1 its kernels are CUDA's (and XPU's)."""
    layer = torch.nn.SyncBatchNorm(4)
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        layer(torch.randn(8, 4))


def failed_with(r, message):
    """A worker raised `message` (torch's own words): its traceback, then the launcher's line."""
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"{SCRIPT}: error: a worker raised the exception above; the other workers were stopped")


def ended(r):
    """The job ended with exit code 1 and the launcher's last line, whatever a rank met first."""
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{SCRIPT}: error: ") and "the other workers were stopped" in last, r.stderr


def test_uneven_batches_end_in_one_line_without_join_and_train_with_it(tmp_path, data_args):
    """Rank 1 has 3 batches fewer: rank 0's next forward broadcasts its buffers to a rank that has
    gone on to evaluate. The two collectives do not match, and the job ends, by the group's timeout
    at the latest. What the launcher reports depends on which rank it hears from first: seen in a
    loop of 8 runs, "Timed out waiting 5000ms", "Connection closed by peer" and "Application timeout
    caused pair closure" (Gloo's words for one ending): not checked here."""
    start = time.monotonic()
    _, _, r = train_ddp(tmp_path, data_args, "--uneven", 3, "--max-steps", 10_000, "--timeout", 5,
                        "--batch-size", 256, check=False)
    assert time.monotonic() - start < 40
    ended(r)
    # Join: rank 1 answers rank 0's last 3 steps' collectives; the model is the same on both after
    _, joined, _ = train_ddp(tmp_path, data_args, "--uneven", 3, "--join", "on", "--max-steps", 10_000,
                             "--batch-size", 256)
    assert joined["epochs"][-1]["spread"] == {"parameters": 0.0, "buffers": 0.0}
    # throw: every rank stops when rank 1 is out, 3 steps before rank 0 would have
    _, thrown, _ = train_ddp(tmp_path, data_args, "--uneven", 3, "--join", "throw", "--max-steps", 10_000,
                             "--batch-size", 256)
    assert joined["epochs"][-1]["steps"] - thrown["epochs"][-1]["steps"] == 3
    assert thrown["epochs"][-1]["spread"]["parameters"] == 0.0


def test_an_unused_parameter_fails_with_the_reducers_message_and_both_cures_match_one_process(
        tmp_path, data_args):
    _, _, r = train_ddp(tmp_path, data_args, "--unused-head", check=False)
    failed_with(r, "RuntimeError: Expected to have finished reduction in the prior iteration")
    reference = one_process(data_args, 2 * BATCH, unused_head=True)
    for cure in ["--find-unused", "--static-graph"]:
        weights, _, _ = train_ddp(tmp_path, data_args, "--unused-head", cure, "--batchnorm", "sync",
                                  "--float64")
        assert max_abs_diff(reference, weights) < EXACT64, cure


def test_reentrant_checkpointing_with_unused_detection_fails_and_its_cures_match_one_process(
        tmp_path, data_args):
    _, _, r = train_ddp(tmp_path, data_args, "--unused-head", "--find-unused", "--checkpoint", "reentrant",
                        check=False)
    failed_with(r, "RuntimeError: Expected to mark a variable ready only once")
    reference = one_process(data_args, 2 * BATCH, unused_head=True)
    for cure in [["--find-unused", "--checkpoint", "non-reentrant"],
                 ["--static-graph", "--checkpoint", "reentrant"]]:
        weights, _, _ = train_ddp(tmp_path, data_args, "--unused-head", *cure, "--batchnorm", "sync",
                                  "--float64")
        assert max_abs_diff(reference, weights) < EXACT64, cure


def test_compiled_ddp_takes_the_steps_of_eager_ddp(tmp_path, data_args):
    """aot_eager: dynamo's graphs split at DDP's buckets, run by autograd without inductor's code
    generation (inductor compiles for over 20 s here: the lesson measures it)."""
    eager, _, _ = train_ddp(tmp_path, data_args)
    compiled, _, _ = train_ddp(tmp_path, data_args, "--compile", "aot_eager")
    assert max_abs_diff(eager, compiled) < EXACT
    reference = one_process(data_args, BATCH, dtype=torch.float32)  # the control: another batch, other steps
    assert max_abs_diff(eager, reference) > 1e-3


def test_fp16_gradients_are_clipped_after_unscaling_and_alike_on_every_rank(tmp_path, data_args):
    _, right, _ = train_ddp(tmp_path, data_args, "--amp", "fp16", "--clip", 1.0)
    _, wrong, _ = train_ddp(tmp_path, data_args, "--amp", "fp16", "--clip", 1.0, "--clip-before-unscale")
    # the first step's gradients, scaled by GradScaler's initial 2**16 when clipped too early
    assert wrong["clip_norms"][0] / right["clip_norms"][0] == pytest.approx(2 ** 16, rel=1e-2)
    assert right["epochs"][-1]["spread"]["parameters"] == 0.0  # the same clip on every rank
