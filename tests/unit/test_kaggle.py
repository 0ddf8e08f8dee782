"""The Kaggle notebook runs the repository's scripts, not hand-kept copies."""
import json
import os
import tempfile

import nbformat
import pytest
from helpers import REPO, SCRIPTS

KAGGLE = REPO / "kaggle"
NOTEBOOK = KAGGLE / "ddp_t4x2.ipynb"
KAGGLE_FILES = ("ddp_hardening.py", "mnist_parts.py", "gcn_parts.py", "mnist_single.py", "mnist_ddp_cpu.py",
                "mnist_ddp_gpu.py", "mnist_ddp_resume.py", "mnist_ddp_comm.py", "mnist_fsdp.py", "gcn_ddp.py")


def test_notebook_is_generated_from_the_current_scripts():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(REPO / "tools" / "generate" / "build_kaggle_notebook.py"),
                        "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_notebook_is_valid_and_embeds_every_script_verbatim():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    written = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%writefile "):
            header, _, body = cell.source.partition("\n")
            written[header.split()[1]] = body
    assert sorted(written) == sorted(KAGGLE_FILES)  # each file once
    for name in KAGGLE_FILES:
        assert written[name].rstrip() == (SCRIPTS / name).read_text().rstrip()
    source_lines = sum(len(cell.source.splitlines()) for cell in nb.cells)
    assert source_lines <= 3500, f"{source_lines} source lines"
    assert all(c.get("outputs", []) == [] for c in nb.cells if c.cell_type == "code")


def test_kernel_metadata_points_at_the_notebook_with_gpu_and_internet():
    meta = json.loads((KAGGLE / "kernel-metadata.json").read_text())
    assert (KAGGLE / meta["code_file"]).exists()
    assert meta["kernel_type"] == "notebook" and meta["language"] == "python"
    assert meta["enable_gpu"] is True and meta["enable_internet"] is True


def test_code_cells_compile():
    # The GPU cells cannot run here; at least every cell must be valid Python.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            source = cell.source.partition("\n")[2] if cell.source.startswith("%%") else cell.source
            compile(source, f"{NOTEBOOK.name} cell {i}", "exec")


def slug(title):
    """Kaggle's kernel slug: the title lowercased, runs of other characters turned into one dash."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def test_kernel_metadata_asks_for_two_t4s_and_its_title_matches_its_id():
    meta = json.loads((KAGGLE / "kernel-metadata.json").read_text())
    # enable_gpu alone has given a P100 ("GPU P100", one GPU); NvidiaTeslaT4 is "GPU T4 x2"
    assert meta["machine_shape"] == "NvidiaTeslaT4"
    assert slug(meta["title"]) == meta["id"].split("/", 1)[1]


def test_scripts_are_collapsed_data_stays_out_of_the_output_and_shared_memory_is_checked():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    written = [c for c in code if c.source.startswith("%%writefile ")]
    assert written and all(c.metadata.get("_kg_hide-input") is True
                           and c.metadata["jupyter"]["source_hidden"] is True for c in written)
    runs = "\n".join(c.source for c in code if c not in written)
    assert '"--data-dir", "data"' not in runs and 'DATA = "/tmp/' in runs
    # the shared-memory check comes before the first GCN run, and picks torchrun when it is short
    check, first_gcn = runs.index("check_shared_memory"), runs.index('run("gcn_ddp.py"')
    assert check < first_gcn and "NCCL_SHM_DISABLE" in runs
    # pyg_lib only from PyG's index (it is not on PyPI); a failed install stops with one line
    assert '"pyg_lib", "--no-index", "-f", index' in runs and "assert pip" not in runs
    first = nb.cells[0].source
    assert "have not been run" in first  # until someone runs it on Kaggle


@pytest.mark.parametrize("shm_short", [None, "/dev/shm has 64 MiB free: give the container more"])
def test_with_a_small_dev_shm_the_gcn_runs_without_sampling_workers(shm_short):
    """Sampling workers hand each sampled batch (tens of MB) to their rank through /dev/shm: where
    it is too small, the GCN runs under torchrun with --num-workers 0. The notebook's cell runs
    here with `run` recording the commands instead of starting them."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and 'run("gcn_ddp.py"' in c.source)
    commands = []

    def run(*argv):
        commands.append([str(a) for a in argv])
        path = argv[argv.index("--metrics-json") + 1]
        with open(path, "w") as f:
            json.dump({"epochs": [{"seconds": 1.0, "sampled_nodes_per_second": 1.0, "test_metric": 0.5}]}, f)

    with tempfile.TemporaryDirectory() as folder:
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            exec(cell, {"run": run, "SHM_SHORT": shm_short, "DATA": "/tmp/data", "json": json,
                        "Markdown": str})
        finally:
            os.chdir(cwd)
    assert len(commands) == 2
    for command in commands:
        workers = command[command.index("--num-workers") + 1]
        assert ("torch.distributed.run" in command, workers) == ((True, "0") if shm_short else (False, "1"))
