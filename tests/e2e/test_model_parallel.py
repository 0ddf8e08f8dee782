"""Model parallelism (mnist_model_parallel.py) splits the model, not the batch: N processes that
each hold a part of the MLP, all seeing the whole global batch, end with the weights of one process
trained on the same batches (--no-shuffle; the MLP has nothing random but its initial weights)."""
import runpy
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import SCRIPTS, load_script, max_abs_diff, read_metrics, run_script

SCRIPT = SCRIPTS / "mnist_model_parallel.py"
WIDTH, BATCH, STEPS, LR = 64, 64, 10, 0.01


def plain_mlp(width):
    """Lesson 6's MLP, as one process builds it (mnist_ddp_comm.py's build_model("mlp"), any width)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def one_process(data_args, batch, steps=STEPS, width=WIDTH):
    """The reference: one process, the plain model, the first `steps` batches in order."""
    dataset, data_dir = data_args[1], data_args[3]
    images, labels = load_script("mnist_model_parallel").load_split(dataset, data_dir, train=True)
    torch.manual_seed(0)
    model = plain_mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        x, y = images[step * batch:(step + 1) * batch], labels[step * batch:(step + 1) * batch]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def train(tmp_path, data_args, mode, *args):
    weights, metrics = tmp_path / f"{mode}.pt", tmp_path / f"{mode}.json"
    r = run_script(SCRIPT.name, "--mode", mode, "--nprocs", "2", "--width", WIDTH, "--batch-size", BATCH,
                   "--lr", LR, "--max-steps", STEPS, "--no-shuffle", "--save", weights, "--metrics-json",
                   metrics, "--quiet", *data_args, *args, timeout=180,
                   fresh=mode == "pp")  # its ranks started by a real spawn (notebooks/launcher.py)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("done:"), r.stdout
    return torch.load(weights), read_metrics(metrics), r.stdout


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory, data_args):
    return train(tmp_path_factory.mktemp("tp"), data_args, "tp")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, data_args):
    return train(tmp_path_factory.mktemp("pp"), data_args, "pp", "--microbatches", "4")


@pytest.fixture(scope="module")
def reference(data_args):
    """One process on the same global batches, and the control: one process with half the batch."""
    return one_process(data_args, BATCH), one_process(data_args, BATCH // 2)


def check_matches_one_process(weights, metrics, reference):
    same_batches, half_batches = reference
    assert max_abs_diff(same_batches, weights) < 1e-5
    # The comparison can fail: half the batch takes other steps.
    assert max_abs_diff(half_batches, weights) > 1e-3
    assert len(metrics["loss"]) == len(metrics["seconds_per_step"]) == STEPS


def test_tensor_parallel_matches_one_process_on_the_same_batches(tensor_parallel, reference):
    weights, metrics, _ = tensor_parallel
    check_matches_one_process(weights, metrics, reference)


def test_pipeline_matches_one_process_on_the_same_batches(pipeline, reference):
    weights, metrics, stdout = pipeline
    check_matches_one_process(weights, metrics, reference)
    assert "4 micro-batches, bubble (N-1)/(M+N-1) = 20%" in stdout


def test_tensor_parallel_and_pipeline_report_the_same_losses(tensor_parallel, pipeline):
    assert tensor_parallel[1]["loss"] == pytest.approx(pipeline[1]["loss"], abs=1e-5)


@pytest.mark.parametrize("run", ["tensor_parallel", "pipeline"])
def test_tensor_parallel_and_pipeline_checkpoints_load_into_the_plain_model(run, request):
    """--save gathers the parts (DTensor shards, pipeline stages) into one plain state_dict."""
    weights = request.getfixturevalue(run)[0]
    assert all(type(t) is torch.Tensor for t in weights.values())
    plain_mlp(WIDTH).load_state_dict(weights)  # strict: every key, every shape


def test_tensor_parallel_model_is_lesson_6s_mlp():
    script, comm = load_script("mnist_model_parallel"), load_script("mnist_ddp_comm")
    ours, lesson_6 = script.build_model().state_dict(), comm.build_model("mlp").state_dict()
    assert {k: t.shape for k, t in ours.items()} == {k: t.shape for k, t in lesson_6.items()}


def refusal(monkeypatch, capsys, *argv):
    """The script run as `python mnist_model_parallel.py ...`, in this process (it refuses before it
    spawns anything): the one line it exits with, which Python prints on stderr with exit status 1."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert capsys.readouterr().out == ""
    message = str(exit_info.value.code)
    assert message.startswith("mnist_model_parallel.py: error: ") and "\n" not in message
    return message


def test_tensor_parallel_refuses_a_width_the_ranks_cannot_split(monkeypatch, capsys, data_args):
    message = refusal(monkeypatch, capsys, "--mode", "tp", "--nprocs", 3, *data_args)
    assert message == ("mnist_model_parallel.py: error: --width 2048 does not split evenly over --nprocs 3 "
                       "(tensor parallelism gives each process width/nprocs features)")


def test_pipeline_refuses_micro_batches_that_do_not_divide_the_batch(monkeypatch, capsys, data_args):
    message = refusal(monkeypatch, capsys, "--mode", "pp", "--batch-size", 64, "--microbatches", 5,
                      *data_args)
    assert "--microbatches 5 does not divide --batch-size 64" in message


def test_pipeline_refuses_more_stages_than_the_mlp_has_layers(monkeypatch, capsys, data_args):
    message = refusal(monkeypatch, capsys, "--mode", "pp", "--nprocs", 4, *data_args)
    assert "--nprocs 4: the MLP has 3 linear layers, so at most 3 pipeline stages" in message


def test_pipeline_refuses_torchs_1f1b_with_fewer_micro_batches_than_stages(monkeypatch, capsys, data_args):
    message = refusal(monkeypatch, capsys, "--mode", "pp", "--nprocs", 3, "--microbatches", 2,
                      "--schedule", "1f1b", *data_args)
    assert "--schedule 1f1b (torch's Schedule1F1B) needs at least as many micro-batches as stages" in message


def test_1f1b_by_hand_takes_fewer_micro_batches_than_stages(tmp_path, data_args, reference):
    """Written out, 1F1B's warm-up is min(M, N - r) forwards: with one micro-batch on two stages it is
    GPipe's order, where torch's Schedule1F1B refuses. One process's weights, with the control."""
    weights, metrics, _ = train(tmp_path, data_args, "pp", "--microbatches", 1, "--schedule", "1f1b-by-hand")
    check_matches_one_process(weights, metrics, reference)
    assert [[kind for kind, *_ in stage[0]] for stage in metrics["timeline"]] == [["F", "B"], ["F", "B"]]


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory, data_args):
    return train(tmp_path_factory.mktemp("1f1b"), data_args, "pp", "--microbatches", "4",
                 "--schedule", "1f1b")


def test_1f1b_takes_gpipes_steps_and_holds_fewer_micro_batches(pipeline, one_f_one_b):
    """The same micro-batches in another order: the same weights. What each stage keeps for backward
    (counted through saved_tensors_hooks, weights left out): GPipe all M micro-batches' activations
    at once; 1F1B on stage r at most N - r of them, here 2 on stage 0 and 1 on the last stage."""
    assert max_abs_diff(pipeline[0], one_f_one_b[0]) == 0.0
    gpipe, one_f = pipeline[1]["saved_peak_bytes"], one_f_one_b[1]["saved_peak_bytes"]
    m, n = 4, 2
    for r in range(n):
        assert one_f[r] == pytest.approx(gpipe[r] * min(m, n - r) / m, rel=0.01), (r, gpipe, one_f)


@pytest.fixture(scope="module")
def one_f_one_b_by_hand(tmp_path_factory, data_args):
    return train(tmp_path_factory.mktemp("1f1b_by_hand"), data_args, "pp", "--microbatches", "4",
                 "--schedule", "1f1b-by-hand")


def test_1f1b_by_hand_takes_torchs_1f1b_steps_and_keeps_what_it_keeps(one_f_one_b, one_f_one_b_by_hand,
                                                                       reference):
    """The script's own 1F1B (sends and receives written out) against torch's Schedule1F1B: the same
    weights bit for bit (the same micro-batches, summed in the same order, then divided by M) and the
    same activations kept at each stage's peak; and one process's weights, with the control."""
    weights, metrics, _ = one_f_one_b_by_hand
    check_matches_one_process(weights, metrics, reference)
    assert max_abs_diff(one_f_one_b[0], weights) == 0.0
    assert metrics["saved_peak_bytes"] == one_f_one_b[1]["saved_peak_bytes"]


def schedule_order(schedule, rank, n, m):
    """The order stage `rank` of `n` runs its forwards and backwards of `m` micro-batches."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm_up = min(m, n - rank)
    order = [("F", i) for i in range(warm_up)]
    for i in range(m - warm_up):
        order += [("B", i), ("F", warm_up + i)]
    return order + [("B", i) for i in range(m - warm_up, m)]


@pytest.mark.parametrize("run", ["pipeline", "one_f_one_b", "one_f_one_b_by_hand"])
def test_pipeline_timeline_is_each_schedules_order_and_respects_the_messages(run, request):
    """The timestamps each stage records (--metrics-json "timeline", what lesson 11's figure draws)
    are those of the schedule: each step, stage r ran its forwards and backwards in the schedule's
    order, none overlapping; micro-batch i's forward on stage r+1 began after it ended on stage r,
    and its backward on stage r after it ended on stage r+1 (one clock for the processes of a machine)."""
    metrics = request.getfixturevalue(run)[1]
    schedule, timeline, m = metrics["schedule"], metrics["timeline"], metrics["microbatches"]
    n = len(timeline)
    assert n == 2 and all(len(stage) == STEPS for stage in timeline)
    for step in range(STEPS):
        events = [{(kind, i): (start, end) for kind, i, start, end in stage[step]} for stage in timeline]
        for r, stage in enumerate(timeline):
            order = schedule_order(schedule.split("-")[0], r, n, m)  # 1f1b-by-hand: 1F1B's order
            assert [(kind, i) for kind, i, _, _ in stage[step]] == order
            times = [t for _, _, start, end in stage[step] for t in (start, end)]
            assert times == sorted(times)
        for r in range(n - 1):
            for i in range(m):
                assert events[r + 1][("F", i)][0] > events[r][("F", i)][1]
                assert events[r][("B", i)][0] > events[r + 1][("B", i)][1]
    assert len(metrics["idle_shares"]) == n and all(0 < share < 1 for share in metrics["idle_shares"])


@pytest.mark.parametrize("n,m", [(2, 1), (2, 4), (3, 4), (4, 8)])
def test_idle_shares_of_an_ideal_gpipe_step_are_the_bubble(n, m):
    """On a made-up timeline where every forward and backward takes one slot and nothing else takes
    time, GPipe's stages idle (N-1)/(M+N-1) of each step; a slot's work lengthened on one stage (or a
    gap) shows: the idle shares are measured, not the formula."""
    idle_shares = load_script("mnist_model_parallel").idle_shares
    backward = [m + 2 * (n - 1) - r for r in range(n)]  # the slot of stage r's first backward
    step = [[("F", i, r + i, r + i + 1) for i in range(m)] +
            [("B", i, backward[r] + i, backward[r] + i + 1) for i in range(m)] for r in range(n)]
    timeline = [[stage, stage] for stage in step]  # two steps: the first is left out
    assert idle_shares(timeline) == pytest.approx([(n - 1) / (m + n - 1)] * n)
    late = [[stage, [(k, i, b + 1, e + 1) if (k, i) == ("B", m - 1) and r == 0 else (k, i, b, e)
                     for k, i, b, e in stage]] for r, stage in enumerate(step)]
    assert idle_shares(late)[1] > (n - 1) / (m + n - 1)
