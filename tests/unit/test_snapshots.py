"""Lesson 5's snapshots, in-process: written whole and durably (synced before and after the
rename), no half file after a failed write; and the refusals of the snapshot flags."""
import argparse
import os

import pytest
import torch
import torch.distributed as dist
from helpers import RESUME_LINEAR as LINEAR
from helpers import load_script, refused_in_process


def test_a_snapshot_that_cannot_be_written_leaves_no_half_file(tmp_path, monkeypatch):
    """A full disk while writing: the error goes on, the previous snapshot stays, no .part is left."""
    resume = load_script("mnist_ddp_resume")
    snapshot = tmp_path / "s.pt"
    snapshot.write_bytes(b"the previous snapshot")

    real_save = torch.save

    def full_disk(obj, f, **kwargs):  # all_gather_object serialises with torch.save too
        if not str(getattr(f, "name", f)).endswith(".part"):
            return real_save(obj, f, **kwargs)
        f.write(b"half a snapshot")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resume.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_one_snapshot(resume, snapshot, monkeypatch)
    assert os.listdir(tmp_path) == ["s.pt"] and snapshot.read_bytes() == b"the previous snapshot"


def save_one_snapshot(resume, path, monkeypatch):
    """save_snapshot() in this process, as a one-rank job would call it."""
    args = argparse.Namespace(snapshot=str(path), **{k: None for k in resume.SNAPSHOT_MUST_MATCH})
    model = torch.nn.Linear(2, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(resume.hardening.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        resume.save_snapshot(args, 1, 10, argparse.Namespace(module=model),
                             torch.optim.SGD(model.parameters(), lr=0.1),
                             torch.amp.GradScaler("cpu", enabled=False), [], torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_a_snapshot_is_on_the_disk_before_it_replaces_the_previous_one(tmp_path, monkeypatch):
    """A power cut cannot be played here; the order of the calls can be checked. The file's bytes
    are synced before the rename (else a machine crash could leave the new name on a file whose
    bytes never reached the disk), and the folder after it (else the rename itself could be lost)."""
    import stat

    resume = load_script("mnist_ddp_resume")
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        calls.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(resume.os, "fsync", fsync)
    monkeypatch.setattr(resume.os, "replace", replace)
    save_one_snapshot(resume, tmp_path / "s.pt", monkeypatch)
    assert calls == ["fsync file", "rename", "fsync folder"]
    assert torch.load(tmp_path / "s.pt", weights_only=True)["epoch"] == 1


def test_a_crash_in_the_first_epoch_is_refused(monkeypatch):
    line = refused_in_process(load_script("mnist_ddp_resume"), [*LINEAR, "--crash-in-epoch", 1],
                              monkeypatch)
    assert "--crash-in-epoch must be between 2 and --epochs (3)" in line


def test_a_snapshot_folder_that_cannot_be_made_is_refused_before_training(monkeypatch, blocker, data_args):
    argv = [*LINEAR, *data_args, "--nprocs", 2, "--snapshot", blocker / "s.pt"]
    line = refused_in_process(load_script("mnist_ddp_resume"), argv, monkeypatch)
    assert f": error: cannot write {blocker / 's.pt'}: cannot create" in line
