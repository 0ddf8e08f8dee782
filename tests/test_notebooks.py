"""The notebooks: committed without outputs, parameterised for papermill, and they run (smoke mode)."""
import re

import nbformat
import papermill
import pytest
from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IDS = [nb.name for nb in NOTEBOOKS]


def test_lessons_are_numbered_in_reading_order():
    numbers = [int(nb.name[:2]) for nb in NOTEBOOKS]
    assert len(numbers) >= 2 and numbers == list(range(1, len(numbers) + 1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs(path):
    # Numbers in a notebook come from the reader's own run, so none are committed.
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{path.name}: clear outputs before committing (jupyter nbconvert --clear-output)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_first_code_cell_holds_the_parameters(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in first.metadata.get("tags", [])
    assert re.search(r"^SMOKE = .*COURSE_SMOKE", first.source, re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_relative_links_point_to_files(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for target in re.findall(r"\]\(([^)#:]+)\)", cell.source):
                assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_in_smoke_mode(path, tmp_path, dataset):
    out = tmp_path / path.name
    papermill.execute_notebook(str(path), str(out), cwd=str(path.parent), parameters={"SMOKE": True},
                               kernel_name="python3", progress_bar=False, execution_timeout=600)
    executed = nbformat.read(out, as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a cell did not run"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.get("output_type") == "stream")
    assert "done:" in text  # the launched scripts ran to the end and printed their summary


def test_plain_runner_executes_code_cells_without_jupyter(tmp_path):
    """tools/run_notebook_plain.py, for the GPU machine that has no Jupyter: cells share one
    namespace, run in the notebook's folder, display() prints, magics are skipped, errors fail."""
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell
    nb.cells = [nbformat.v4.new_markdown_cell("# title"),
                cell("%matplotlib inline\nimport os\nSMOKE = os.environ.get('COURSE_SMOKE')"),
                cell("from IPython.display import Markdown, display\n"
                     "display(Markdown(f'smoke={SMOKE} here={os.path.basename(os.getcwd())}'))")]
    path = tmp_path / "nb" / "x.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    runner = [sys.executable, str(REPO / "tools" / "run_notebook_plain.py"), str(path)]
    r = subprocess.run([*runner, "--smoke"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "smoke=1 here=nb" in r.stdout and "every code cell ran" in r.stdout

    nb.cells.append(nbformat.v4.new_code_cell("raise ValueError('cell failed')"))
    nbformat.write(nb, path)
    r = subprocess.run(runner, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ValueError: cell failed" in r.stderr
    assert "every code cell ran" not in r.stdout


def test_interrupting_a_run_stops_every_process_it_started():
    """The notebook's stop button (KeyboardInterrupt in the kernel) stops the launched command and
    what it started, instead of waiting for them to finish."""
    import signal
    import sys
    import time

    import psutil

    sys.path.insert(0, str(REPO / "notebooks"))
    from course_helpers import run

    sleeper = "import time; time.sleep(60)"
    child = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); "
             "print('started', flush=True); time.sleep(60)")

    def interrupt(*args):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run("-c", child)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 20
    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=5)
    assert not alive
