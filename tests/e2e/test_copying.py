"""What a user who copies the scripts gets (README, "Use the scripts in your own project"): the
template and the hardening module, two files, train in an empty folder as they come; a lesson
script with the modules it imports beside it runs; a script copied alone says, in one line, which
file it needs. Each run is a new interpreter in a folder of its own, as on the user's machine."""
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS, script_env

pytestmark = pytest.mark.slow  # left out of make test-quick


def run_copy(folder, script, *args, timeout=240):
    return subprocess.run([sys.executable, script, *[str(a) for a in args]], cwd=folder, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def copy(folder, *names):
    folder.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(SCRIPTS / name, folder / name)
    return folder


def test_the_template_and_the_hardening_module_train_in_an_empty_folder(tmp_path):
    folder = copy(tmp_path / "project", "template_ddp.py", "ddp_hardening.py")
    r = run_copy(folder, "template_ddp.py", "--nprocs", 2, "--max-steps", 4, "--save", "w.pt")
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout and torch.load(folder / "w.pt")  # its weights, and its own data file
    assert sorted(p.name for p in folder.iterdir()) == ["data", "ddp_hardening.py", "template_ddp.py", "w.pt"]


def test_a_lesson_script_copied_with_its_modules_trains(tmp_path, data_args):
    """Lesson 2's script beside the two modules it imports, its data where the suite keeps it."""
    folder = copy(tmp_path / "mine", "mnist_ddp_cpu.py", "mnist_parts.py", "ddp_hardening.py")
    data = [str(a) for a in data_args]
    r = run_copy(folder, "mnist_ddp_cpu.py", "--nprocs", 2, "--model", "linear", "--max-steps", 3, "--quiet",
                 *data)
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout


def test_a_later_lesson_copied_with_the_files_it_imports_trains(tmp_path, data_args):
    """Lesson 6's script runs lesson 3's launching: beside lesson 3's script and the two modules."""
    folder = copy(tmp_path / "mine", "mnist_ddp_comm.py", "mnist_ddp_gpu.py", "mnist_parts.py",
                  "ddp_hardening.py")
    r = run_copy(folder, "mnist_ddp_comm.py", "--backend", "gloo", "--device", "cpu", "--nprocs", 2,
                 "--model", "linear", "--accum-steps", 2, "--max-steps", 3, "--quiet", *map(str, data_args))
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout


@pytest.mark.parametrize("script, has, needs", [
    ("template_ddp.py", [], "ddp_hardening.py"),
    ("mnist_ddp_cpu.py", [], "ddp_hardening.py"),
    ("mnist_single.py", [], "ddp_hardening.py"),
    ("gcn_ddp.py", [], "ddp_hardening.py"),
    ("mnist_by_hand.py", ["ddp_hardening.py"], "mnist_parts.py"),  # the one module it has: the other
    ("mnist_ddp_resume.py", [], "mnist_ddp_gpu.py"),  # a later lesson: the lesson it runs
    ("mnist_ddp_practice.py", [], "mnist_ddp_cpu.py"),
    ("mnist_ddp_comm.py", ["mnist_ddp_gpu.py", "ddp_hardening.py"], "mnist_parts.py"),  # what lesson 3 needs
])
def test_a_script_copied_alone_names_the_file_it_needs_in_one_line(tmp_path, script, has, needs):
    folder = copy(tmp_path / "alone", script, *has)
    r = run_copy(folder, script, "--help", timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and needs in r.stderr and "copy it" in r.stderr, r.stderr
