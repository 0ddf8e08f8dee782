"""docs/TROUBLESHOOTING.md quotes what PyTorch prints for common DDP mistakes. Every section marked
*Checked* is run here: its python snippet (in 2 spawned Gloo processes when it defines
`body(rank)`, in a Jupyter kernel when it says so, else as a script) must print every line of its
quoted text block, numbers aside (for a notebook: the cell's output, then the kernel's stderr)."""
import re
import subprocess
import sys

import pytest
from helpers import REPO, script_env

pytestmark = pytest.mark.slow  # left out of make test-quick

DOC = REPO / "docs" / "TROUBLESHOOTING.md"

# What the document says runs around a snippet that defines body(rank): the lesson 2 worker.
HARNESS = '''
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world_size, body):
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=5))
    try:
        body(rank)
    finally:
        dist.destroy_process_group()
'''
LAUNCH = '''
if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    size = globals().get("WORLD_SIZE", 2)
    mp.spawn(worker, args=(size, body), nprocs=globals().get("STARTED", size))
'''


def checked_sections():
    """(title, how, code, expected lines) for each section marked *Checked*."""
    sections = re.split(r"^### ", DOC.read_text(), flags=re.M)[1:]
    found = []
    for section in sections:
        title, _, rest = section.partition("\n")
        mark = re.match(r"\s*\*Checked([^*]*)\*", rest)
        if not mark:
            continue
        code = re.search(r"```python\n(.*?)```", rest, re.S).group(1)
        # a notebook section quotes the cell, then the terminal; the others quote one output
        texts = [[line for line in t.splitlines() if line.strip()]
                 for t in re.findall(r"```text\n(.*?)```", rest, re.S)]
        how = "notebook" if "Jupyter" in mark.group(1) else "spawn" if "def body(" in code else "script"
        found.append((title.strip(), how, code, texts))
    return found


def pattern(line):
    """A quoted line as a regex: any number may differ, `...` stands for any text."""
    escaped = re.escape(line.strip())
    return re.sub(r"\d+", r"\\d+", escaped).replace(re.escape("..."), ".*")


# Runs one cell in a Jupyter kernel; prints what the cell shows. The kernel's own stderr (what the
# terminal running Jupyter shows) is this program's stderr.
KERNEL = """
import sys
import nbclient
import nbformat

sys.path.insert(0, sys.argv[1])
from kernels import UnixSocketKernelManager  # a kernel on Unix sockets (tools/generate/kernels.py)

nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(sys.stdin.read())])
try:
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3",
                            kernel_manager_class=UnixSocketKernelManager).execute()
except nbclient.exceptions.CellExecutionError:
    pass  # the error is the point; it is in the outputs
for output in nb.cells[0].outputs:
    print(output.get("text", ""))
    if output.output_type == "error":
        print(f"{output.ename}: {output.evalue}")
"""


SECTIONS = checked_sections()


def test_the_document_has_checked_sections_of_each_kind():
    assert len(SECTIONS) >= 8
    assert {how for _, how, _, _ in SECTIONS} == {"notebook", "spawn", "script"}


@pytest.mark.parametrize("title, how, code, expected", SECTIONS, ids=[s[0][:40] for s in SECTIONS])
def test_the_snippet_prints_what_the_document_quotes(tmp_path, title, how, code, expected):
    if how == "notebook":
        pytest.importorskip("nbclient")
        r = subprocess.run([sys.executable, "-c", KERNEL, str(REPO / "tools" / "generate")], input=code,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=script_env())
        outputs = [r.stdout, r.stderr]  # the cell, the terminal
    else:
        source = HARNESS + "\n" + code + LAUNCH if how == "spawn" else code
        (tmp_path / "snippet.py").write_text(source)
        r = subprocess.run([sys.executable, "snippet.py"], capture_output=True, text=True, timeout=90,
                           cwd=tmp_path, env=script_env())
        outputs = [r.stdout + r.stderr]
    assert len(expected) == len(outputs), f"{title}: {len(expected)} quoted blocks"
    for lines, output in zip(expected, outputs):
        missing = [line for line in lines if not re.search(pattern(line), output)]
        assert not missing, f"{title}: not printed: {missing}\n--- output:\n{output[-3000:]}"
