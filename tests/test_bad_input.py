"""Mistakes a user makes get one line on stderr, a non-zero exit, within seconds, no traceback."""
import socket
import time

import pytest
from conftest import OFFLINE, run_script, script_env, torchrun

SCRIPTS = ["mnist_single.py", "mnist_ddp_cpu.py", "mnist_ddp_gpu.py"]
CPU_ONLY = {"mnist_ddp_gpu.py": ["--backend", "gloo", "--device", "cpu"]}  # runs without a GPU
LIMIT_S = 30  # "within seconds": generous for a loaded 2-core machine, far from a hang


def refused(script, *args, env=None):
    start = time.monotonic()
    r = run_script(script, *args, env=env, timeout=LIMIT_S + 30)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    assert elapsed < LIMIT_S
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error" in lines[0]
    return lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("args, expected", [
    (["--batch-size", "-8"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--model", "resnet"], "invalid choice"),
    (["--dataset", "imagenet"], "invalid choice"),
    (["--max-steps", "zero"], "--max-steps"),
])
def test_bad_flag_values(script, args, expected):
    assert expected in refused(script, *args)


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_zero_processes(script):
    assert "--nprocs" in refused(script, "--nprocs", "0")


@pytest.mark.parametrize("script", SCRIPTS)
def test_mnist_asked_for_offline_without_files(tmp_path, script):
    line = refused(script, *CPU_ONLY.get(script, []), "--dataset", "mnist", "--data-dir", tmp_path,
                   env=script_env(**OFFLINE))
    assert "MNIST" in line and "--dataset fashion-mnist" in line


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_master_port_in_use(script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = refused(script, *CPU_ONLY.get(script, []), "--max-steps", "1",
                       env=script_env(MASTER_PORT=port))
    assert f"MASTER_PORT={port}" in line


@pytest.mark.parametrize("script", [*SCRIPTS, "gcn_ddp.py"])
@pytest.mark.parametrize("flag", ["--metrics-json", "--save"])
def test_output_that_cannot_be_written_is_refused_before_training(blocker, script, flag):
    """Not after an hour of training."""
    if script == "gcn_ddp.py":
        pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
    cpu = ["--device", "cpu", "--num-nodes", "2000"] if script == "gcn_ddp.py" else CPU_ONLY.get(script, [])
    line = refused(script, *cpu, "--max-steps", "1", flag, blocker / "out")
    assert f"cannot write {blocker / 'out'}" in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_data_dir_that_cannot_be_created(blocker, script):
    line = refused(script, *CPU_ONLY.get(script, []), "--data-dir", blocker / "data")
    assert "cannot use --data-dir" in line


@pytest.mark.parametrize("script", SCRIPTS[:2])
def test_missing_output_folders_are_created(tmp_path, script, data_args):
    save, metrics = tmp_path / "new" / "deeper" / "weights.pt", tmp_path / "other" / "metrics.json"
    r = run_script(script, "--model", "linear", "--max-steps", "2", "--quiet", "--save", save,
                   "--metrics-json", metrics, *data_args)
    assert r.returncode == 0, r.stderr
    assert save.stat().st_size > 0 and metrics.stat().st_size > 0


@pytest.mark.parametrize("script, args, expected, restarts", [
    ("mnist_ddp_cpu.py", ["--epochs", "0"], "--epochs", 2),  # the parser (through the roll call)
    ("mnist_ddp_gpu.py", ["--device", "cpu", "--amp", "fp16"], "--amp fp16 needs a GPU", 0),  # a check
])
def test_under_torchrun_a_refusal_is_said_once(script, args, expected, restarts):
    """Every rank refuses; one of them says so (it was one line from each rank). With torchrun
    --max-restarts, every attempt is refused; only the first says so (it was one line each)."""
    start = time.monotonic()
    launcher = [*torchrun(2), "--max-restarts", str(restarts)]
    r = run_script(script, *args, launcher=launcher, timeout=LIMIT_S + 30)
    assert r.returncode != 0 and time.monotonic() - start < LIMIT_S
    lines = [line for line in r.stderr.splitlines() if line.startswith(f"{script}: error:")]
    assert len(lines) == 1 and expected in lines[0], r.stderr
    assert "]: Traceback" not in r.stderr


@pytest.mark.parametrize("script", ["gcn_ddp.py", "gcn_single.py"])
@pytest.mark.parametrize("missing, expected", [
    ("torch_geometric", "torch_geometric is not installed: pip install torch_geometric"),
    ("the sampler", "NeighborLoader needs pyg-lib or torch-sparse: pip install torch_geometric pyg_lib"),
])
def test_lesson_4_without_pyg_says_what_to_install(tmp_path, script, missing, expected):
    """Where PyG, or its neighbour sampler, is not installed (`make demo` does not install it),
    lesson 4's scripts say in one line what to install. A package of the same name, found first
    on the path, stands in for what is missing."""
    fake = tmp_path / "torch_geometric"
    fake.mkdir()
    if missing == "torch_geometric":
        (fake / "__init__.py").write_text("raise ImportError('No module named torch_geometric')\n")
    else:  # PyG without pyg-lib or torch-sparse
        (fake / "__init__.py").write_text("")
        (fake / "typing.py").write_text("WITH_PYG_LIB = False\nWITH_TORCH_SPARSE = False\n")
    line = refused(script, "--device", "cpu", "--dataset", "synthetic", env=script_env(PYTHONPATH=tmp_path))
    assert expected in line, line
