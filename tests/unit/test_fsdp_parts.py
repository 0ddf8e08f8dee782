"""mnist_fsdp.py in-process: its one-line refusals (nothing spawned), the parts the sharded runs rely
on (evaluation with as many forwards on every rank, the data order by global step whatever the
number of ranks, the state counted), and a resumed run equal to an uninterrupted one (one rank,
Gloo, shuffled data, across an epoch's end). tests/e2e/test_fsdp.py launches the runs of 2 and 3 ranks."""
import json
import sys

import pytest
import torch
from helpers import REPO, launching, load_script, refused_in_process

sys.path.insert(0, str(REPO / "tools" / "figures"))
import draw_sharding  # noqa: E402  (lesson 10's figure of what each rank holds)

CPU = ["--backend", "gloo", "--device", "cpu"]


@pytest.fixture(scope="module")
def fsdp_script():
    return load_script("mnist_fsdp")


def refused(module, monkeypatch, *argv):
    return refused_in_process(module, [*CPU, *map(str, argv)], monkeypatch)


def write_checkpoint_record(folder, **changes):
    """A latest.json as save_checkpoint writes it (2 ranks, 20 steps of the MLP, global batch 60)."""
    folder.mkdir(exist_ok=True)
    record = {"folder": "step-20", "steps": 20, "epochs_done": 0, "model": "mlp", "shard": "fsdp",
              "global_batch_size": 60, "world_size": 2, **changes}
    (folder / "latest.json").write_text(json.dumps(record))
    return folder


# --------------------------------------------------------------------------- refusals
def test_fp16_on_a_cpu(monkeypatch, fsdp_script):
    assert "--amp fp16 is for GPUs" in refused(fsdp_script, monkeypatch, "--amp", "fp16")


def test_a_torch_without_fully_shard(monkeypatch, fsdp_script):
    monkeypatch.delattr(fsdp_script.fsdp, "fully_shard")  # as in torch 2.5 and before
    line = refused(fsdp_script, monkeypatch, "--shard", "ddp")
    assert "needs torch >= 2.6" in line and torch.__version__ in line


@pytest.mark.parametrize("shard", ["ddp", "zero", "fsdp"])
def test_a_global_batch_the_ranks_cannot_split(monkeypatch, fsdp_script, shard):
    line = refused(fsdp_script, monkeypatch, "--shard", shard, "--nprocs", 4, "--global-batch-size", 90)
    assert "--global-batch-size 90 does not split evenly over 4 ranks" in line


def test_a_global_batch_under_torchrun_counts_its_ranks(monkeypatch, fsdp_script):
    """torchrun's WORLD_SIZE decides, not --nprocs."""
    args = fsdp_script.parse_args([*CPU, "--global-batch-size", "90", "--nprocs", "3"])
    monkeypatch.setenv("WORLD_SIZE", "3")
    fsdp_script.check_setup(args, rank=0)  # 90 splits over 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(fsdp_script.UsageError, match="over 4 ranks"):
        fsdp_script.check_setup(args, rank=0)


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--resume-from"])
def test_zero_has_no_sharded_checkpoint(monkeypatch, tmp_path, fsdp_script, flag):
    line = refused(fsdp_script, monkeypatch, "--shard", "zero", flag, write_checkpoint_record(tmp_path / "c"))
    assert "--shard zero has no sharded checkpoint" in line


def test_resuming_from_a_folder_without_a_checkpoint(monkeypatch, tmp_path, fsdp_script):
    line = refused(fsdp_script, monkeypatch, "--resume-from", tmp_path)
    assert f"{tmp_path} holds no checkpoint of this script" in line


@pytest.mark.parametrize("record, argv, expected", [
    ({"model": "linear"}, [], "holds --model linear, not mlp: resume with --model linear"),
    ({}, ["--global-batch-size", 120], "global batch of 60, this run's is 120: pass --global-batch-size 60"),
    ({}, ["--nprocs", 3, "--batch-size", 30], "this run's is 90"),  # 3 x 30: another global batch
    ({}, ["--global-batch-size", 60, "--max-steps", 20], "has taken 20 steps (0 epochs) already"),
    ({"epochs_done": 1}, ["--global-batch-size", 60], "raise --max-steps or --epochs"),
])
def test_a_checkpoint_this_run_cannot_continue(monkeypatch, tmp_path, fsdp_script, record, argv, expected):
    folder = write_checkpoint_record(tmp_path / "c", **record)
    assert expected in refused(fsdp_script, monkeypatch, "--resume-from", folder, *argv)


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_a_checkpoint_resumes_in_the_other_mode_and_on_other_ranks(tmp_path, fsdp_script, shard):
    """DCP holds whole tensors by name, in shards: DDP's and FSDP's checkpoints are alike to it (the
    resumed weights are checked in tests/e2e/test_fsdp.py). The control: one refusal above."""
    folder = write_checkpoint_record(tmp_path / "c", shard="ddp" if shard == "fsdp" else "fsdp")
    for ranks in (1, 2, 3):
        args = fsdp_script.parse_args([*CPU, "--shard", shard, "--resume-from", str(folder),
                                       "--global-batch-size", "60", "--max-steps", "40"])
        fsdp_script.check_sharding(args, world_size=ranks)  # no refusal


def test_a_checkpoint_folder_that_cannot_be_created(monkeypatch, blocker, fsdp_script):
    line = refused(fsdp_script, monkeypatch, "--checkpoint-dir", blocker / "ckpt")
    assert f"cannot write {blocker / 'ckpt' / 'latest.json'}" in line


# --------------------------------------------------------------------------- the parts
class CountingModel(torch.nn.Module):
    """Stands in for an FSDP model: counts its forwards (each would be an all-gather)."""

    def __init__(self):
        super().__init__()
        self.calls, self.images = 0, 0

    def forward(self, x):
        self.calls += 1
        self.images += len(x)
        return torch.zeros(len(x), 10)


@pytest.mark.parametrize("test_images", [1000, 385, 257, 129, 5, 2])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_evaluation_runs_as_many_forwards_on_every_rank(one_rank_group, fsdp_script, world_size, test_images):
    """Under FSDP every forward is a collective: a rank with one forward fewer leaves the others
    waiting in the all-gather until --timeout. Each rank is called here in turn (the sums' all_reduce
    over a one-rank group leaves them as they are)."""
    images, labels = torch.zeros(test_images, 1, 28, 28), torch.zeros(test_images, dtype=torch.long)

    def forwards(evaluate):
        models = [CountingModel() for _ in range(world_size)]
        for rank, model in enumerate(models):
            evaluate(model, images, labels, rank, world_size)
        assert sum(m.images for m in models) == test_images  # every image scored once
        return [m.calls for m in models]

    def per_shard(model, images, labels, rank, world_size):  # the control: batches of 128 per shard
        for x in images[rank::world_size].split(128):
            model(x)

    assert len(set(forwards(fsdp_script.evaluate))) == 1
    if (test_images, world_size) == (257, 2):  # 129 and 128 images: 2 forwards and 1
        assert forwards(per_shard) == [2, 1]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_global_step_trains_on_the_same_samples_whatever_the_ranks(shuffle):
    """What a resume on another number of ranks relies on: with a global batch G (G/N per rank),
    DistributedSampler and the script's split give step k the samples k*G to k*G + G - 1 of one
    permutation, for N = 1, 2, 3, 6."""
    from torch.utils.data.distributed import DistributedSampler

    data, global_batch = list(range(600)), 60

    def steps(world_size, epoch):
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(torch.tensor(list(sampler)).split(global_batch // world_size))
        return [sorted(torch.cat(batches).tolist()) for batches in zip(*per_rank)]

    for epoch in (1, 2):
        one = steps(1, epoch)
        assert len(one) == 10
        for world_size in (2, 3, 6):
            assert steps(world_size, epoch) == one
    assert (steps(1, 1) == steps(1, 2)) != shuffle  # the control: shuffled epochs differ


@pytest.mark.parametrize("shard", ["ddp", "zero", "fsdp"])
def test_the_state_counted_is_parameters_gradients_and_adamw(one_rank_group, fsdp_script, shard):
    """On one rank nothing is split: every mode holds 4 numbers per parameter (the weight, its
    gradient, AdamW's two averages) and AdamW's step counts (one 4-byte scalar per tensor)."""
    model = fsdp_script.build_model("linear")
    params = sum(p.numel() for p in model.parameters())
    if shard == "fsdp":
        mesh = fsdp_script.init_device_mesh("cpu", (1,))
        fsdp_script.fsdp.fully_shard(model[1], mesh=mesh)
        fsdp_script.fsdp.fully_shard(model, mesh=mesh)
    else:
        model = fsdp_script.DDP(model)
    optimizer = (fsdp_script.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
                 if shard == "zero" else torch.optim.AdamW(model.parameters()))
    assert fsdp_script.state_bytes(model, optimizer) == params * 4  # before a step: the weights
    model(torch.zeros(3, 1, 28, 28)).sum().backward()
    optimizer.step()
    assert fsdp_script.state_bytes(model, optimizer) == 4 * params * 4 + 2 * 4


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_sharding_figure_deals_the_state_as_torch_does(one_rank_group, fsdp_script, world_size):
    """tools/figures/draw_sharding.py's shares, against torch 2.14.1's own rules: ZeroRedundancyOptimizer's
    partition of the MLP's parameters (its method, run as if the group had world_size ranks) and
    fully_shard's cut of each tensor's rows (_chunk_with_empty, the function it calls)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    params = list(fsdp_script.build_model("mlp").parameters())
    shapes = [tuple(p.shape) for p in params]

    zero = fsdp_script.ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW)
    zero.world_size, zero._partition_parameters_cache = world_size, []
    per_rank = [sum(p.numel() for group in groups for p in group["params"])
                for groups in zero._partition_parameters()]
    assert draw_sharding.zero_shares(shapes, world_size) == per_rank

    cut = [sum(_chunk_with_empty(p.detach(), world_size, dim=0)[rank].numel() for p in params)
           for rank in range(world_size)]
    assert draw_sharding.fsdp_shares(shapes, world_size) == cut


def test_a_resumed_run_is_the_uninterrupted_one(in_process_rank, tmp_path, data_args, fsdp_script):
    """One rank, in this process, shuffled data, 12 steps an epoch: 17 steps and a checkpoint, then
    a resume to 24 (5 into epoch 2, then its 7 left) ends with the weights of 24 steps in one run,
    bit for bit. The control: the checkpoint's own weights differ."""
    common = [*CPU, "--model", "linear", *map(str, data_args), "--global-batch-size", "500", "--nprocs", "1",
              "--epochs", "2", "--quiet"]

    def run(*flags):
        path = tmp_path / f"weights{len(list(tmp_path.glob('weights*')))}.pt"
        args = fsdp_script.parse_args([*common, "--save", str(path), *map(str, flags)])
        launching(fsdp_script)[0](0, 1, args)
        return torch.load(path)

    whole = run("--max-steps", 24)
    halfway = run("--max-steps", 17, "--checkpoint-dir", tmp_path / "ckpt")
    record = json.loads((tmp_path / "ckpt" / "latest.json").read_text())
    assert (record["steps"], record["epochs_done"], record["folder"]) == (17, 1, "step-17")
    resumed = run("--max-steps", 24, "--resume-from", tmp_path / "ckpt")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert any(not torch.equal(whole[k], halfway[k]) for k in whole)
