"""mnist_fsdp.py launched on CPU ranks (Gloo), the MLP and AdamW on unshuffled data: ZeRO and FSDP
take DDP's steps (up to float rounding) while each rank holds less of the state; --save writes the
plain model in every mode; a sharded checkpoint of 2 ranks resumes on 1 and on 3 ranks where the
uninterrupted run goes. Every comparison has a control that differs. The in-process parts (refusals,
evaluation, data order, the counting): tests/unit/test_fsdp_parts.py."""
import sys

import pytest
import torch
from helpers import REPO, load_script, max_abs_diff, read_metrics, run_script, torchrun

sys.path.insert(0, str(REPO / "tools" / "figures"))
import draw_sharding  # noqa: E402  (lesson 10's figure of what each rank holds)

CPU = ["--backend", "gloo", "--device", "cpu", "--no-shuffle", "--quiet"]
STEPS = 20
GLOBAL_BATCH = 60  # splits over 1, 2 and 3 ranks (and divides the 6,000 images: 100 steps an epoch)
MLP_PARAMETERS = 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
MIB = 2 ** 20
# After 20 AdamW steps, weights of DDP and of ZeRO/FSDP: on 2 ranks the same bits (measured: 0; the
# average of two numbers rounds alike whoever adds them). On 3 ranks the gradients' sums round
# differently, and AdamW divides each gradient by the root of its running square: for a weight
# whose gradient is near 0 that magnifies the rounding (measured: 9e-5 at most, in a few hundred of
# the 5.8M weights). The bound: 5e-4, half a step of the learning rate (1e-3). The controls (one
# process with one rank's batch) end 2.6e-2 away.
BOUND = {2: 1e-5, 3: 5e-4}
THREE = pytest.param(3, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_args):
    """run(*flags, nprocs=2, steps=STEPS, under_torchrun=False) -> (weights, metrics) of mnist_fsdp.py
    with those flags, its ranks spawned by the script or started by torchrun; each distinct run once
    per module."""
    folder, cache = tmp_path_factory.mktemp("fsdp"), {}

    def run(*flags, nprocs=2, steps=STEPS, under_torchrun=False):
        key = (tuple(map(str, flags)), nprocs, steps, under_torchrun)
        if key not in cache:
            weights, metrics = folder / f"w{len(cache)}.pt", folder / f"m{len(cache)}.json"
            r = run_script("mnist_fsdp.py", *CPU, "--nprocs", nprocs, "--max-steps", steps, "--save", weights,
                           "--metrics-json", metrics, *flags, *data_args, timeout=240,
                           launcher=torchrun(nprocs) if under_torchrun else None)
            assert r.returncode == 0, r.stderr
            cache[key] = torch.load(weights), read_metrics(metrics)
        return cache[key]

    run.folder = folder
    return run


def trained(run, shard, nprocs=2, *flags, **options):
    """A run in that mode with the global batch of the tests."""
    return run("--shard", shard, "--global-batch-size", GLOBAL_BATCH, *flags, nprocs=nprocs, **options)


@pytest.mark.parametrize("nprocs", [2, THREE])
def test_zero_and_fsdp_take_ddps_steps(run, nprocs):
    ddp, _ = trained(run, "ddp", nprocs)
    for shard in ("zero", "fsdp"):
        weights, metrics = trained(run, shard, nprocs)
        assert (metrics["shard"], metrics["world_size"]) == (shard, nprocs)
        assert max_abs_diff(weights, ddp) < BOUND[nprocs], shard
    # The control: one process with one rank's batch takes other steps.
    alone, _ = run("--shard", "ddp", "--batch-size", GLOBAL_BATCH // nprocs, nprocs=1)
    assert max_abs_diff(alone, ddp) > 1e-3


def test_each_rank_holds_less_of_the_state(run):
    """state_mib_per_rank, counted from the tensors each rank holds after a step: DDP's is the
    weights, gradients and AdamW's two averages, 4 x 4 bytes a parameter (and AdamW's step counts);
    ZeRO splits the averages (each counted once, on the rank that owns it); FSDP splits everything
    in half on 2 ranks."""
    whole = 4 * MLP_PARAMETERS * 4 / MIB
    state = {shard: trained(run, shard)[1]["state_mib_per_rank"] for shard in ("ddp", "zero", "fsdp")}
    assert state["ddp"] == [pytest.approx(whole, abs=0.01)] * 2
    assert max(state["fsdp"]) <= 0.6 * state["ddp"][0]
    assert state["fsdp"] == [pytest.approx(whole / 2, abs=0.01)] * 2
    assert max(state["zero"]) < state["ddp"][0]
    weights_and_gradients = 2 * MLP_PARAMETERS * 4 / MIB
    assert sum(s - weights_and_gradients for s in state["zero"]) == pytest.approx(whole / 2, abs=0.01)
    # Lesson 10's figure (tools/figures/draw_sharding.py) draws what each rank holds: the same, rank by rank
    # (AdamW's step counts, 4 bytes a tensor, aside).
    shapes = [(2048, 784), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]
    for shard, mode in (("ddp", "DDP"), ("zero", "ZeRO-1"), ("fsdp", "FSDP")):
        drawn = draw_sharding.held(mode, 2, shapes)
        assert state[shard] == [pytest.approx(sum(parts), abs=0.01) for parts in drawn]
    for shard in state:  # the peak: of the whole process (CPU: its resident set), hence above its state
        peaks = trained(run, shard)[1]["peak_mib_per_rank"]
        assert len(peaks) == 2 and all(peak > s for peak, s in zip(peaks, state[shard])), (shard, peaks)


@pytest.mark.parametrize("shard", ["ddp", "zero", "fsdp"])
def test_save_writes_the_plain_model_in_every_mode(run, shard):
    weights, _ = trained(run, shard)
    assert all(type(w) is torch.Tensor for w in weights.values())  # no DTensor, all on the CPU
    plain = load_script("mnist_fsdp").build_model("mlp")
    plain.load_state_dict(weights)  # strict: the plain model's names and shapes, every one
    assert max_abs_diff(plain.state_dict(), weights) == 0


@pytest.fixture(scope="module")
def checkpoint(run):
    """2 FSDP ranks, STEPS // 2 steps, a sharded checkpoint at the end; its folder and weights."""
    folder = run.folder / "checkpoint"
    weights, _ = trained(run, "fsdp", 2, "--checkpoint-dir", folder, steps=STEPS // 2)
    assert sorted(p.name for p in folder.iterdir()) == ["latest.json", f"step-{STEPS // 2}"]
    return folder, weights


@pytest.mark.parametrize("nprocs, shard, under_torchrun", [
    (1, "fsdp", False), pytest.param(3, "fsdp", True, marks=pytest.mark.slow),
    pytest.param(3, "ddp", False, marks=pytest.mark.slow)],
    ids=["2-to-1", "2-to-3-torchrun", "2-to-3-as-ddp"])
def test_a_sharded_checkpoint_resumes_on_other_ranks(run, checkpoint, nprocs, shard, under_torchrun):
    """Trained on 2 ranks for 10 steps, resumed on 1 or 3 for 10 more: where 20 uninterrupted steps
    on 2 ranks end (measured: 4e-7 apart; the last 10 steps round as that many ranks do). 2-to-3-as-ddp:
    FSDP's shards resumed as DDP's whole tensors; 2-to-3-torchrun: the ranks started by torchrun."""
    folder, halfway = checkpoint
    uninterrupted, _ = trained(run, "fsdp")
    resumed, metrics = trained(run, shard, nprocs, "--resume-from", folder, under_torchrun=under_torchrun)
    assert metrics["world_size"] == nprocs and metrics["epochs"][-1]["steps"] == STEPS
    assert max_abs_diff(resumed, uninterrupted) < 1e-5
    # The control: the checkpoint's own weights, 10 steps short, are far from there.
    assert max_abs_diff(halfway, uninterrupted) > 1e-3


def test_the_kaggle_notebooks_sharding_cell_reports_these_runs(run, tmp_path, monkeypatch):
    """kaggle/ddp_t4x2.ipynb's lesson 10 cell (two T4s there) runs here on this module's CPU runs:
    its `run` hands over the weights and metrics of the same modes, 2 ranks and 20 unshuffled steps,
    and the cell's table must show FSDP's half of DDP's state and ZeRO's weights equal to DDP's."""
    import json

    import nbformat

    nb = nbformat.read(REPO / "kaggle" / "ddp_t4x2.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and 'run("mnist_fsdp.py"' in c.source)
    launched, shown = [], []

    def kaggle_run(script, *argv):
        argv = [str(a) for a in argv]

        def flag(name):
            return argv[argv.index(name) + 1]

        assert (script, flag("--nprocs"), flag("--max-steps")) == ("mnist_fsdp.py", "2", str(STEPS))
        assert "--no-shuffle" in argv
        launched.append(flag("--shard"))
        weights, metrics = trained(run, flag("--shard"))
        torch.save(weights, flag("--save"))
        with open(flag("--metrics-json"), "w") as f:
            json.dump(metrics, f)

    monkeypatch.chdir(tmp_path)
    exec(cell, {"run": kaggle_run, "DATA": "/tmp/data", "json": json, "torch": torch,
                "print": lambda *a: None, "Markdown": shown.append})
    assert launched == ["ddp", "zero", "fsdp"]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in shown[0].splitlines()
             if line.startswith("|")]
    rows = {row[0]: row for row in table if row[0] in launched}  # --shard, state, vs ddp, peak, difference
    assert rows["ddp"][2] == "1.00x" and rows["fsdp"][2] == "0.50x", rows
    assert float(rows["zero"][2].rstrip("x")) < 1
    for shard in launched:  # on 2 CPU ranks the very same bits (test_zero_and_fsdp_take_ddps_steps)
        assert float(rows[shard][4]) < BOUND[2], rows[shard]
