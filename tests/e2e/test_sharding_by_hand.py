"""ddp_scripts/sharding_by_hand.py, ZeRO stage 1 by hand: ShardedOptimizer ends with the weights of
one process running the unsharded optimizer on the same global batch (AdamW and SGD with momentum,
parameter groups or a plain list, a parameter shared by two layers), for 2 and 3 ranks, and a control
without the broadcast does not; it deals the parameters out as torch's ZeroRedundancyOptimizer does
and holds, rank by rank, the optimizer state that torch's holds, together the unsharded state. And
the script itself: each --shard takes DDP's steps."""
import json
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, free_port, load_script, max_abs_diff, run_script, script_env

HARNESS = Path(__file__).with_name("sharding_harness.py")
CASES = [("adamw", "groups"), ("sgd", "groups"), ("adamw", "list")]
by_hand = load_script("sharding_by_hand")


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                ids=["2-ranks", "3-ranks"])
def sharded(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "results.pt"
    r = run_script(HARNESS, request.param, SCRIPTS / "sharding_by_hand.py", out, timeout=180,
                   env=script_env(HARNESS_PORT=free_port()))
    assert r.returncode == 0, r.stderr
    return request.param, torch.load(out)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_zero1_by_hand_ends_with_one_process_weights(sharded, case):
    _, results = sharded
    got = results[case]
    assert max_abs_diff(got["sharded"], got["one"]) < 1e-5  # 8 steps: float rounding only
    assert got["sharded_ranks_equal"] and got["torch_ranks_equal"]
    assert max_abs_diff(got["torch"], got["one"]) < 1e-5
    # The control: without the broadcast, a rank never sees the others' shares updated.
    assert max_abs_diff(got["control"], got["one"]) > 1e-4
    assert not got["control_ranks_equal"]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_the_shares_are_torchs_and_so_is_the_state_per_rank(sharded, case):
    n, results = sharded
    got = results[case]
    assert got["owners"] == got["torch_owners"]
    assert set(got["owners"].values()) == set(range(n))  # every rank owns something
    assert "third.weight" not in got["owners"]  # the shared weight: one parameter, one owner
    assert got["sharded_state"] == got["torch_state"]  # byte for byte, rank by rank
    assert sum(got["sharded_state"]) == got["unsharded_state"]
    assert max(got["sharded_state"]) < got["unsharded_state"]


def test_the_dealing_is_largest_first_to_the_emptiest_rank(one_rank_group, monkeypatch):
    """ZeroRedundancyOptimizer's rule, on sizes chosen so that a mistake shows: the counts go on from
    one group to the next, and a tie goes to the lowest rank."""
    monkeypatch.setattr(by_hand.dist, "get_world_size", lambda group=None: 3)
    sizes = [[5, 100, 40], [60, 7]]
    groups = [{"params": [torch.zeros(s) for s in group]} for group in sizes]
    optimizer = by_hand.ShardedOptimizer(groups, torch.optim.SGD, lr=0.1)
    owner = {p.numel(): r for p, r in optimizer.owner.items()}
    # group 1: 100 -> 0, 40 -> 1, 5 -> 2; group 2: 60 -> 2 (5 elements), 7 -> 1 (40)
    assert owner == {100: 0, 40: 1, 5: 2, 60: 2, 7: 1}
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 0]  # rank 0's share of each group


def test_a_tensor_listed_twice_is_dealt_and_stepped_once(one_rank_group):
    """A weight shared by two layers, listed with each (in one group or two): one owner, one state,
    one update a step."""
    shared, other = torch.ones(10, requires_grad=True), torch.ones(3, requires_grad=True)
    groups = [{"params": [shared, other, shared]}, {"params": [shared], "lr": 0.5}]
    optimizer = by_hand.ShardedOptimizer(groups, torch.optim.SGD, lr=0.1)
    assert [id(p) for p in optimizer.params] == [id(shared), id(other)] and len(optimizer.owner) == 2
    shared.grad, other.grad = torch.ones(10), torch.ones(3)
    optimizer.step()
    assert torch.allclose(shared.detach(), torch.full((10,), 0.9))  # one step of lr 0.1, not two
    optimizer.zero_grad()
    assert shared.grad is None and other.grad is None


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_script_in_each_mode_takes_ddps_steps(trained_sharding, optimizer):
    ddp = trained_sharding("none", optimizer)
    for shard in ("zero1", "torch"):
        assert max_abs_diff(trained_sharding(shard, optimizer), ddp) == 0.0  # the same arithmetic
    # DDP itself takes one process's steps up to rounding; the control, one process on half the
    # global batch, takes other steps
    one = trained_sharding("none", optimizer, nprocs=1)
    half = trained_sharding("none", optimizer, nprocs=1, batch=30)
    assert max_abs_diff(ddp, one) < 0.1 * max_abs_diff(half, one)


def test_the_script_reports_the_state_per_rank(trained_sharding, tmp_path):
    metrics = {shard: trained_sharding(shard, "adamw", metrics=True) for shard in ("none", "zero1", "torch")}
    unsharded = metrics["none"]["optimizer_state_bytes"]
    assert unsharded[0] == unsharded[1] > 2 * metrics["none"]["parameter_bytes"]  # AdamW: 2P, and its steps
    assert metrics["zero1"]["optimizer_state_bytes"] == metrics["torch"]["optimizer_state_bytes"]
    assert sum(metrics["zero1"]["optimizer_state_bytes"]) == unsharded[0]


@pytest.fixture(scope="module")
def trained_sharding(tmp_path_factory, data_args):
    """trained_sharding(shard, optimizer, nprocs=2, batch=60, metrics=False): the final weights (or
    the metrics) of 8 unshuffled steps of the MLP; each run once per module."""
    folder, done = tmp_path_factory.mktemp("sharding-script"), {}

    def train(shard, optimizer, nprocs=2, batch=60, metrics=False):
        key = (shard, optimizer, nprocs, batch)
        if key not in done:
            weights, json_path = folder / f"{len(done)}.pt", folder / f"{len(done)}.json"
            r = run_script("sharding_by_hand.py", "--shard", shard, "--optimizer", optimizer,
                           "--nprocs", nprocs, "--global-batch-size", batch, "--max-steps", 8,
                           "--no-shuffle", "--quiet", *data_args, "--save", weights,
                           "--metrics-json", json_path, timeout=180)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip().splitlines()[-1].startswith("done:")
            done[key] = (torch.load(weights), json.loads(json_path.read_text()))
        return done[key][1 if metrics else 0]

    return train


@pytest.mark.parametrize("args", [["--nprocs", "7"], ["--weight-decay", "-1"]])
def test_bad_flags_are_refused(args, data_args):
    with pytest.raises(by_hand.UsageError):
        by_hand.parse_args([*args, *map(str, data_args)])
