"""The notebooks: committed without outputs, parameterised for papermill, each run as a test by
nbmake (smoke mode), with exercises and their solutions; and the tools that run them."""
import json
import re
import sys

import nbformat
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "generate"))
import compute_times  # noqa: E402
import study_time  # noqa: E402

LESSONS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((REPO / "notebooks" / "solutions").glob("*.ipynb"))
NOTEBOOKS = LESSONS + SOLUTIONS
IDS = [str(nb.relative_to(REPO / "notebooks")) for nb in NOTEBOOKS]
LESSON_IDS = [nb.name for nb in LESSONS]


def test_lessons_are_numbered_in_reading_order():
    numbers = [int(nb.name[:2]) for nb in LESSONS]
    assert len(numbers) >= 2 and numbers == list(range(1, len(numbers) + 1))


def headings(path, level="## "):
    nb = nbformat.read(path, as_version=4)
    return [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
            if line.startswith(level)]


@pytest.mark.parametrize("path", LESSONS, ids=LESSON_IDS)
def test_every_lesson_ends_with_exercises_and_their_solutions(path):
    """The last section of each lesson: 2 to 4 numbered exercises, and a link to the lesson's
    solutions notebook in notebooks/solutions/ (which the suite runs, as it runs the lessons)."""
    assert headings(path)[-1] == "## Exercises"
    nb = nbformat.read(path, as_version=4)
    start = max(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "## Exercises" in c.source)
    text = "\n".join(c.source for c in nb.cells[start:] if c.cell_type == "markdown")
    exercises = re.findall(r"^(\d+)\. ", text.split("## Exercises", 1)[1], re.M)
    assert 2 <= len(exercises) <= 4 and exercises == [str(i + 1) for i in range(len(exercises))], exercises
    solutions = REPO / "notebooks" / "solutions" / f"{path.stem}_solutions.ipynb"
    assert solutions.exists() and f"solutions/{solutions.name}" in text
    # A starter cell right after them, where the learner makes the edit; run as it comes (the
    # notebook tier runs it), it only says what to fill in.
    starter = nb.cells[start + 1]
    assert starter.cell_type == "code" and "Run as it is, it only says what to fill in" in starter.source
    assert len([h for h in headings(solutions) if h.startswith("## Exercise ")]) == len(exercises)


@pytest.mark.parametrize("path", LESSONS, ids=LESSON_IDS)
def test_first_cell_says_how_long_and_on_what(path):
    """A reader knows before running: the time in smoke mode and in full (measured on a 2-core
    CPU), and the hardware each part needs."""
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown"
    assert re.search(r"\*\*Time:\*\*.*smoke.*full", first.source, re.S), first.source[-600:]
    assert "**Hardware:**" in first.source


@pytest.mark.parametrize("path", LESSONS, ids=LESSON_IDS)
def test_each_lesson_states_the_times_its_runs_took(path):
    """A lesson's **Time:** line, its rendered page's and the README's row state the measured runs
    (tools/generate/compute_times.py): smoke mode's from docs/measured/smoke_times.json, in full the
    rendered page's stamp; the README says the same at the rounding the line uses."""
    line = compute_times.sentence(path.stem)
    assert compute_times.stated(nbformat.read(path, as_version=4).cells[0].source) == line, \
        f"{path.name}: run `make times`"
    assert compute_times.stated((compute_times.PAGES / f"{path.stem}.md").read_text()) == line, \
        f"{path.stem}.md: run `make times`"
    row = compute_times.readme_row(int(path.name[:2])).search((REPO / "README.md").read_text())
    assert row, f"README.md's lesson table has no time for {path.name}"
    assert (row[2], row[3]) == compute_times.times(path.stem, table=True), f"{path.name}: run `make times`"
    assert int(row[5]) == study_time.stated(path), f"{path.name}: run `make study-times`"


def test_times_are_rounded_as_a_reader_needs_them():
    assert [compute_times.rounded(s) for s in (3.4, 9.6, 44, 84, 86, 100, 140, 3600)] == \
        ["3 s", "10 s", "40 s", "80 s", "90 s", "1.5 minutes", "2.5 minutes", "60 minutes"]


def test_the_time_line_names_each_runs_machine_and_date(tmp_path, monkeypatch):
    """compute_times.py: a smoke run recorded (merged into the record, this machine, today) and a
    rendered page's stamp make one sentence; one machine named once, two each with its run."""
    monkeypatch.setattr(compute_times, "SMOKE_TIMES", tmp_path / "smoke_times.json")
    monkeypatch.setattr(compute_times, "PAGES", tmp_path)
    monkeypatch.setattr(compute_times, "machine", lambda: ("AMD EPYC, 2 cores, no GPU", "2.14.1"))
    compute_times.record_smoke({"01_x": 12.3})
    compute_times.record_smoke({"02_y": 4.0})
    record = json.loads(compute_times.SMOKE_TIMES.read_text())
    assert record["01_x"]["seconds"] == 12.3 and record["02_y"]["machine"] == "AMD EPYC, 2 cores, no GPU"
    stamp = {"machine": "AMD EPYC, 2 cores, no GPU", "date": "2026-12-06", "minutes": 2.8}
    (tmp_path / "01_x.md").write_text(f"<!-- rendered: {json.dumps(stamp)} -->\n# Lesson\n")
    today = record["01_x"]["date"]
    assert compute_times.sentence("01_x") == (
        "**Time:** 10 s in smoke mode (`SMOKE = True`), 3 minutes in full, measured on AMD EPYC, 2 cores, "
        f"no GPU ({today}; 2026-12-06).")
    stamp["machine"] = "Intel Xeon, 2 cores, no GPU"
    (tmp_path / "01_x.md").write_text(f"<!-- rendered: {json.dumps(stamp)} -->\n# Lesson\n")
    line = compute_times.sentence("01_x")
    assert line == (f"**Time:** 10 s in smoke mode (`SMOKE = True`) on AMD EPYC, 2 cores, no GPU ({today}), "
                    "3 minutes in full on Intel Xeon, 2 cores, no GPU (2026-12-06).")
    assert compute_times.stated(f"# L\n\n{line}\n\n**Hardware:** any") == line
    with pytest.raises(SystemExit, match="no rendered page"):
        compute_times.sentence("02_y")


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_bytes()) <= 12_000, "README.md is over 12 KB: move detail to docs/"


@pytest.mark.parametrize("path", LESSONS, ids=LESSON_IDS)
def test_the_study_time_follows_its_rule(path):
    """Each lesson states its study time, estimated by one rule (tools/generate/study_time.py: words at
    150 a minute, 5 minutes an exercise), labelled as an estimate; it changes with the lesson."""
    minutes, words, exercises = study_time.estimate(path)
    assert words > 500 and exercises >= 2
    assert study_time.stated(path) == minutes, f"{path.name}: run `make study-times`"
    assert "an estimate" in nbformat.read(path, as_version=4).cells[0].source


def test_every_solution_belongs_to_a_lesson():
    assert {p.name for p in SOLUTIONS} == {f"{p.stem}_solutions.ipynb" for p in LESSONS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs(path):
    # Numbers in a notebook come from the reader's own run, so none are committed.
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: clear outputs before committing "
                f"(.venv/bin/jupyter nbconvert --clear-output --inplace {path.relative_to(REPO)})")


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


def test_every_notebook_runs_as_a_test():
    """make test runs each notebook once, through nbmake (pyproject.toml: testpaths, --nbmake), in
    smoke mode (tests/conftest.py); the lessons' solutions too."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "notebooks"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    collected = {line.split("::")[0] for line in r.stdout.splitlines() if ".ipynb::" in line}
    expected = {str(p.relative_to(REPO)) for p in (REPO / "notebooks").rglob("*.ipynb")
                if "output" not in p.parts and ".ipynb_checkpoints" not in p.parts}
    assert expected and collected == expected, r.stdout + r.stderr


def test_papermill_runs_a_notebook_with_its_parameters(tmp_path):
    """make notebooks (tools/generate/run_notebooks.py): papermill overrides the first cell's parameters,
    the executed copy is written, a failing cell fails the run."""
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell("SMOKE = False")
    parameters.metadata["tags"] = ["parameters"]
    nb.cells = [parameters, nbformat.v4.new_code_cell("print(f'smoke={SMOKE}')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "01_tiny.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "out"
    runner = [sys.executable, str(REPO / "tools" / "generate" / "run_notebooks.py"), "--out", str(out)]
    r = subprocess.run([*runner, "--smoke", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    executed = nbformat.read(out / path.name, as_version=4)
    assert "smoke=True" in "".join(o.get("text", "") for o in executed.cells[-1].outputs)

    nb.cells.append(nbformat.v4.new_code_cell("assert SMOKE is False, 'a cell that fails'"))
    nbformat.write(nb, path)
    r = subprocess.run([*runner, "--smoke", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "a cell that fails" in r.stdout + r.stderr


def test_the_suites_kernels_listen_on_unix_sockets(tmp_path, monkeypatch):
    """kernels_on_unix_sockets (notebooks/conftest.py): a notebook nbmake runs gets a kernel on
    Jupyter's ipc transport, its socket files in a folder of the suite's own; nbmake left alone
    (the control) starts it on TCP ports, which another process may take before the kernel binds."""
    import os

    import nbclient
    import nbmake.nb_run
    from helpers import kernels_on_unix_sockets

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from ipykernel.kernelapp import IPKernelApp\n"
                                          "app = IPKernelApp.instance()\nprint(app.transport, app.ip)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)

    def transport_and_address():
        result = nbmake.nb_run.NotebookRun(path, 120).execute()
        assert result.error is None, result.error
        return result.nb.cells[0].outputs[0]["text"].split()

    monkeypatch.setattr(nbmake.nb_run, "NotebookClient", nbclient.NotebookClient)
    assert transport_and_address() == ["tcp", "127.0.0.1"]
    kernels_on_unix_sockets()
    transport, address = transport_and_address()
    assert transport == "ipc", transport
    assert os.path.basename(os.path.dirname(address)).startswith("course-kernels-"), address


def test_plain_runner_executes_code_cells_without_jupyter(tmp_path):
    """tools/generate/run_notebook_plain.py, for the GPU machine that has no Jupyter: cells share one
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
    runner = [sys.executable, str(REPO / "tools" / "generate" / "run_notebook_plain.py"), str(path)]
    r = subprocess.run([*runner, "--smoke"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "smoke=1 here=nb" in r.stdout and "every code cell ran" in r.stdout

    nb.cells.append(nbformat.v4.new_code_cell("raise ValueError('cell failed')"))
    nbformat.write(nb, path)
    r = subprocess.run(runner, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ValueError: cell failed" in r.stderr
    assert "every code cell ran" not in r.stdout


def test_interrupting_a_run_stops_every_process_it_started(monkeypatch):
    """The notebook's stop button (KeyboardInterrupt in the kernel) stops the launched command and
    what it started, instead of waiting for them to finish (a command run as a reader's is)."""
    monkeypatch.setenv("COURSE_PRELOADED", "0")
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

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. the suite's launcher
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
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(started, timeout=5)
    assert not alive


def test_captured_output_is_shown_and_kept(capsys):
    """The solutions' asserts read what a run printed: it is still shown under the cell, and kept."""
    import sys

    sys.path.insert(0, str(REPO / "notebooks"))
    from course_helpers import captured, run_captured

    result, text = run_captured("-c", "print('first'); print('second')")
    assert text.splitlines()[-2:] == ["first", "second"]
    with captured() as out:
        print("third")
    assert out.text == "third\n"
    shown = capsys.readouterr().out
    assert "second" in shown and "third" in shown


LAB_COMMANDS = r"tools/lab/(netlab|slurm_lab)\.py"  # the network lab and its Slurm cluster, run as commands


def test_the_notebooks_need_nothing_from_the_maintainers_tools():
    """What a lesson imports lives with the lessons (course_helpers.py, course_demos.py); tools/ holds
    the maintainers' generators and benchmarks, which may import from notebooks/, not the reverse.
    The one exception: lesson 7 runs the network lab and its Slurm cluster as commands, as a reader
    does by hand (sudo python3 tools/lab/netlab.py up, make netlab-up); no lesson imports them."""
    sources = [c.source for path in NOTEBOOKS for c in nbformat.read(path, as_version=4).cells
               if c.cell_type == "code"]
    sources += [p.read_text() for p in (REPO / "notebooks").glob("*.py")]
    assert not [s for s in sources if re.search(r"""/\s*["']tools["']|["'](\.\./)?tools/""",
                                                re.sub(LAB_COMMANDS, "", s))]
    assert not [s for s in sources if re.search(r"\bimport (netlab|slurm_lab)\b", s)]


ONE_SITTING = (35, 2500)  # cells, and words of prose (Markdown cells), of any lesson
STRICTER = {"02_ddp_cpu_gloo.ipynb": (25, 1800)}  # the idea, by hand, DDP, launching, the global batch


@pytest.mark.parametrize("path", LESSONS, ids=LESSON_IDS)
def test_a_lesson_reads_in_one_sitting(path):
    """Every lesson (found by name, so a new one is covered) reads in one sitting: at most 35 cells
    and 2,500 words of Markdown prose; lesson 2, the course's first DDP lesson, at most 25 and 1,800.
    Reference material (tables of runs, lab details, edge cases) goes to docs/MEASURED.md,
    docs/TROUBLESHOOTING.md or a folder's README, linked from the lesson in one line."""
    assert set(STRICTER) <= set(LESSON_IDS), "a lesson with a stricter limit was renamed"
    cells, words = STRICTER.get(path.name, ONE_SITTING)
    nb = nbformat.read(path, as_version=4)
    prose = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    assert len(nb.cells) <= cells and prose <= words, (len(nb.cells), prose)


def test_an_edited_copy_of_a_training_script_must_print_its_summary(tmp_path):
    """run() insists on the `done:` line of a training script, and of an edited copy of one
    (course_helpers.trains): the copy of a later lesson, whose summary comes from the report of
    mnist_parts.py, counts as one; a small script in the same folder does not (the control)."""
    from course_helpers import OUTPUT, edited_copy, trains

    for script in ("mnist_ddp_comm.py", "mnist_single.py", "gcn_ddp.py", "mnist_by_hand.py"):
        copy = edited_copy(script, [], "test_trains_copy")
        assert trains([str(copy), "--nprocs", "2"]), script
        assert not trains([str(copy), "--help"])
    other = OUTPUT / "test_trains_other.py"
    other.write_text("print('hello')\n")
    assert not trains([str(other)])
    for path in (copy, other):
        path.unlink()


def test_a_copy_carries_every_file_its_script_imports():
    """course_helpers.course_imports follows the imports: a later lesson needs the lesson it runs
    and that lesson's modules; lesson 1 its two modules; the template the hardening alone."""
    from course_helpers import course_imports

    modules = ["ddp_hardening.py", "mnist_parts.py"]
    assert course_imports("mnist_ddp_resume.py") == sorted(modules + ["mnist_ddp_gpu.py"])
    assert course_imports("mnist_ddp_practice.py") == sorted(modules + ["mnist_ddp_cpu.py"])
    assert course_imports("mnist_single.py") == ["ddp_hardening.py", "mnist_parts.py"]
    assert course_imports("template_ddp.py") == ["ddp_hardening.py"]


def test_a_lesson_diff_shows_train_against_the_earlier_one_and_the_rest_whole():
    """lesson_diff: lesson 5's train() as a diff against lesson 3's (its snapshot code added, lesson
    3's lines it keeps as context), each function lesson 5 adds whole; lesson 3's launching, which
    lesson 5 imports, not repeated."""
    from course_helpers import lesson_diff

    text = lesson_diff("mnist_ddp_gpu.py", "mnist_ddp_resume.py")
    assert "+    snapshot = load_snapshot(args, rank, device)" in text
    assert " def train(rank, local_rank, world_size, args):" in text  # context: the same in both
    assert "@@ mnist_ddp_resume.py: save_snapshot @@" in text and "+def save_snapshot(" in text
    assert "def worker(" not in text and "def parser(" not in text
