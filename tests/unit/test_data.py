"""Which dataset the scripts use, and where its files come from (MNIST, or Fashion-MNIST offline)."""
import os

import pytest
import torch
from helpers import DATA_DIR, load_script, write_tiny_mnist

single = load_script("mnist_parts")  # the MNIST pieces every lesson imports
needs_package = pytest.mark.skipif(
    not os.path.isdir(single.FASHION_MNIST_PACKAGE_DIR),
    reason="Debian's dataset-fashion-mnist is not installed (make setup installs it as root)")


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


@needs_package
def test_explicit_fashion_mnist_prepares_an_empty_data_dir_from_the_package(tmp_path):
    assert single.prepare_data("fashion-mnist", str(tmp_path), verbose=False) == "fashion-mnist"
    images, labels = single.load_split("fashion-mnist", str(tmp_path), train=False)
    assert images.shape == (10000, 1, 28, 28)
    assert torch.bincount(labels).tolist() == [1000] * 10
    # normalised with the dataset's own statistics
    assert abs(images.mean().item()) < 0.05 and abs(images.std().item() - 1) < 0.05


@pytest.mark.parametrize("name, argv", [("mnist_by_hand", []), ("sharding_by_hand", []),
                                        ("mnist_model_parallel", ["--mode", "tp"])])
def test_a_failed_download_is_not_taken_for_mnist(tmp_path, name, argv):
    """torchvision's failed download leaves data/MNIST/raw behind, empty or partly filled: the
    scripts that choose by what is on disk look for every file, never the folder."""
    write_tiny_mnist(tmp_path / "fashion")  # four files in MNIST's layout, moved to Fashion-MNIST's
    (tmp_path / "FashionMNIST").mkdir()
    (tmp_path / "fashion" / "MNIST" / "raw").rename(tmp_path / "FashionMNIST" / "raw")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")  # the first of four files, begun
    assert load_script(name).parse_args([*argv, "--data-dir", str(tmp_path)]).dataset == "fashion-mnist"
