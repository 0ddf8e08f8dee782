"""ddp_scripts/libraries/: lesson 2's training written with Accelerate and with Lightning Fabric
(docs/LIBRARIES.md), each run on 2 CPU processes with accumulation over 2 micro-batches, ends with
the weights one process reaches on the same global batches, and counts the same correct test
images (an odd number of them: Accelerate's gather_for_metrics must drop the copy it pads with)."""
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, load_script, run_script, write_tiny_mnist

parts = load_script("mnist_parts")
STEPS, BATCH, LR, EVAL = 6, 16, 0.05, 39  # the tiny data set's 96 images: 6 global batches of 16


def one_process(data_dir):
    """The reference: one process, the same model and seed, SGD on the same global batches in order."""
    images, labels = parts.load_split("mnist", str(data_dir), train=True)
    torch.manual_seed(0)
    model = parts.build_model("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for k in range(STEPS):
        optimizer.zero_grad()
        batch = slice(k * BATCH, (k + 1) * BATCH)
        F.cross_entropy(model(images[batch]), labels[batch]).backward()
        optimizer.step()
    test_images, test_labels = parts.load_split("mnist", str(data_dir), train=False)
    with torch.no_grad():
        correct = (model(test_images[:EVAL]).argmax(1) == test_labels[:EVAL]).sum().item()
    return model.state_dict(), correct


@pytest.mark.parametrize("script, library", [("with_accelerate.py", "accelerate"),
                                             ("with_fabric.py", "lightning_fabric")])
def test_the_library_trains_as_one_process_on_the_global_batch(tmp_path, script, library):
    pytest.importorskip(library, reason=f"{library} is not installed (make setup installs "
                                        f"requirements-libraries.txt)")
    write_tiny_mnist(tmp_path / "data")
    r = run_script(f"libraries/{script}", "--nprocs", 2, "--batch-size", BATCH, "--accum", 2, "--lr", LR,
                   "--max-steps", STEPS, "--eval-images", EVAL, "--data-dir", tmp_path / "data",
                   "--save", tmp_path / "model.pt", "--metrics-json", tmp_path / "metrics.json",
                   timeout=180, fresh=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 2 processes, test accuracy" in r.stdout, r.stdout
    expected, correct = one_process(tmp_path / "data")
    theirs = torch.load(tmp_path / "model.pt")
    assert list(theirs) == list(expected)
    for name in expected:
        torch.testing.assert_close(theirs[name], expected[name], rtol=0, atol=1e-6)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == {"world_size": 2, "correct": correct, "total": EVAL}


def test_the_examples_are_where_the_page_says():
    page = (REPO / "docs" / "LIBRARIES.md").read_text()
    for script in ("with_accelerate.py", "with_fabric.py"):
        assert f"ddp_scripts/libraries/{script}" in page
