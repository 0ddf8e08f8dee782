"""launch/: the Slurm batch script and the Kubernetes manifest that lesson 7 shows are files people
copy. Checked here without a cluster: the Slurm script runs in bash with stand-ins for `scontrol`
and `srun` that record what it would start (tests/cluster/test_slurm.py submits it to a real Slurm), and
the manifest's command names a course script with flags that script takes."""
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from helpers import REPO, load_script

LAUNCH = REPO / "launch"


def script_and_flags(command):
    """The course script a torchrun command line runs, and the flags it passes to it ($VARIABLES
    filled in with a stand-in)."""
    words = shlex.split(re.sub(r'"?\$\{?(\w+)\}?"?', "1", command.replace("\\\n", " ")))
    start = next(i for i, word in enumerate(words) if word.startswith("ddp_scripts/"))
    return words[start], words[start + 1:]


def check_flags(script, flags):
    assert (REPO / script).exists(), script
    module = load_script(script.split("/")[-1].removesuffix(".py"))
    return module.parse_args(flags)  # raises (one line) on a flag the script does not take


def check(command):
    script, flags = script_and_flags(command)
    check_flags(script, flags)
    assert "torchrun" in command and "--nproc-per-node" in command


def sbatch_in_bash(tmp_path, *args, **slurm):
    """Run launch/slurm_ddp.sbatch as the batch step would, with `scontrol` and `srun` replaced by
    stand-ins: returns the words srun was given."""
    stubs, recorded = tmp_path / "bin", tmp_path / "srun-args"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text('#!/bin/sh\nprintf "node-a\\nnode-b\\n"\n')
    (stubs / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {recorded}\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "123456",
           "SLURM_NNODES": "2", **slurm}
    r = subprocess.run(["bash", str(LAUNCH / "slurm_ddp.sbatch"), *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return recorded.read_text().splitlines()


def option(words, name):
    return words[words.index(name) + 1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_slurm_script_gives_the_step_its_cpus_and_runs_lesson_5(tmp_path):
    path = LAUNCH / "slurm_ddp.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    assert "#SBATCH --ntasks-per-node 1" in text  # one torchrun per machine
    assert "lesson 5's script" in text.splitlines()[1] and "--local-addr" in text
    srun = sbatch_in_bash(tmp_path, SLURM_CPUS_PER_TASK="8")
    torchrun = srun.index("torchrun")
    # Slurm >= 22.05: srun takes no --cpus-per-task from sbatch; without it the step gets one CPU.
    assert option(srun[:torchrun], "--cpus-per-task") == "8"
    assert "--kill-on-bad-exit=1" in srun[:torchrun]
    assert option(srun, "--rdzv-endpoint") == f"node-a:{20000 + 123456 % 20000}"  # from the job's id
    assert option(srun, "--nnodes") == "2" and option(srun, "--rdzv-id") == "123456"
    # A CPU-only allocation: processes on the CPUs, Gloo.
    assert option(srun, "--nproc-per-node") == "2"
    script = next(w for w in srun if w.startswith("ddp_scripts/"))
    args = check_flags(script, srun[srun.index(script) + 1:])
    assert script.endswith("mnist_ddp_resume.py") and (args.device, args.backend) == ("cpu", "gloo")


def test_the_slurm_script_uses_the_allocations_gpus_and_passes_on_extra_flags(tmp_path):
    srun = sbatch_in_bash(tmp_path, "--epochs", "1", SLURM_CPUS_PER_TASK="16", SLURM_GPUS_ON_NODE="4")
    assert option(srun, "--nproc-per-node") == "4" and option(srun, "--cpus-per-task") == "16"
    script = next(w for w in srun if w.startswith("ddp_scripts/"))
    args = check_flags(script, srun[srun.index(script) + 1:])
    assert (args.device, args.backend, args.epochs) == ("cuda", "nccl", 1)  # the last --epochs wins


def test_the_pytorchjob_is_valid_yaml_and_runs_a_course_script():
    text = (LAUNCH / "pytorchjob.yaml").read_text()
    job = yaml.safe_load(text)
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    assert "version 1.7 or later" in text  # the operator versions whose variables it relies on
    nproc = job["spec"]["nprocPerNode"]
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the name the operator expects
        command = " ".join(container["args"])
        check(command)
        # WORLD_SIZE counts pods on some operator versions, processes on others: not used.
        assert "WORLD_SIZE" not in command
        for variable in ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR"):
            assert f'"${variable}"' in command
        assert int(nproc) == container["resources"]["limits"]["nvidia.com/gpu"]  # one process per GPU


def test_the_check_can_fail():
    with pytest.raises(Exception, match="unrecognized arguments"):
        check("torchrun --nproc-per-node 4 ddp_scripts/mnist_ddp_gpu.py --no-such-flag 3")


def test_licence_and_citation():
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["cff-version"] and citation["license"] == "MIT" and citation["authors"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_slurm_tasks_script_gives_each_task_its_rank_from_slurm(tmp_path):
    """launch/slurm_tasks.sbatch, one task per rank: srun (a stand-in here, starting the step's two
    tasks as Slurm would, with their SLURM_ variables) runs python once per task, each with its
    RANK, LOCAL_RANK, WORLD_SIZE and the master taken from the allocation."""
    path = LAUNCH / "slurm_tasks.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "lesson 5's script" in path.read_text().splitlines()[1]
    stubs, seen = tmp_path / "bin", tmp_path / "seen"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/sh\nprintf "node-a\\nnode-b\\n"\n')
    (stubs / "srun").write_text(f"""#!/bin/bash
printf "%s\\n" "$@" > {tmp_path}/srun-args
while [ "$1" != bash ]; do shift; done
for task in 0 1 2 3; do
    SLURM_PROCID=$task SLURM_LOCALID=$((task % 2)) SLURM_NTASKS=4 SLURM_NTASKS_PER_NODE=2 "$@"
done
""")
    (stubs / "python").write_text(f'#!/bin/sh\necho "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE '
                                  f'$MASTER_ADDR $MASTER_PORT $*" >> {seen}\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "123456",
           "SLURM_CPUS_PER_TASK": "4"}
    r = subprocess.run(["bash", str(path), "--epochs", "1"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    srun = (tmp_path / "srun-args").read_text().splitlines()
    assert option(srun, "--cpus-per-task") == "4" and "--kill-on-bad-exit=1" in srun
    port = str(20000 + 123456 % 20000)
    tasks = [line.split() for line in seen.read_text().splitlines()]
    assert [t[:6] for t in tasks] == [[str(r), str(r % 2), "4", "2", "node-a", port] for r in range(4)]
    words = tasks[0][6:]
    args = check_flags(words[0], words[1:])
    assert words[0].endswith("mnist_ddp_resume.py")
    assert (args.device, args.backend, args.epochs) == ("cpu", "gloo", 1)
