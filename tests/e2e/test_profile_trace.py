"""--profile DIR: a torch.profiler trace per rank, with backward's operators and the all-reduces on
Gloo's threads (mnist_ddp_comm.py); and the claim of figures/ddp_overlap_trace.png, read from
traces by tools/figures/draw_overlap_trace.py's parsing: the by-hand overlap mode starts an all-reduce
while backward still computes, the per-tensor mode never does."""
import sys

import pytest
from helpers import REPO, load_script, refused_in_process, run_script

sys.path.insert(0, str(REPO / "tools" / "figures"))
import draw_overlap_trace as trace  # noqa: E402

MLP = ["--nprocs", 2, "--model", "mlp", "--max-steps", 6, "--threads-per-proc", 1]
RECORDED = ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # wait 1, warm up 1, record 3


@pytest.fixture(scope="module")
def by_hand_traces(tmp_path_factory, data_args):
    """{mode: the steps of rank 0's trace} for the MLP trained by hand, per-tensor and overlap."""
    folder = tmp_path_factory.mktemp("by-hand-traces")
    steps = {}
    for mode in ("per-tensor", "overlap"):
        r = run_script("mnist_by_hand.py", *MLP, "--sync", mode, "--profile", folder / mode, *data_args,
                       timeout=120)
        assert r.returncode == 0, r.stderr
        steps[mode] = trace.read_steps(folder / mode / "rank0.json")
    return steps


def test_ddp_writes_a_trace_per_rank_with_backward_and_its_all_reduces(tmp_path, data_args):
    r = run_script("mnist_ddp_comm.py", "--backend", "gloo", "--device", "cpu", *MLP, "--quiet",
                   "--profile", tmp_path / "traces", *data_args, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        steps = trace.read_steps(tmp_path / "traces" / f"rank{rank}.json")
        assert [s.name for s in steps] == RECORDED  # optimizer steps 3 to 5, once
        for s in steps:
            assert "AddmmBackward0" in {op for op, _, _ in s.backward}
            assert s.allreduce, f"rank {rank}, {s.name}: no gloo:all_reduce on a thread of its own"


@pytest.mark.slow  # two launches of 2 spawned processes: about 20 s
def test_the_overlap_mode_all_reduces_while_backward_computes(by_hand_traces):
    steps = by_hand_traces["overlap"]
    assert [s.name for s in steps] == RECORDED
    assert any(trace.overlapping(s) and trace.overlap_ms(s) > 0 for s in steps), \
        [(s.name, s.backward_end, s.allreduce) for s in steps]


@pytest.mark.slow  # two launches of 2 spawned processes: about 20 s
def test_the_per_tensor_mode_all_reduces_only_after_backward(by_hand_traces):
    steps = by_hand_traces["per-tensor"]
    assert [s.name for s in steps] == RECORDED
    for s in steps:
        assert s.allreduce  # there is something to find ...
        assert not trace.overlapping(s) and trace.overlap_ms(s) == 0  # ... but none during backward


def test_overlap_is_measured_within_backward():
    step = trace.Step("ProfilerStep#0", 100.0, backward=[("AddmmBackward0", 10.0, 40.0),
                                                         (trace.ACCUMULATE, 40.0, 60.0)],
                      allreduce=[(0, 20.0, 30.0), (1, 25.0, 50.0), (0, 70.0, 80.0)])
    assert step.backward_end == 40.0  # AccumulateGrad computes no gradient: it does not count
    assert trace.overlapping(step) == [(0, 20.0, 30.0), (1, 25.0, 50.0)]
    assert trace.overlap_ms(step) == 20.0  # 20 to 40, counted once though two all-reduces run


def test_a_profile_folder_that_cannot_be_made_is_refused(monkeypatch, blocker):
    line = refused_in_process(load_script("mnist_ddp_comm"), ["--backend", "gloo", "--device", "cpu",
                                                              "--profile", blocker / "traces"], monkeypatch)
    assert f"cannot write {blocker / 'traces' / 'rank0.json'}" in line
