"""Which dataset the scripts use, and where its files come from (MNIST, or Fashion-MNIST offline)."""
import os

import pytest
import torch
from conftest import DATA_DIR, OFFLINE, load_script, read_metrics, run_script, script_env, write_idx

single = load_script("mnist_single")
needs_package = pytest.mark.skipif(
    not os.path.isdir(single.FASHION_MNIST_PACKAGE_DIR),
    reason="Debian's dataset-fashion-mnist is not installed (make setup installs it as root)")


def write_tiny_mnist(data_dir, n_train=96, n_test=40):
    """Learnable fake MNIST files: the label is which quarter of the image is bright."""
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8)
        images = torch.randint(0, 60, (n, 28, 28), generator=g, dtype=torch.uint8)
        for i, label in enumerate(labels.tolist()):
            r, c = divmod(label, 2)
            images[i, 14 * r:14 * r + 14, 14 * c:14 * c + 14] += 180
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)


def test_mnist_files_in_torchvisions_layout_are_found_and_read(tmp_path):
    write_tiny_mnist(tmp_path)
    assert single.prepare_data("auto", str(tmp_path)) == "mnist"
    images, labels = single.load_split("mnist", str(tmp_path), train=True)
    assert images.shape == (96, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (96,) and labels.dtype == torch.int64 and labels.max() <= 3


@pytest.mark.parametrize("train", [True, False], ids=["train", "test"])
def test_the_scripts_read_the_files_as_torchvision_does(dataset, train):
    """The scripts read the IDX files themselves (importing torchvision costs every process ~1.5 s);
    what they read must be what torchvision's own dataset class reads."""
    from torchvision import datasets

    reference = getattr(datasets, single.FOLDERS[dataset])(str(DATA_DIR), train=train, download=False)
    images, labels = single.load_split(dataset, str(DATA_DIR), train=train)
    mean, std = single.MEAN_STD[dataset]
    assert torch.equal(labels, reference.targets)
    assert torch.equal(images, reference.data.float().div(255).sub(mean).div(std).unsqueeze(1))


def test_a_file_cut_short_is_refused_in_one_line(tmp_path):
    write_tiny_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])  # an interrupted copy
    with pytest.raises(single.UsageError, match="is not a whole MNIST-format file .* delete it"):
        single.load_split("mnist", str(tmp_path), train=False)
    path.write_bytes(b"<html>")  # a proxy's error page saved under the file's name
    with pytest.raises(single.UsageError, match="is not a whole MNIST-format file"):
        single.load_split("mnist", str(tmp_path), train=False)


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


@needs_package
def test_explicit_fashion_mnist_prepares_an_empty_data_dir_from_the_package(tmp_path):
    assert single.prepare_data("fashion-mnist", str(tmp_path), verbose=False) == "fashion-mnist"
    images, labels = single.load_split("fashion-mnist", str(tmp_path), train=False)
    assert images.shape == (10000, 1, 28, 28)
    assert torch.bincount(labels).tolist() == [1000] * 10
    # normalised with the dataset's own statistics
    assert abs(images.mean().item()) < 0.05 and abs(images.std().item() - 1) < 0.05


def test_offline_without_a_proxy_no_download_is_tried(tmp_path):
    """Where the mirror's name cannot be looked up, try_download says so at once, without
    importing torchvision; with a proxy set, the lookup is the proxy's and torchvision is asked."""
    import json
    import subprocess
    import sys
    from urllib.parse import urlparse

    from conftest import SCRIPTS
    from torchvision import datasets

    mirror = urlparse(datasets.MNIST.mirrors[0]).hostname  # the name looked up must be torchvision's
    probe = f"""
import socket, sys
sys.path.insert(0, {str(SCRIPTS)!r})
import mnist_single
looked_up = []
def refuse(host, *args, **kwargs):
    looked_up.append(host)
    raise socket.gaierror(-2, "Name or service not known")
socket.getaddrinfo = refuse
import json
tried = mnist_single.try_download("mnist", {str(tmp_path)!r})
print(json.dumps([tried, looked_up, "torchvision" in sys.modules]))
"""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(r.stdout) == [False, [mirror], False], r.stderr
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       env={**env, **OFFLINE})  # a proxy where nothing listens
    found, looked_up, imported = json.loads(r.stdout)
    assert (found, imported) == (False, True) and mirror not in looked_up, r.stderr
