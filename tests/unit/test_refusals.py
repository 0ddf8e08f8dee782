"""Mistakes a user makes get one line on stderr, a non-zero exit, within seconds, before anything is
trained or spawned: each script's command line run in this process (run_main, or a plain script's
main), nothing launched. tests/e2e/test_one_line_errors.py launches each script once as a user
would, for the part a process alone can show (no traceback, the exit code)."""
import socket
import sys

import pytest
from helpers import OFFLINE, load_script, needs_sampler, refused_in_process

CPU_ONLY = {"mnist_ddp_gpu": ["--backend", "gloo", "--device", "cpu"]}  # runs without a GPU
MNIST = ["mnist_single", "mnist_ddp_cpu", "mnist_ddp_gpu"]
MODULES = {}


def script(name):
    """Each script imported once for the whole file (a module's state is not changed by a refusal)."""
    if name not in MODULES:
        MODULES[name] = load_script(name)
    return MODULES[name]


def refused(name, monkeypatch, *argv, gpus=None):
    return refused_in_process(script(name), [*CPU_ONLY.get(name, []), *argv], monkeypatch, gpus=gpus)


@pytest.mark.parametrize("name", MNIST)
@pytest.mark.parametrize("args, expected", [
    (["--batch-size", "-8"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--model", "resnet"], "invalid choice"),
    (["--dataset", "imagenet"], "invalid choice"),
    (["--max-steps", "zero"], "--max-steps"),
    (["--epoch", "3"], "unrecognized arguments: --epoch 3"),  # no abbreviations
])
def test_bad_flag_values(monkeypatch, name, args, expected):
    assert expected in refused(name, monkeypatch, *args)


@pytest.mark.parametrize("name", MNIST[1:])
def test_zero_processes(monkeypatch, name):
    assert "--nprocs" in refused(name, monkeypatch, "--nprocs", "0")


@pytest.mark.parametrize("name", MNIST)
def test_mnist_asked_for_offline_without_files(monkeypatch, tmp_path, name):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    line = refused(name, monkeypatch, "--dataset", "mnist", "--data-dir", tmp_path)
    assert "MNIST" in line and "--dataset fashion-mnist" in line


@pytest.mark.parametrize("name", MNIST[1:])
def test_master_port_in_use(monkeypatch, data_args, name):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        line = refused(name, monkeypatch, "--max-steps", "1", *data_args)
    assert f"MASTER_PORT={port}" in line


@pytest.mark.parametrize("name", [*MNIST, "gcn_ddp", "mnist_ddp_resume", "mnist_ddp_comm", "template_ddp"])
@pytest.mark.parametrize("flag", ["--metrics-json", "--save"])
def test_output_that_cannot_be_written_is_refused_before_training(monkeypatch, blocker, name, flag):
    """Not after an hour of training."""
    if name == "gcn_ddp":
        needs_sampler()
    extra = {"gcn_ddp": ["--device", "cpu", "--num-nodes", "2000"],
             "mnist_ddp_resume": ["--backend", "gloo", "--device", "cpu"],
             "mnist_ddp_comm": ["--backend", "gloo", "--device", "cpu"]}.get(name, [])
    line = refused(name, monkeypatch, *extra, "--max-steps", "1", flag, blocker / "out")
    assert f"cannot write {blocker / 'out'}" in line


@pytest.mark.parametrize("name", MNIST)
def test_data_dir_that_cannot_be_created(monkeypatch, blocker, name):
    assert "cannot use --data-dir" in refused(name, monkeypatch, "--data-dir", blocker / "data")


@pytest.mark.parametrize("name", ["gcn_ddp", "gcn_single"])
@pytest.mark.parametrize("missing, expected", [
    ("torch_geometric", "torch_geometric is not installed: pip install torch_geometric"),
    ("the sampler", "NeighborLoader needs pyg-lib or torch-sparse: pip install torch_geometric pyg_lib"),
])
def test_lesson_4_without_pyg_says_what_to_install(monkeypatch, name, missing, expected):
    """Where PyG, or its neighbour sampler, is not installed (`make demo` does not install it),
    lesson 4's scripts say in one line what to install. Modules of those names that fail to
    import, or that say no sampler is there, stand in for what is missing."""
    import types

    if missing == "torch_geometric":
        monkeypatch.setitem(sys.modules, "torch_geometric", None)  # `import torch_geometric` fails
    else:  # PyG without pyg-lib or torch-sparse
        typing = types.ModuleType("torch_geometric.typing")
        typing.WITH_PYG_LIB = typing.WITH_TORCH_SPARSE = False
        monkeypatch.setitem(sys.modules, "torch_geometric", types.ModuleType("torch_geometric"))
        monkeypatch.setitem(sys.modules, "torch_geometric.typing", typing)
    line = refused(name, monkeypatch, "--device", "cpu", "--dataset", "synthetic")
    assert expected in line, line


@pytest.mark.parametrize("args, expected", [
    (["--accum-steps", "0"], "--accum-steps"),
    (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
    (["--comm-hook", "int8"], "invalid choice"),
])
def test_lesson_6_bad_values_of_its_flags(monkeypatch, args, expected):
    assert expected in refused("mnist_ddp_comm", monkeypatch, "--backend", "gloo", "--device", "cpu", *args)


@pytest.mark.parametrize("args, expected", [
    (["--watchdog", "-1"], "--watchdog"),
    (["--check-sync-every", "x"], "--check-sync-every"),
    (["--bug", "segfault"], "invalid choice"),
])
def test_lesson_8_bad_values_of_its_flags(monkeypatch, args, expected):
    assert expected in refused("mnist_ddp_debug", monkeypatch, *args)


@pytest.mark.parametrize("args, expected", [
    (["--sync", "ring"], "invalid choice"),
    (["--sync", "bucketed", "--bucket-mb", "0"], "--bucket-mb"),
    (["--sync", "flat", "--bucket-mb", "4"], "--bucket-mb sets the buckets of --sync bucketed"),
])
def test_the_by_hand_modes_bad_values(monkeypatch, data_args, args, expected):
    assert expected in refused("mnist_by_hand", monkeypatch, *args, "--data-dir", data_args[3])


def test_the_by_hand_profile_folder_that_cannot_be_made(monkeypatch, blocker, data_args):
    line = refused("mnist_by_hand", monkeypatch, "--profile", blocker / "traces", "--data-dir", data_args[3])
    assert f"cannot use --profile {blocker / 'traces'}" in line


@pytest.mark.parametrize("args, expected", [
    (["--epochs", "0"], "--epochs"),
    (["--data", "no-such-file.pt"], "no data file at no-such-file.pt"),
    (["--device", "cpu", "--backend", "nccl"], "NCCL needs CUDA tensors"),
])
def test_the_template_refuses_in_one_line(monkeypatch, tmp_path, args, expected):
    monkeypatch.chdir(tmp_path)
    assert expected in refused("template_ddp", monkeypatch, *args)


def test_the_template_has_no_preparation_flag_when_it_has_nothing_to_prepare(monkeypatch):
    """add_hardening_flags(p, prepare=False): --prepare-timeout exists only where data is prepared."""
    template = script("template_ddp")
    assert template.parse_args([]).prepare_timeout == 3600
    monkeypatch.setattr(template, "prepare_data", None)
    assert not hasattr(template.parse_args([]), "prepare_timeout")
    assert "--prepare-timeout" in refused("template_ddp", monkeypatch, "--prepare-timeout", "5")


def test_a_network_interface_this_machine_lacks_is_refused(monkeypatch, data_args):
    """GLOO_SOCKET_IFNAME naming an interface that is not here: one line, before any worker starts
    (Gloo itself stops every rank with a C++ traceback). Interfaces that exist pass."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert script("mnist_ddp_cpu").hardening.check_network() is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,nosuch0")
    line = refused("mnist_ddp_cpu", monkeypatch, "--max-steps", "1", *data_args)
    assert "GLOO_SOCKET_IFNAME=lo,nosuch0: this machine has no network interface nosuch0 (it has " in line
    assert "lo" in line.split("(it has ")[1]


@pytest.mark.parametrize("args, expected", [
    (["--model", "linear", "--batchnorm", "sync"], "use --model bnnet"),
    (["--uneven", "-1"], "--uneven must be 0 or more"),
    (["--float64", "--amp", "bf16"], "use one of them"),
])
def test_lesson_12s_flags_that_do_not_go_together(monkeypatch, args, expected):
    assert expected in refused("mnist_ddp_practice", monkeypatch, *args)
