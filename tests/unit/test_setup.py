"""The set-up in layers: where lesson 4's neighbour sampler comes from (prebuilt wheels, PyG's
index, or the sources), decided offline against local folders standing in for each."""
import re
import shutil
import sys
import time

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "setup"))
import install_graph  # noqa: E402

TAG = install_graph.PYTHON_TAG
FITTING = [f"torch_scatter-2.1.2-{TAG}-{TAG}-linux_x86_64.whl",
           f"torch_sparse-0.6.18-{TAG}-{TAG}-linux_x86_64.whl"]


def index_page(folder, names):
    """A folder with an index page listing `names`, as PyG's wheel index lists its wheels."""
    folder.mkdir(exist_ok=True)
    links = "".join(f'<a href="{name.replace("+", "%2B")}">{name}</a><br>' for name in names)
    (folder / "index.html").write_text(f"<html><body>{links}</body></html>")
    return (folder / "index.html").as_uri()


def test_prebuilt_wheels_come_first(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in FITTING:
        (wheels / name).write_bytes(b"")
    assert install_graph.choose(wheels, index_page(tmp_path / "index", FITTING)) == ("wheels", str(wheels))


def test_then_pyg_index_when_it_lists_wheels_for_this_python(tmp_path):
    names = [n.replace("-2.1.2-", "-2.1.2+pt214cpu-").replace("-0.6.18-", "-0.6.18+pt214cpu-")
             for n in FITTING]
    url = index_page(tmp_path / "index", names)
    assert install_graph.choose(tmp_path / "no-wheels", url) == ("index", url)


def test_wheels_for_another_python_do_not_count(tmp_path):
    other = [n.replace(TAG, "cp38") for n in FITTING]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in other:
        (wheels / name).write_bytes(b"")
    assert install_graph.choose(wheels, index_page(tmp_path / "index", other)) == ("source", None)
    # half the sampler is not enough either
    chosen = install_graph.choose(tmp_path / "none", index_page(tmp_path / "half", FITTING[:1]))
    assert chosen == ("source", None)


def test_offline_the_sources_are_chosen_in_seconds():
    start = time.monotonic()
    chosen = install_graph.choose("/nonexistent", "http://127.0.0.1:9/whl/torch.html", timeout=5)
    assert chosen == ("source", None)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("version, cuda, tag", [("2.14.1+cu130", "13.0", "torch-2.14.0+cu130"),
                                                ("2.8.0", None, "torch-2.8.0+cpu")])
def test_pyg_index_names_the_torch_and_cuda(monkeypatch, version, cuda, tag):
    import torch

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert install_graph.torch_tag() == tag


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_help_lists_every_target_in_its_group():
    """`make` alone, or `make help`: every target the README or a maintainer uses, with its line."""
    import re
    import subprocess

    r = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^  make (\S+) ", r.stdout, re.M))
    makefile = (REPO / "Makefile").read_text()
    documented = set(re.findall(r"^([a-z][a-z-]*):.*## ", makefile, re.M))
    assert listed == documented and {"demo", "test", "lab", "test-quick", "kaggle", "help"} <= listed
    assert "\nThe course\n" in r.stdout and "\nMaintainers" in r.stdout
    r = subprocess.run(["make", "-s"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip().startswith("The course"), "make alone should show the help"


def test_the_gpu_session_names_tests_and_scripts_that_exist():
    """tools/gpu/gpu_session.sh runs chosen tests and scripts on a GPU machine; a path that has moved
    would only show there, as a missing file, in the little time such a machine is at hand."""
    text = (REPO / "tools" / "gpu" / "gpu_session.sh").read_text()
    paths = set(re.findall(r"\b((?:tests|ddp_scripts|tools|notebooks)/[\w/]+\.(?:py|ipynb))", text))
    assert {"tests/e2e/test_resume.py", "tests/unit/test_gpu_checks.py", "ddp_scripts/mnist_fsdp.py"} <= paths
    assert not [p for p in paths if not (REPO / p).exists()]


@pytest.mark.parametrize("index", ["", "https://download.pytorch.org/whl/cpu"])
def test_torch_index_reaches_pip_before_the_requirements(tmp_path, index):
    """`make base TORCH_INDEX=...` (PyTorch's CPU build, for a machine without a GPU): torch and
    torchvision come from that index first, with the same constraints, then the requirements from
    PyPI; without it, only the requirements. Run with a stand-in Python that logs what pip is given."""
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    python.chmod(0o755)
    r = subprocess.run(["make", "-B", f"VENV={venv}", *([f"TORCH_INDEX={index}"] if index else []),
                        str(venv / ".installed-base")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    pip = "-m pip install --quiet --disable-pip-version-check -c constraints.txt"
    expected = [f"{pip} torch torchvision --index-url {index}"] if index else []
    assert calls == expected + [f"{pip} -r requirements.txt"], calls
