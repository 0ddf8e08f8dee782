"""launch/: the Slurm batch script and the Kubernetes manifest that lesson 7 shows are files people
copy. No Slurm or Kubernetes here: they are checked for what can be checked without one: bash
syntax, YAML, and that the command they run names a course script with flags that script takes."""
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from conftest import REPO, load_script

LAUNCH = REPO / "launch"


def script_and_flags(command):
    """The course script a torchrun command line runs, and the flags it passes to it ($VARIABLES
    filled in with a stand-in)."""
    words = shlex.split(re.sub(r'"?\$\{?(\w+)\}?"?', "1", command.replace("\\\n", " ")))
    start = next(i for i, word in enumerate(words) if word.startswith("ddp_scripts/"))
    return words[start], words[start + 1:]


def check(command):
    script, flags = script_and_flags(command)
    assert (REPO / script).exists(), script
    module = load_script(script.split("/")[-1].removesuffix(".py"))
    module.parse_args(flags)  # raises (one line) on a flag the script does not take
    assert "torchrun" in command and "--nproc-per-node" in command


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_slurm_script_is_valid_bash_and_runs_a_course_script():
    path = LAUNCH / "slurm_ddp.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    assert "#SBATCH --ntasks-per-node 1" in text  # one torchrun per machine
    command = text[text.index("srun torchrun"):]
    check(command)


def test_the_pytorchjob_is_valid_yaml_and_runs_a_course_script():
    job = yaml.safe_load((LAUNCH / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the name the operator expects
        check(" ".join(container["args"]))


def test_the_check_can_fail():
    with pytest.raises(Exception, match="unrecognized arguments"):
        check("torchrun --nproc-per-node 4 ddp_scripts/mnist_ddp_gpu.py --no-such-flag 3")


def test_licence_and_citation():
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["cff-version"] and citation["license"] == "MIT" and citation["authors"]
