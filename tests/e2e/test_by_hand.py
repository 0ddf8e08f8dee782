"""mnist_by_hand.py, data parallelism without DDP, in its four ways of averaging the gradients
(per-tensor, flat, overlap, bucketed): each ends with DDP's weights on the same global batch, for
2 and 3 ranks, with dropout, with a parameter shared by two layers and a frozen one; an
unsynchronised control ends elsewhere. And the script itself, launched per mode."""
from pathlib import Path

import pytest
import torch
from helpers import GPUS, SCRIPTS, free_port, max_abs_diff, needs_gpu, run_script, script_env

HARNESS = Path(__file__).with_name("by_hand_harness.py")
MODES = ["per-tensor", "flat", "overlap", "bucketed"]


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                ids=["2-ranks", "3-ranks"])
def every_way(request, tmp_path_factory, data_args):
    out = tmp_path_factory.mktemp("by-hand") / "weights.pt"
    r = run_script(HARNESS, request.param, SCRIPTS / "mnist_by_hand.py", data_args[1], data_args[3], out,
                   timeout=300, env=script_env(HARNESS_PORT=free_port()))
    assert r.returncode == 0, r.stderr
    return torch.load(out)


@pytest.mark.parametrize("model", ["convnet", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_each_way_ends_with_ddps_weights(every_way, mode, model):
    ddp = every_way[("ddp", model)]
    assert max_abs_diff(every_way[(mode, model)], ddp) < 1e-6
    # the control: without the averaging, rank 0 trains on its own batches and ends elsewhere
    assert max_abs_diff(every_way[("none", model)], ddp) > 1e-3


@needs_gpu
def test_each_way_ends_with_ddps_weights_on_gpus(tmp_path, data_args):
    """The same classes on CUDA tensors with NCCL, one GPU per rank (up to 2): their buffers on the
    gradients' device, each way still DDP's steps (to 1e-4: cuDNN's convolutions may pick other
    algorithms from run to run)."""
    world = min(2, GPUS)
    out = tmp_path / "weights.pt"
    r = run_script(HARNESS, world, SCRIPTS / "mnist_by_hand.py", data_args[1], data_args[3], out,
                   timeout=300, env=script_env(HARNESS_PORT=free_port(), HARNESS_DEVICE="cuda"), fresh=True)
    assert r.returncode == 0, r.stderr
    got = torch.load(out)
    for model in ("convnet", "shared"):
        for mode in MODES:
            assert max_abs_diff(got[(mode, model)], got[("ddp", model)]) < 1e-4, (mode, model)
        if world > 1:  # the control
            assert max_abs_diff(got[("none", model)], got[("ddp", model)]) > 1e-3, model


@pytest.mark.parametrize("mode", MODES)
def test_the_script_in_each_mode_takes_the_steps_of_ddp_and_of_one_process(trained, mode):
    world_size, batch = 2, 32
    common = ["--nprocs", world_size, "--batch-size", batch]
    bucket = ["--bucket-mb", 0.01] if mode == "bucketed" else []
    # overlap: in a new interpreter, its ranks started by mp.spawn's real spawn (the others are
    # forked from the suite's preloaded Python, notebooks/launcher.py)
    by_hand = trained("mnist_by_hand.py", "--sync", mode, *bucket, *common, fresh=mode == "overlap")
    ddp = trained("mnist_ddp_cpu.py", *common)
    single = trained("mnist_single.py", "--batch-size", world_size * batch)
    assert max_abs_diff(ddp, by_hand) < 1e-6
    assert max_abs_diff(single, by_hand) < 1e-5
    # The control: one process with one rank's batch takes other steps, so the comparison can fail.
    alone = trained("mnist_single.py", "--batch-size", batch)
    assert max_abs_diff(alone, by_hand) > 1e-3
