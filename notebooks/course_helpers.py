"""Small helpers the notebooks share. The training code itself lives in ../ddp_scripts/.

Why launch scripts instead of calling functions: DDP starts N fresh Python processes, and each
must import the code it runs from a file. A notebook kernel has no such file (its __main__ is the
kernel), so the notebooks run the scripts in a subprocess and stream what they print.
"""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "ddp_scripts"
DATA_DIR = REPO / "data"
OUTPUT = REPO / "notebooks" / "output"  # ignored by git: metrics, checkpoints, plots of your runs


def smoke_from_env():
    """SMOKE mode (tiny runs) when COURSE_SMOKE=1, e.g. under nbmake or a quick CI job."""
    return os.environ.get("COURSE_SMOKE", "0") == "1"


def run(*args, check=True):
    """Run `python <args>` from the repository root, printing its output line by line as it comes.

    run("ddp_scripts/mnist_ddp_cpu.py", "--nprocs", 2) is what you would type in a terminal.
    """
    argv = [str(a) for a in args]
    print("$ python " + " ".join(shlex.quote(a) for a in argv), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # each run picks a free port
    with subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, text=True, bufsize=1,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"the command exited with code {proc.returncode} (its output is above)")
    return proc.returncode


def output_path(name):
    """A path under notebooks/output/ for --metrics-json, --save or a plot."""
    OUTPUT.mkdir(exist_ok=True)
    return OUTPUT / name


def read_json(path):
    with open(path) as f:
        return json.load(f)
