"""ddp_scripts/sharding_by_hand.py, ZeRO stages 1 and 3 by hand. Stage 1: ShardedOptimizer ends with
the weights of one process running the unsharded optimizer on the same global batch (AdamW and SGD
with momentum, parameter groups or a plain list, a parameter shared by two layers), for 2 and 3
ranks, and a control without the broadcast does not; it deals the parameters out as torch's
ZeroRedundancyOptimizer does and holds, rank by rank, the optimizer state that torch's holds,
together the unsharded state. Stage 3 (tests/e2e/fsdp_harness.py): one process's weights in float32,
and in bfloat16 one process computing as the ranks do; its rows, one layer whole at a time, and its
collectives' bytes. And the script itself: each --shard takes DDP's steps; zero3's memory and bytes
on lesson 10's MLP; torch's fully_shard, with and without resharding, against ZeRO-3 and ZeRO-2."""
import json
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, free_port, load_script, max_abs_diff, run_script, script_env

HARNESS = Path(__file__).with_name("sharding_harness.py")
CASES = [("adamw", "groups"), ("sgd", "groups"), ("adamw", "list")]
by_hand = load_script("sharding_by_hand")
comm_bytes = load_script("comm_bytes")
BF16_TOLERANCE = 1e-3  # ZeRO-3 computing in bfloat16 against one process doing the same


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
    # zero2 and zero3 average by reduce-scatter, not all-reduce: the same sums, on 2 ranks in the same order
    for shard in ("zero2", "zero3"):
        assert max_abs_diff(trained_sharding(shard, optimizer), ddp) < 1e-6
    # DDP itself takes one process's steps up to rounding; the control, one process on half the
    # global batch, takes other steps
    one = trained_sharding("none", optimizer, nprocs=1)
    half = trained_sharding("none", optimizer, nprocs=1, batch=30)
    assert max_abs_diff(ddp, one) < 0.1 * max_abs_diff(half, one)


def test_the_script_reports_the_state_per_rank(trained_sharding, tmp_path):
    metrics = {shard: trained_sharding(shard, "adamw", metrics=True) for shard in ("none", "zero1", "torch")}
    unsharded = metrics["none"]["optimizer_state_bytes"]
    assert unsharded[0] == unsharded[1] > 2 * metrics["none"]["parameter_bytes"][0]  # AdamW: 2P, steps
    assert metrics["zero1"]["optimizer_state_bytes"] == metrics["torch"]["optimizer_state_bytes"]
    assert sum(metrics["zero1"]["optimizer_state_bytes"]) == unsharded[0]


def test_zero3_in_the_script_holds_half_and_peaks_at_its_largest_layer(trained_sharding):
    """Lesson 10's MLP on 2 ranks (its rows divide evenly): ZeRO-3's state (parameters, gradients,
    AdamW's averages) is half of DDP's; its peak adds the largest layer gathered whole, 2048 x 2048
    and 2048, and that matrix's whole gradient: about 0.86x DDP's state. What it wrote to its
    sockets in a step is what comm_bytes counts for Gloo (the barrier's few bytes aside)."""
    ddp, z3 = (trained_sharding(shard, "adamw", metrics=True) for shard in ("none", "zero3"))
    state = {name: 2 * m["parameter_bytes"][0] + m["optimizer_state_bytes"][0]
             for name, m in (("ddp", ddp), ("zero3", z3))}
    steps = 4 * 6  # AdamW's step count, 4 bytes for each of the 6 tensors, on every rank
    assert state["zero3"] - steps == (state["ddp"] - steps) / 2
    assert z3["gathered_peak_bytes"] == [4 * (2048 * 2048 + 2048)] * 2
    assert z3["gradient_peak_bytes"] == [4 * 2048 * 2048] * 2
    peak = state["zero3"] + z3["gathered_peak_bytes"][0] + z3["gradient_peak_bytes"][0]
    assert peak / state["ddp"] == pytest.approx(0.86, abs=0.005)
    counted = z3["sent_bytes_per_step"]["gloo"]
    assert all(counted <= written < 1.001 * counted for written in z3["written_bytes_per_step"])
    assert z3["sent_bytes_per_step"]["nccl"] < counted


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


def test_fully_shard_without_resharding_writes_zero2s_bytes_and_holds_zero3s_state(trained_sharding):
    """torch's fully_shard against the by-hand stages on lesson 10's MLP, 2 ranks, AdamW: the same
    weights as DDP; after a step each holds ZeRO-3's state (a half of DDP's); resharding after forward
    (the default) gathers every weight again for backward: more bytes on the sockets than ZeRO-3 by
    hand, which gathers only the weights whose layer's input needs a gradient; kept whole from forward
    to backward (reshard_after_forward=False), it writes what ZeRO-2 by hand writes, within 0.1%."""
    ddp = trained_sharding("none", "adamw")
    metrics = {shard: trained_sharding(shard, "adamw", metrics=True)
               for shard in ("zero2", "zero3", "fsdp", "fsdp-no-reshard")}
    for shard in ("fsdp", "fsdp-no-reshard"):
        assert max_abs_diff(trained_sharding(shard, "adamw"), ddp) < 1e-6

    def state(m):
        parts = (m["parameter_bytes"], m["gradient_bytes"], m["optimizer_state_bytes"])
        return [sum(held) for held in zip(*parts)]

    assert state(metrics["fsdp"]) == state(metrics["fsdp-no-reshard"]) == state(metrics["zero3"])
    written = {shard: m["written_bytes_per_step"] for shard, m in metrics.items()}
    for r in range(2):
        assert written["fsdp-no-reshard"][r] == pytest.approx(written["zero2"][r], rel=1e-3)
        assert written["fsdp"][r] > 1.05 * written["zero3"][r] > 1.05 * written["zero2"][r]


@pytest.mark.parametrize("args", [["--nprocs", "7"], ["--weight-decay", "-1"],
                                  ["--compute-dtype", "bfloat16"]])  # zero3's alone
def test_bad_flags_are_refused(args, data_args):
    with pytest.raises(by_hand.UsageError):
        by_hand.parse_args([*args, *map(str, data_args)])


# ZeRO-3 and ZeRO-2 by hand: tests/e2e/fsdp_harness.py runs them on 2 and 3 ranks
FSDP_HARNESS = Path(__file__).with_name("fsdp_harness.py")
ROWS = {"0": 47, "2": 33, "4": 5}  # the harness's layers' output rows: 2 and 3 ranks do not divide them


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                ids=["2-ranks", "3-ranks"])
def stages(request, tmp_path_factory):
    """ZeRO-3 (float32, bfloat16, two controls) and ZeRO-2 by hand, and the references, on N ranks."""
    out = tmp_path_factory.mktemp("zero3") / "results.pt"
    r = run_script(FSDP_HARNESS, request.param, SCRIPTS / "sharding_by_hand.py", out, timeout=180,
                   env=script_env(HARNESS_PORT=free_port()))
    assert r.returncode == 0, r.stderr
    return request.param, torch.load(out)


def test_zero3_by_hand_ends_with_one_process_weights(stages):
    _, got = stages
    assert max_abs_diff(got["float32"]["weights"], got["one_float32"]) < 1e-5  # 8 steps: rounding only
    # the control: no reduce-scatter, each rank steps its rows with its own half of the batch
    assert max_abs_diff(got["no_reduce_scatter"]["weights"], got["one_float32"]) > 1e-3


def test_zero3_computing_in_bfloat16_is_one_process_computing_in_bfloat16(stages):
    """The shards stay float32; the layers compute in bfloat16, each rank on its part of the batch,
    and the gradients are averaged in float32. One process doing the same (a bfloat16 copy computes
    each part's gradients, averaged in float32, as gradient accumulation does) takes the same steps,
    but for the order of the sums: 0 on 2 ranks and 5.7e-5 on 3 here (a float32 difference of one
    unit in the last place can round a weight to another bfloat16 at the next step). The control,
    one process in float32, is 3.2e-2 away."""
    _, got = stages
    bf16 = got["bfloat16"]["weights"]
    near, far = max_abs_diff(bf16, got["one_bfloat16_in_parts"]), max_abs_diff(bf16, got["one_float32"])
    assert near < BF16_TOLERANCE < far


def test_zero3_holds_its_rows_and_one_layer_whole_at_a_time(stages):
    n, got = stages
    held = got["float32"]["held"]
    shapes = held[0]["shapes"]
    whole = {k: 4 * n * torch.Size(s).numel() for k, s in shapes.items()}  # bytes, float32, padded
    for name, rows in ROWS.items():  # each parameter's rows dealt out, the last rank's padded
        assert shapes[f"{name}.weight"][0] == -(-rows // n) and shapes[f"{name}.bias"] == (-(-rows // n),)
    padded = sum(whole.values())
    assert [h["parameters"] for h in held] == [padded // n] * n
    # AdamW: two averages of each shard and a 4-byte step count per tensor
    assert [h["optimizer_state"] for h in held] == [2 * padded // n + 4 * 6] * n
    # the gathered parameters alive at once: one layer's, the largest (weight and bias), never more
    layer = max(whole[f"{k}.weight"] + whole[f"{k}.bias"] for k in ROWS)
    assert all(h["gathered_peak"] == layer for h in held)
    # the control keeps what autograd saves (the weights) whole until backward: more alive at once
    assert all(h["gathered_peak"] > layer for h in got["keeps_whole"]["held"])


def test_zero3_counts_its_collectives_and_their_bytes(stages):
    """A step: forward gathers every parameter; backward gathers again what autograd saved, the
    weights of the layers whose input needs a gradient (not the first's); every gradient is
    reduce-scattered. Each collective's bytes from comm_bytes.bytes_sent, as lessons 10 and 13 say."""
    n, got = stages
    shapes = got["float32"]["held"][0]["shapes"]
    whole = {k: 4 * n * torch.Size(s).numel() for k, s in shapes.items()}
    sent = got["float32"]["sent"]
    gathered = [size for c, size in sent if c == "all_gather"]
    assert sorted(gathered) == sorted([*whole.values(), whole["2.weight"], whole["4.weight"]])
    assert sorted(size for c, size in sent if c == "reduce_scatter") == sorted(whole.values())
    padded = sum(whole.values())
    total = {b: sum(comm_bytes.bytes_sent(c, size, n, b) for c, size in sent) for b in comm_bytes.BACKENDS}
    again = whole["2.weight"] + whole["4.weight"]  # gathered for backward
    assert total["nccl"] == pytest.approx((n - 1) / n * (2 * padded + again))
    assert total["gloo"] == pytest.approx((n - 1) / n * (3 * padded + again))


def test_zero2_by_hand_ends_with_one_process_weights_holding_its_rows_gradients(stages):
    """ZeRO-2: the parameters whole on every rank (equal after each all-gather), the gradients and
    AdamW's state of its rows only; a step reduce-scatters every gradient and all-gathers every
    parameter: on NCCL the all-reduce's bytes, DDP's."""
    n, got = stages
    assert max_abs_diff(got["zero2"]["weights"], got["one_float32"]) < 1e-5 and got["zero2"]["ranks_equal"]
    shapes = got["float32"]["held"][0]["shapes"]  # ZeRO-3's rows: the same dealing
    rows = sum(4 * torch.Size(s).numel() for s in shapes.values())
    assert all(h == {"gradients": rows, "rows": rows, "optimizer_state": 2 * rows + 4 * 6}
               for h in got["zero2"]["held"])
    padded = n * rows
    sent = got["zero2"]["sent"]
    assert sorted(c for c, _ in sent) == ["all_gather"] * 6 + ["reduce_scatter"] * 6
    nccl = sum(comm_bytes.bytes_sent(c, size, n, "nccl") for c, size in sent)
    assert nccl == pytest.approx(comm_bytes.bytes_sent("all_reduce", padded, n, "nccl"))


def test_shard_model_refuses_a_weight_shared_by_two_layers_or_the_models_own(one_rank_group):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="shared by 0 and 1"):
        by_hand.shard_model(model)
    with pytest.raises(ValueError, match="parameters of its own"):
        by_hand.shard_model(torch.nn.Linear(4, 4))


def test_a_sharded_layer_keeps_a_frozen_parameter_frozen_and_computes_as_the_layer(one_rank_group):
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3)
    layer.bias.requires_grad_(False)
    x = torch.randn(4, 5)
    expected = layer(x).sum()
    model = by_hand.shard_model(torch.nn.Sequential(layer))
    got = model(x).sum()
    got.backward()
    assert torch.allclose(got, expected)
    assert model[0].weight.grad is not None and not model[0].bias.requires_grad


def test_bytes_sent_is_the_ring_and_gloos_reduce_scatter_an_all_reduce():
    assert comm_bytes.bytes_sent("all_reduce", 1200, 3) == 1600  # 2 (N - 1) / N
    assert comm_bytes.bytes_sent("all_gather", 1200, 3, "gloo") == 800  # (N - 1) / N
    assert comm_bytes.bytes_sent("reduce_scatter", 1200, 3, "nccl") == 800
    assert comm_bytes.bytes_sent("reduce_scatter", 1200, 3, "gloo") == 1600
    assert comm_bytes.bytes_sent("all_reduce", 1200, 1) == 0
    for bad in [("broadcast", 1, 2), ("all_reduce", 1, 0), ("all_reduce", -1, 2)]:
        with pytest.raises(ValueError):
            comm_bytes.bytes_sent(*bad)
    with pytest.raises(ValueError):
        comm_bytes.bytes_sent("all_reduce", 1, 2, "mpi")
