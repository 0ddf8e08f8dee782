"""Lesson 5 on one machine: a job that loses a rank resumes from its last snapshot when the same
command runs again after mp.spawn's job has stopped, and ends exactly where a job that was never
interrupted ends (the same weights, bit for bit). Snapshots that cannot be continued are refused
in one line, before any worker starts. (torchrun's restarts: tests/cluster/test_restarts.py.)"""
import os
import shutil
import socket
import time

import pytest
import torch
from helpers import RESUME_LINEAR as LINEAR
from helpers import GPUS, max_difference, needs_gpu, read_metrics, run_script, torchrun

SCRIPT = "mnist_ddp_resume.py"
CPU = ["--backend", "gloo", "--device", "cpu"]
STEPS_PER_EPOCH = 47  # 6,000 images in global batches of 2 x 64


def test_a_part_left_by_a_killed_writer_is_removed(uninterrupted):
    """A writer killed mid-write (SIGKILL: no clean-up) leaves `<snapshot>.<host>.<pid>.part`; the
    next writer on that host removes the parts whose process has ended, and only those: one of a
    process still running stays, and so does one of another host (whose writer cleans up there)."""
    remaining = {p.name for p in uninterrupted.parent.glob("s.pt.*.part")}
    gone = next(name for name in remaining if ".elsewhere." in name).split(".")[-2]
    assert remaining == {f"s.pt.{socket.gethostname()}.{os.getpid()}.part", f"s.pt.elsewhere.{gone}.part"}


def test_after_a_crash_without_torchrun_the_same_command_resumes(tmp_path, data_args, uninterrupted):
    command = [*LINEAR, *data_args, "--nprocs", 2, "--crash-in-epoch", 2, "--snapshot", tmp_path / "s.pt",
               "--save", tmp_path / "w.pt", "--metrics-json", tmp_path / "m.json"]
    r = run_script(SCRIPT, *command)
    assert r.returncode == 1
    # the metrics are written after every epoch: the crashed run's file holds the epoch it finished
    assert [e["epoch"] for e in read_metrics(tmp_path / "m.json")["epochs"]] == [1]
    assert not (tmp_path / "m.json.part").exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith(f"{SCRIPT}: error:")]
    assert errors == [f"{SCRIPT}: error: worker 1 ended with signal SIGKILL; the other workers were stopped"]
    assert "leaked semaphore" not in r.stderr
    assert torch.load(tmp_path / "s.pt", weights_only=True)["epoch"] == 1
    r = run_script(SCRIPT, *command)  # the crash is not repeated: this run begins in epoch 2
    assert r.returncode == 0, r.stderr
    assert "epoch 1 done" in r.stdout and "simulated crash" not in r.stderr
    assert max_difference(tmp_path / "w.pt", uninterrupted) == 0.0

    r = run_script(SCRIPT, *command)  # and once more: all 3 epochs are done
    assert r.returncode == 0, r.stderr
    assert f"nothing left to train: the snapshot has 3 epochs, {3 * STEPS_PER_EPOCH} steps" in r.stdout
    assert max_difference(tmp_path / "w.pt", uninterrupted) == 0.0


def test_more_processes_can_take_over_a_snapshot(tmp_path, data_args, uninterrupted):
    snapshot = tmp_path / "s.pt"
    shutil.copy(uninterrupted.parent / "s.pt", snapshot)  # 3 epochs by 2 processes
    r = run_script(SCRIPT, *CPU, "--model", "linear", "--epochs", 4, *data_args, "--nprocs", 3,
                   "--snapshot", snapshot, "--metrics-json", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert "(taken with 2 processes; now 3: the global batch is 192, the snapshot's was 128" in r.stdout
    assert [e["epoch"] for e in read_metrics(tmp_path / "m.json")["epochs"]] == [1, 2, 3, 4]


def test_fewer_processes_with_the_same_global_batch_take_over_a_snapshot(tmp_path, data_args, uninterrupted):
    """2 processes x 64 snapshotted; 1 process x 128 continues it (the faithful continuation on
    fewer processes), while 1 x 64 (the global batch halved) would also be accepted, with its note."""
    snapshot = tmp_path / "s.pt"
    shutil.copy(uninterrupted.parent / "s.pt", snapshot)
    r = run_script(SCRIPT, *CPU, "--model", "linear", "--epochs", 4, *data_args, "--nprocs", 1,
                   "--batch-size", 128, "--snapshot", snapshot, "--metrics-json", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert "now 1: the global batch is 128, the snapshot's was 128" in r.stdout
    assert [e["epoch"] for e in read_metrics(tmp_path / "m.json")["epochs"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("change, expected", [
    (["--batch-size", 32], "was taken with --batch-size 64: run with the same, or delete it"),
    (["--model", "convnet", "--no-shuffle"], "was taken with --model linear, no --no-shuffle:"),
])
def test_a_snapshot_of_another_run_is_refused_before_any_worker_starts(change, expected, data_args,
                                                                      uninterrupted):
    start = time.monotonic()
    r = run_script(SCRIPT, *LINEAR, *data_args, "--nprocs", 2, "--snapshot", uninterrupted.parent / "s.pt",
                   *change)
    assert r.returncode == 1 and time.monotonic() - start < 30
    assert r.stderr.strip().splitlines()[-1] == r.stderr.strip() and expected in r.stderr, r.stderr
    assert "training" not in r.stdout


def test_an_unreadable_snapshot_is_refused_in_one_line(tmp_path, data_args):
    (tmp_path / "s.pt").write_text("not a snapshot")
    for launcher in (None, torchrun(2)):
        r = run_script(SCRIPT, *LINEAR, *data_args, "--snapshot", tmp_path / "s.pt", launcher=launcher)
        assert r.returncode != 0
        lines = [line for line in r.stderr.splitlines() if line.startswith(f"{SCRIPT}: error:")]
        assert len(lines) == 1 and "not a snapshot that this script can read" in lines[0], r.stderr


@needs_gpu
def test_on_gpus_with_nccl_too(tmp_path, data_args):
    """NCCL: the snapshot's broadcast and gather go through GPU tensors, and each rank restores its
    CUDA random state. Some GPU kernels add in a varying order (on an H200, two identical 2-epoch
    runs ended up to 0.14 apart in a weight), so all three runs ask for --deterministic kernels:
    then the resumed run must equal the uninterrupted one bit for bit, as on CPU."""
    nprocs = min(GPUS, 2)
    common = ["--model", "convnet", "--epochs", 2, "--deterministic", *data_args]
    r = run_script(SCRIPT, *common, "--crash-in-epoch", 2, "--snapshot", tmp_path / "s.pt",
                   "--save", tmp_path / "resumed.pt", launcher=[*torchrun(nprocs), "--max-restarts", "1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "simulated crash" in r.stderr and "resuming from" in r.stdout
    for name in ("first", "second"):
        r = run_script(SCRIPT, *common, "--nprocs", nprocs, "--snapshot", tmp_path / f"{name}.pt",
                       "--save", tmp_path / f"uninterrupted-{name}.pt")
        assert r.returncode == 0, r.stderr
    noise = max_difference(tmp_path / "uninterrupted-first.pt", tmp_path / "uninterrupted-second.pt")
    difference = max_difference(tmp_path / "resumed.pt", tmp_path / "uninterrupted-first.pt")
    print(f"resumed vs uninterrupted: {difference:.2e}; two uninterrupted runs: {noise:.2e}")
    assert noise == 0.0, "--deterministic did not make two identical GPU runs equal"
    assert difference == 0.0


def test_a_resume_with_another_learning_rate_applies_it_and_says_so(tmp_path, data_args):
    """optimizer.load_state_dict() restores the snapshot's learning rate with the momentum; the
    run's own --lr replaces it, in one line. (Batch size, seed, model: refused instead, above.)"""
    common = [*CPU, "--model", "linear", "--nprocs", 2, *data_args, "--snapshot", tmp_path / "s.pt"]
    r = run_script(SCRIPT, *common, "--epochs", 1, "--lr", 0.01)
    assert r.returncode == 0, r.stderr
    r = run_script(SCRIPT, *common, "--epochs", 2, "--lr", 0.05)
    assert r.returncode == 0, r.stderr
    assert "learning rate 0.05 (--lr), not the snapshot's 0.01" in r.stdout
    groups = torch.load(tmp_path / "s.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [0.05]
    r = run_script(SCRIPT, *common, "--epochs", 3, "--lr", 0.05)  # the same rate: nothing to say
    assert r.returncode == 0 and "learning rate" not in r.stdout
