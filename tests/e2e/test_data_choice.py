"""Which dataset the scripts choose, launched as a user would: MNIST when its files are there,
Fashion-MNIST offline (announced once), and no download tried where none can work."""
import os

import pytest
from helpers import OFFLINE, load_script, read_metrics, run_script, script_env, write_tiny_mnist

single = load_script("mnist_parts")  # the MNIST pieces every lesson imports
pytestmark = pytest.mark.slow  # left out of make test-quick
needs_package = pytest.mark.skipif(
    not os.path.isdir(single.FASHION_MNIST_PACKAGE_DIR),
    reason="Debian's dataset-fashion-mnist is not installed (make setup installs it as root)")


@pytest.mark.parametrize("script, extra", [("mnist_single.py", []),
                                           ("mnist_ddp_cpu.py", ["--nprocs", "2"])])
def test_auto_prefers_mnist_when_its_files_are_there(tmp_path, script, extra):
    write_tiny_mnist(tmp_path / "data")
    out = tmp_path / "m.json"
    r = run_script(script, *extra, "--model", "linear", "--batch-size", 16, "--epochs", 2,
                   "--data-dir", tmp_path / "data", "--metrics-json", out, env=script_env(**OFFLINE))
    assert r.returncode == 0, r.stderr
    assert "Fashion" not in r.stdout
    metrics = read_metrics(out)
    assert metrics["dataset"] == "mnist"
    assert metrics["epochs"][-1]["test_accuracy"] > 0.5  # 4 classes: chance is 0.25


@needs_package
def test_auto_falls_back_to_fashion_mnist_offline_and_says_so(tmp_path):
    out = tmp_path / "m.json"
    r = run_script("mnist_single.py", "--model", "linear", "--max-steps", 5, "--data-dir", tmp_path,
                   "--metrics-json", out, env=script_env(**OFFLINE))
    assert r.returncode == 0, r.stderr
    announcements = [line for line in r.stdout.splitlines() if "Fashion-MNIST" in line]
    assert len(announcements) == 1
    assert read_metrics(out)["dataset"] == "fashion-mnist"
    assert single.have_files("fashion-mnist", str(tmp_path))


def test_offline_without_a_proxy_no_download_is_tried(tmp_path):
    """Where the mirror's name cannot be looked up, try_download says so at once, without
    importing torchvision; with a proxy set, the lookup is the proxy's and torchvision is asked."""
    import json
    import subprocess
    import sys
    from urllib.parse import urlparse

    from helpers import SCRIPTS
    from torchvision import datasets

    mirror = urlparse(datasets.MNIST.mirrors[0]).hostname  # the name looked up must be torchvision's
    probe = f"""
import socket, sys
sys.path.insert(0, {str(SCRIPTS)!r})
import mnist_parts
looked_up = []
def refuse(host, *args, **kwargs):
    looked_up.append(host)
    raise socket.gaierror(-2, "Name or service not known")
socket.getaddrinfo = refuse
import json
tried = mnist_parts.try_download("mnist", {str(tmp_path)!r})
print(json.dumps([tried, looked_up, "torchvision" in sys.modules]))
"""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(r.stdout) == [False, [mirror], False], r.stderr
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       env={**env, **OFFLINE})  # a proxy where nothing listens
    found, looked_up, imported = json.loads(r.stdout)
    assert (found, imported) == (False, True) and mirror not in looked_up, r.stderr
